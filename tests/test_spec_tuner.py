"""The adaptive speculation length: its choice follows measured step costs and acceptance, and
greedy output stays equal to target-only greedy while it changes widths."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import generate_latest

from protocol.messages import (
    DraftTokenIds,
    ModelRunnerOutput,
    NewRequest,
    SamplingParams,
    SchedulerOutput,
)
from scheduler_client.engine import Engine
from scheduler_client.prom import SchedulerMetrics
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.spec_tuner import (
    CALIBRATION_RANGE,
    EXPLORE_EVERY,
    MAX_EXPLORE_EVERY,
    OFF_FOR,
    PLAIN_RUN,
    SpeculationTuner,
    batch_bucket,
    expected_tokens,
)
from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, tiny_model
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner


def small_limits(max_num_seqs: int) -> WorkerLimits:
    """A worker of 4 drafts a request, 100 tokens and 64 positions, for scheduler-level tests."""
    return WorkerLimits(
        vocab_size=100,
        eos_token_ids=(0,),
        max_model_len=64,
        max_num_speculative_tokens=4,
        max_num_seqs=max_num_seqs,
    )


def settle(
    tuner: SpeculationTuner,
    n: int,
    cost: dict[int, float],
    alpha: float,
    draft_cost: float = 0.0,
    steps: int = 30,
) -> int:
    """Drive the tuner as the scheduler does: each step verifies what the last one proposed
    (``choose``), proposes for the next (``propose``), and costs verifying ``cost[1 + K]`` plus
    ``draft_cost`` per proposed draft. Returns the width it settled on (verified = proposed)."""
    avail, k, p = 0, 0, 0
    for _ in range(steps):
        k = tuner.choose([alpha] * n, [avail] * n)
        p = tuner.propose([alpha] * n, [4] * n)
        tuner.observe_step(n, 1 + k, cost[1 + k] + draft_cost * p, p)
        avail = p
    assert k == p, (k, p)
    return k


def test_flat_cost_speculates_fully_and_costly_verification_turns_it_off() -> None:
    flat = {w: 1.0 for w in range(1, 6)}
    assert settle(SpeculationTuner(4), 1, flat, 0.6) == 4
    # each extra token costs as much as the step itself (compute bound): drafts never pay
    steep = {w: float(w) for w in range(1, 6)}
    assert settle(SpeculationTuner(4), 64, steep, 0.6) == 0
    # a middle ground: the best width is in between and is found
    mid = {w: 1.0 + 0.3 * (w - 1) for w in range(1, 6)}
    k = settle(SpeculationTuner(4), 8, mid, 0.7)
    goodput = {j: expected_tokens(0.7, j) / mid[1 + j] for j in range(5)}
    assert k == max(goodput, key=lambda j: goodput[j]) and 0 < k < 4


def test_low_acceptance_stops_speculation() -> None:
    mild = {w: 1.0 + 0.05 * (w - 1) for w in range(1, 6)}
    assert settle(SpeculationTuner(4), 4, mild, 0.02) == 0
    assert settle(SpeculationTuner(4), 4, mild, 0.9) == 4


def test_a_slow_drafter_turns_drafting_off() -> None:
    """Verifying costs nothing extra (batch 1 on a GPU) but each draft costs the drafter half a
    step (an EAGLE head or a draft model run k times): at acceptance 0.3 no width pays, so the
    tuner proposes nothing and the drafter stops working. A cheap drafter at acceptance 0.8
    keeps full width."""
    flat = {w: 1.0 for w in range(1, 6)}
    assert settle(SpeculationTuner(4), 1, flat, 0.3, draft_cost=0.5) == 0
    assert settle(SpeculationTuner(4), 1, flat, 0.8, draft_cost=0.01) == 4


def test_steps_switching_widths_are_not_measured() -> None:
    """Verify K, propose P: counted when P == K, or 0 < K < P (a drafter found fewer than
    asked); a step that verified drafts and proposed fewer, or proposed drafts it did not
    verify, costs neither width's price."""
    tuner = SpeculationTuner(4)
    tuner.observe_step(1, 5, 1.0, 0)  # verified 4, drafted none: cheaper than width 5 is
    tuner.observe_step(1, 1, 9.0, 4)  # verified none, drafted 4: dearer than width 1 is
    assert (1, False) not in tuner._buckets
    tuner.observe_step(1, 5, 2.0, 4)
    tuner.observe_step(1, 3, 1.5, 4)
    tuner.observe_step(1, 1, 1.0, 0)
    tuner.observe_step(1, 2, 1.2, -1)  # no proposal cap (the worker's own widths): counted
    assert tuner._buckets[1, False].seconds == {5: 2.0, 3: 1.5, 1: 1.0, 2: 1.2}


def explorations(
    tuner: SpeculationTuner, cost: dict[int, float], alpha: float, steps: int, draft_cost: float
) -> list[tuple[int, int]]:
    """Drive ``steps`` more steps as ``settle`` does; returns (decision, K) of every step that
    proposed drafts and then verified them all (a re-measurement of the drafting end)."""
    avail, out = 0, []
    for step in range(steps):
        k = tuner.choose([alpha], [avail])
        p = tuner.propose([alpha], [4])
        tuner.observe_step(1, 1 + k, cost[1 + k] + draft_cost * p, p)
        if k and k == avail:
            out.append((step, k))
        avail = p
    return out


def test_the_drafting_end_is_re_measured_and_verified() -> None:
    """Settled at zero, the tuner still proposes full width now and then, and the next step
    verifies what was proposed, so that step counts as the drafting end's cost (a re-measurement
    that proposed drafts and then verified none measured nothing and cost the drafting)."""
    tuner = SpeculationTuner(4)
    flat = {w: 1.0 for w in range(1, 6)}
    settle(tuner, 1, flat, 0.3, draft_cost=0.5)
    samples = tuner._buckets[1, False].fits[5].n
    seen = explorations(tuner, flat, 0.3, 1000, draft_cost=0.5)
    assert seen and all(k == 4 for _, k in seen), seen
    assert tuner._buckets[1, False].fits[5].n == samples + len(seen)


