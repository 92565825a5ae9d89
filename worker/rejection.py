"""Batched verification of drafts against the target (Leviathan et al., 2023).

Greedy rows accept a draft while it equals the target's argmax. Sampled rows accept draft ``d`` with
probability ``min(1, p(d) / q(d))``; at the first rejection they sample from the normalised
``max(0, p - q)``; when every draft is accepted they sample a bonus token from ``p``. Drafters without a
distribution (n-gram) have a one-hot ``q``. The grammar mask is applied to the target logits before
any of this, so a forbidden draft has ``p = 0`` and is always rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.host_copy import to_device
from worker.sampling import probs_from_logits, sample_from


@dataclass
class VerifyInput:
    """Per step, for the requests that sample. B requests, K = max drafts, R = sum(w_i + 1) rows.

    logits: [R, V] float32, grammar mask already applied; rows of request i are
    ``cu_rows[i] .. cu_rows[i+1]`` (its w_i drafts' positions, then the bonus position).
    draft_token_ids: [B, K] (entries past w_i are ignored); num_drafts: [B] (host list).
    draft_probs: [B, K, V] or None (one-hot drafts); an all-zero row means one-hot too.
    temperature, top_p: [B] float; top_k: [B] int; greedy: [B] bool.
    uniforms: [B, K + 2] in [0, 1): request i accepts draft j with draw j and samples its final
    token with draw num_drafts[i], so its randomness does not depend on the batch's widest draft.
    """

    logits: torch.Tensor
    cu_rows: list[int]
    num_drafts: list[int]
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    uniforms: torch.Tensor
    all_greedy: bool = False  # host knowledge: skip the sampling path entirely
    filtered: bool = True  # host knowledge: some row uses top-k or top-p


@dataclass
class VerifyOutput:
    """output_token_ids: [B, K + 1], -1 past num_sampled; num_accepted: [B]."""

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


def pad_rows(x: torch.Tensor, cu_rows: list[int], width: int, fill: float) -> torch.Tensor:
    """Flat rows [R, ...] -> [B, width, ...], padded with ``fill``."""
    b = len(cu_rows) - 1
    out = x.new_full((b, width, *x.shape[1:]), fill)
    # on the host: repeat_interleave on the device would read its output size back (a sync)
    index = to_device(np.stack(_row_owners(cu_rows)), x.device)  # [2, R]
    out[index[0], index[1]] = x
    return out


def _row_owners(cu_rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each flat logit row's (request, column): request j owns rows cu_rows[j] ..
    cu_rows[j + 1] - 1."""
    cu = np.asarray(cu_rows, np.int64)
    lens = np.diff(cu)
    return np.repeat(np.arange(len(lens)), lens), np.arange(int(cu[-1])) - np.repeat(cu[:-1], lens)


def verify(inp: VerifyInput) -> VerifyOutput:
    b = len(inp.num_drafts)
    k = inp.draft_token_ids.shape[1]
    device = inp.logits.device
    num_drafts = to_device(inp.num_drafts, device)  # [B]
    pos = torch.arange(k + 1, device=device)[None, :]  # [1, K+1]
    logits = pad_rows(inp.logits, inp.cu_rows, k + 1, 0.0)  # [B, K+1, V]
    vocab = logits.shape[-1]
    in_vocab = (inp.draft_token_ids >= 0) & (inp.draft_token_ids < vocab)  # [B, K]
    drafts = torch.where(in_vocab, inp.draft_token_ids.long(), 0)  # [B, K]
    # an id outside the vocabulary is a draft the target can never accept
    valid = pos[:, :k] < num_drafts[:, None]  # [B, K]

    # Greedy: accept while the draft equals the argmax; the argmax after the accepted run is the
    # corrected (or bonus) token, so the output is simply the argmax row.
    argmax = logits.argmax(-1)  # [B, K+1]
    greedy_match = (argmax[:, :k] == drafts) & valid & in_vocab
    greedy_accepted = greedy_match.int().cumprod(-1).sum(-1)  # [B]
    if inp.all_greedy:
        tokens = torch.where(pos <= greedy_accepted[:, None], argmax, torch.full_like(argmax, -1))
        return VerifyOutput(output_token_ids=tokens, num_accepted=greedy_accepted)

    # Sampled rows.
    temp = torch.where(inp.greedy, torch.ones_like(inp.temperature), inp.temperature)
    rep = lambda t: t[:, None].expand(b, k + 1).reshape(-1)  # noqa: E731
    p = probs_from_logits(
        logits.view(-1, vocab), rep(temp), rep(inp.top_k), rep(inp.top_p), inp.filtered
    )
    p = p.view(b, k + 1, vocab)
    q = torch.zeros(b, k, vocab, device=device).scatter_(2, drafts[..., None], 1.0)
    if inp.draft_probs is not None:
        # rows the drafter left all-zero (scheduler-supplied ids) stay one-hot
        has_q = inp.draft_probs.sum(-1, keepdim=True) > 0
        q = torch.where(has_q, inp.draft_probs, q)
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    q_d = q.gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    accept = (inp.uniforms[:, :k] * q_d < p_d) & valid & in_vocab  # u < p/q, no division
    sampled_accepted = accept.int().cumprod(-1).sum(-1)  # [B]
    # The final token: from max(0, p - q) at the first rejected position, or from p at the bonus
    # position when all w drafts were accepted.
    at = sampled_accepted  # [B]
    p_at = p[torch.arange(b, device=device), at]  # [B, V]
    all_accepted = at >= num_drafts
    q_at = (
        q[torch.arange(b, device=device), at.clamp(max=max(k - 1, 0))]
        if k
        else torch.zeros_like(p_at)
    )
    residual = torch.where(all_accepted[:, None], p_at, (p_at - q_at).clamp(min=0))
    # A residual of all zeros means p == q exactly there; then sampling from p is exact.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    # the draw right after the request's own drafts, so the batch's widest draft does not matter
    final = sample_from(residual, inp.uniforms.gather(1, num_drafts[:, None]).squeeze(1))  # [B]

    num_accepted = torch.where(inp.greedy, greedy_accepted, sampled_accepted)
    sampled_row = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)  # [B, K+1] accepted drafts
    sampled_row = sampled_row.scatter(1, at[:, None], final[:, None])  # ... then the final token
    tokens = torch.where(inp.greedy[:, None], argmax, sampled_row)
    tokens = torch.where(pos <= num_accepted[:, None], tokens, torch.full_like(tokens, -1))
    return VerifyOutput(output_token_ids=tokens, num_accepted=num_accepted)


