"""Adaptive speculation length, from measured goodput.

Each step the tuner makes two choices for the batch: ``propose``, how many drafts the worker
proposes after the step (``SchedulerOutput.max_draft_proposals``), and ``choose``, how many of the
drafts it holds the step verifies (each request then verifies min(K, its own drafts)). The worker
pads a decode step to its widest request, and drafting K tokens costs the drafter's K forwards, so a
step's cost depends on the batch size and that width: the tuner keeps the measured step time per
(batch bucket, width), where a step counts only when what it verified and what it drafted agree
(``observe_step``), so the time of width 1 + K is the whole cost of speculating K per step:
verifying K and drafting the next K. It estimates each request's per-draft acceptance probability
alpha from its own history and picks the K that maximises expected goodput,

    sum over requests of (1 - alpha^(k+1)) / (1 - alpha)   /   step time(batch, 1 + K),

with k = min(K, the request's drafts). For a batch size it has not measured, it runs each end (no
drafts, all drafts) for two steps, propose then verify; widths in between are interpolated, and
the end not in use is re-measured now and then, so a machine whose costs change is followed. At
batch 1 on a GPU, where a step costs about the same whatever its width, this keeps full
speculation; where verifying or drafting costs more than the accepted drafts save (large batches,
a slow drafter), the proposal width goes to zero and the drafter stops working, so speculation
never costs throughput.
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
    hold: int = -1  # a proposal width to repeat for one more step (measuring it), -1: none


class SpeculationTuner:
    """Owned by the scheduler: ``choose`` before a step, ``observe_step`` after it."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def alpha(num_judged: float, num_accepted: float) -> float:
        """Per-draft acceptance probability from a request's counts, smoothed by a prior."""
        return (num_accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (num_judged + PRIOR_WEIGHT)

    def propose(self, alphas: Sequence[float], caps: Sequence[int]) -> int:
        """How many drafts (0..max_k) the worker proposes for each of these requests after this
        step (those that sample; ``caps[i]``: a request's own width), for the next step to
        verify. Zero when speculation does not pay: then the drafter does no work."""
        top = min(self.max_k, max(caps, default=0))
        if top <= 0:
            return 0
        bucket = self._buckets.setdefault(batch_bucket(len(caps)), _Bucket())
        bucket.decisions += 1
        if bucket.hold >= 0:  # the second step of a measurement: propose, then verify as much
            k, bucket.hold = bucket.hold, -1
            return k
        for width in (1 + top, 1):  # measure both ends first
            if width not in bucket.seconds:
                bucket.hold = width - 1
                return width - 1
        best_k = self._best(bucket.seconds, alphas, caps, top)
        if bucket.decisions % EXPLORE_EVERY == 0:  # refresh the end we are not using
            bucket.hold = 0 if best_k > 0 else top
            return bucket.hold
        return best_k

    def choose(self, alphas: Sequence[float], caps: Sequence[int]) -> int:
        """The batch's draft width K (0..max_k) for a decode step of these requests (all of
        them: a request without drafts has cap 0 and still yields its one token), each able to
        verify at most ``caps[i]`` drafts (what the worker proposed). Every draft held, until
        both ends are measured."""
        top = min(self.max_k, max(caps, default=0))
        if top <= 0:
            return 0
        known = self._buckets.setdefault(batch_bucket(len(caps)), _Bucket()).seconds
        if 1 + top not in known or 1 not in known:
            return top
        return self._best(known, alphas, caps, top)

    def _best(
        self, known: dict[int, float], alphas: Sequence[float], caps: Sequence[int], top: int
    ) -> int:
        """The K in 0..top of the highest expected tokens per second."""
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
        return best_k

    def observe_step(self, num_reqs: int, width: int, seconds: float, proposals: int = -1) -> None:
        """A decode-only step of ``num_reqs`` requests whose widest ran ``width`` tokens and
        after which the worker proposed at most ``proposals`` drafts (-1: not capped). Counted
        when it is a step of its width's steady state: it drafted what it verified, or verified
        some drafts and proposed more (a drafter that found fewer than asked). A step that
        verified drafts and proposed fewer, or proposed drafts it did not verify, is a switch
        between widths: its time belongs to neither."""
        k = width - 1
        if proposals >= 0 and not (proposals == k or 0 < k < proposals):
            return
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