def test_re_measurements_that_confirm_the_choice_come_less_often() -> None:
    """A drafter that keeps losing is re-measured after 64 decisions, then 128, ... up to 1,024,
    and never sooner than what keeps the re-measurements' cost at 1% of the time (each costs two
    drafting steps), once its end has samples enough to trust (at most 64 * 4^(samples - 1));
    when drafting pays again the next re-measurement finds it, the tuner drafts again, and the
    wait starts over."""
    tuner = SpeculationTuner(4)
    flat = {w: 1.0 for w in range(1, 6)}
    settle(tuner, 1, flat, 0.4, draft_cost=0.5)
    bucket = tuner._buckets[1, False]
    # width 5 takes 3 steps' time at 1.65 / 3 of the rate: 2 * 3 * 0.45 = 2.7 steps lost,
    # 270 decisions' wait; with one sample of it, 64
    assert tuner._explore_wait(bucket, tuner._rates(bucket.seconds, [0.4], [4], 4)) == EXPLORE_EVERY
    bucket.fits[5].n = 3
    assert tuner._explore_wait(bucket, tuner._rates(bucket.seconds, [0.4], [4], 4)) == 270
    bucket.fits[5].n = 1
    seen = [step for step, _ in explorations(tuner, flat, 0.4, 8000, draft_cost=0.5)]
    gaps = np.diff(seen).tolist()
    want = [
        max(min(EXPLORE_EVERY * 2**i, MAX_EXPLORE_EVERY), min(270, EXPLORE_EVERY * 4**i))
        for i in range(1, len(gaps) + 1)
    ]
    assert gaps == want, gaps
    # the drafter got cheap: found at the next re-measurements (the first moved the drafting
    # end's time by a third: the waits start over), then drafting holds
    waits, avail, k = set(), 0, 0
    for _ in range(MAX_EXPLORE_EVERY + 300):
        k = tuner.choose([0.4], [avail])
        avail = tuner.propose([0.4], [4])
        tuner.observe_step(1, 1 + k, 1.0, avail)
        waits.add(tuner._buckets[1, False].explore_every)
    assert k > 0 and EXPLORE_EVERY in waits, waits


def test_a_drafter_that_loses_badly_is_re_measured_rarely() -> None:
    """A drafting step 21 times as long as a plain one (a draft model at batch 64) is re-measured
    only every 3,870 decisions (2 steps * 21 * (1 - 1.65 / 21) lost, at 1% of the time): every
    64, its two steps would cost two thirds of the time."""
    tuner = SpeculationTuner(4)
    flat = {w: 1.0 for w in range(1, 6)}
    settle(tuner, 64, flat, 0.4, draft_cost=5.0)
    bucket = tuner._buckets[64, False]
    bucket.fits[5].n = 7  # measured often enough to be trusted
    assert (
        tuner._explore_wait(bucket, tuner._rates(bucket.seconds, [0.4] * 64, [4] * 64, 4)) == 3870
    )


def with_arrivals(
    tuner: SpeculationTuner,
    n: int,
    width_cost: float,
    alpha: float,
    draft_cost: float,
    steps: int = 400,
    seed: int = 0,
) -> list[int]:
    """Steps at batch ``n`` under arrivals, as served c=64 runs: 9 steps in 10 carry a prompt
    chunk of 50..800 tokens costing 0.01 a token, beside a decode of width 1 + K costing 1 +
    ``width_cost`` K, plus ``draft_cost`` per proposed draft. Returns each step's verified K."""
    rng = random.Random(seed)
    avail, ks = 0, []
    for _ in range(steps):
        k = tuner.choose([alpha] * n, [avail] * n)
        p = tuner.propose([alpha] * n, [4] * n)
        prefill = rng.randrange(50, 800) if rng.random() < 0.9 else 0
        seconds = 1.0 + width_cost * k + 0.01 * prefill + draft_cost * p
        tuner.observe_step(n, 1 + k, seconds * rng.uniform(0.97, 1.03), p, prefill)
        avail = p
        ks.append(k)
    return ks


def test_steps_that_carry_prefill_measure_the_widths() -> None:
    """Under arrivals nearly every step carries a prompt chunk. Counted with their prefill tokens,
    they measure the widths by their decode part: a drafter that loses at every width (alpha 0.6,
    each draft costing 0.8 of a 1.0 decode) is turned down to zero, though beside the average
    prefill (3.8 more a step) its drafts would look worth their cost; one that wins (alpha 0.8,
    0.02 a draft) keeps full width."""
    losing = with_arrivals(SpeculationTuner(4), 48, 0.05, 0.6, draft_cost=0.8)
    assert losing[-200:].count(0) >= 195, losing[-200:]
    winning = with_arrivals(SpeculationTuner(4), 48, 0.05, 0.8, draft_cost=0.02)
    assert winning[-200:].count(4) >= 195, winning[-200:]


def test_widths_measured_under_different_prefill_loads_are_compared_at_one_load() -> None:
    """Width 5 measured in steps with about 2,000 prefill tokens, width 1 in steps without: taken
    as they are, width 5 looks 20 times dearer; at one load it costs 0.5 more than width 1, and
    drafting (alpha 0.6: 2.3 tokens a step) pays."""
    tuner = SpeculationTuner(4)
    rng = random.Random(1)
    for _ in range(30):
        p = rng.randrange(1500, 2500)
        tuner.observe_step(8, 5, 1.5 + 0.01 * p, 4, p)
    for _ in range(30):
        tuner.observe_step(8, 1, 1.0, 0, 0)
    bucket = tuner._buckets[8, False]
    assert bucket.fits[5].t > 15 * bucket.fits[1].t
    times = bucket.seconds
    assert abs(times[5] - times[1] - 0.5) < 1e-6, times
    assert tuner.choose([0.6] * 8, [4] * 8) > 0


def test_a_steps_premium_for_any_prompt_chunk_is_fitted_apart_from_its_tokens() -> None:
    """A step with any prompt chunk leaves the decode graphs for the ragged path: 3.0 more
    whatever its size, beside 0.001 a prompt token. The no-drafts end measured mostly in such
    steps (arrivals), the drafting end mostly without: one slope per token left 0.68 of that
    premium in the no-drafts end's decode part (3.68 against 3.0), and a losing drafter (alpha
    0.3, 7.0 a step) drafted one; fitted apart, both decode parts come out exact and it drafts
    none."""
    tuner = SpeculationTuner(4)
    rng = random.Random(2)

    def cost(width: int, p: int) -> float:
        return (3.0 if width == 1 else 7.0) + 0.001 * p + (3.0 if p else 0.0)

    for _ in range(30):
        p = rng.randrange(100, 600) if rng.random() < 0.8 else 0
        tuner.observe_step(48, 1, cost(1, p), 0, p)
    for _ in range(15):
        p = rng.randrange(100, 600) if rng.random() < 0.2 else 0
        tuner.observe_step(48, 5, cost(5, p), 4, p)
    times = tuner._buckets[64, False].seconds
    assert times[1] == pytest.approx(3.0) and times[5] == pytest.approx(7.0), times
    assert tuner.choose([0.3] * 48, [4] * 48) == 0


