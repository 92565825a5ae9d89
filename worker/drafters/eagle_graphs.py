"""The EAGLE head's greedy drafting as one padded layout, replayed from a CUDA graph on GPU.

A drafting step of the head is a catch-up forward (each request's pairs since its last proposal:
one plus the drafts it just had accepted, so at most k + 1) and then K - 1 one-token forwards,
each fed the previous forward's predicted hidden state and its argmax draft. Run eagerly that is
some fifteen small launches and a host-built layout per forward, K + 1 times: on an H100 a
drafting step at batch 1 took 11.7 ms in process against 2.3 ms for the target's own step. Here
the whole step is one replay: every request is padded to ``width`` catch-up pairs and the batch
to its bucket (the target's ``BATCH_BUCKETS``), and the K forwards with their argmaxes are
captured in one graph per (batch bucket, K). The host writes the layout into one pinned buffer
and one copy sends it.

The eager path keeps what does not fit: requests that sample (their drafts are drawn with each
request's own generator), and the part of a backlog longer than ``width`` pairs (a new prompt,
or the tokens since the tuner last turned drafting down), which the drafter runs first.

Padding: a request's catch-up rows past its real pairs write their keys at the positions its
drafts take next (each draft forward rewrites its position's keys before any query reads them),
past the blocks it holds into the scratch block, and past max_model_len (fed clamped) into rows
no query reads; padded requests run on the scratch slot. Attention runs the paged kernel, whose
work follows each token's own position (the drafter uses this layout where it runs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.decode_graphs import BATCH_BUCKETS
from worker.graph_capture import GraphCapture, StagedInputs
from worker.kv_cache import KVCache

log = logging.getLogger("specd.worker")

# (tokens [B*W], feature rows [B*W], positions [B*W], slot_mapping [B*W], slot_idx [B],
#  last [B], draft positions [(K-1)*B], draft slot_mapping [(K-1)*B], B, W, K) -> drafts [B, K]
DraftBody = Callable[..., torch.Tensor]


@dataclass
class _Shape:
    """Buffers (and on CUDA the graph) of one (batch bucket, number of drafts)."""

    num_reqs: int  # B: the batch bucket
    num_drafts: int  # K
    width: int  # W: catch-up pairs per request
    buf: StagedInputs  # int64, the parts of ``split``
    graph: torch.cuda.CUDAGraph | None = None
    drafts: torch.Tensor | None = None  # [B, K] the captured output

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, b, d = self.num_reqs * self.width, self.num_reqs, self.num_reqs * (self.num_drafts - 1)
        return torch.split(t, [n, n, n, n, b, b, d, d])


class EagleGraphs:
    """Owned by one ``EagleDrafter``: ``drafts`` runs a greedy drafting step whose every request
    has at most ``width`` pairs to catch up."""

    def __init__(
        self,
        body: DraftBody,
        kv_cache: KVCache,
        *,
        width: int,
        max_drafts: int,
        device: torch.device,
        use_graphs: bool,
    ) -> None:
        self.body = body
        self.kv_cache = kv_cache
        self.width = width
        self.max_drafts = max_drafts
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._capturer = GraphCapture(device) if self.use_graphs else None
        self.num_captured = 0
        self.num_runs = 0

    def _bucket(self, num_reqs: int) -> int:
        top = self.kv_cache.max_num_seqs
        return min(next((x for x in BATCH_BUCKETS if x >= num_reqs), num_reqs), top)

    def _shape(self, num_reqs: int, k: int) -> _Shape:
        key = (num_reqs, k)
        shape = self._shapes.get(key)
        if shape is not None:
            return shape
        size = 4 * num_reqs * self.width + 2 * num_reqs * k
        shape = _Shape(num_reqs, k, self.width, StagedInputs(size, self.device))
        self._shapes[key] = shape
        if self.use_graphs:
            self._capture(shape)
        return shape

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every batch bucket and number of drafts now (before the first request, as the
        target's decode graphs are). Returns how many shapes exist."""
        if not self.use_graphs:
            return 0
        for b in sorted({self._bucket(x) for x in BATCH_BUCKETS}):
            for k in range(1, self.max_drafts + 1):
                self._shape(b, k)
        return len(self._shapes)

    def _fill_padding(self, shape: _Shape, num_reqs: int) -> None:
        """Rows past the real requests: dummy requests on the scratch slot."""
        b, w, k = shape.num_reqs, shape.width, shape.num_drafts
        tok, feat, pos, smap, slot_idx, last, dpos, dmap = (
            t.numpy() for t in shape.split(shape.buf.staging)
        )
        bs = self.kv_cache.block_size  # the scratch block holds flat rows 0 .. bs - 1
        pad = slice(num_reqs * w, b * w)
        pos[pad] = np.tile(np.arange(w), b - num_reqs)
        smap[pad] = pos[pad] % bs
        tok[pad] = 0
        feat[pad] = 0  # the feature store's scratch row
        slot_idx[num_reqs:] = self.kv_cache.scratch_slot
        last[num_reqs:] = np.arange(num_reqs, b) * w
        for j in range(k - 1):
            dpos[j * b + num_reqs : (j + 1) * b] = j
            dmap[j * b + num_reqs : (j + 1) * b] = j % bs

    def _run_body(self, shape: _Shape) -> torch.Tensor:
        parts = shape.split(shape.buf.inputs)
        return self.body(*parts, shape.num_reqs, shape.width, shape.num_drafts)

    def _capture(self, shape: _Shape) -> None:
        """Warm up on a side stream, then capture; the dummy inputs only touch scratch rows."""
        assert self._capturer is not None
        self._fill_padding(shape, 0)
        graph, shape.drafts = self._capturer.capture(shape.buf, lambda: self._run_body(shape))
        shape.graph = graph
        self.num_captured += 1
        log.debug(
            "captured an EAGLE drafting graph: batch %d, %d drafts",
            shape.num_reqs,
            shape.num_drafts,
        )

    def drafts(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        tokens: np.ndarray,
        feature_rows: np.ndarray,
        k: int,
    ) -> torch.Tensor:
        """[n, k] greedy drafts of n requests: request i catches up its pairs at positions
        ``starts[i]`` .. ``lengths[i] - 2`` (at most ``width`` of them; ``tokens`` and
        ``feature_rows`` hold their next tokens and feature-store rows, flat and request-major),
        then drafts k tokens from position ``lengths[i] - 1`` on. The head's cache must hold
        blocks up to each request's last draft position (``EagleDrafter`` allocates them)."""
        n = len(slots)
        counts = lengths - 1 - starts
        assert n and counts.min() >= 1 and counts.max() <= self.width, "catch up first"
        self.num_runs += 1
        shape = self._shape(self._bucket(n), k)
        b, w = shape.num_reqs, shape.width
        tok, feat, pos, smap, slot_idx, last, dpos, dmap = (
            t.numpy() for t in shape.split(shape.buf.host())
        )
        self._fill_padding(shape, n)
        top = self.kv_cache.max_model_len - 1
        blocks = self.kv_cache.blocks
        # catch-up rows: request i's pairs from starts[i], padded to w positions (past its blocks
        # or past max_model_len the keys go to the scratch block; the position fed is clamped)
        grid = (starts[:, None] + np.arange(w)).ravel()  # [n * w]
        pos[: n * w] = np.minimum(grid, top)
        smap[: n * w] = blocks.cache_rows(np.repeat(slots, w), grid)
        cu = np.concatenate([[0], np.cumsum(counts)])
        real = np.repeat(np.arange(n) * w - cu[:-1], counts) + np.arange(int(cu[-1]))
        tok[: n * w] = 0
        tok[real] = tokens
        feat[: n * w] = 0
        feat[real] = feature_rows
        slot_idx[:n] = slots
        last[:n] = np.arange(n) * w + counts - 1
        # draft forward j runs position lengths - 1 + j
        for j in range(k - 1):
            p = lengths - 1 + j
            dpos[j * b : j * b + n] = np.minimum(p, top)
            dmap[j * b : j * b + n] = blocks.cache_rows(slots, p)
        shape.buf.send()
        if shape.graph is not None:
            shape.graph.replay()
            assert shape.drafts is not None
            out = shape.drafts
        else:
            out = self._run_body(shape)
        # a copy: the next replay rewrites the captured buffer while these may still be read
        return out[:n].clone()
