"""The adaptive speculation length: its choice follows measured step costs and acceptance, and
greedy output stays equal to target-only greedy while it changes widths."""

from __future__ import annotations

from scheduler_client.spec_tuner import EXPLORE_EVERY, SpeculationTuner, expected_tokens
from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, tiny_model
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner


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
    assert 1 not in tuner._buckets
    tuner.observe_step(1, 5, 2.0, 4)
    tuner.observe_step(1, 3, 1.5, 4)
    tuner.observe_step(1, 1, 1.0, 0)
    tuner.observe_step(1, 2, 1.2, -1)  # no proposal cap (the worker's own widths): counted
    assert tuner._buckets[1].seconds == {5: 2.0, 3: 1.5, 1: 1.0, 2: 1.2}


def test_the_drafting_end_is_re_measured() -> None:
    """Settled at zero, the tuner still proposes full width now and then (two steps: propose,
    then verify), so a drafter that became worth it is found again."""
    tuner = SpeculationTuner(4)
    flat = {w: 1.0 for w in range(1, 6)}
    settle(tuner, 1, flat, 0.3, draft_cost=0.5)
    proposals = [tuner.propose([0.3], [4]) for _ in range(EXPLORE_EVERY * 2)]
    assert proposals.count(4) == 4 and proposals.count(0) == len(proposals) - 4


def test_alpha_estimate_is_smoothed_toward_the_prior() -> None:
    assert SpeculationTuner.alpha(0, 0) == 0.5
    assert abs(SpeculationTuner.alpha(100, 90) - 91 / 102) < 1e-12


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
    import random

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
