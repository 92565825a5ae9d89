"""Drafting kept only while it pays, measured as what users get: output tokens a second.

The speculation tuner (spec_tuner.py) chooses each step's width from a model: the step costs it
timed per batch and width, and each request's acceptance. What the model leaves out is not
weighed: the scheduler's own work a step with a drafter, a drafting step that the worker cannot
leave open. On an H100 whose host CPU ran the scheduler about three times slower than h100-s27's
(h100-s29, the real SmolLM2, pipelined), n-gram drafted on 47-68% of the steps at c=8 to 64, as
its model chose, and made 0.80-0.87x the output tokens a second of no drafts; the draft model
drafted on 65% of the steps at c=64 and made 0.91x.

The guard compares the outcome itself. The outputs are cut into windows: ``settle`` outputs of
steps sent before the window began (overlap, up to 4 in flight) are not counted, then ``window``
outputs are. A window runs either as the tuner decides or with drafting off (the scheduler asks
the worker for no drafts, so the steps cost what steps without a drafter cost). Everything is
kept per batch bucket (a power of two at or above the requests running when the window begins,
rounded as the tuner's buckets are), since drafting can win at c=8 and lose at c=64: which kind
is preferred (drafting, at first), and each kind's output tokens a second, a moving average of
its windows (a bucket's first window is not counted, nor one that ends in another bucket or that
a worker restart fell in). Now and then a window runs as the kind not preferred: after the
bucket's first 2 counted windows, then after twice as many each time the preferred kind wins,
up to ``MAX_BACKOFF``, and after ``probe_every`` where the two are within ``margin``.

A probe is judged against the preferred kind's windows on either side of it: the one before and
the one after, averaged. A served row's steps drift (h100-s30: at one load, steps without drafts
took 1.45-1.54 ms and then 2.1-2.2 ms; SmolLM2 at c=64, 3.1-3.4 and then 3.7-3.9 ms), and a probe
judged against the windows before it alone takes that drift for its own gain or loss: the windows
either side cancel a steady drift. A probe that beats them by ``margin`` is probed again after
one window of the preferred kind, and a second such win turns the preference over (one lucky
window does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_client.spec_tuner import batch_bucket

MAX_BACKOFF = 64  # windows of the preferred kind between probes, at most
EMA = 0.5  # weight of a new window in its kind's moving average


@dataclass
class GuardBucket:
    """One batch bucket's judgement."""

    prefer: bool = True  # drafting is preferred (windows with it off are the probes)
    on: float = 0.0  # output tokens a second, moving average of windows with drafting
    off: float = 0.0  # ... with drafting off
    num_on: int = 0
    num_off: int = 0
    warm: bool = False  # its first window has passed (not counted: a start or a load change)
    backoff: int = 2  # windows of the preferred kind between probes
    since_probe: int = 0  # windows of the preferred kind since the last probe
    confirming: bool = False  # a probe won: the next probe comes after one preferred window
    last: float = 0.0  # the preferred kind's last window, if counted (0: none since a switch)
    pending: float = 0.0  # a probe's rate, judged when the preferred window after it ends

    def add(self, drafting: bool, rate: float) -> None:
        if drafting:
            self.on = rate if not self.num_on else self.on + EMA * (rate - self.on)
            self.num_on += 1
        else:
            self.off = rate if not self.num_off else self.off + EMA * (rate - self.off)
            self.num_off += 1