def test_the_engine_counts_steps_with_prompt_chunks_for_the_tuner() -> None:
    """``Engine._observe`` passes a step with a new request and a prompt chunk to the tuner
    with its prefill tokens, at the width the worker ran."""
    tuner = SpeculationTuner(4)
    engine = SimpleNamespace(scheduler=SimpleNamespace(tuner=tuner), _trace=None, _held=None)
    sched = SchedulerOutput(
        step_id=3,
        new_requests=[NewRequest("b", np.arange(3, 40, dtype=np.int32), SamplingParams(), 4)],
        req_ids=["a", "b"],
        num_scheduled_tokens=np.array([5, 37], np.int32),
        num_draft_tokens=np.array([4, 0], np.int32),
        draft_token_ids=np.full(4, -1, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
        max_draft_proposals=2,
    )
    out = ModelRunnerOutput(
        step_id=3,
        req_ids=["a", "b"],
        num_sampled=np.array([2, 1], np.int32),
        sampled_token_ids=np.array([7, 8, 9], np.int32),
        num_draft_tokens=np.array([2, 0], np.int32),
        num_accepted=np.array([1, 0], np.int32),
    )
    Engine._observe(engine, sched, out, 0.25)  # type: ignore[arg-type]
    fit = tuner._buckets[2, False].fits[3]
    assert (fit.n, fit.p, fit.t) == (1, 37.0, 0.25)


def test_a_step_whose_output_was_held_is_timed_with_the_next_cycle() -> None:
    """``--pipeline-steps``: the worker sends a step's output after it has launched the next
    step (``held``), so that step's cycle is long and the next one short (2.3 then 0.5 ms,
    h100-s26). A held no-drafts step is timed by the mean of the two, even where the next step
    is a switch the tuner does not count; after an idle spell (a time from the step's send, not
    a cycle) it keeps its own."""
    tuner = SpeculationTuner(4)
    engine = SimpleNamespace(scheduler=SimpleNamespace(tuner=tuner), _trace=None, _held=None)

    def step(step_id: int, proposals: int) -> SchedulerOutput:
        return SchedulerOutput(
            step_id=step_id, new_requests=[], req_ids=["a"],
            num_scheduled_tokens=np.array([1], np.int32), num_draft_tokens=np.zeros(1, np.int32),
            draft_token_ids=np.zeros(0, np.int32), finished_req_ids=[], aborted_req_ids=[],
            structured_req_ids=[], max_draft_proposals=proposals,
        )  # fmt: skip

    def out(step_id: int, held: bool) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            step_id=step_id, req_ids=["a"], num_sampled=np.ones(1, np.int32),
            sampled_token_ids=np.array([5], np.int32), num_draft_tokens=np.zeros(1, np.int32),
            num_accepted=np.zeros(1, np.int32), held=held,
        )  # fmt: skip

    Engine._observe(engine, step(1, 0), out(1, True), 0.0023)  # type: ignore[arg-type]
    assert (1, False) not in tuner._buckets  # waits for the next cycle
    Engine._observe(engine, step(2, 4), out(2, False), 0.0005)  # type: ignore[arg-type]
    fit = tuner._buckets[1, False].fits[1]  # the switch (proposed 4, verified none) is not counted
    assert fit.n == 1 and fit.t == pytest.approx(0.0014)
    Engine._observe(engine, step(3, 0), out(3, True), 0.0030)  # type: ignore[arg-type]
    Engine._observe(engine, step(4, 0), out(4, False), 0.0020, cycle=False)  # type: ignore[arg-type]
    assert tuner._buckets[1, False].fits[1].n == 3  # the held one at its own 3.0 ms, then 2.0


def test_alpha_estimate_is_smoothed_toward_the_prior() -> None:
    tuner = SpeculationTuner(4)
    assert tuner.alpha(0, 0) == 0.5
    assert abs(tuner.alpha(100, 90) - 91 / 102) < 1e-12


def test_a_new_request_starts_from_the_drafters_recent_acceptance() -> None:
    """The prior is the drafter's acceptance over recent requests: after requests that accepted
    a third of their judged drafts, a new request starts near a third, not at 0.5 (a head that
    loses kept drafting at c=8 on the CPU on every young request's optimism), and the pool
    follows a drafter whose acceptance changes."""
    tuner = SpeculationTuner(4)
    for _ in range(300):
        tuner.observe_judged(3, 1)
    assert abs(tuner.alpha(0, 0) - 1 / 3) < 1e-9
    assert abs(tuner.alpha(10, 9) - (9 + 2 / 3) / 12) < 1e-9
    for _ in range(2000):
        tuner.observe_judged(4, 4)
    assert tuner.alpha(0, 0) > 0.99
    tuner.observe_judged(0, 0)  # a step without drafts judges nothing
    assert tuner.alpha(0, 0) > 0.99


def test_greedy_output_is_unchanged_by_the_tuner() -> None:
    target = tiny_model("llama", seed=77)
    ref = reference_copy(target)
    runner = ModelRunner(
        ModelExecutor(target, max_num_seqs=4, max_model_len=256, decode_width=5),
        NgramDrafter(min_n=1, max_n=3, max_num_tokens=4),
        max_num_seqs=4,
        max_model_len=256,
        max_num_draft_tokens=4,
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [3, 4, 5, 3, 4, 5, 3]]
    reqs = [Req(f"r{i}", p, 30, k=4) for i, p in enumerate(prompts)]
    got = run(runner, reqs, tuner=SpeculationTuner(4))
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens)
    assert sum(r.verified for r in reqs) > 0


