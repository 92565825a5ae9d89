"""A drafter's catch-up forward, cut to the worker's token budget.

A drafter with its own cache (a draft model, the EAGLE head, parallel drafting) runs, before it
proposes, every committed token its cache lacks. That backlog has no bound of its own: a new
request's whole prompt, or every token since the speculation tuner turned the drafter down to
zero, for each request at once (64 requests of 8k tokens: half a million tokens in one forward).
The target's prefill is chunked by ``--max-num-batched-tokens``; the catch-up is chunked the same
way, so a drafter never runs a forward the target would not, and chunks of the budget's size
replay the ragged CUDA graphs instead of running eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from worker.host_copy import to_device
from worker.model_executor import ModelExecutor

# run(tokens, idx, starts, counts, rows): one forward over the flat tokens ``tokens`` of the
# requests ``idx`` (request j of the chunk: counts[j] tokens from position starts[j]); returns its
# outputs [len(rows), ...] at ``rows``, flat rows of the chunk.
ChunkForward = Callable[[slice, list[int], list[int], list[int], np.ndarray], torch.Tensor]


def forward_in_chunks(
    run: ChunkForward,
    starts: list[int],
    counts: list[int],
    rows: np.ndarray,
    max_tokens: int,
) -> torch.Tensor:
    """One flat batch (request i: ``counts[i]`` tokens from position ``starts[i]``) run as
    forwards of at most ``max_tokens`` tokens (0: one forward), in order. A request's tokens may
    be cut anywhere: a later chunk reads the earlier chunks' keys from the cache. ``rows`` [R]
    (flat, ascending) are the rows whose outputs are wanted; returns them in that order."""
    total = sum(counts)
    if max_tokens <= 0 or total <= max_tokens:
        return run(slice(0, total), list(range(len(counts))), starts, counts, rows)
    outs: list[torch.Tensor] = []
    i, done = 0, 0  # the request the next chunk starts in, and its tokens already run
    for lo in range(0, total, max_tokens):
        hi = min(lo + max_tokens, total)
        idx: list[int] = []
        chunk_starts: list[int] = []
        chunk_counts: list[int] = []
        at = lo
        while at < hi:
            take = min(counts[i] - done, hi - at)
            if take:
                idx.append(i)
                chunk_starts.append(starts[i] + done)
                chunk_counts.append(take)
            at, done = at + take, done + take
            if done == counts[i]:
                i, done = i + 1, 0
        wanted = rows[(rows >= lo) & (rows < hi)] - lo
        outs.append(run(slice(lo, hi), idx, chunk_starts, chunk_counts, wanted))
    return torch.cat(outs)


def executor_forward(
    ex: ModelExecutor, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[int]
) -> ChunkForward:
    """The ``ChunkForward`` of a draft model's executor over a flat batch: ``input_ids`` and
    ``positions`` [T] of the requests in ``slots``; returns the logits at the rows."""

    def run(
        tokens: slice, idx: list[int], starts: list[int], counts: list[int], rows: np.ndarray
    ) -> torch.Tensor:
        logits, _ = ex.forward(
            input_ids[tokens],
            positions[tokens],
            [slots[j] for j in idx],
            starts,
            counts,
            to_device(rows, ex.device),
        )
        return logits

    return run