@dataclass
class SpeculationGuard:
    window: int = 32
    settle: int = 5
    probe_every: int = 8
    margin: float = 0.03
    drafting: bool = True  # the current window lets the tuner draft
    num_switches: int = 0  # times a bucket's preference changed
    buckets: dict[int, GuardBucket] = field(default_factory=dict)
    _bucket: GuardBucket | None = None  # the current window's (None: set by its first output)
    _key: int = 0  # ... and its batch bucket
    _seen: int = 0  # outputs in this window, settling ones included
    _tokens: int = 0
    _seconds: float = 0.0
    _skip: bool = False  # the window under way does not count (``restart``)

    def observe(self, seconds: float, tokens: int, running: int) -> None:
        """An output: its cycle (``seconds`` since the output before; 0 or less after an idle
        spell, not counted), the tokens it committed, and the requests running for it."""
        if self._bucket is None:
            self._begin(running)
            assert self._bucket is not None
        self._seen += 1
        if self._seen > self.settle and seconds > 0:
            self._tokens += tokens
            self._seconds += seconds
        if self._seen >= self.settle + self.window:
            self._close(self._bucket, running)

    def restart(self) -> None:
        """A worker restart: the window under way ends uncounted, and the next, which the
        replayed prompts fall in, begins now and does not count either."""
        self._reset()
        self._skip = True

    def _reset(self) -> None:
        self._seen = self._tokens = 0
        self._seconds = 0.0

    def _begin(self, running: int) -> None:
        """The next window: the bucket of the requests running now, and its kind."""
        self._key = batch_bucket(running)
        self._bucket = self.buckets.setdefault(self._key, GuardBucket())
        self.drafting = self._kind(self._bucket)

    @staticmethod
    def _kind(b: GuardBucket) -> bool:
        """Whether a window of bucket ``b`` drafts: its preferred kind, or a probe of the
        other (never right after a probe: the window after it is its judge's second half)."""
        probe = not b.pending and (b.confirming or b.since_probe >= b.backoff)
        return b.prefer != probe

    def _close(self, b: GuardBucket, running: int) -> None:
        # a bucket's first window (the requests' prompts at a start) does not count, nor one
        # that ends in another bucket than it began in (the load moved: its kind was chosen for
        # the one, its rate is the other's), nor one a worker restart fell in; but for the first,
        # each still moves the bucket's probes on, so that a load that keeps moving cannot stop
        # them
        first, skip = not b.warm, self._skip
        b.warm, self._skip = True, False
        # (a window that committed nothing, all prompt chunks, says nothing of either kind)
        counted = not (first or skip) and self._seconds > 0 and self._tokens > 0
        counted = counted and batch_bucket(running) == self._key
        probe = self.drafting != b.prefer
        if not first:  # (before the judgement: a switch starts the count anew)
            b.since_probe = 0 if probe else b.since_probe + 1
        if counted:
            rate = self._tokens / self._seconds
            b.add(self.drafting, rate)
            if probe:  # judged once the preferred window after it has run
                b.pending = rate if b.last > 0 else 0.0
                b.confirming = b.confirming and b.pending > 0
            else:
                switched = b.pending > 0 and self._judge(b, b.pending, 0.5 * (b.last + rate))
                b.pending, b.last = 0.0, 0.0 if switched else rate
        else:  # a probe or the window either side of it uncounted: that probe is not judged,
            # nor followed by a second, and the next is judged by windows either side of it
            b.pending, b.confirming, b.last = 0.0, False, 0.0
        self._reset()
        self._begin(running)

    def _judge(self, b: GuardBucket, rate: float, preferred: float) -> bool:
        """A probe's window (``rate``, its output tokens a second) against the preferred kind's
        windows either side of it (``preferred``, their mean): a first win by ``margin`` is
        probed again after one preferred window, a second turns the preference over; a loss by
        the margin puts the next probe twice as far; in between, it comes after
        ``probe_every``."""
        if rate > (1.0 + self.margin) * preferred:
            if b.confirming:
                b.prefer = not b.prefer
                b.confirming, b.backoff, b.since_probe = False, self.probe_every, 0
                self.num_switches += 1
                return True
            b.confirming = True
        elif preferred > (1.0 + self.margin) * rate:
            b.confirming, b.backoff = False, min(MAX_BACKOFF, 2 * b.backoff)
        else:
            b.confirming, b.backoff = False, self.probe_every
        return False