def test_the_batched_goodput_picks_what_the_per_request_formula_picks() -> None:
    """``choose`` sums expected tokens for every width at once; it must pick the width the plain
    per-request formula picks (random batches, measured times for every width)."""
    rng = random.Random(3)
    for _ in range(200):
        tuner = SpeculationTuner(4)
        batch = rng.choice([1, 3, 8, 64])
        times = {w: 0.004 + rng.random() * 0.004 for w in range(1, 6)}
        for w, t in times.items():
            tuner.observe_step(batch, w, t)
        alphas = [tuner.alpha(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(batch)]
        caps = [rng.randint(0, 4) for _ in range(batch)]
        top = min(4, max(caps))
        if top == 0:
            continue
        rates = [
            sum(expected_tokens(a, min(k, c)) for a, c in zip(alphas, caps, strict=True))
            / times[1 + k]
            for k in range(top + 1)
        ]
        want = max(range(top + 1), key=lambda k: (rates[k], -k))
        got = tuner.choose(alphas, caps)
        assert got == want or rates[got] == rates[want]


def test_a_batch_size_borrows_its_drafting_cost_from_the_nearest_one_measured() -> None:
    """Measured at batch 64 to lose badly, drafting is not measured again as the batch drains to
    32 (two steps of a losing draft model): width 1 is measured there, the drafting end's time is
    borrowed as a ratio to it, and the tuner does not draft."""
    tuner = SpeculationTuner(4)
    flat = {w: 1.0 for w in range(1, 6)}
    settle(tuner, 64, flat, 0.4, draft_cost=5.0)
    proposals = []
    for _ in range(20):
        tuner.choose([0.4] * 32, [0] * 32)
        p = tuner.propose([0.4] * 32, [4] * 32)
        tuner.observe_step(32, 1, 0.5, p)
        proposals.append(p)
    assert proposals == [0] * 20
    assert tuner._buckets[32, False].seconds[5] == 0.5 * 21.0


def test_the_served_c64_cost_model_turns_a_losing_draft_model_off() -> None:
    """bench/tuner_sim.py's draft-model profile (fitted to the H200's served figures, where the
    tuner drafted at full width at c=64 and served 0.38x no drafts): at c=64 with arrivals the
    tuner fed every step keeps at least 0.92x no drafts in a row as short as the served ones
    (0.98x over 2,000 requests), where drafting every step makes 0.41x; a cheap drafter keeps
    its speedup; so does no drafting a losing EAGLE-like head with a mixed-step premium, and one
    whose drafting costs a fixed catch-up forward and the catch-up of its backlogs."""
    from bench.tuner_sim import PROFILES, simulate

    draft_model, cheap, _, eagle_mixed, eagle_fixed = PROFILES
    base = simulate(draft_model, "none", 64, 300)
    assert simulate(draft_model, "always", 64, 300) < 0.5 * base
    assert simulate(draft_model, "tuner", 64, 300) >= 0.92 * base
    assert simulate(cheap, "tuner", 64, 300) >= 1.8 * base
    # a losing EAGLE-like head whose mixed steps pay a premium of their own (0.60x every step)
    base = simulate(eagle_mixed, "none", 64, 300)
    assert simulate(eagle_mixed, "tuner", 64, 300) >= 0.9 * base
    base = simulate(eagle_fixed, "none", 64, 300)
    assert simulate(eagle_fixed, "always", 64, 300) < 0.6 * base
    assert simulate(eagle_fixed, "tuner", 64, 300) >= 0.93 * base


def test_one_slow_step_does_not_keep_a_paying_drafter_off() -> None:
    """The drafting end's first measured step ran 10 times slow (a busy host): the tuner turns
    drafting off, re-measures it every 64 decisions while each re-measurement moves its time,
    and drafts again within a few hundred (a wait computed from that one sample would have been
    thousands of decisions)."""
    tuner = SpeculationTuner(4)
    avail, k, first = 0, 0, True
    ks = []
    for _ in range(400):
        k = tuner.choose([0.8], [avail])
        p = tuner.propose([0.8], [4])
        seconds = 1.0
        if k == 4 and first:
            seconds, first = 10.0, False
        tuner.observe_step(1, 1 + k, seconds, p)
        avail = p
        ks.append(k)
    assert 0 in ks[:60] and ks[-60:] == [4] * 60, ks


def test_metrics_show_what_the_tuner_measured() -> None:
    """/metrics exports the tuner's step time and samples per batch bucket and width, read at
    each scrape."""
    tuner = SpeculationTuner(4)
    prom = SchedulerMetrics()
    prom.watch_tuner(tuner)
    assert "specd_scheduler_tuner_step_seconds{" not in generate_latest(prom.registry).decode()
    for _ in range(3):
        tuner.observe_step(3, 1, 0.002, 0, 0)
    tuner.observe_step(3, 5, 0.004, 4, 0)
    assert tuner.snapshot() == [
        ("4", 1, pytest.approx(0.002), 3),
        ("4", 5, pytest.approx(0.004), 1),
    ]
    text = generate_latest(prom.registry).decode()
    assert 'specd_scheduler_tuner_step_seconds{batch="4",width="5"} 0.004' in text
    assert 'specd_scheduler_tuner_samples{batch="4",width="1"} 3.0' in text
    assert "specd_scheduler_tuner_calibration 1.0" in text


def test_a_drafter_that_finds_drafts_for_few_requests_is_turned_down() -> None:
    """An n-gram lookup finds a match for some requests only: the gain of a width counts each
    request's share of hits (``hits``), so a width that pays when every request drafts is
    turned down when one request in twenty does (the served c=64 n-gram rows drafted at 0.93x no
    drafts, h100-s15)."""
    mid = {w: 1.0 + 0.05 * (w - 1) for w in range(1, 6)}
    tuner = SpeculationTuner(4)
    for w, t in mid.items():
        for _ in range(3):
            tuner.observe_step(64, w, t, w - 1)
    alphas, caps = [0.6] * 64, [4] * 64
    assert tuner.choose(alphas, caps) == tuner.choose(alphas, caps, [1.0] * 64) == 4
    assert tuner.choose(alphas, caps, [0.05] * 64) == 0
    assert tuner.propose(alphas, caps, [0.05] * 64) == 0


def test_the_scheduler_learns_each_requests_draft_hit_rate() -> None:
    """``Request.draft_hits`` follows what the drafter proposed of what the step asked for;
    a step that asked for none leaves it as it was."""
    limits = small_limits(4)
    s = Scheduler(SchedulerConfig(adaptive_speculation=False), limits, None, None)
    for r in ("hit", "miss"):
        s.add(Request(r, [1, 2, 3], SamplingParams(max_tokens=30), 4))
    for _ in range(6):
        sched = s.schedule()
        assert sched is not None and sched.max_draft_proposals == -1
        out = ModelRunnerOutput(
            step_id=sched.step_id, req_ids=["hit", "miss"], num_sampled=np.ones(2, np.int32),
            sampled_token_ids=np.array([5, 5], np.int32), num_draft_tokens=np.zeros(2, np.int32),
            num_accepted=np.zeros(2, np.int32),
        )  # fmt: skip
        s.update(out)
        n = s.requests["hit"].num_tokens
        s.take_drafts(
            DraftTokenIds(
                step_id=sched.step_id, req_ids=["hit", "miss"],
                num_draft_tokens=np.array([4, 0], np.int32),
                draft_token_ids=np.full(4, -1, np.int32),
                num_committed_tokens=np.array([n, n], np.int32),
            )
        )  # fmt: skip
        s.requests["hit"].draft_ids = s.requests["miss"].draft_ids = np.zeros(0, np.int32)
    assert s.requests["hit"].draft_hits == 1.0
    assert s.requests["miss"].draft_hits < 0.2
    # a request never asked for drafts stands at the pooled share of recent asks: about half
    s.add(Request("new", [1, 2, 3], SamplingParams(max_tokens=30), 4))
    assert s.requests["new"].draft_hits is None
    assert s._hits(s.requests["new"]) == pytest.approx(0.5, abs=0.02)


def test_new_requests_are_not_asked_for_drafts_a_drafter_rarely_finds() -> None:
    """Under arrivals most requests are new. Counted as finding every draft asked for, a batch
    of them made the tuner ask a prompt-lookup drafter for drafts it mostly did not find, and
    the few found were not worth a wider step: the next step verified none (h100, 2026-12-06,
    dummy 135m, n-gram, sync, c=64: 106 such proposals in 474 steps). With the pooled share of
    recent asks they are not asked."""
    limits = small_limits(8)
    s = Scheduler(SchedulerConfig(), limits, None, None)
    assert s.tuner is not None
    for _ in range(4):  # both ends of batch 8: four drafts cost half a step more
        s.tuner.observe_step(8, 1, 1.0, 0)
        s.tuner.observe_step(8, 5, 1.5, 4)
    for i in range(8):
        s.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=30), 4))
    sampling = set(s.requests)
    assert s._proposals(sampling, False) > 0  # no ask yet: every draft counted as found
    s._hits_pool[False] = [100.0, 10.0]  # recent asks found a tenth
    assert s._proposals(sampling, False) == 0


