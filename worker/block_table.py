"""Which physical KV blocks hold which request's positions: a free list and one block table.

Position p of the request in slot s lives in physical block ``table[s, p // block_size]`` at row
``p % block_size``. A request holds ``ceil(length / block_size)`` blocks for the positions its
forward writes: ``grow`` takes blocks as it lengthens, ``trim`` gives back the ones wholly past a
shorter length (rejected drafts), and ``trim(slot, 0)`` frees them all (finish or abort). Freed
blocks go back on top of the free list, so the next request to grow reuses them first.

Block 0 is the scratch block: it belongs to nobody, every unused table entry points at it, and
padding tokens write there. No real query ever reads it (causality stops every query at its own
position, which lies in an allocated block). The slot past the last request's (``max_num_seqs``)
is the scratch row, all zeros, for the dummy requests of a padded decode batch.

The host table (``table_np``) is the truth; ``sync`` copies the rows that changed to the device
table, which a CUDA graph indexes in place (a static buffer: it is never reallocated).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from worker.host_copy import to_device

SCRATCH_BLOCK = 0
Tokens = TypeVar("Tokens", int, np.ndarray)  # a token count, or an array of them


class KVCacheFull(RuntimeError):
    """No free block is left. The scheduler's block accounting and the worker's step check keep
    the target's cache from reaching this; raising it means they disagree with the allocator."""


class BlockTable:
    """Owned by one ``KVCache``. The executor grows rows before a forward writes them; the runner
    trims them after it commits and frees them when a request leaves."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks  # usable blocks, 1 .. num_blocks (0 is the scratch block)
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = max_num_seqs
        # popped from the end: the lowest block first, then the most recently freed
        self._free = list(range(num_blocks, 0, -1))
        self.num_held = np.zeros(max_num_seqs + 1, np.int64)  # slot -> blocks it holds
        # [slot, logical block] -> physical block (SCRATCH_BLOCK where none is held)
        self.table_np = np.zeros((max_num_seqs + 1, max_blocks_per_seq), np.int64)
        self.table = torch.zeros(
            (max_num_seqs + 1, max_blocks_per_seq), dtype=torch.long, device=device
        )
        self._dirty: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: Tokens) -> Tokens:
        """Blocks that hold positions 0 .. num_tokens - 1 (of each, for an array)."""
        return -(-num_tokens // self.block_size)

    def needed(self, slot: int, num_tokens: int) -> int:
        """Blocks ``grow(slot, num_tokens)`` would take."""
        return max(self.blocks_for(num_tokens) - int(self.num_held[slot]), 0)

    def grow(self, slot: int, num_tokens: int) -> None:
        """Hold blocks for positions 0 .. num_tokens - 1 (no-op when already held)."""
        assert slot != self.scratch_slot, "the scratch row never holds blocks"
        want = self.blocks_for(num_tokens)
        assert want <= self.max_blocks_per_seq, f"{num_tokens} tokens exceed max_model_len"
        have = int(self.num_held[slot])
        if want <= have:
            return
        if want - have > len(self._free):
            raise KVCacheFull(
                f"slot {slot} needs {want - have} more KV blocks for {num_tokens} tokens; "
                f"{len(self._free)} of {self.num_blocks} are free"
            )
        for j in range(have, want):
            self.table_np[slot, j] = self._free.pop()
        self.num_held[slot] = want
        self._dirty.add(slot)

    def trim(self, slot: int, num_tokens: int) -> None:
        """Give back the blocks wholly past position ``num_tokens - 1`` (0: all of them)."""
        keep = self.blocks_for(num_tokens)
        have = int(self.num_held[slot])
        if keep >= have:
            return
        self._free.extend(self.table_np[slot, keep:have][::-1].tolist())
        self.table_np[slot, keep:have] = SCRATCH_BLOCK
        self.num_held[slot] = keep
        self._dirty.add(slot)

    def sync(self) -> None:
        """Copy the rows changed since the last sync to the device table (before a forward)."""
        if not self._dirty:
            return
        rows = np.fromiter(self._dirty, np.int64, len(self._dirty))
        self._dirty.clear()
        # the rows' indices and contents in one copy
        both = to_device(np.concatenate([rows, self.table_np[rows].ravel()]), self.table.device)
        self.table[both[: len(rows)]] = both[len(rows) :].view(len(rows), -1)

    def cache_rows(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Physical flat cache row of each (slot, position) pair: [N] int64. A position in a
        block the slot does not hold maps into the scratch block."""
        bs = self.block_size
        logical = positions // bs
        inside = logical < self.max_blocks_per_seq
        blocks = np.where(inside, self.table_np[slots, np.where(inside, logical, 0)], SCRATCH_BLOCK)
        return blocks * bs + positions % bs

    def cache_rows_device(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``cache_rows`` on the device, from the device table (synced before a forward)."""
        bs = self.block_size
        logical = positions // bs
        inside = logical < self.max_blocks_per_seq
        blocks = self.table[slots, logical.clamp(max=self.max_blocks_per_seq - 1)]
        return torch.where(inside, blocks, SCRATCH_BLOCK) * bs + positions % bs
