"""The speculation guard (spec_guard.py): windows of steps with drafting off are compared with the
tuner's by their output tokens a second; drafting that loses is turned off and re-tried ever
more rarely, drafting that wins is kept, and the scheduler asks the worker for no drafts in a
window with drafting off."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from protocol.messages import ModelRunnerOutput, SamplingParams
from scheduler_client.prom import SchedulerMetrics
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.spec_guard import MAX_BACKOFF, SpeculationGuard
from scheduler_client.spec_tuner import SpeculationTuner


def run_windows(
    g: SpeculationGuard, n: int, on_rate: float, off_rate: float, running: int = 64
) -> list[bool]:
    """``n`` windows of outputs at ``running`` requests, one token each per output, at these
    output tokens a second; returns each window's kind (True: drafting)."""
    kinds = []
    for _ in range(n):
        kind = None
        for _ in range(g.settle + g.window):
            kind = g.drafting if kind is None else kind
            rate = on_rate if kind else off_rate
            g.observe(running / rate, running, running)
        kinds.append(bool(kind))
    return kinds


def test_drafting_that_loses_is_turned_off_and_retried_ever_more_rarely() -> None:
    g = SpeculationGuard()
    kinds = run_windows(g, 7, on_rate=1000.0, off_rate=1100.0)
    # the first window is not counted; an off window after 2 counted, judged by the windows
    # either side of it, and a second to confirm it
    assert kinds == [True, True, True, False, True, False, True]
    assert not g.buckets[64].prefer and not g.drafting and g.num_switches == 1
    kinds = run_windows(g, 400, on_rate=1000.0, off_rate=1100.0)
    retries = [i for i, k in enumerate(kinds) if k]
    gaps = np.diff(retries).tolist()
    assert retries[0] == 8 and gaps[:4] == [17, 33, 65, 65], (retries[:3], gaps)
    assert max(gaps) == MAX_BACKOFF + 1 and g.num_switches == 1
    assert sum(kinds) / len(kinds) < 0.03


def test_drafting_that_wins_is_kept_and_probed_ever_more_rarely() -> None:
    g = SpeculationGuard()
    kinds = run_windows(g, 300, on_rate=1300.0, off_rate=1000.0)
    assert g.buckets[64].prefer and g.num_switches == 0
    probes = [i for i, k in enumerate(kinds) if not k]
    assert probes[:6] == [3, 8, 17, 34, 67, 132], probes  # after 2, 4, 8, ... 64 windows
    # within the margin: probes after every 8 windows, and no switch either way
    kinds = run_windows(g, 90, on_rate=1000.0, off_rate=1020.0)
    assert g.buckets[64].prefer and g.num_switches == 0 and 7 <= kinds.count(False) <= 11


def test_one_lucky_window_does_not_switch() -> None:
    """A second probe must win by itself: a lucky probe window averaged with a plain one
    does not turn the preference over."""
    g = SpeculationGuard()
    run_windows(g, 3, on_rate=1000.0, off_rate=1000.0)
    run_windows(g, 2, on_rate=1000.0, off_rate=1200.0)  # the probe wins once (judged after)
    assert g.buckets[64].confirming and not g.drafting  # probed again
    run_windows(g, 2, on_rate=1000.0, off_rate=1010.0)  # within the margin (their mean: 1,105)
    assert g.buckets[64].prefer and g.drafting and g.num_switches == 0


def test_a_steady_drift_is_not_taken_for_a_gain() -> None:
    """Every window 2% faster than the one before (a served row's steps drift by that much,
    h100-s30), drafting and drafting off alike: each probe beats the windows before it by
    more than the margin, and yet no switch, since it is judged by the windows either side."""
    g = SpeculationGuard()
    kinds = []
    for i in range(60):
        rate = 1000.0 * 1.02**i
        kinds += run_windows(g, 1, on_rate=rate, off_rate=rate)
    assert g.num_switches == 0 and g.buckets[64].prefer and kinds.count(False) >= 4
    g = SpeculationGuard()  # a real gain on top of the drift still switches
    for i in range(12):
        run_windows(g, 1, on_rate=1000.0 * 1.02**i, off_rate=1150.0 * 1.02**i)
    assert not g.buckets[64].prefer and g.num_switches == 1