def test_small_batches_rate_widths_as_the_array_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SMALL_BATCH requests the goodput sums run as a Python loop: the same rates as the
    numpy path, for any alphas, caps and hit rates."""
    import scheduler_client.spec_tuner as spec_tuner

    tuner = SpeculationTuner(4)
    rng = random.Random(3)
    for b in range(1, spec_tuner.SMALL_BATCH + 1):
        for _ in range(20):
            known = {
                1: rng.uniform(1e-3, 5e-3),
                3: rng.uniform(2e-3, 8e-3),
                5: rng.uniform(3e-3, 9e-3),
            }
            alphas = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(b)]
            caps = [rng.randint(0, 4) for _ in range(b)]
            hits = [rng.uniform(-0.5, 1.5) for _ in range(b)] if rng.random() < 0.7 else None
            loop = tuner._rates(known, alphas, caps, 4, hits)
            monkeypatch.setattr(spec_tuner, "SMALL_BATCH", 0)
            array = tuner._rates(known, alphas, caps, 4, hits)
            monkeypatch.setattr(spec_tuner, "SMALL_BATCH", 8)
            assert loop == pytest.approx(array, rel=1e-9)


def test_a_buckets_times_follow_every_new_step() -> None:
    """The per-width times are computed once per change of the fits: a new step moves them."""
    tuner = SpeculationTuner(4)
    for _ in range(3):
        tuner.observe_step(1, 1, 0.002)
        tuner.observe_step(1, 5, 0.004)
    bucket = tuner._buckets[1, False]
    before = dict(bucket.seconds)
    assert bucket.seconds is bucket.seconds  # cached between changes
    tuner.observe_step(1, 5, 0.010)
    assert bucket.seconds[5] > before[5]
    assert bucket.seconds[1] == pytest.approx(before[1])


def drive(
    tuner: SpeculationTuner,
    n: int,
    alpha: float,
    decisions: int,
    seconds: Callable[[int, int], float],
) -> list[int]:
    """``decisions`` steps at batch ``n`` as the scheduler drives the tuner (each request with
    acceptance ``alpha`` and its own width 4): a step verifies what the last one proposed and
    takes ``seconds(verified K, proposed)``. Returns each step's verified K."""
    avail, ks = 0, []
    for _ in range(decisions):
        k = tuner.choose([alpha] * n, [avail] * n)
        p = tuner.propose([alpha] * n, [4] * n)
        tuner.observe_step(n, 1 + k, seconds(k, p), p)
        avail = p
        ks.append(k)
    return ks


def test_a_no_drafts_end_measured_slow_is_measured_again_soon() -> None:
    """The no-drafts end's first steps ran three times slow (a ramp-up's prefill at c=64, where
    a served EAGLE row then drafted at width 1 for 364 of its 381 steps, its no-drafts time at
    9.1 ms against 3.7 ms drafting): while that end has few samples, or a re-measurement moved
    its time, it is measured again 8 decisions later, and the tuner stops drafting within a few
    dozen decisions (64 apart, the first 300 decisions drafted 253 times)."""
    slow = [2]

    def seconds(k: int, p: int) -> float:
        if k == 0 and p == 0 and slow[0]:
            slow[0] -= 1
            return 3.0
        return 1.0 + 0.5 * k  # drafting loses: 1.3 tokens for 1.5x the time at best

    ks = drive(SpeculationTuner(4), 48, 0.3, 300, seconds)
    assert sum(k > 0 for k in ks) <= 40, ks
    assert ks[-200:].count(0) >= 198, ks


def test_a_losing_drafting_end_whose_time_moves_is_not_re_measured_soon() -> None:
    """A losing drafter's end whose re-measured time swings by half each time: only the
    no-drafts end (a step that costs no more than the chosen one) is measured again soon after
    a re-measurement made it cheaper; the drafting end's re-measurements stay at least 64
    decisions apart (each costs the drafter's catch-up and its steps)."""
    turns = [0]

    def seconds(k: int, p: int) -> float:
        if not k:
            return 1.0
        turns[0] += 1
        return 3.0 if turns[0] % 2 else 4.5

    ks = drive(SpeculationTuner(4), 48, 0.3, 1000, seconds)
    drafting_steps = [i for i, k in enumerate(ks) if k]
    gaps = np.diff(drafting_steps[2:]).tolist()  # after the first measurement of both ends
    assert gaps and min(gaps) >= EXPLORE_EVERY, gaps


def test_an_end_that_grows_dearer_confirms_the_choice() -> None:
    """Each re-measurement finds a losing drafter's end 30% dearer than the last: that confirms
    drafting nothing, and the waits double (taken as a surprise, every move reset them to 64
    decisions, 46 re-measurements in 3,000 decisions)."""
    dearer = [0]

    def seconds(k: int, p: int) -> float:
        if not k:
            return 1.0
        dearer[0] += 1
        return 3.0 * 1.3 ** (dearer[0] - 1)

    ks = drive(SpeculationTuner(4), 48, 0.3, 3000, seconds)
    gaps = np.diff([i for i, k in enumerate(ks) if k]).tolist()
    assert len(gaps) <= 8 and gaps[1:] == sorted(gaps[1:]) and gaps[-1] >= 512, gaps