def verify_greedy(
    logits: torch.Tensor, drafts_by_row: torch.Tensor, cu_rows: list[int], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """An all-greedy batch: the same result as ``verify`` for greedy rows, with one argmax and
    one host copy (the designed sync) instead of its ~20 small kernels and host-to-device copies.

    logits [R, V]; drafts_by_row [R]: the draft each row verifies (the bonus row's is ignored);
    request j owns rows cu_rows[j] .. cu_rows[j+1] (its drafts, then the bonus). Returns
    (tokens [B, width + 1] with -1 past each request's sampled tokens, num_accepted [B]): each
    request accepts its drafts while they equal the argmax, counted on the host.
    """
    argmax, drafts = torch.stack([logits.argmax(-1), drafts_by_row.to(torch.long)]).cpu().numpy()
    num = len(cu_rows) - 1
    tokens = np.full((num, width + 1), -1, np.int64)
    if num >= ARRAY_ACCEPT_MIN_BATCH:
        return _accept_arrays(argmax, drafts, cu_rows, tokens)
    accepted = np.zeros(num, np.int64)
    for j in range(num):
        a, w = cu_rows[j], cu_rows[j + 1] - cu_rows[j] - 1
        match = argmax[a : a + w] == drafts[a : a + w]
        n = w if match.all() else int(match.argmin())
        accepted[j] = n
        tokens[j, : n + 1] = argmax[a : a + n + 1]
    return tokens, accepted


# from this many requests ``verify_greedy`` counts acceptance over the batch as arrays; a
# request at a time it cost 235-290 us at batch 64 on the 2-core CPU machine against 17-35, and
# 7 against 24 at batch 1
ARRAY_ACCEPT_MIN_BATCH = 8


def _accept_arrays(
    argmax: np.ndarray, drafts: np.ndarray, cu_rows: list[int], tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``verify_greedy``'s counting over the batch as arrays: each request's first row whose
    argmax is not its draft (its bonus row at the latest) ends its accepted run."""
    cu = np.asarray(cu_rows, np.int64)
    rows = int(cu[-1])
    miss = argmax != drafts
    miss[cu[1:] - 1] = True  # a request's bonus row verifies no draft
    first_miss = np.minimum.reduceat(np.where(miss, np.arange(rows), rows), cu[:-1])
    accepted = first_miss - cu[:-1]
    req, col = _row_owners(cu_rows)
    keep = col <= accepted[req]  # the accepted drafts' rows and the one after them
    tokens[req[keep], col[keep]] = argmax[keep]
    return tokens, accepted
