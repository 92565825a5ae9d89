"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's last n
tokens (n from max_n down to min_n) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np
import torch

from worker.drafters.base import Drafter, Proposal
from worker.host_copy import to_device
from worker.requests import RequestStates


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix n-gram.

    Candidates are the earlier positions e holding the last token; each longer n keeps those whose
    n - 1 preceding tokens match too, so the work shrinks with n instead of rescanning."""
    length = len(tokens)
    if length < 2:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # e <= length - 2
    best: np.ndarray | None = ends if min_n <= 1 and len(ends) else None
    for n in range(2, min(max_n, length - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends
    if best is None:
        return tokens[:0]
    start = int(best[-1]) + 1
    return tokens[start : start + k]


def ngram_lookup_device(
    tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ngram_lookup`` for a batch at once, on the tokens' device, without reading them back.

    ``tokens`` [B, C]: row b's first ``lengths[b]`` entries are its tokens (C at least the longest
    length); ``lengths`` [B] int64. Returns drafts [B, k] (entries past a row's count are junk) and
    the count of each row [B]: row by row what ``ngram_lookup`` returns. The work is B x C compares
    per n, a few kernels whatever B."""
    batch, width = tokens.shape
    cols = torch.arange(width, device=tokens.device)[None, :]
    ends = lengths[:, None]
    # candidate end positions e <= length - 2 holding the last token (n = 1)
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])
    match = (cols <= ends - 2) & (tokens == last)
    none = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
    best = _latest(match, cols) if min_n <= 1 else none
    for n in range(2, max_n + 1):
        # tokens[e - (n - 1)] == tokens[length - n], with n <= length - 1
        earlier = torch.nn.functional.pad(tokens, (n - 1, 0))[:, :width]
        want = tokens.gather(1, (lengths - n).clamp(min=0)[:, None])
        match = match & (cols >= n - 1) & (earlier == want) & (ends - 1 >= n)
        if n >= min_n:
            found = _latest(match, cols)
            best = torch.where(found >= 0, found, best)
    num = torch.where(best >= 0, (lengths - 1 - best).clamp(max=k), 0)
    index = ((best + 1)[:, None] + torch.arange(k, device=tokens.device)[None, :]).clamp(
        0, width - 1
    )
    return tokens.gather(1, index), num


def _latest(match: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The last column of each row where ``match`` holds, -1 where none does."""
    return torch.where(match, cols, -1).amax(1)


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, *, min_n: int = 1, max_n: int = 4, max_num_tokens: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_num_tokens = min_n, max_n, max_num_tokens

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        out = np.zeros((len(slots), max(max(widths, default=0), 1)), np.int64)
        num = []
        for i, (slot, k) in enumerate(zip(slots, widths, strict=True)):
            drafts = ngram_lookup(states.tokens(slot), self.min_n, self.max_n, k) if k else []
            out[i, : len(drafts)] = drafts
            num.append(len(drafts))
        return Proposal(to_device(out, states.device), num)
