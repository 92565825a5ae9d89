"""The worker's side of overlap scheduling: capped widths and deferred grammar rows
(``StepBitmask``), driven directly (CPU, float32, a tiny model, a drafter that knows the target's
greedy continuation so every draft would be accepted unless capped)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput, StepBitmask
from tests.models import VOCAB, greedy_reference, reference_copy, tiny_model
from worker.drafters.base import Drafter, Proposal
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.runner import ModelRunner
from worker.step_batch import StepError

PROMPT = [3, 9, 4, 7, 1]
WORDS = (VOCAB + 31) // 32


class TruthDrafter(Drafter):
    """Proposes the target's own greedy continuation (``truth``), up to ``num`` drafts."""

    name = "truth"

    def __init__(self, truth: list[int], num: int) -> None:
        self.truth, self.num = truth, num

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        out = torch.zeros((len(slots), 4), dtype=torch.long)
        nums = []
        for j, (slot, w) in enumerate(zip(slots, widths, strict=True)):
            done = int(states.num_tokens[slot]) - len(PROMPT)
            want = self.truth[done : done + min(w, self.num)]
            out[j, : len(want)] = torch.tensor(want)
            nums.append(len(want))
        return Proposal(out, nums)


def setup(num_drafts: int = 4, temperature: float = 0.0) -> tuple[ModelRunner, list[int]]:
    model = tiny_model("llama", seed=5)
    truth = greedy_reference(reference_copy(model), PROMPT, 12)
    runner = ModelRunner(
        ModelExecutor(model, max_num_seqs=2, max_model_len=64, decode_width=5),
        TruthDrafter(truth, num_drafts),
        max_num_seqs=2,
        max_model_len=64,
        max_num_draft_tokens=4,
    )
    new = NewRequest(
        "r", np.array(PROMPT, np.int32), SamplingParams(temperature=temperature, seed=1), 4, True
    )
    runner.execute(step(0, [new], n=len(PROMPT), w=0, structured=True))
    runner.take_draft_tokens()
    return runner, truth


def step(
    step_id: int, new: list[NewRequest], n: int, w: int, structured: bool = False
) -> SchedulerOutput:
    rows = np.full((1 + w, WORDS), -1, np.int32)  # allow every token
    return SchedulerOutput(
        step_id=step_id,
        new_requests=new,
        req_ids=["r"],
        num_scheduled_tokens=np.array([n], np.int32),
        num_draft_tokens=np.array([w], np.int32),
        draft_token_ids=np.full(w, -1, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=["r"] if structured else [],
        cu_bitmask_rows=np.array([0, 1 + w], np.int32) if structured else None,
        grammar_bitmask=rows if structured else None,
    )


def overlapped(step_id: int, w: int) -> SchedulerOutput:
    """A decode step sent before the previous output: placeholder width as a cap, rows deferred."""
    return msgspec.structs.replace(
        step(step_id, [], n=1 + w, w=w), draft_widths_are_caps=True, deferred_req_ids=["r"]
    )


def rows_for(step_id: int, valid: int, rows: int | None = None) -> StepBitmask:
    n = valid + 1 if rows is None else rows
    return StepBitmask(
        step_id=step_id,
        req_ids=["r"],
        num_valid_drafts=np.array([valid], np.int32),
        cu_bitmask_rows=np.array([0, n], np.int32),
        grammar_bitmask=np.full((n, WORDS), -1, np.int32),
    )


@pytest.mark.parametrize("valid", [0, 2, 4])
def test_acceptance_is_capped_at_the_valid_drafts_and_stays_lossless(valid: int) -> None:
    runner, truth = setup()
    out, rejected = runner.execute(overlapped(1, 4), lambda sid: rows_for(sid, valid))
    assert not rejected
    assert int(out.num_accepted[0]) == valid  # every draft was right; the cap decides
    got = out.sampled_token_ids.tolist()
    assert got == truth[1 : 2 + valid]  # the token at the cap is the target's own choice


def test_a_capped_width_shrinks_to_the_drafts_the_worker_has() -> None:
    runner, truth = setup(num_drafts=2)
    out, _ = runner.execute(overlapped(1, 4), lambda sid: rows_for(sid, 2))
    assert int(out.num_draft_tokens[0]) == 2
    assert out.sampled_token_ids.tolist() == truth[1:4]


def test_a_deferred_bitmask_that_does_not_fit_refuses_the_step_and_changes_nothing() -> None:
    runner, truth = setup()
    with pytest.raises(StepError, match="deferred bitmask does not fit"):
        runner.execute(overlapped(1, 4), lambda sid: rows_for(sid, 2, rows=2))
    with pytest.raises(StepError, match="deferred bitmask does not fit"):
        runner.execute(overlapped(1, 4), lambda sid: rows_for(sid + 1, 0))
    with pytest.raises(StepError, match="not supported here"):
        runner.execute(overlapped(1, 4))  # no way to receive the rows
    # the request is where it was: a plain step now gives the right tokens
    out, _ = runner.execute(overlapped(1, 4), lambda sid: rows_for(sid, 4))
    assert out.sampled_token_ids.tolist() == truth[1:6]


def test_a_sampled_request_is_never_deferred() -> None:
    runner, _ = setup(temperature=0.7)
    with pytest.raises(StepError, match="only greedy requests may be deferred"):
        runner.execute(overlapped(1, 4), lambda sid: rows_for(sid, 0))
