"""Adaptive speculation length, from measured goodput.

Each step the tuner makes two choices for the batch: ``propose``, how many drafts the worker
proposes after the step (``SchedulerOutput.max_draft_proposals``), and ``choose``, how many of the
drafts it holds the step verifies (each request then verifies min(K, its own drafts)). The worker
pads a decode step to its widest request, and drafting K tokens costs the drafter's K forwards, so a
step's cost depends on the batch size and that width: the tuner keeps the measured step time per
(batch bucket, width), where a step counts only when what it verified and what it drafted agree
(``observe_step``), so the time of width 1 + K is the whole cost of speculating K per step:
verifying K and drafting the next K. Under continuous batching with arrivals nearly every step also
carries a prefill chunk, so steps with one count too: each width keeps a fit of its step time
against the step's prefill tokens (``_Fit``), and widths are compared by the fit's decode part, its
time at no prefill. The prompts are prefilled whatever the width, so the width that makes decode
tokens cheapest is the one that makes the run fastest; comparing at the typical load would favour
drafting (the prefill dilutes what the extra width costs) where it loses. It estimates each
request's per-draft acceptance probability alpha from its own history and picks the K that maximises
expected goodput,

    sum over requests of 1 + c * h * ((1 - alpha^(k+1)) / (1 - alpha) - 1)   /   step time(batch, 1 + K),

with k = min(K, the request's drafts), h the share of the drafts asked for that the drafter
finds for the request (``Request.draft_hits``: an n-gram lookup finds a match for some requests;
1 where the drafts are already known, and for a model drafter) and c the calibration: what the
verify steps' accepted drafts made for each token this model expected of them (recent steps,
``observe_verified``; at most 1). For a batch size it has not measured, it runs each end (no
drafts, all drafts) for two steps, propose then verify; widths in between are interpolated, and the
end not in use is re-measured now and then (two steps: propose, then verify what was proposed), so a
machine whose costs change is followed; each re-measurement that confirms the choice doubles the
wait before the next one (64 decisions up to 1,024), since re-measuring a losing drafter costs its
catch-up and two of its steps; a re-measurement that made its end cheaper starts the waits over
(one that made it dearer confirms the choice); the no-drafts end, while counted in fewer than three
steps or when its last re-measurement made it cheaper (up to three times in a row), is measured
again after 8 decisions. While drafting is chosen, a width measured when the width in use cost
a quarter more than it does now (``STALE``: a worker's first, slow steps, a host that sped up),
for ``STALE_FOR`` decisions in a row, is measured anew: its samples are dropped, or for the
drafting end, it is re-measured at the next decision. While no drafts win by a clear margin
(``OFF_MARGIN``), the widths are weighed once in ``OFF_FOR`` decisions: without drafts nothing
is judged, so the choice holds until the step times move. At batch 1 on a GPU, where a step costs
about the same whatever its width, this keeps full speculation; where verifying or drafting costs
more than the accepted drafts save (large batches, a slow drafter), the proposal width goes to
zero and the drafter stops working, so speculation never costs throughput.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from protocol.messages import ModelRunnerOutput, SchedulerOutput

PRIOR_ALPHA = 0.5  # before any request has history
PRIOR_WEIGHT = 2.0  # a request's prior, worth this many judged drafts: the drafter's recent
POOL_KEEP = 0.995  # acceptance over all requests, its counts kept this much a judged step
EMA = 0.2  # weight of a new step-time sample (a running mean for the first 1 / EMA)
EXPLORE_EVERY = 64  # decisions per batch bucket between re-measurements of the other end, at first
MAX_EXPLORE_EVERY = 1024  # ... after re-measurements that kept confirming the choice
EXPLORE_SHARE = 0.01  # the most of the time re-measurements may cost (waits up to ...)
MAX_EXPLORE_WAIT = 4096  # ... this many decisions)
REMEASURE = 0.5  # weight of a re-measured step in its width's time
SMALL_BATCH = 8  # up to this many requests, the goodput sums run as a Python loop
SURPRISE = 0.1  # a re-measurement that cut its width's time by more than this share starts
# the waits over at EXPLORE_EVERY, as a changed choice does, and measures the same end next
EXPLORE_SOON = 8  # decisions before the no-drafts end is measured again when its last
MAX_SOON = 3  # re-measurement cut its time (at most this many times in a row: on a noisy host
# every measurement moves), or while drafting is chosen on fewer than SURE_SAMPLES of its steps
SURE_SAMPLES = 3
STALE = 0.2  # while drafting is chosen, the width in use got this much cheaper since another
# width was last measured: that width's time is from a slower machine (a worker's first steps, a
# host that sped up), and it is measured anew ...
STALE_FOR = 4  # ... once that has held this many decisions in a row (a moving average's dip on a
# noisy host, or under prompt chunks of every size, is not a new machine)
CALIBRATION_KEEP = 0.98  # the realized / expected sums keep this much a verify step (~50 steps)
CALIBRATION_PRIOR = 16.0  # expected tokens' worth of the model's own word (a ratio of 1)
CALIBRATION_FADE = 0.999  # ... and the sums keep this much a decision: while drafting is off
# (verify steps only from re-measurements, far apart) the calibration returns to 1 within a few
# thousand decisions, so a drafter turned down by it is weighed by the model alone again
CALIBRATION_RANGE = (0.25, 1.0)  # the ratio's bounds: a few unlucky steps never stop a drafter
# for good, and drafts that make more than the model expects never widen a choice past the model's
# own (a dummy target's EAGLE drafts made 0.9-2.2x what it expected on an H100, h100-s24, and
# its rows stayed within their spread of no drafts): the calibration only ever turns drafting down
OFF_MARGIN = 0.1  # no drafts beat every width by more than this share: the choice stands ...
OFF_FOR = 8  # ... and the widths are weighed once in this many decisions (of any batch size:
# while drafting is off no draft is judged, so the requests' acceptance stays as it was; weighing
# every step cost the scheduler about 0.1 ms a step at c=64, h200-s25), unless a re-measurement
# falls due or a width's time moved since by more than keeps the margin (OFF_MARGIN / (2 +
# OFF_MARGIN): no drafts dearer and a width cheaper by that much still leave no drafts ahead)
PLAIN_RUN = 8  # with a worker that leaves steps without drafts open (``--pipeline-steps``, in
# overlap), the no-drafts end is measured over this many steps in a row, and a step without drafts
# counts only after another: the first after a drafting step is laid out once that step is
# finished, so the GPU waits for it as it would without open steps. Measured one step at a time,
# a 1B target's no-drafts end was 1.91 ms at batch 1 where a run of them cost 1.40 a step, and its
# dummy draft model kept drafting at 0.92x no drafts at c=64 (h100-s27)
FOLLOW_SHARE = 0.5  # ``choose`` verifies a proposal when at least this share of the requests
# expected to get drafts got them (else the few found are weighed anew: a wide step for them;
# with overlap a request whose drafts are not back yet counts as having them, and the worker
# verifies only what it proposed)


class StepShape(NamedTuple):
    """What the tuner files a step's time under (``SpeculationTuner.observe_step``)."""

    num_reqs: int
    width: int  # 1 + the most drafts a request ran (with overlap the step's widths are caps)
    proposals: int  # the most drafts the worker proposed after it (-1: not capped)
    prefill_tokens: int  # its requests' tokens other than drafts, of those running more than one
    deferred: bool  # it carried grammar rows deferred to a later message (overlap)

    @classmethod
    def of(cls, sched: SchedulerOutput, out: ModelRunnerOutput) -> StepShape:
        own = sched.num_scheduled_tokens - sched.num_draft_tokens
        ran = out.num_draft_tokens
        return cls(
            len(sched.num_scheduled_tokens),
            1 + (int(ran.max()) if len(ran) else 0),
            sched.max_draft_proposals,
            int(own[own > 1].sum()),
            bool(len(sched.deferred_req_ids)),
        )