def test_from_a_width_in_between_both_ends_are_re_measured() -> None:
    """Full width paid for thousands of steps, then a width in between did, then full width
    pays again: the tuner follows each change (from a width in between the two ends are
    re-measured by turns, so neither end's time stays stale)."""
    tuner = SpeculationTuner(4)

    def steps(count: int, alpha: float, per_width: float) -> list[int]:
        return drive(tuner, 16, alpha, count, lambda k, p: 1.0 + per_width * k)

    assert steps(3000, 0.8, 0.05)[-100:].count(4) >= 95
    assert steps(400, 0.7, 0.3)[-100:].count(2) >= 90
    assert steps(4000, 0.8, 0.05)[-1000:].count(4) >= 990


def test_with_drafting_off_a_step_in_flight_asks_the_tuner_for_no_choice() -> None:
    """Overlap: a request whose drafts are not back yet can verify at most what the last step
    asked the worker to propose. While the tuner keeps that at zero, the next step has nothing
    to verify and makes no choice (its per-request lists and rates cost every step at c=64);
    once a step asks for drafts, the next one chooses again."""
    limits = small_limits(4)
    s = Scheduler(SchedulerConfig(async_scheduling=True), limits, None, None)
    assert s.tuner is not None
    for r in ("a", "b"):
        s.add(Request(r, [1, 2, 3], SamplingParams(max_tokens=30), 4))
    chosen: list[int] = []
    choose = s.tuner.choose
    s.tuner.choose = lambda *a: chosen.append(1) or choose(*a)  # type: ignore[method-assign]
    asked = [0, 0, 4, 4]
    s.tuner.propose = lambda *a: asked.pop(0)  # type: ignore[method-assign]
    asks, widths = [], []
    for _ in range(4):  # in flight, none answered
        sched = s.schedule()
        assert sched is not None
        asks.append(sched.max_draft_proposals)
        widths.append(sched.num_draft_tokens.tolist())
    assert asks == [0, 0, 4, 4]
    assert widths[:3] == [[0, 0]] * 3 and widths[3] == [4, 4], widths  # (caps, with overlap)
    assert len(chosen) == 1  # only the step after the one that asked for 4


def test_the_step_after_a_proposal_verifies_it() -> None:
    """Drafts proposed to be verified are verified: their cost is paid. Weighed anew on the next
    step's requests, a near tie left a drafter proposing on every step and the next step
    verifying none (EAGLE, sync, c=64: 47 such proposals in 469 steps, h100 2026-12-06). When
    far fewer requests got drafts than expected, the few are weighed anew (a wide step for
    them)."""
    tuner = SpeculationTuner(4)
    for _ in range(4):
        tuner.observe_step(8, 1, 1.0, 0)
        tuner.observe_step(8, 5, 1.2, 4)
    k = tuner.propose([0.6] * 8, [4] * 8)
    assert k > 0 and tuner.reason == "best"
    for _ in range(3):  # slower drafting steps seen since: anew, no drafts would win
        tuner.observe_step(8, 5, 10.0, 4)
    assert tuner.choose([0.6] * 8, [4] * 8) == k
    assert tuner.choose([0.6] * 8, [4] * 8) == 0  # no proposal to follow
    assert tuner.propose([0.6] * 8, [4] * 8) == 0
    for _ in range(20):
        tuner.observe_step(8, 5, 1.2, 4)
    k = tuner.propose([0.6] * 8, [4] * 8)
    assert k > 0
    for _ in range(3):
        tuner.observe_step(8, 5, 10.0, 4)
    assert tuner.choose([0.6] * 8, [4] + [0] * 7) == 0  # one of eight got drafts: anew
    # requests without a width of their own (k = 0) never get drafts: they do not count against
    # the share (three of eight can draft, and all three got them)
    for _ in range(20):
        tuner.observe_step(8, 5, 1.2, 4)
    caps = [4, 4, 4, 0, 0, 0, 0, 0]
    k = tuner.propose([0.9] * 8, caps)
    assert k > 0 and tuner.reason == "best"
    for _ in range(3):
        tuner.observe_step(8, 5, 10.0, 4)
    assert tuner.choose([0.9] * 8, caps) == min(k, 4)


def slowing_down_at_first(cost: Callable[[int], float]) -> Callable[[int, int], float]:
    """Step times ``cost(K)`` on a machine six times slower at the first step, the slowness
    fading over the first few dozen steps (h100-s20: a worker's first steps after it was ready
    took 12.6 and 7.3 ms where later ones took 2.3)."""
    step = [0]

    def seconds(k: int, p: int) -> float:
        slow = 1.0 + 5.0 * math.exp(-step[0] / 5.0)
        step[0] += 1
        return slow * cost(k)

    return seconds


def test_widths_measured_on_a_slower_machine_are_measured_again() -> None:
    """Both ends measured in the slow first steps, the width in use then got cheaper while the
    no-drafts end kept its slow time: a losing drafter drafted 131 of the first 400 decisions
    (42 of the last 300), as an n-gram drafter did through the first quarter of a served row in
    h100-s20. Once the width in use is a fifth cheaper than when another width was measured,
    that width is measured anew."""
    ks = drive(SpeculationTuner(4), 48, 0.3, 400, slowing_down_at_first(lambda k: 1.0 + 0.5 * k))
    assert sum(k > 0 for k in ks) <= 20, ks
    assert sum(k > 0 for k in ks[100:]) <= 5, ks


def test_a_paying_drafter_keeps_full_width_after_a_slow_start() -> None:
    """The same start with a drafter that pays at full width: it settles there. A first
    version of the rule above, which measured only the no-drafts end anew, left the drafting
    end's slow time standing: a width in between looked cheaper, and 4 of the last 300
    decisions were at full width (294 before either)."""
    ks = drive(SpeculationTuner(4), 48, 0.8, 400, slowing_down_at_first(lambda k: 1.0 + 0.05 * k))
    assert ks[-300:].count(4) >= 295, ks


