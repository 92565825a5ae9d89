"""The worker's warm-up (worker/warm_up.py): its made-up requests run every drafter's path, drafts
verified at batch 2 and 1 and at the full batch, and leave nothing behind: the runner's greedy
output after it is the target's own."""

from __future__ import annotations

import numpy as np
import pytest

from tests.drafting import KINDS, K, drafting_runner
from tests.driver import Req, run
from tests.models import VOCAB, greedy_reference
from worker import grammar_rows
from worker.warm_up import warm_up


@pytest.mark.parametrize("kind", KINDS)
def test_the_warm_up_verifies_drafts_and_leaves_the_runner_empty(kind: str) -> None:
    runner, ref = drafting_runner(kind, 31, max_num_seqs=3)
    verified: list[tuple[int, int]] = []  # (batch, drafts) of each step the warm-up ran
    launch = runner.launch

    def counting(sched, *args, **kw):  # type: ignore[no-untyped-def]
        verified.append((len(sched.req_ids), int(np.sum(sched.num_draft_tokens))))
        return launch(sched, *args, **kw)

    runner.launch = counting  # type: ignore[method-assign]
    masked: list[int] = []  # the rows of each grammar bitmask applied (its kernel compiled)
    apply = grammar_rows.apply_bitmask_

    def applying(logits, rows, bitmask, **kw):  # type: ignore[no-untyped-def]
        masked.append(len(rows))
        return apply(logits, rows, bitmask, **kw)

    grammar_rows.apply_bitmask_ = applying  # type: ignore[assignment]
    try:
        steps = warm_up(runner, K, VOCAB)
    finally:
        runner.launch = launch  # type: ignore[method-assign]
        grammar_rows.apply_bitmask_ = apply
    assert steps == len(verified) > 0
    assert masked and all(masked), masked  # a structured request's rows at every step it ran
    assert runner.num_steps == 0
    if kind != "none":
        # drafts ran at both batch sizes (an n-gram lookup on random prompts may find none)
        assert any(b == 2 and d for b, d in verified) or kind == "ngram", verified
        assert any(b == 1 and d for b, d in verified) or kind == "ngram", verified
    # the full batch (max_num_seqs = 3): a step at full width whatever the drafter found, and a
    # plain one
    assert (3, 3 * K) in verified and (3, 0) in verified, verified
    assert not runner.states.slot_of
    blocks = runner.target.kv_cache.blocks
    assert blocks.num_free == blocks.num_blocks
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5]
    got = run(runner, [Req("r", prompt, 12, k=K)])
    assert got["r"] == greedy_reference(ref, prompt, 12)


def test_no_warm_up_where_two_requests_do_not_fit() -> None:
    runner, _ = drafting_runner("ngram", 3, max_num_seqs=1)
    assert warm_up(runner, K, VOCAB) == 0


def test_the_warm_up_keeps_within_the_step_token_budget() -> None:
    runner, _ = drafting_runner("draft_model", 5, max_num_seqs=3)
    runs: list[int] = []
    launch = runner.launch

    def counting(sched, *args, **kw):  # type: ignore[no-untyped-def]
        runs.append(int(np.sum(sched.num_scheduled_tokens)))
        return launch(sched, *args, **kw)

    runner.launch = counting  # type: ignore[method-assign]
    runner.target.max_num_tokens = 12
    assert warm_up(runner, K, VOCAB) > 0
    assert max(runs) <= 12, runs
    runner.target.max_num_tokens = 2 * (K + 1) - 1  # a batch-2 verify step would not fit
    assert warm_up(runner, K, VOCAB) == 0