def test_a_window_that_committed_nothing_judges_no_probe() -> None:
    """The preferred window after a winning probe commits nothing (all prompt chunks): it does
    not count, the probe is not judged, and the bucket goes back to its preferred kind rather
    than probing on unjudged."""
    g = SpeculationGuard()
    while g.drafting:
        run_windows(g, 1, on_rate=1000.0, off_rate=1000.0)
    run_windows(g, 1, on_rate=1000.0, off_rate=1200.0)  # a probe that would win
    for _ in range(g.settle + g.window):
        g.observe(0.01, 0, 64)  # the window after it: nothing committed
    b = g.buckets[64]
    assert not b.confirming and not b.pending and b.last == 0.0 and g.drafting
    kinds = run_windows(g, 40, on_rate=1000.0, off_rate=1000.0)
    assert kinds.count(True) > 30 and g.num_switches == 0


def test_after_a_switch_the_probes_judge_windows_of_the_new_preference() -> None:
    """After a switch no window of the old preference stands for the new one, and the next
    probe comes after ``probe_every`` windows of the new kind."""
    g = SpeculationGuard()
    run_windows(g, 7, on_rate=1000.0, off_rate=1100.0)
    b = g.buckets[64]
    assert not b.prefer and b.last == 0.0 and b.since_probe == 0
    kinds = run_windows(g, g.probe_every + 1, on_rate=1000.0, off_rate=1100.0)
    assert kinds == [False] * g.probe_every + [True] and b.last == pytest.approx(1100.0)


def test_drafting_comes_back_when_a_retry_wins() -> None:
    g = SpeculationGuard()
    run_windows(g, 7, on_rate=1000.0, off_rate=1200.0)
    assert not g.buckets[64].prefer
    run_windows(g, 40, on_rate=1500.0, off_rate=1000.0)  # the drafter got better (longer outputs)
    assert g.buckets[64].prefer and g.num_switches == 2


def test_each_batch_bucket_judges_for_itself() -> None:
    """Drafting that wins at 8 running requests and loses at 64 is kept at 8 and turned off at
    64 within a few windows there, whatever the probes' spacing at 8 had grown to."""
    g = SpeculationGuard()
    run_windows(g, 100, on_rate=1300.0, off_rate=1000.0, running=8)
    assert g.buckets[8].prefer and g.buckets[8].backoff == MAX_BACKOFF
    kinds = run_windows(g, 8, on_rate=1000.0, off_rate=1100.0, running=64)
    # the first window at 64 began at 8: it counts for neither; the next is 64's first
    assert kinds == [True] * 4 + [False, True] * 2 and not g.buckets[64].prefer
    assert g.buckets[8].num_on + g.buckets[8].num_off == 99 and g.buckets[64].num_on == 4
    # back at 8: the window that began at 64 is 64's kind, the next is 8's
    assert run_windows(g, 2, 1300.0, 1000.0, running=8) == [False, True] and g.buckets[8].prefer


def test_the_first_outputs_of_a_window_and_idle_gaps_are_not_counted() -> None:
    """The first ``settle`` outputs of a window come from steps sent before it (overlap), and
    a cycle after an idle spell is no cycle."""
    g = SpeculationGuard()
    run_windows(g, 1, on_rate=1.0, off_rate=1.0)  # the first window: not counted
    assert not g.buckets[64].num_on
    for i in range(g.settle + g.window):
        if i < g.settle:
            g.observe(1e-6, 1, 64)  # a drafting step's output, sent before the window
        elif i == g.settle + 5:
            g.observe(0.0, 1000, 64)  # the first output after an idle spell
        else:
            g.observe(0.064, 64, 64)
    assert g.buckets[64].on == pytest.approx(1000.0) and g.buckets[64].num_on == 1
    for _ in range(g.settle + g.window - 1):
        g.observe(0.064, 64, 64)  # a window one output short of its end
    g.restart()  # a worker restart: that window ends uncounted, and the next (the replays) too
    assert g._seen == 0
    run_windows(g, 1, on_rate=5.0, off_rate=5.0)
    assert g.buckets[64].num_on == 1 and g.buckets[64].on == pytest.approx(1000.0)
    run_windows(g, 1, on_rate=500.0, off_rate=500.0)  # (a probe: the skipped window moved it on)
    b = g.buckets[64]
    assert (b.num_on, b.num_off) == (1, 1) and b.on == pytest.approx(1000.0)