def test_prompt_chunks_of_every_size_do_not_make_widths_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drafter near break-even at batch 1, half its steps carrying a prompt chunk of 50 to
    2,048 tokens, every step ±15%: the decode parts move with the pooled prefill fit, not with
    the machine. Widths are measured anew at most 8 times a run of 3,000 decisions (21 in
    these three runs; 112 at f889118, where each forget moved the fit and set off the next)."""
    from scheduler_client import spec_tuner

    forgets = [0]
    forget = spec_tuner._Bucket.forget

    def counted(self: spec_tuner._Bucket, width: int) -> None:
        forgets[0] += 1
        forget(self, width)

    monkeypatch.setattr(spec_tuner._Bucket, "forget", counted)
    for seed in range(3):
        rng = random.Random(seed)
        tuner, avail = SpeculationTuner(4), 0
        for _ in range(3000):
            k = tuner.choose([0.5], [avail])
            p = tuner.propose([0.5], [4])
            chunk = rng.choice([0, rng.randint(50, 2048)])
            t = 1.03 * (1 + 0.12 * k) + 0.02 * p + 0.002 * chunk + 0.3 * (chunk > 0)
            tuner.observe_step(1, 1 + k, t * rng.uniform(0.85, 1.15), p, chunk)
            avail = p
    assert forgets[0] <= 3 * 8, forgets


def test_drafts_that_make_less_than_the_model_expects_turn_drafting_down() -> None:
    """The model's expected gain is scaled by what verified drafts made of it (recent steps):
    drafts that make a third of what it expects no longer pay where the model says they do."""
    cost = {w: 1.0 + 0.25 * (w - 1) for w in range(1, 6)}  # at alpha 0.5 one draft pays
    tuner = SpeculationTuner(4)
    assert settle(tuner, 4, cost, 0.5) == 1
    for _ in range(100):
        tuner.observe_verified(3.0, 1)
    assert tuner.calibration < 0.45  # a third, drawn toward 1 by the model's prior
    assert settle(tuner, 4, cost, 0.5) == 0


def test_the_calibration_trusts_few_steps_little_stays_in_its_bounds_and_fades() -> None:
    tuner = SpeculationTuner(4)
    tuner.observe_verified(2.0, 0)  # one step that made nothing: little said yet
    tuner.observe_verified(0.0, 3)  # a step with nothing expected of it is not counted
    assert tuner.calibration == pytest.approx(16 / 18)
    for _ in range(300):
        tuner.observe_verified(2.0, 0)
    assert tuner.calibration == CALIBRATION_RANGE[0]  # never zero: it can come back
    # without verify steps (drafting off) it returns to the model's own within a few thousand
    # decisions
    for _ in range(5000):
        tuner.propose([0.5], [4])
    assert tuner.calibration > 0.9
    for _ in range(300):
        tuner.observe_verified(1.0, 4)
    assert tuner.calibration == CALIBRATION_RANGE[1] == 1.0  # never past the model's own


def test_the_scheduler_pairs_each_request_s_expected_gain_with_what_its_drafts_made() -> None:
    """Only requests that ran their drafts and are still there when the output comes count, on
    both sides; a worker replaced drops what was in flight."""
    limits = small_limits(4)
    s = Scheduler(SchedulerConfig(), limits, None, None)
    assert s.tuner is not None
    seen: list[tuple[float, int]] = []
    s.tuner.observe_verified = lambda p, a: seen.append((p, a))  # type: ignore[method-assign]
    s.tuner.propose = lambda *a: 2  # type: ignore[method-assign]
    names = ["a", "b", "c"]
    for r in names:
        s.add(Request(r, [1, 2, 3], SamplingParams(max_tokens=30), 4))
    sched = s.schedule()
    assert sched is not None
    s.update(
        ModelRunnerOutput(
            step_id=sched.step_id, req_ids=names, num_sampled=np.ones(3, np.int32),
            sampled_token_ids=np.array([5, 5, 5], np.int32),
            num_draft_tokens=np.zeros(3, np.int32), num_accepted=np.zeros(3, np.int32),
        )
    )  # fmt: skip
    assert not seen  # nothing was verified
    n = s.requests["a"].num_tokens
    s.take_drafts(
        DraftTokenIds(
            step_id=sched.step_id, req_ids=names, num_draft_tokens=np.array([2, 2, 2], np.int32),
            draft_token_ids=np.full(6, -1, np.int32),
            num_committed_tokens=np.array([n, n, n], np.int32),
        )
    )  # fmt: skip
    sched = s.schedule()
    assert sched is not None and sched.num_draft_tokens.tolist() == [2, 2, 2]
    each = s.predicted[sched.step_id]
    assert set(each) == set(names)
    assert each["a"] == pytest.approx(expected_tokens(s.tuner.alpha(0, 0), 2) - 1)
    s.abort("c")  # ends while its step is in flight: its drafts' outcome never counts
    s.update(
        ModelRunnerOutput(
            step_id=sched.step_id, req_ids=names, num_sampled=np.array([2, 1, 3], np.int32),
            sampled_token_ids=np.array([5, 5, 5, 5, 5, 5], np.int32),
            num_draft_tokens=np.array([2, 2, 2], np.int32),
            num_accepted=np.array([1, 0, 2], np.int32),
        )
    )  # fmt: skip
    assert seen == [(pytest.approx(each["a"] + each["b"]), 1)] and not s.predicted
    s.predicted[s.step_id] = {"a": 1.0}  # in flight when the worker is replaced
    s.requeue_all()
    assert not s.predicted and not s.choices


def test_a_clear_choice_of_no_drafts_stands_without_weighing_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While drafting is off no draft is judged, so a clear choice of no drafts is weighed once
    in OFF_FOR decisions (at c=64 weighing every step cost the scheduler about 0.1 ms a step);
    a width whose time moves, a re-measurement falling due, or decisions of another batch size
    in between weigh the widths again."""
    tuner = SpeculationTuner(4)
    for _ in range(4):
        tuner.observe_step(64, 1, 1.0, 0)
        tuner.observe_step(64, 5, 4.0, 4)
    weighed = []
    rates = tuner._rates
    monkeypatch.setattr(tuner, "_rates", lambda *a: weighed.append(1) or rates(*a))
    alphas, caps = [0.2] * 64, [4] * 64
    made = []  # the per-request lists, made only where the widths are weighed (lazily)

    def alphas_made() -> list[float]:
        made.append(1)
        return alphas

    ks = [tuner.propose(alphas_made, caps, lambda: [1.0] * 64) for _ in range(OFF_FOR)]
    assert ks == [0] * OFF_FOR and tuner.reason == "best"
    assert len(weighed) == 1  # the first decision weighed, the rest stood
    assert len(made) == 1
    assert tuner.propose(alphas, caps) == 0 and len(weighed) == 2  # OFF_FOR passed: anew
    tuner.observe_step(64, 1, 1.5, 0)  # the no-drafts end got dearer: anew at once
    assert tuner.propose(alphas, caps) == 0 and len(weighed) == 3
    assert tuner.propose(alphas, caps) == 0 and len(weighed) == 3  # stands
    bucket = tuner._buckets[batch_bucket(64), False]
    bucket.next_explore = bucket.decisions + 1  # a re-measurement falls due: it is made
    assert tuner.propose(alphas, caps) == 4 and tuner.reason == "explore"
    assert tuner.propose(alphas, caps) == 4 and tuner.reason == "hold"  # its second step
    for _ in range(30):  # drafting got cheap: the next weighing turns it on
        tuner.observe_step(64, 5, 1.0, 4)
    assert tuner.propose([0.9] * 64, caps) > 0 and tuner.reason == "best"
    # the decisions of another batch size count: after OFF_FOR of them, this one weighs anew
    tuner = SpeculationTuner(4)
    for n in (64, 32):
        for _ in range(4):
            tuner.observe_step(n, 1, 1.0, 0)
            tuner.observe_step(n, 5, 4.0, 4)
    weighed.clear()
    rates_b = tuner._rates
    monkeypatch.setattr(tuner, "_rates", lambda *a: weighed.append(1) or rates_b(*a))
    assert tuner.propose(alphas, caps) == 0 and len(weighed) == 1
    for _ in range(OFF_FOR):
        assert tuner.propose([0.2] * 32, [4] * 32) == 0
    weighed.clear()
    assert tuner.propose(alphas, caps) == 0 and len(weighed) == 1


