"""The worker's paged KV cache: fixed-size blocks, a block table per request, rolled back by length.

Layout per layer: keys and values ``[(num_blocks + 1) * block_size, num_kv_heads, head_dim]``,
token major, so one ``index_copy_`` writes every new token of a step (flat row = physical block *
block_size + position % block_size; ``BlockTable`` maps a request's positions to blocks, block 0 is
scratch). The cache holds no lengths: each request's ``num_computed_tokens`` (in the runner's
request state) says how much of its blocks is valid, so rejecting drafts costs nothing; the blocks
wholly past that length go back to the free list when the runner trims.

``num_blocks`` defaults to ``max_num_seqs * ceil(max_model_len / block_size)``: the memory of one
``max_model_len`` slot per request, so every request can reach ``max_model_len`` at once.
"""

from __future__ import annotations

import torch

from worker.block_table import BlockTable

DEFAULT_BLOCK_SIZE = 16


def default_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    return max_num_seqs * -(-max_model_len // block_size)


def draft_num_blocks(
    target_blocks: int, max_num_seqs: int, max_model_len: int, block_size: int, k: int
) -> int:
    """Blocks for a drafter's own cache (a draft model's, the EAGLE head's) beside a target
    cache of ``target_blocks``: it runs up to k positions past the target's committed length, so
    it gets the target's blocks plus that much per request (never more than full-length slots)."""
    full = default_num_blocks(max_num_seqs, max_model_len, block_size)
    return min(full, target_blocks + max_num_seqs * (-(-(k + 1) // block_size) + 1))


class KVCache:
    """Owned by one ``ModelExecutor`` (or the EAGLE drafter); written only by the attention
    function during its forward. ``blocks`` says which blocks belong to which slot."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        if num_blocks is None:
            num_blocks = default_num_blocks(max_num_seqs, max_model_len, block_size)
        self.blocks = BlockTable(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            device=device,
        )
        self.scratch_slot = self.blocks.scratch_slot
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    def allocate(self, slots: list[int], ends: list[int]) -> None:
        """Before a forward: each slot holds blocks for its positions up to ``ends[i] - 1``,
        and the device table shows them."""
        for slot, end in zip(slots, ends, strict=True):
            self.blocks.grow(slot, end)
        self.blocks.sync()

    def trim(self, slot: int, num_tokens: int) -> None:
        """After a commit: give back the blocks wholly past ``num_tokens`` valid positions."""
        self.blocks.trim(slot, num_tokens)

    def free(self, slot: int) -> None:
        """The request in ``slot`` left: all its blocks go back to the free list."""
        self.blocks.trim(slot, 0)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``k``, ``v``: [num_tokens, num_kv_heads, head_dim]; ``slot_mapping``: [num_tokens] flat rows."""
        self.keys[layer].index_copy_(0, slot_mapping, k)
        self.values[layer].index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the positions 0 .. nb * block_size - 1 of each row of
        ``block_table`` [B, nb] (physical blocks): [B, num_kv_heads, nb * block_size, head_dim]
        each (a copy; graph-safe: no host values)."""
        bs = self.block_size
        b, nb = block_table.shape
        keys = self.keys[layer].view(-1, bs, *self.keys[layer].shape[1:])
        values = self.values[layer].view(-1, bs, *self.values[layer].shape[1:])
        k = keys[block_table].view(b, nb * bs, *keys.shape[2:])  # [B, L, kv_heads, D]
        v = values[block_table].view(b, nb * bs, *values.shape[2:])
        return k.transpose(1, 2), v.transpose(1, 2)