def test_a_load_that_keeps_moving_does_not_stop_the_probes() -> None:
    """Windows that end in another bucket than they began in count for neither, but move the
    bucket's probes on: a bucket that turned drafting off still re-tries it."""
    g = SpeculationGuard()
    run_windows(g, 7, on_rate=1000.0, off_rate=1100.0)
    assert not g.buckets[64].prefer
    kinds = []
    for i in range(40):  # the running requests cross 32 in every window
        kinds += run_windows(g, 1, 1000.0, 1100.0, running=64 if i % 2 else 32)
    assert g.buckets[64].num_on == 4 and True in kinds  # no window counted, the re-tries came


def test_a_window_with_drafting_off_asks_the_worker_for_no_drafts() -> None:
    """While the guard's window has drafting off the scheduler proposes nothing, whatever the
    tuner would, and pauses the tuner, which gives up a measurement under way."""
    limits = WorkerLimits(
        vocab_size=100, eos_token_ids=(0,), max_model_len=512, max_num_speculative_tokens=4,
        max_num_seqs=8,
    )  # fmt: skip
    for guarded in (True, False):
        s = Scheduler(SchedulerConfig(speculation_guard=guarded), limits, None, None)
        assert (s.guard is not None) == guarded and s.tuner is not None
        s.tuner.propose = lambda *a: 3  # type: ignore[method-assign]  # a tuner that drafts
        s.add(Request("a", list(range(1, 20)), SamplingParams(max_tokens=64), 4))
        asked = []
        for step in range(12):
            if s.guard is not None:
                s.guard.drafting = step < 6
            sched = s.schedule()
            assert sched is not None
            asked.append(int(sched.max_draft_proposals))
            out = ModelRunnerOutput(
                step_id=sched.step_id, req_ids=["a"], num_sampled=np.ones(1, np.int32),
                sampled_token_ids=np.array([5], np.int32),
                num_draft_tokens=np.zeros(1, np.int32), num_accepted=np.zeros(1, np.int32),
            )  # fmt: skip
            s.update(out)
            s.no_drafts(out)  # as the engine does after an output that says none follow
        assert asked == ([3] * 6 + [0] * 6 if guarded else [3] * 12)
        assert s.last_committed == 1 and (s.tuner.reason == "guard") == guarded


def test_pausing_the_tuner_gives_up_a_measurement_under_way() -> None:
    tuner = SpeculationTuner(4)
    assert tuner.propose([0.5] * 4, [4] * 4) == 0 and tuner.reason == "ends"
    bucket = tuner._holding
    assert bucket is not None and bucket.hold == 0  # the no-drafts end, measured next step
    tuner.pause()
    assert tuner._holding is None and bucket.hold == -1 and bucket.run == 0
    assert tuner.reason == "guard"


def test_the_guard_shows_in_the_metrics() -> None:
    g = SpeculationGuard()
    run_windows(g, 7, on_rate=1000.0, off_rate=1100.0)
    m = SchedulerMetrics()
    m.watch_tuner(SpeculationTuner(4), g)
    text = generate_latest(m.registry).decode()
    assert 'specd_scheduler_speculation_guard_preferred{batch="64"} 0.0' in text
    assert "specd_scheduler_speculation_guard_switches_total 1.0" in text
    assert 'guard_tokens_per_second{batch="64",kind="off"} 1100.0' in text
