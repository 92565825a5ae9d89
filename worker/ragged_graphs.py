"""Any step layout replayed from a CUDA graph per token bucket: prefill chunks, mixed steps.

Decode-shaped steps have ``decode_graphs.py``. The rest (a step that carries a prefill chunk, or
requests of mixed widths) used to run eagerly, a Python-issued kernel at a time: ~20 ms for a
30-layer model whatever the token count, 5-7x a decode step. With the paged kernel
(``paged_kernel.py``) attention takes its layout from device tensors only (token positions, the
first token of each request, the block table) and its launch grid from the token count and the
request count, so one graph per token bucket serves every layout of up to that many tokens:

- the token count is padded to its bucket; padding tokens belong to no request, write their keys
  into the scratch block and come out as zeros;
- the request count is always ``max_num_seqs``: requests past the real ones own no tokens, read
  the scratch row of the block table, and their kernel programs return at once;
- the block table is the cache's whole device table, gathered inside the graph by slot.

The graph returns hidden states; the caller projects the rows it samples (a prefill chunk's
logits are one row, not the chunk's). Host inputs travel in one pinned buffer and one copy, as in
``decode_graphs.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.attention import PagedMetadata, kernel_metadata
from worker.graph_capture import GraphCapture, StagedInputs
from worker.kv_cache import KVCache

log = logging.getLogger("specd.worker")

# (input_ids [T], positions [T], meta) -> hidden [T, hidden]
Backbone = Callable[[torch.Tensor, torch.Tensor, PagedMetadata], torch.Tensor]


def token_buckets(smallest: int, max_tokens: int) -> list[int]:
    """Multiples of ``smallest`` up to 8x it, then multiples of 4x it, up to the first that holds
    ``max_tokens``. A step is padded to the next bucket, so the steps of continuous batching (the
    running decodes plus an arrival's prompt: 64 + 73 tokens, say) want fine steps where they
    fall: powers of two ran that one at 256 tokens, 1.9x its work. Every bucket stays a multiple
    of ``smallest`` (pad mode's token bucket)."""
    out = [smallest]
    while out[-1] < max_tokens:
        step = smallest if out[-1] < 8 * smallest else 4 * smallest
        out.append(out[-1] + step)
    return out


@dataclass
class _Graph:
    num_tokens: int  # T, the bucket
    # device int64: positions [T] | slot_mapping [T] | query_start [B + 1] | slot_idx [B]
    buf: StagedInputs
    input_ids: torch.Tensor  # [T], filled on the device from the step's ids
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None

    def split(self, t: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
        n = self.num_tokens
        return t[:n], t[n : 2 * n], t[2 * n : 2 * n + b + 1], t[2 * n + b + 1 :]


class RaggedGraphs:
    """Owned by one ``ModelExecutor`` (CUDA, paged kernel): ``fits`` then ``forward``."""

    def __init__(
        self,
        backbone: Backbone,
        kv_cache: KVCache,
        *,
        max_tokens: int,
        device: torch.device,
        smallest: int = 64,
        use_graphs: bool = True,
    ) -> None:
        self.backbone = backbone
        self.kv_cache = kv_cache
        self.device = device
        self.buckets = token_buckets(smallest, max_tokens)
        self.num_reqs = kv_cache.max_num_seqs
        self.use_graphs = use_graphs and device.type == "cuda"
        self._graphs: dict[int, _Graph] = {}
        self._capturer = GraphCapture(device) if self.use_graphs else None
        self.num_captured = 0
        self.num_forwards = 0
        self.last_rows: torch.Tensor | None = None  # the last forward's tokens' cache rows

    def fits(self, total_tokens: int, num_reqs: int) -> bool:
        return 0 < total_tokens <= self.buckets[-1] and 0 < num_reqs <= self.num_reqs

    def _meta(self, g: _Graph) -> tuple[torch.Tensor, PagedMetadata]:
        pos, slot_mapping, query_start, slot_idx = g.split(g.buf.inputs, self.num_reqs)
        cache = self.kv_cache
        meta = kernel_metadata(
            cache, slot_mapping, cache.blocks.table[slot_idx], query_start, pos, unowned_rows=True
        )
        return pos, meta

    def _graph(self, num_tokens: int) -> _Graph:
        g = self._graphs.get(num_tokens)
        if g is not None:
            return g
        size = 2 * num_tokens + 2 * self.num_reqs + 1
        g = _Graph(
            num_tokens,
            StagedInputs(size, self.device),
            torch.zeros(num_tokens, dtype=torch.long, device=self.device),
        )
        self._graphs[num_tokens] = g
        if self.use_graphs:
            self._capture(g)
        return g

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket now (a daemon does before it reports ready)."""
        if self.use_graphs:
            for n in self.buckets:
                self._graph(n)
        return len(self._graphs) if self.use_graphs else 0

    def _fill(self, g: _Graph, slots: list[int], starts: list[int], counts: list[int]) -> int:
        """The step's layout into ``g.buf.staging``; returns the real token count."""
        cache, b = self.kv_cache, self.num_reqs
        pos, slot_mapping, query_start, slot_idx = (t.numpy() for t in g.split(g.buf.staging, b))
        c = np.asarray(counts, np.int64)
        total = int(c.sum())
        n = len(slots)
        owner = np.repeat(np.arange(n), c)
        cu = np.concatenate([[0], np.cumsum(c)])
        pos[:total] = np.asarray(starts, np.int64)[owner] + np.arange(total) - cu[owner]
        pos[total:] = 0
        slots_np = np.asarray(slots, np.int64)
        slot_mapping[:total] = cache.blocks.cache_rows(slots_np[owner], pos[:total])
        # padding tokens write into the scratch block (flat rows 0 .. block_size - 1)
        slot_mapping[total:] = np.arange(g.num_tokens - total) % cache.block_size
        query_start[: n + 1] = cu
        query_start[n + 1 :] = total  # requests past the real ones own no tokens
        slot_idx[:n] = slots_np
        slot_idx[n:] = cache.scratch_slot
        return total

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream, then capture; the dummy layout only touches the scratch
        block (one request of no tokens: every token is padding)."""
        assert self._capturer is not None
        self._fill(g, [], [], [])
        graph, g.hidden = self._capturer.capture(
            g.buf, lambda: self.backbone(g.input_ids, *self._meta(g))
        )
        g.graph = graph
        self.num_captured += 1
        log.debug("captured a ragged graph: %d tokens", g.num_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: list[int],
        start_positions: list[int],
        num_tokens: list[int],
    ) -> torch.Tensor:
        """Hidden states [sum(num_tokens), hidden] of a step that ``fits`` (its slots hold their
        blocks already: ``KVCache.allocate``)."""
        self.num_forwards += 1
        total = sum(num_tokens)
        bucket = next(n for n in self.buckets if n >= total)
        g = self._graph(bucket)
        g.buf.host()  # (the last copy out of the staging buffer has finished)
        self._fill(g, slots, start_positions, num_tokens)
        g.buf.send()
        g.input_ids[:total].copy_(input_ids)
        if g.graph is not None:
            g.graph.replay()
            assert g.hidden is not None
            hidden = g.hidden
        else:
            hidden = self.backbone(g.input_ids, *self._meta(g))
        self.last_rows = g.split(g.buf.inputs, self.num_reqs)[1][:total]  # the tokens' cache rows
        # a copy: the graph's output buffer is overwritten by the next replay
        return hidden[:total].clone()
