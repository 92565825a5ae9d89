"""The oracle: one speculative step for one request, written plainly (gpt-fast style).

No batching, no cache, no padding: one full forward over prefix + drafts, then the textbook
acceptance loop, one position at a time. The fast path must match it exactly for greedy, and
exactly for sampling when both consume the same uniform random numbers.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def target_probs(
    model: torch.nn.Module, prefix: list[int], drafts: list[int], temperature: float
) -> torch.Tensor:
    """[len(drafts) + 1, V]: the target's next-token distribution at each verify position
    (one-hot argmax when temperature is 0)."""
    logits = model(torch.tensor([prefix + drafts])).logits[0, len(prefix) - 1 :].float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return (logits / temperature).softmax(-1)


def speculative_step(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, uniforms: list[float]
) -> list[int]:
    """Leviathan et al., one position at a time. p [k+1, V] target, q [k, V] draft (None: one-hot),
    uniforms: k acceptance draws then one for the final sample. Returns the emitted tokens."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        q_i = torch.zeros_like(p[i]) if q is None else q[i]
        if q is None:
            q_i[d] = 1.0
        if uniforms[i] * q_i[d] < p[i, d]:  # accept with probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[i] - q_i).clamp(min=0)
        if residual.sum() <= 0:
            residual = p[i]
        out.append(_inverse_cdf(residual, uniforms[len(drafts)]))
        return out
    out.append(_inverse_cdf(p[len(drafts)], uniforms[len(drafts)]))
    return out


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    cdf = weights.cumsum(0)
    return min(int(torch.searchsorted(cdf, torch.tensor([u]) * cdf[-1]).item()), len(cdf) - 1)
