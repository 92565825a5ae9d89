"""The adaptive speculation length: its choice follows measured step costs and acceptance, and
greedy output stays equal to target-only greedy while it changes widths."""

from __future__ import annotations

from scheduler_client.spec_tuner import SpeculationTuner, expected_tokens
from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, tiny_model
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner


def settle(tuner: SpeculationTuner, n: int, cost: dict[int, float], alpha: float) -> int:
    """Drive the tuner with a fixed cost per width; returns its final choice."""
    k = 0
    for _ in range(20):
        k = tuner.choose([alpha] * n, [4] * n)
        tuner.observe_step(n, 1 + k, cost[1 + k])
    return tuner.choose([alpha] * n, [4] * n)


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
