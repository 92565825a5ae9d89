"""Turning logits into distributions: grammar bitmasks, temperature, top-k, top-p."""

from __future__ import annotations

import torch

from worker import bitmask_kernel


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(V/32)] -> bool [rows, V]; bit t % 32 of word t // 32 allows token t."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Forbid, in place, every token the grammar disallows. logits [R, V]; rows [M] the logit rows
    that bitmask [M, words] belongs to. ``use_triton`` (default: on CUDA when triton is there) runs
    it as one Triton launch (``bitmask_kernel``), with the same result."""
    if use_triton is None:
        use_triton = logits.is_cuda and bitmask_kernel.triton is not None
    if use_triton:
        bitmask_kernel.apply_bitmask_triton(logits, rows, bitmask)
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [M, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def probs_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """Softmax of filtered, tempered logits. logits [R, V]; temperature, top_k, top_p [R].

    temperature must be > 0 here (greedy rows never come this way); top_k 0 and top_p 1 disable.
    ``filtered`` False (known on the host) skips the sort when no row uses top-k or top-p; it is
    never read from the device, which would be a hidden sync.
    """
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    if filtered:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab)[:, None]
        drop = rank >= k
        probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs_sorted.cumsum(-1) - probs_sorted
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [R, V], uniform [R] in [0, 1) -> token ids [R]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)
