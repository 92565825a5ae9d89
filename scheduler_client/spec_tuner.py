"""Adaptive speculation length, from measured goodput.

Each decode step the tuner picks one draft width K for the batch (each request then verifies
min(K, its own drafts)). The worker pads a decode step to its widest request, so a step's cost
depends on the batch size and that width: the tuner keeps the measured step time per (batch
bucket, width) and estimates each request's per-draft acceptance probability alpha from its own
history. It picks the K that maximises expected goodput,

    sum over requests of (1 - alpha^(k+1)) / (1 - alpha)   /   step time(batch, 1 + K),

with k = min(K, the request's drafts). Widths it has not measured for a batch size are tried
(the ends first), unmeasured ones in between are interpolated, and the other end is re-measured
now and then, so a machine whose costs change is followed. At batch 1 on a GPU, where a step costs
about the same whatever its width, this keeps full speculation; at large batch, where verifying
drafts costs real compute, it speculates less or not at all, so speculation never costs throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PRIOR_ALPHA = 0.5  # before a request has history
PRIOR_WEIGHT = 2.0  # ... worth this many judged drafts
EMA = 0.2  # weight of a new step-time sample
EXPLORE_EVERY = 64  # decisions per batch bucket between re-measurements of the other end


def batch_bucket(num_reqs: int) -> int:
    b = 1
    while b < num_reqs:
        b *= 2
    return b


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a request gains from one verify step with k drafts (accepted run + 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class _Bucket:
    seconds: dict[int, float] = field(default_factory=dict)  # width (1 + K) -> EMA step time
    decisions: int = 0


class SpeculationTuner:
    """Owned by the scheduler: ``choose`` before a step, ``observe_step`` after it."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def alpha(num_judged: float, num_accepted: float) -> float:
        """Per-draft acceptance probability from a request's counts, smoothed by a prior."""
        return (num_accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (num_judged + PRIOR_WEIGHT)

    def choose(self, alphas: Sequence[float], caps: Sequence[int]) -> int:
        """The batch's draft width K (0..max_k) for a decode step of these requests (all of
        them: a request without drafts has cap 0 and still yields its one token), each able to
        verify at most ``caps[i]`` drafts."""
        top = min(self.max_k, max(caps, default=0))
        if top <= 0:
            return 0
        bucket = self._buckets.setdefault(batch_bucket(len(caps)), _Bucket())
        bucket.decisions += 1
        known = bucket.seconds
        for width in (1 + top, 1):  # measure both ends first
            if width not in known:
                return width - 1
        # gain[k] = sum over requests of expected_tokens(alpha, min(k, cap)), for every k at once
        # (a Python double loop cost 0.22 ms a step at batch 64: bench/scheduler_step_bench.py)
        a = np.minimum(np.asarray(alphas, np.float64), 1.0 - 1e-9)
        ks = np.minimum(np.arange(top + 1)[:, None], np.asarray(caps)[None, :])  # [K + 1, B]
        gains = ((1.0 - a ** (ks + 1)) / (1.0 - a)).sum(axis=1)
        best_k, best = top, -1.0
        for k in range(top + 1):
            rate = float(gains[k]) / self._time(known, 1 + k)
            if rate > best:
                best_k, best = k, rate
        if bucket.decisions % EXPLORE_EVERY == 0:  # refresh the end we are not using
            return 0 if best_k > 0 else top
        return best_k

    def observe_step(self, num_reqs: int, width: int, seconds: float) -> None:
        """A decode-only step of ``num_reqs`` requests whose widest ran ``width`` tokens."""
        known = self._buckets.setdefault(batch_bucket(num_reqs), _Bucket()).seconds
        old = known.get(width)
        known[width] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    @staticmethod
    def _time(known: dict[int, float], width: int) -> float:
        """Measured, else linear between the nearest measured widths (at least the two ends)."""
        if width in known:
            return known[width]
        lo = max(w for w in known if w < width)
        hi = min(w for w in known if w > width)
        f = (width - lo) / (hi - lo)
        return known[lo] + f * (known[hi] - known[lo])