def plain_steps_drafting(pooled: bool) -> int:
    """Batch 1 in overlap with ``--pipeline-steps``, as h100-s26 timed it: 100 steps of a chat,
    then 20 of a structured request whose grammar rows are deferred, ten times over. A chat's
    step costs 1.1 ms without drafts (left open) and 2.0 ms at full width; a structured one 2.4
    and 2.0. Acceptance 0.25; the drafter finds half the drafts asked for a chat and none for a
    structured request. Returns how many of the last 500 chat steps verified drafts, with the
    steps timed apart by their grammar rows, or together (``pooled``, as before)."""
    tuner = SpeculationTuner(4)
    cost = {False: {1: 1.1, 5: 2.0}, True: {1: 2.4, 5: 2.0}}  # ms, [deferred][width]
    avail, drafting = 0, 0
    for step in range(1200):
        deferred = step % 120 >= 100
        hits = [0.0 if deferred else 0.5]
        kind = deferred and not pooled
        k = tuner.choose([0.25], [avail], hits, kind)
        p = tuner.propose([0.25], [4], hits, kind)
        table = cost[deferred]
        t = table.get(1 + k, table[1] + (table[5] - table[1]) * k / 4)
        tuner.observe_step(1, 1 + k, t, p, 0, deferred=kind)
        avail = p
        drafting += step >= 600 and not deferred and k > 0
    return drafting


def test_steps_with_deferred_grammar_rows_do_not_price_a_plain_steps_widths() -> None:
    """Overlap with ``--pipeline-steps``: a plain step without drafts is left open and costs
    half what it costs when a structured request's grammar rows are deferred (then it cannot
    be). An n-gram lookup finds no drafts for the structured requests, so the tuner timed them
    at width 1 and priced the plain requests' no-drafts steps by them: at acceptance 0.25 with
    half the drafts found it drafted for them at 0.82x no drafts (SmolLM2, H100, c=1,
    h100-s26). Timed apart, the plain requests draft nothing but re-measurements."""
    assert plain_steps_drafting(pooled=True) > 100  # the failure: timed together
    assert plain_steps_drafting(pooled=False) < 10


def test_a_measurement_whose_second_step_falls_in_another_bucket_is_given_up() -> None:
    """A measurement proposes, then verifies what it proposed in the next step. When that step
    falls in another bucket (the batch changed size, or a structured request's rows began to be
    deferred), the measurement is given up: its bucket measures anew when it decides next,
    where its hold used to fire on some later step, verifying drafts nobody proposed for it."""
    tuner = SpeculationTuner(4)
    assert tuner.propose([0.5], [4], None, False) == 0 and tuner.reason == "ends"
    tuner.propose([0.5], [4], None, True)  # the next step: rows deferred
    tuner.propose([0.5], [4], None, False)
    assert tuner.reason == "ends" and tuner._buckets[1, False].hold == 0  # measured anew
    tuner.propose([0.5], [4], None, False)  # ... and its second step in the same bucket
    assert tuner.reason == "hold"


def draft_model_drafting(plain_run: int) -> int:
    """c=64 in overlap with ``--pipeline-steps``, as h100-s27 timed the 1B dummy target with its
    dummy draft model (acceptance about 0.97): a step drafting 4 costs 9.76 ms, one without drafts
    1.9 ms when the step before it had none either (it is launched behind that one, left open)
    and 3.04 ms after a drafting step. Returns how many of the last 1,000 steps verified drafts."""
    before_plain = False

    def seconds(k: int, p: int) -> float:
        nonlocal before_plain
        t = 9.76 if k else 1.9 if before_plain else 3.04
        before_plain = k == 0 and p == 0
        return t

    ks = drive(SpeculationTuner(4, plain_run), 64, 0.97, 3000, seconds)
    return sum(k > 0 for k in ks[2000:])


def test_with_steps_left_open_the_no_drafts_end_is_timed_over_a_run() -> None:
    """A worker that leaves steps without drafts open (``--pipeline-steps``) runs them a third
    faster in a row than one at a time between drafting steps: timed one step at a time, no
    drafts looked dearer than drafting and the draft model drafted at 0.92x no drafts (c=64,
    h100-s27). Timed over a run of ``PLAIN_RUN`` steps, the first not counted, it is turned
    off but for its re-measurements."""
    assert draft_model_drafting(1) > 900  # the failure: one step at a time
    assert draft_model_drafting(PLAIN_RUN) < 100


def test_a_no_drafts_end_is_measured_where_batch_sizes_interleave() -> None:
    """Timed over a run (``PLAIN_RUN``), a bucket's no-drafts end still gets its first time from
    any step without drafts: where batches of two sizes interleave (8, 8, 64, ...: requests
    that sample around a bucket's edge under arrivals), a run in one bucket never comes, and the
    bucket measured its no-drafts end on every other decision for good."""
    tuner = SpeculationTuner(4, PLAIN_RUN)
    avail, ends = 0, 0
    for step in range(700):  # batch 64 alone first: it drafts, then the sizes interleave
        n = 64 if step < 100 else (8, 8, 64)[step % 3]
        k = tuner.choose([0.9] * n, [avail] * n)
        p = tuner.propose([0.9] * n, [4] * n)
        ends += n == 8 and tuner.reason == "ends"
        tuner.observe_step(n, 1 + k, 1.0 + 0.05 * k, p, 0)
        avail = p
    assert tuner._buckets[8, False].fits[1].n > 0
    assert ends < 10