# per request, in the order of ``caps``: the values, or a function that makes them
PerRequest = Sequence[float] | Callable[[], Sequence[float]]


def _values(per_request: PerRequest) -> Sequence[float]:
    return per_request() if callable(per_request) else per_request


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


def _extra_tokens(
    alphas: Sequence[float], caps: Sequence[int], ks: np.ndarray, hits: Sequence[float] | None
) -> np.ndarray:
    """[len(ks), requests]: the tokens each request's drafts add at each K of ``ks``, by the
    model: hit * (expected_tokens(alpha, min(K, cap)) - 1)."""
    a = np.minimum(np.asarray(alphas, np.float64), 1.0 - 1e-9)
    ks = np.minimum(ks[:, None], np.asarray(caps)[None, :])  # [len(ks), B]
    extra = (1.0 - a ** (ks + 1)) / (1.0 - a) - 1.0
    if hits is not None:
        extra = extra * np.clip(np.asarray(hits, np.float64), 0.0, 1.0)
    return np.asarray(extra, np.float64)


def _blend(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


@dataclass
class _Fit:
    """One width's step time t against the step's prefill tokens p and whether it had any
    (m = 1 if p > 0: a step with a prompt chunk leaves the decode graphs for the ragged path, a
    premium whatever its size): moving averages of p, m, t and their products (a running mean
    for the first 1 / EMA samples, then EMA)."""

    n: int = 0
    p: float = 0.0
    t: float = 0.0
    pp: float = 0.0
    pt: float = 0.0
    m: float = 0.0
    mp: float = 0.0
    mt: float = 0.0

    def add(self, p: float, t: float, weight: float = EMA) -> None:
        self.n += 1
        w = max(1.0 / self.n, weight)
        m = 1.0 if p > 0 else 0.0
        self.p, self.t = _blend(self.p, p, w), _blend(self.t, t, w)
        self.pp, self.pt = _blend(self.pp, p * p, w), _blend(self.pt, p * t, w)
        self.m, self.mp, self.mt = (
            _blend(self.m, m, w),
            _blend(self.mp, m * p, w),
            _blend(self.mt, m * t, w),
        )

    def var(self) -> float:
        return max(self.pp - self.p * self.p, 0.0)

    def cov(self) -> float:
        return self.pt - self.p * self.t

    def var_m(self) -> float:
        return max(self.m - self.m * self.m, 0.0)

    def cov_mp(self) -> float:
        return self.mp - self.m * self.p

    def cov_mt(self) -> float:
        return self.mt - self.m * self.t


def _prefill_costs(fits: Sequence[_Fit]) -> tuple[float, float]:
    """(per prompt token, per step that carries any) pooled over the widths' own spreads: least
    squares of t on p and m within each width. Where the steps leave either without spread (all
    with prompt chunks, or none), or a coefficient comes out negative, the other is fitted
    alone."""
    spp = sum(f.var() for f in fits)
    smm = sum(f.var_m() for f in fits)
    spm = sum(f.cov_mp() for f in fits)
    spt = sum(f.cov() for f in fits)
    smt = sum(f.cov_mt() for f in fits)
    det = spp * smm - spm * spm
    if spp > 1.0 and smm > 1e-3 and det > 1e-6 * spp * smm:
        per_token = (smm * spt - spm * smt) / det
        per_step = (spp * smt - spm * spt) / det
        if per_token >= 0.0 and per_step >= 0.0:
            return per_token, per_step
    by_token = max(spt / spp, 0.0) if spp > 1.0 else 0.0
    by_step = max(smt / smm, 0.0) if smm > 1e-3 else 0.0
    if by_token > 0.0 and (spp > 1.0 and (smm <= 1e-3 or by_step * smt <= by_token * spt)):
        return by_token, 0.0  # (the one that explains more of the spread)
    return 0.0, by_step


@dataclass
class _Bucket:
    fits: dict[int, _Fit] = field(default_factory=dict)  # width (1 + K) -> its step time
    decisions: int = 0
    hold: int = -1  # a proposal width to repeat for one more step (measuring it), -1: none
    run: int = 0  # ... and, for no drafts (``PLAIN_RUN``), for this many more after that
    explore_every: int = EXPLORE_EVERY
    next_explore: int = -1  # the decision count of the next re-measurement (-1: not set)
    explored_from: int = -1  # the choice before the re-measurement now under way, -1: none
    explored_width: int = 0  # the width it measures ...
    explored_samples: int = 0  # ... and that width's samples before it
    explored_at: int = 0  # ... and the decision that started it
    explored_time: float = 0.0  # ... and that width's time before it
    explore_top: bool = False  # the last re-measurement was of the drafting end
    repeat: bool = False  # ... and it moved that end's time: measure the same end next
    soon: int = 0  # re-measurements of the no-drafts end in a row that moved its time
    chosen: int = 0  # the last ``best`` choice's K
    off_until: int = -1  # a clear choice of no drafts stands until this decision of the tuner's
    # (``SpeculationTuner.decisions``, OFF_FOR) ...
    off_known: dict[int, float] = field(default_factory=dict)  # ... while the times stay these
    # width -> every width's time when it was last measured (a width measured only later: its
    # first time), for ``stale``
    at: dict[int, dict[int, float]] = field(default_factory=dict)

    _seconds: dict[int, float] | None = None  # ``seconds`` until a fit changes
    _due: set[int] = field(default_factory=set)  # widths observed since ``seconds`` was computed
    _over: dict[int, int] = field(default_factory=dict)  # stale widths: decisions in a row

    def observe(self, width: int, prefill: float, seconds: float) -> None:
        # a re-measurement is one step of a width seen rarely: it weighs half, so a cost that
        # changed is followed within a few re-measurements (a run of them, PLAIN_RUN: its first
        # step counted weighs half, the others as any step)
        fit = self.fits.setdefault(width, _Fit())
        remeasured = (
            self.explored_from >= 0
            and width == self.explored_width
            and fit.n == self.explored_samples
        )
        fit.add(prefill, seconds, REMEASURE if remeasured else EMA)
        self._seconds = None
        self._due.add(width)

    def stale(self, known: dict[int, float]) -> list[int]:
        """While drafting is chosen: the widths measured when the width in use cost more than
        1 / (1 - STALE) times what it costs now, STALE_FOR decisions in a row. h100-s20: the
        no-drafts end measured at 7.9 ms in a worker's first, slow steps, the drafting end at
        3.6 ms later on; an n-gram drafter that lost drafted through the first quarter of a row."""
        use = 1 + self.chosen
        if self.chosen <= 0 or use not in known:
            self._over = {}
            return []
        bar = known[use] / (1.0 - STALE)
        over = [
            w for w, then in self.at.items() if w != use and w in known and then.get(use, 0.0) > bar
        ]
        self._over = {w: self._over.get(w, 0) + 1 for w in over}
        return [w for w, n in self._over.items() if n >= STALE_FOR]

    def measure_stale_anew(self, known: dict[int, float], top: int) -> bool:
        """The ``stale`` widths are measured anew: the drafting end (``top``) at the next
        decision, through a re-measurement; a width below it loses its samples (``forget``),
        and then every width's snapshot is re-based (forgetting moved the pooled prefill fit
        and with it every decode part). A width past ``top`` (a batch whose requests ask for
        fewer drafts) is left as it is. Returns whether any width was stale."""
        stale = self.stale(known)
        for width in stale:
            if width == top:
                self.at.pop(width)
                self.next_explore = self.decisions
                self.repeat = self.explore_top = True
            elif width < top:
                self.forget(width)
        if stale:
            now = self.seconds
            for then in self.at.values():
                then.update((w, t) for w, t in now.items() if self.fits[w].n)
        return bool(stale)

    def forget(self, width: int) -> None:
        """Drops a width's samples: the no-drafts end is then measured again as at the start,
        and measured once more soon after (``_unsure``); a width between the ends is
        interpolated until it is used."""
        self.fits.pop(width, None)
        self.at.pop(width, None)
        if width == 1:
            self.next_explore = -1
        self._seconds = None

    def set_fit(self, width: int, fit: _Fit) -> None:
        self.fits[width] = fit
        self._seconds = None

    @property
    def seconds(self) -> dict[int, float]:
        """Width -> the decode part of its step time (at no prefill). What a prefill token and
        a step with any prompt chunk cost is one fit for the bucket (``_prefill_costs``), pooled
        over the widths' own spreads (the width in use has many samples; the other end,
        re-measured now and then, few), and at most what leaves each width a hundredth of its
        mean time. Computed once per change of the fits (both
        decisions of a step read it): read-only."""
        if self._seconds is None:
            fits = list(self.fits.values())
            per_token, per_step = _prefill_costs(fits)
            # at most what leaves each width a hundredth of its mean time
            scale = min(
                [
                    1.0,
                    *(0.99 * f.t / x for f in fits if (x := per_token * f.p + per_step * f.m) > 0),
                ]
            )
            per_token, per_step = scale * per_token, scale * per_step
            self._seconds = {
                w: max(f.t - per_token * f.p - per_step * f.m, 1e-9) for w, f in self.fits.items()
            }
            measured = {w: t for w, t in self._seconds.items() if self.fits[w].n}  # not borrowed
            for w in self._due:
                self.at[w] = dict(measured)
            self._due.clear()
            for then in self.at.values():  # a width first measured since: its first time
                if then.keys() != measured.keys():
                    for w, t in measured.items():
                        then.setdefault(w, t)
        return self._seconds


class SpeculationTuner:
    """Owned by the scheduler: ``choose`` before a step, ``observe_step`` after it."""

    def __init__(self, max_k: int, plain_run: int = 1) -> None:
        self.max_k = max_k
        # steps in a row that measure the no-drafts end (``PLAIN_RUN`` for a worker that leaves
        # steps open in overlap; 1: one step, and every step without drafts counts)
        self.plain_run = plain_run
        self._after_plain = False  # the last step observed verified and proposed no drafts
        # (batch bucket, deferred) -> its step times and choices; deferred: steps that carry
        # grammar rows deferred to a later message (overlap scheduling, a structured greedy
        # request), timed apart: each waits for the scheduler's round trip, so without
        # drafts they cost about what a drafting step does, where a plain step left open
        # (``--pipeline-steps``) costs half that (SmolLM2 on an H100, c=1: 1.9-2.0 against 1.05
        # ms, h100-s26, when they were not yet launched behind an open step).
        # Timed together, such steps were most of n-gram's no-drafts samples (it finds no
        # drafts for them), and the plain requests drafted at 0.82x no drafts.
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        # drafts judged and accepted over every request, decayed: the prior of a new request
        self._pool_judged = 0.0
        self._pool_accepted = 0.0
        # drafts the next step verifies (a measurement's second step: the step after a proposal
        # verifies it, whatever bucket its batch falls in), -1: the tuner's choice
        self._verify = -1
        # the bucket whose measurement (propose, then verify as much) waits for its second step
        self._holding: _Bucket | None = None
        self.reason = ""  # why ``propose`` chose its last width (hold, ends, explore, best)
        # the last ``best`` proposal: its width and the share of its requests expected to get
        # drafts (``choose`` verifies it when about that share has them); (0, 0.0): none
        self._proposed = (0, 0.0)
        # over recent verify steps (decayed), the tokens the model expected their drafts to
        # add and what the drafts accepted made
        self._expected = 0.0
        self._made = 0.0
        self.calibration = 1.0  # what the accepted drafts made for each token the model expected
        self.decisions = 0  # ``propose`` calls, every batch size's

    @property
    def prior(self) -> float:
        """The drafter's recent per-draft acceptance over all requests (PRIOR_ALPHA before any)."""
        if self._pool_judged < 1.0:
            return PRIOR_ALPHA
        return self._pool_accepted / self._pool_judged

    def alpha(self, num_judged: float, num_accepted: float) -> float:
        """Per-draft acceptance probability from a request's counts, smoothed toward the prior.
        Under arrivals most requests are young: with a fixed prior of 0.5 a head accepting 0.33
        kept drafting on every new request's optimism."""
        return (num_accepted + self.prior * PRIOR_WEIGHT) / (num_judged + PRIOR_WEIGHT)

    def snapshot(self) -> list[tuple[str, int, float, int]]:
        """(batch bucket, width 1 + K, the decode part of its step time in seconds, samples) of
        every width measured: what the choices are made from (``/metrics``). The bucket of
        steps with deferred grammar rows is named with a "d" ("8d")."""
        out = []
        for (b, deferred), bucket in sorted(self._buckets.items(), key=lambda kv: kv[0][1]):
            fits = dict(bucket.fits)  # a scrape's thread: the engine's may add a width meanwhile
            for w, seconds in sorted(_Bucket(fits=fits).seconds.items()):
                if fits[w].n:  # a time borrowed from another batch size is not shown
                    out.append((f"{b}d" if deferred else str(b), w, seconds, fits[w].n))
        return out

    def _bucket(self, num_reqs: int, deferred: bool) -> _Bucket:
        """The step times and choices of a batch of ``num_reqs`` requests, with or without
        deferred grammar rows."""
        return self._buckets.setdefault((batch_bucket(num_reqs), deferred), _Bucket())

    def observe_judged(self, num_judged: int, num_accepted: int) -> None:
        """One request's step: drafts the target judged (accepted + the first rejected) and
        accepted."""
        if num_judged <= 0:
            return
        self._pool_judged = POOL_KEEP * self._pool_judged + num_judged
        self._pool_accepted = POOL_KEEP * self._pool_accepted + num_accepted

    def propose(
        self,
        alphas: PerRequest,
        caps: Sequence[int],
        hits: PerRequest | None = None,
        deferred: bool = False,
    ) -> int:
        """How many drafts (0..max_k) the worker proposes for each of these requests after this
        step (those that sample; ``caps[i]``: a request's own width; ``hits[i]``: the share of
        the drafts asked for that the drafter finds for it, 1 if None), for the next step to
        verify. Zero when speculation does not pay: then the drafter does no work.
        ``deferred``: the step carries deferred grammar rows (timed apart). ``alphas`` and
        ``hits`` may come as functions that make them: they are read only where the widths are
        weighed, and most decisions are not (a measurement under way, a clear choice of no
        drafts standing; at batch 64 the decision took 35 us with the lists made each step and
        17 us without, ``bench/zero_width_bench.py --proposals`` on the CPU)."""
        top = min(self.max_k, max(caps, default=0))
        self._proposed = (0, 0.0)
        if top <= 0:
            self.reason = "none"
            return 0
        bucket = self._bucket(len(caps), deferred)
        if self._holding is not bucket:
            # the measurement's second step fell in another bucket (the batch changed size, or
            # a structured request's rows began to be deferred): it is given up
            self._give_up()
        self._holding = None
        bucket.decisions += 1
        self.decisions += 1
        if self._expected:
            self._expected *= CALIBRATION_FADE
            self._made *= CALIBRATION_FADE
            self._calibrate()
        if bucket.hold >= 0:  # the second step of a measurement: propose, then verify as much
            k = bucket.hold
            if bucket.run > 0:  # a run of steps without drafts (PLAIN_RUN)
                bucket.run -= 1
                self._holding = bucket
            else:
                bucket.hold = -1
            self.reason = "hold"
            return k
        known = bucket.seconds
        if bucket.measure_stale_anew(known, 1 + top):
            known = bucket.seconds
        if 1 + top not in known and 1 in known:
            self._borrow(bucket, len(caps), 1 + top, deferred)
            known = bucket.seconds
        for width in (1, 1 + top):  # measure both ends first
            if width not in known:
                self._measure(bucket, width - 1)
                self.reason = "ends"
                return width - 1
        if self._off_stands(bucket, known):
            self.reason = "best"
            return 0
        alphas, hits = _values(alphas), None if hits is None else _values(hits)
        rates = self._rates(known, alphas, caps, top, hits)
        best_k = self._best(rates)
        bucket.off_until = -1
        if best_k == 0 and rates[0] > (1.0 + OFF_MARGIN) * max(rates[1:]):
            bucket.off_until, bucket.off_known = self.decisions + OFF_FOR, dict(known)
        if bucket.next_explore < 0:  # both ends just measured
            wait = max(bucket.explore_every, self._explore_wait(bucket, rates))
            if self._unsure(bucket, best_k):
                wait = EXPLORE_SOON
            bucket.next_explore = bucket.decisions + wait
        if bucket.explored_from >= 0:
            fit = bucket.fits.get(bucket.explored_width)
            if fit is not None and fit.n > bucket.explored_samples:
                # the re-measured step has been observed: did it change the choice, or make
                # the end it measured cheaper? (An end not in use that got dearer confirms
                # the choice; counted as a surprise, a losing drafter that kept measuring
                # dearer was re-measured every 64 decisions, each costing its catch-up.)
                before = bucket.explored_time
                moved = before - known[bucket.explored_width] > SURPRISE * before
                same = (best_k > 0) == (bucket.explored_from > 0) and not moved
                bucket.repeat = moved  # it got cheaper: the same end again next
                # (soon only the no-drafts end: a drafting end's re-measurement costs its catch-up)
                bucket.soon = bucket.soon + 1 if moved and bucket.explored_width == 1 else 0
                bucket.explore_every = (
                    min(2 * bucket.explore_every, MAX_EXPLORE_EVERY) if same else EXPLORE_EVERY
                )
                bucket.explored_from = -1
            elif bucket.decisions >= bucket.explored_at + 8:  # its step was not counted
                bucket.explored_from = -1
            if bucket.explored_from < 0:
                wait = bucket.explore_every
                if wait > EXPLORE_EVERY:  # confirmed: no sooner than its cost allows
                    wait = max(wait, self._explore_wait(bucket, rates))
                if 0 < bucket.soon <= MAX_SOON or self._unsure(bucket, best_k):
                    # an end whose time moved was measured wrong (its first steps under a
                    # ramp-up's prefill, a busy host): half of the error goes with each
                    # re-measurement (REMEASURE), and 64 decisions apart a short served run
                    # ended at the width that error chose
                    wait = EXPLORE_SOON
                bucket.next_explore = bucket.explored_at + wait
        elif bucket.decisions >= bucket.next_explore:  # refresh an end we are not using
            # from a width in between, the two ends by turns (the widths between are timed only
            # when in use, so a stale end would hold the choice there), or the same end again
            # when its last re-measurement moved its time
            if not (bucket.repeat and 0 < best_k < top):
                bucket.explore_top = best_k == 0 or (best_k < top and not bucket.explore_top)
            k = top if bucket.explore_top else 0
            fit = bucket.fits.get(1 + k)
            bucket.explored_from, bucket.explored_width = best_k, 1 + k
            bucket.explored_at = bucket.decisions
            bucket.explored_time = known[1 + k]
            bucket.explored_samples = 0 if fit is None else fit.n
            self._measure(bucket, k)
            self.reason = "explore"
            return k
        self.reason = "best"
        bucket.chosen = best_k
        if best_k:
            # the share of these requests expected to get drafts: those with a width of their
            # own, each by its hit rate (a request with none dilutes nothing: it never has drafts)
            able = np.asarray(caps) > 0
            got = able if hits is None else able * np.clip(np.asarray(hits, np.float64), 0, 1)
            self._proposed = (best_k, float(got.sum()) / len(caps))
        return best_k

    def _measure(self, bucket: _Bucket, k: int) -> None:
        """Start a measurement of width ``1 + k`` in ``bucket``: propose ``k`` now, then verify as
        much (for no drafts, over ``plain_run`` steps)."""
        bucket.hold = self._verify = k
        bucket.run = 0 if k else self.plain_run - 1
        self._holding = bucket

    def _off_stands(self, bucket: _Bucket, known: dict[int, float]) -> bool:
        """The bucket's last choice, no drafts by a clear margin, stands without weighing the
        widths again: within OFF_FOR of the tuner's decisions of it, no re-measurement under way
        or due, and every width's time near enough what it was then to keep the margin."""
        if not (
            bucket.chosen == 0
            and self.decisions < bucket.off_until
            and bucket.explored_from < 0
            and bucket.decisions < bucket.next_explore
            and known.keys() == bucket.off_known.keys()
        ):
            return False
        near = OFF_MARGIN / (2.0 + OFF_MARGIN)
        then = bucket.off_known
        return all(abs(t - then[w]) <= near * then[w] for w, t in known.items())

    @staticmethod
    def _unsure(bucket: _Bucket, best_k: int) -> bool:
        """Drafting is chosen while the no-drafts end has fewer than SURE_SAMPLES steps counted
        (its first measurement is one step, under whatever prefill and host load it met):
        measure it again soon. Only that end: a step without drafts costs no more than the
        chosen one, where a losing drafter's end costs its catch-up and long steps."""
        fit = bucket.fits.get(1)
        return best_k > 0 and (fit is None or fit.n < SURE_SAMPLES)

    def _borrow(self, bucket: _Bucket, num_reqs: int, width: int, deferred: bool) -> None:
        """A batch size's first drafting-end time from the nearest batch size measured at both
        ends (as a ratio to width 1, which is measured here): the batch drains through every
        bucket below it as requests end, and measuring a losing draft model's end in each cost
        two of its steps there (a tenth of a short served row at c=64). Its first step at that
        width replaces the borrowed time. Steps with the same kind of grammar rows first."""
        own = batch_bucket(num_reqs)
        near = sorted(
            (kind != deferred, abs(b.bit_length() - own.bit_length()), b, kind)
            for (b, kind), other in self._buckets.items()
            if other is not bucket and {1, width} <= {w for w, f in other.fits.items() if f.n}
        )
        if not near:
            return
        *_, b, kind = near[0]
        times = self._buckets[b, kind].seconds
        bucket.set_fit(width, _Fit(t=bucket.seconds[1] * times[width] / times[1]))

    def choose(
        self,
        alphas: Sequence[float],
        caps: Sequence[int],
        hits: Sequence[float] | None = None,
        deferred: bool = False,
    ) -> int:
        """The batch's draft width K (0..max_k) for a decode step of these requests (all of
        them: a request without drafts has cap 0 and still yields its one token), each able to
        verify at most ``caps[i]`` drafts (what the worker proposed; with overlap, for a request
        whose drafts are not back yet, its own width found with the share ``hits[i]``). Every
        draft held, until both ends are measured."""
        top = min(self.max_k, max(caps, default=0))
        bucket = self._bucket(len(caps), deferred)
        verify, self._verify = self._verify, -1
        proposed, share = self._proposed
        self._proposed = (0, 0.0)
        if top <= 0:
            return 0
        if verify >= 0:  # a measurement proposed these drafts to verify them
            return min(verify, top)
        if proposed and sum(1 for c in caps if c > 0) >= FOLLOW_SHARE * share * len(caps):
            # proposed to be verified, and their cost is paid: weighed anew on this step's
            # requests, a near tie left a drafter proposing on every step and the next step
            # verifying none (EAGLE, sync, c=64: 47 such proposals in 469 steps, h100 2026-12-06)
            return min(proposed, top)
        known = bucket.seconds
        if 1 + top not in known or 1 not in known:
            return top
        return self._best(self._rates(known, alphas, caps, top, hits))

    def observe_verified(self, predicted: float, accepted: int) -> None:
        """A verify step's outcome: the tokens its drafts were expected to add (``predicted``:
        ``expected_extras`` of the requests that ran them) and the drafts they accepted. Their
        decayed ratio, within CALIBRATION_RANGE, scales what the model expects drafts to add
        (``calibration``): per-draft acceptance pooled over positions overstates the first
        draft's, and a drafter's hits come in runs (served SmolLM2 on the CPU, mixed workload,
        c=8, sync: n-gram made 0.80 and EAGLE 0.73 of what the model expected,
        bench/results/cpu-s24/)."""
        if predicted <= 0.0:
            return
        self._expected = CALIBRATION_KEEP * self._expected + predicted
        self._made = CALIBRATION_KEEP * self._made + accepted
        self._calibrate()

    def _calibrate(self) -> None:
        """made / expected, drawn toward 1 by CALIBRATION_PRIOR expected tokens (a few steps
        say little, and as the sums fade without verify steps it returns to the model's own)."""
        lo, hi = CALIBRATION_RANGE
        ratio = (self._made + CALIBRATION_PRIOR) / (self._expected + CALIBRATION_PRIOR)
        self.calibration = min(max(ratio, lo), hi)

    def pause(self) -> None:
        """Drafting is off for a while (``Scheduler.guard``): no proposal is decided, and a
        measurement under way is given up, as where its second step falls in another bucket."""
        self._give_up()
        self._proposed = (0, 0.0)
        self.reason = "guard"

    def _give_up(self) -> None:
        """The measurement under way, if any, is given up: its bucket measures anew when it
        decides next, where its hold would have fired on some later step."""
        if self._holding is not None:
            self._holding.hold = -1
            self._holding.run = 0
            self._holding = None

    def skip_choice(self) -> None:
        """A step with no drafts to verify: no choice is made, and a measurement's verify width
        (``propose``'s) is used up as ``choose`` would have used it."""
        self._verify = -1
        self._proposed = (0, 0.0)

    @staticmethod
    def _best(rates: list[float]) -> int:
        """The K of the highest expected tokens per second (the narrower of a tie)."""
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def _rates(
        self,
        known: dict[int, float],
        alphas: Sequence[float],
        caps: Sequence[int],
        top: int,
        hits: Sequence[float] | None = None,
    ) -> list[float]:
        """Expected tokens per second of each K in 0..top."""
        extras = self._extras(alphas, caps, top, hits)
        n = float(len(alphas))
        return [
            (n + self.calibration * extras[k]) / self._time(known, 1 + k) for k in range(top + 1)
        ]

    @staticmethod
    def _extras(
        alphas: Sequence[float], caps: Sequence[int], top: int, hits: Sequence[float] | None = None
    ) -> list[float]:
        """The tokens the accepted drafts add to a step of each K in 0..top, by the model: the
        sum over requests of hit * (expected_tokens(alpha, min(k, cap)) - 1) (a request the
        drafter finds nothing for yields its one token)."""
        if len(alphas) <= SMALL_BATCH:  # numpy's per-call cost outweighs a few requests' loop
            sums = [0.0] * (top + 1)
            for j, (alpha, cap) in enumerate(zip(alphas, caps, strict=True)):
                p = min(float(alpha), 1.0 - 1e-9)
                hit = 1.0 if hits is None else min(max(float(hits[j]), 0.0), 1.0)
                for k in range(1, top + 1):
                    kk = min(k, int(cap))
                    sums[k] += hit * ((1.0 - p ** (kk + 1)) / (1.0 - p) - 1.0)
            return sums
        # for every k at once (a Python double loop cost 0.22 ms a step at batch 64:
        # bench/scheduler_step_bench.py)
        return [float(x) for x in _extra_tokens(alphas, caps, np.arange(top + 1), hits).sum(axis=1)]

    @staticmethod
    def expected_extras(
        alphas: Sequence[float], caps: Sequence[int], k: int, hits: Sequence[float] | None = None
    ) -> list[float]:
        """Each request's tokens its drafts are expected to add at width ``k`` (the model's,
        uncalibrated): what the scheduler pairs with the drafts it accepted
        (``observe_verified``)."""
        return [float(x) for x in _extra_tokens(alphas, caps, np.array([k]), hits)[0]]

    def _explore_wait(self, bucket: _Bucket, rates: list[float]) -> int:
        """Decisions between re-measurements so that they cost at most EXPLORE_SHARE of the
        time: a re-measurement runs two steps at the other end, each losing what the best width
        would have made in its time (a losing draft model at batch 64: a step 8 times as long
        at 0.4 of the rate, 9 steps' worth). Until the other end has several samples the wait is
        at most EXPLORE_EVERY * 4^(samples - 1): one step slowed by a busy host must not keep a
        drafter that pays off for thousands of steps. ``rates``: ``_rates`` of this decision."""
        known = bucket.seconds
        best_k = self._best(rates)
        top = len(rates) - 1
        other = top if best_k == 0 else 0
        longer = self._time(known, 1 + other) / self._time(known, 1 + best_k)
        loss = 2.0 * longer * max(1.0 - rates[other] / max(rates[best_k], 1e-30), 0.0)
        fit = bucket.fits.get(1 + other)
        samples = fit.n if fit is not None else 0
        trust: int = EXPLORE_EVERY * 4 ** max(samples - 1, 0)
        return min(int(loss / EXPLORE_SHARE), MAX_EXPLORE_WAIT, trust)

    def observe_step(
        self,
        num_reqs: int,
        width: int,
        seconds: float,
        proposals: int = -1,
        prefill_tokens: int = 0,
        deferred: bool = False,
    ) -> None:
        """A step of ``num_reqs`` requests whose widest decode ran ``width`` tokens, beside
        ``prefill_tokens`` tokens of prompt chunks, and after which the worker proposed at most
        ``proposals`` drafts (-1: not capped). Counted when it is a step of its width's steady
        state: it drafted what it verified, or verified some drafts and proposed more (a drafter
        that found fewer than asked). A step that verified drafts and proposed fewer, or
        proposed drafts it did not verify, is a switch between widths: its time belongs to
        neither. ``deferred``: it carried deferred grammar rows (timed apart). With
        ``plain_run`` above 1, a step without drafts after one with drafts is not counted
        (``PLAIN_RUN``)."""
        k = width - 1
        plain = k == 0 and proposals <= 0
        after_plain, self._after_plain = self._after_plain, plain
        if proposals >= 0 and not (proposals == k or 0 < k < proposals):
            return
        bucket = self._bucket(num_reqs, deferred)
        first = bucket.fits.get(1)
        if plain and self.plain_run > 1 and not after_plain and first is not None and first.n:
            # the first measurement of a bucket's no-drafts end takes any such step: where
            # batch sizes interleave, a run in one bucket may never come
            return
        bucket.observe(width, prefill_tokens, seconds)

    def observe_shape(self, shape: StepShape, seconds: float) -> None:
        """``observe_step`` of a step of this shape."""
        self.observe_step(
            shape.num_reqs,
            shape.width,
            seconds,
            shape.proposals,
            shape.prefill_tokens,
            shape.deferred,
        )

    @staticmethod
    def _time(known: dict[int, float], width: int) -> float:
        """Measured, else linear between the nearest measured widths (at least the two ends)."""
        if width in known:
            return known[width]
        lo = max(w for w in known if w < width)
        hi = min(w for w in known if w > width)
        f = (width - lo) / (hi - lo)
        return known[lo] + f * (known[hi] - known[lo])
