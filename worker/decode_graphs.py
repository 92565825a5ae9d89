"""Decode-shaped forwards as one padded ``[batch, width]`` layout, replayed from CUDA graphs on GPU.

A step in which every request runs 1..W tokens (its last token plus up to W - 1 drafts) and none is
prefilling has a shape known in advance: a batch bucket, the step's width w (its widest request,
so a step whose drafts were cut to fewer, or to none, costs what a narrower step costs) and a
context-length bucket. The layout pads every request to w tokens and the batch to its bucket; padding tokens write their keys
where nothing reads them (past the request's own positions, or the scratch block) and their outputs
are dropped. On CUDA each (batch bucket, length bucket) is captured once into a graph and then
replayed: one launch for the whole model instead of a dozen Python-issued kernels per layer.
Shapes are captured on first use. With ``length_buckets`` False (attention through the paged
kernel, whose work follows each token's own position whatever the block table's width) there is
one length, ``max_model_len``: ``capture_all`` captures every shape before the first request,
and no step waits for a capture when its context outgrows a bucket.

Host inputs travel in one pinned buffer and one non-blocking copy; before the host rewrites that
buffer it waits on the event of the previous copy (the copy may still be reading it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.graph_capture import GraphCapture, StagedInputs
from worker.kv_cache import KVCache

log = logging.getLogger("specd.worker")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_LEN_BUCKET = 256

# (input_ids [T], positions [T], slot_mapping [T], slot_idx [B], num_reqs, width, max_len)
#   -> (logits [T, vocab] float32, hidden [T, hidden])
DenseForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class _Shape:
    """Buffers (and on CUDA the graph) of one (batch bucket, width, length bucket)."""

    num_reqs: int  # batch bucket
    width: int  # tokens per request
    max_len: int  # keys attended per request
    num_tokens: int  # T: num_reqs * width, rounded up to the token bucket
    # device int64: ids [T] | positions [T] | slot_mapping [T] | slot_idx [B] | dest [B * width]
    buf: StagedInputs
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, b = self.num_tokens, self.num_reqs
        return t[:n], t[n : 2 * n], t[2 * n : 3 * n], t[3 * n : 3 * n + b], t[3 * n + b :]


class DecodeGraphs:
    """Owned by one ``ModelExecutor``: it calls ``fits`` and then ``forward`` for decode steps."""

    def __init__(
        self,
        dense_forward: DenseForward,
        kv_cache: KVCache,
        *,
        width: int,
        device: torch.device,
        use_graphs: bool,
        token_bucket: int = 1,
        length_buckets: bool = True,
    ) -> None:
        self.dense_forward = dense_forward
        self.length_buckets = length_buckets
        self.kv_cache = kv_cache
        self.width = width  # the widest a request may be
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.token_bucket = token_bucket
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self._capturer = GraphCapture(device) if self.use_graphs else None
        self.num_captured = 0
        self.num_forwards = 0
        # the last forward's (slot mapping [T], flat token -> padded row [total]) on the device
        self.last_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def fits(self, num_tokens: list[int], start_positions: list[int]) -> bool:
        if not num_tokens or len(num_tokens) > self.kv_cache.max_num_seqs:
            return False
        if max(num_tokens) > self.width or min(num_tokens) < 1:
            return False
        return max(start_positions) + self.width <= self.kv_cache.max_model_len

    def _buckets(self, num_reqs: int, start_positions: list[int]) -> tuple[int, int]:
        # fits() keeps num_reqs <= max_num_seqs, so the bucket is capped there
        b = min(
            next((x for x in BATCH_BUCKETS if x >= num_reqs), num_reqs), self.kv_cache.max_num_seqs
        )
        if not self.length_buckets:
            return b, self.kv_cache.max_model_len
        need = max(start_positions) + self.width
        length = MIN_LEN_BUCKET
        while length < need:
            length *= 2
        return b, min(length, self.kv_cache.max_model_len)

    def _shape(self, num_reqs: int, w: int, max_len: int) -> _Shape:
        key = (num_reqs, w, max_len)
        shape = self._shapes.get(key)
        if shape is not None:
            return shape
        tb = self.token_bucket
        n = -(-num_reqs * w // tb) * tb
        size = 3 * n + num_reqs + num_reqs * w
        shape = _Shape(num_reqs, w, max_len, n, StagedInputs(size, self.device))
        self._shapes[key] = shape
        if self.use_graphs:
            self._capture(shape)
        return shape

    @torch.inference_mode()
    def capture_all(self, max_context: int = MIN_LEN_BUCKET) -> int:
        """Capture every batch bucket and width for every length bucket up to ``max_context``
        now (a daemon does this for the shortest bucket before it reports ready, so the first
        requests do not pay for captures; longer contexts are captured when first met; without
        ``length_buckets`` the one length covers every context).
        Returns how many shapes exist."""
        if not self.use_graphs:
            return 0
        lengths = {self._buckets(1, [max(n - self.width, 0)])[1] for n in (1, max_context)}
        length = MIN_LEN_BUCKET
        while self.length_buckets and length < max(lengths):
            lengths.add(min(length, self.kv_cache.max_model_len))
            length *= 2
        for max_len in sorted(lengths):
            for b in sorted({min(x, self.kv_cache.max_num_seqs) for x in BATCH_BUCKETS}):
                for w in range(1, self.width + 1):
                    self._shape(b, w, max_len)
        return len(self._shapes)

    def _fill_padding(self, shape: _Shape, num_reqs: int) -> None:
        """Rows past the real requests: dummy requests on the scratch slot, then token padding."""
        cache, w = self.kv_cache, shape.width
        ids, pos, slot_mapping, slot_idx, _dest = (
            t.numpy() for t in shape.split(shape.buf.staging)
        )
        bs = cache.block_size  # the scratch block holds flat rows 0 .. bs - 1
        t = np.arange(w)
        pos[num_reqs * w : shape.num_reqs * w] = np.tile(t, shape.num_reqs - num_reqs)
        slot_mapping[num_reqs * w : shape.num_reqs * w] = (
            pos[num_reqs * w : shape.num_reqs * w] % bs
        )
        tail = shape.num_tokens - shape.num_reqs * w
        pos[shape.num_reqs * w :] = 0
        slot_mapping[shape.num_reqs * w :] = np.arange(tail) % bs
        slot_idx[num_reqs:] = cache.scratch_slot
        ids[:] = 0

    def _capture(self, shape: _Shape) -> None:
        """Warm up on a side stream, then capture; the dummy inputs only touch the scratch block."""
        assert self._capturer is not None
        self._fill_padding(shape, 0)
        args = (*shape.split(shape.buf.inputs)[:4], shape.num_reqs, shape.width, shape.max_len)
        graph, (shape.logits, shape.hidden) = self._capturer.capture(
            shape.buf, lambda: self.dense_forward(*args)
        )
        shape.graph = graph
        self.num_captured += 1
        log.debug(
            "captured a decode graph: batch %d, width %d, length %d",
            shape.num_reqs,
            shape.width,
            shape.max_len,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: list[int],
        start_positions: list[int],
        num_tokens: list[int],
        logits_indices: torch.Tensor,
        device_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``ModelExecutor.forward`` for a step that ``fits``: input_ids
        [num_tokens_total] flat; returns (logits [num_logits, vocab], hidden [num_tokens_total, H]).
        With ``device_starts`` [num_reqs] the real requests' positions and cache rows are
        written on the device from those (``start_positions``: upper bounds, for the bucket)."""
        num_reqs = len(slots)
        self.num_forwards += 1
        w = max(num_tokens)
        b, max_len = self._buckets(num_reqs, start_positions)
        shape = self._shape(b, w, max_len)
        cache = self.kv_cache
        _ids, pos, slot_mapping, slot_idx, dest = (t.numpy() for t in shape.split(shape.buf.host()))
        self._fill_padding(shape, num_reqs)
        starts = np.asarray(start_positions, np.int64)
        slots_np = np.asarray(slots, np.int64)
        real = (starts[:, None] + np.arange(w)).ravel()  # [num_reqs * W]
        pos[: num_reqs * w] = real
        # padding tokens past a request's blocks land in the scratch block (cache_rows)
        slot_mapping[: num_reqs * w] = cache.blocks.cache_rows(np.repeat(slots_np, w), real)
        slot_idx[:num_reqs] = slots_np
        # flat token f of request r at offset j -> padded row r * W + j
        counts = np.asarray(num_tokens, np.int64)
        cu = np.concatenate([[0], np.cumsum(counts)])
        total = int(cu[-1])
        dest[:total] = np.repeat(np.arange(num_reqs) * w - cu[:-1], counts) + np.arange(total)
        shape.buf.send()
        d_ids, d_pos, d_map, d_slots, d_dest = shape.split(shape.buf.inputs)
        d_dest = d_dest[:total]
        d_ids[d_dest] = input_ids
        if device_starts is not None:
            real_d = (device_starts[:, None] + torch.arange(w, device=self.device)).view(-1)
            n = num_reqs * w
            d_pos[:n] = real_d
            d_map[:n] = cache.blocks.cache_rows_device(
                d_slots[:num_reqs].repeat_interleave(w), real_d
            )
        if shape.graph is not None:
            shape.graph.replay()
            logits, hidden = shape.logits, shape.hidden
            assert logits is not None and hidden is not None
        else:
            logits, hidden = self.dense_forward(d_ids, d_pos, d_map, d_slots, b, w, max_len)
        self.last_rows = (d_map, d_dest)  # the tokens' cache rows: d_map[d_dest]
        return logits[d_dest[logits_indices]], hidden[d_dest]
