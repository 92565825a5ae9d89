"""Each step that used to crash the worker or corrupt its state, now refused by field before
anything is applied (``worker/step_checks.py``), on an in-process runner over a tiny model; and a
draft model whose vocabulary is smaller than the target's, serving sampled requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput, StepBitmask
from tests.driver import Req, run
from tests.models import VOCAB, greedy_reference, reference_copy, save_tiny, tiny_model
from worker.config import parse_args
from worker.drafters.draft_model import DraftModelDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner, StepError
from worker.service import build_runner

K = 3
MAX_LEN = 64
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture
def runner() -> ModelRunner:
    """Two running greedy requests, "a" (prefilled, one token sampled) and free slots for two."""
    r = ModelRunner(
        ModelExecutor(tiny_model("llama", 3), max_num_seqs=4, max_model_len=MAX_LEN),
        NgramDrafter(min_n=1, max_n=3, max_num_tokens=K),
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
    )
    out, rejected = r.execute(step(0, new=[new("a"), new("b")], ids=["a", "b"], counts=[8, 8]))
    assert not rejected and out.num_sampled.tolist() == [1, 1]
    return r


def new(req_id: str, prompt: object = None, **sampling: object) -> NewRequest:
    ids = np.array(PROMPT, np.int32) if prompt is None else prompt
    return NewRequest(req_id, ids, SamplingParams(**sampling), K)  # type: ignore[arg-type]


def step(
    step_id: int,
    *,
    new: list[NewRequest] = (),  # type: ignore[assignment]
    ids: list[str] = (),  # type: ignore[assignment]
    counts: list[int] = (),  # type: ignore[assignment]
    widths: list[int] | None = None,
    drafts: list[int] | None = None,
    **kw: object,
) -> SchedulerOutput:
    widths = [0] * len(ids) if widths is None else widths
    return SchedulerOutput(
        step_id=step_id,
        new_requests=list(new),
        req_ids=list(ids),
        num_scheduled_tokens=np.array(counts, np.int32),
        num_draft_tokens=np.array(widths, np.int32),
        draft_token_ids=np.array(
            [5] * sum(max(w, 0) for w in widths) if drafts is None else drafts, np.int32
        ),
        finished_req_ids=kw.pop("finished", []),  # type: ignore[arg-type]
        aborted_req_ids=[],
        structured_req_ids=kw.pop("structured", []),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def snapshot(r: ModelRunner) -> tuple[object, ...]:
    """Every running request's slot and lengths, and the free slots (a free slot's stale
    numbers are never read)."""
    st = r.states
    running = {
        req_id: (
            slot,
            int(st.num_tokens[slot]),
            int(st.num_computed[slot]),
            int(st.num_drafts[slot]),
        )
        for req_id, slot in st.slot_of.items()
    }
    return running, sorted(st.free_slots)


def refuse(r: ModelRunner, sched: SchedulerOutput, field: str, code: str = "bad_step") -> None:
    before = snapshot(r)
    with pytest.raises(StepError) as info:
        r.execute(sched, lambda sid: pytest.fail("waited for rows"))
    assert info.value.field == field and info.value.code == code, info.value
    assert field in str(info.value) and f"step {sched.step_id}" in str(info.value)
    assert snapshot(r) == before, "a refused step changed the worker's state"


def test_more_real_drafts_than_k_for_a_sampled_request(runner: ModelRunner) -> None:
    runner.execute(step(1, new=[new("s", temperature=0.8, seed=1)], ids=["s"], counts=[8]))
    sched = step(2, ids=["s"], counts=[1 + K + 2], widths=[K + 2])
    refuse(runner, sched, "num_draft_tokens[0]", "width_mismatch")


def test_a_float_bitmask(runner: ModelRunner) -> None:
    words = (VOCAB + 31) // 32
    for owners in (["a"], []):
        sched = step(
            1,
            ids=["a"],
            counts=[1],
            structured=owners,
            cu_bitmask_rows=np.array([0, 1], np.int32),
            grammar_bitmask=np.full((1, words), -1, np.float32),
        )
        refuse(runner, sched, "grammar_bitmask")


def test_a_2d_prompt_is_refused_alone_and_leaks_no_slot(runner: ModelRunner) -> None:
    flat = new("c")
    for i in range(4):  # more times than there are free slots
        bad = new("bad", np.full((2, 4), 7, np.int32))
        out, rejected = runner.execute(step(1 + i, new=[bad], ids=["bad"], counts=[2]))
        assert [(e.req_id, e.field) for e in rejected] == [
            ("bad", "new_requests[0].prompt_token_ids")
        ]
        assert out.req_ids == [] and "bad" not in runner.states.slot_of
    assert len(runner.states.free_slots) == 2
    out, rejected = runner.execute(step(9, new=[flat, new("d")], ids=["c", "d"], counts=[8, 8]))
    assert not rejected and out.num_sampled.tolist() == [1, 1]


def test_a_negative_width(runner: ModelRunner) -> None:
    refuse(runner, step(1, ids=["a"], counts=[1], widths=[-2], drafts=[]), "num_draft_tokens[0]")


def test_a_proposal_cap_out_of_range(runner: ModelRunner) -> None:
    for cap in (-2, K + 1):
        sched = step(1, ids=["a"], counts=[1], max_draft_proposals=cap)
        refuse(runner, sched, "max_draft_proposals")


def test_the_proposal_cap_bounds_the_drafts() -> None:
    """``max_draft_proposals`` caps every request's proposal and 0 proposes nothing: the draft
    model (which always proposes its full width) does not run at all then, and catches up on
    the tokens it skipped when asked again. Output stays the target's greedy output."""
    target = tiny_model("llama", 3)
    draft = ModelExecutor(tiny_model("llama", 4), max_num_seqs=4, max_model_len=MAX_LEN)
    r = ModelRunner(
        ModelExecutor(target, max_num_seqs=4, max_model_len=MAX_LEN),
        DraftModelDrafter(draft, max_num_tokens=K),
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
    )
    st = r.states
    out, _ = r.execute(step(0, new=[new("a"), new("b")], ids=["a", "b"], counts=[8, 8]))
    assert [int(st.num_drafts[st.slot_of[x]]) for x in "ab"] == [K, K]
    tokens = {x: [int(t)] for x, t in zip("ab", out.sampled_token_ids, strict=True)}
    for i, cap in enumerate((1, 0, 0, -1, 2), start=1):
        drafts = [int(st.num_drafts[st.slot_of[x]]) for x in "ab"]
        before = r.drafter.num_computed.copy()  # type: ignore[attr-defined]
        out, _ = r.execute(
            step(i, ids=["a", "b"], counts=[1 + w for w in drafts], widths=drafts,
                 max_draft_proposals=cap)
        )  # fmt: skip
        cu = np.cumsum([0, *out.num_sampled])
        for j, x in enumerate("ab"):
            tokens[x] += out.sampled_token_ids[cu[j] : cu[j + 1]].tolist()
        want = K if cap < 0 else cap
        assert [int(st.num_drafts[st.slot_of[x]]) for x in "ab"] == [want, want]
        if cap == 0:  # the drafter ran nothing: its cache did not move
            assert (r.drafter.num_computed == before).all()  # type: ignore[attr-defined]
    got = r.take_draft_tokens()
    assert got is not None and np.asarray(got.num_draft_tokens).tolist() == [2, 2]
    ref = greedy_reference(reference_copy(target), PROMPT, len(tokens["a"]))
    assert tokens["a"] == tokens["b"] == ref


def test_duplicate_ids(runner: ModelRunner) -> None:
    refuse(runner, step(1, ids=["a", "a"], counts=[1, 1]), "req_ids[1]")
    refuse(
        runner,
        step(1, new=[new("c"), new("c")], ids=["c"], counts=[8]),
        "new_requests[1].req_id",
    )
    refuse(runner, step(1, ids=["a"], counts=[1], finished=["x", "x"]), "finished_req_ids[1]")


def test_a_new_request_reusing_a_running_id(runner: ModelRunner) -> None:
    """Refused whole: the running "a" neither disappears nor is skipped, and decodes on."""
    refuse(
        runner,
        step(1, new=[new("a", np.array([9, 9], np.int32))], ids=["a"], counts=[1]),
        "new_requests[0].req_id",
    )
    out, _ = runner.execute(step(2, ids=["a"], counts=[1]))
    assert out.req_ids == ["a"] and out.num_sampled.tolist() == [1]
    # reusing the id of a request the same step finishes is fine
    out, rejected = runner.execute(step(3, new=[new("a")], ids=["a"], counts=[8], finished=["a"]))
    assert not rejected and out.num_sampled.tolist() == [1]


def test_a_step_refused_during_its_deferred_wait_applies_nothing(runner: ModelRunner) -> None:
    words = (VOCAB + 31) // 32
    sched = step(
        1,
        new=[new("c")],
        ids=["a", "c"],
        counts=[1, 8],
        deferred_req_ids=["a"],
        draft_widths_are_caps=True,
    )
    before = snapshot(runner)
    good_rows = (np.array([0], np.int32), np.array([0, 1], np.int32))

    def bad_rows(sid: int) -> StepBitmask:
        return StepBitmask(sid, ["a"], *good_rows, np.full((1, words), -1, np.float32))

    def silence(sid: int) -> StepBitmask:
        raise StepError("bad_step", f"step {sid}: no rows", field="deferred_req_ids")

    for wait, field in ((bad_rows, "StepBitmask.grammar_bitmask"), (silence, "deferred_req_ids")):
        with pytest.raises(StepError) as info:
            runner.execute(sched, wait)
        assert info.value.field == field
        assert snapshot(runner) == before, "the refused step kept something (its new request?)"
    # the same step with good rows runs, "c" included
    out, _ = runner.execute(
        sched,
        lambda sid: StepBitmask(sid, ["a"], *good_rows, np.full((1, words), -1, np.int32)),
    )
    assert out.req_ids == ["a", "c"]


def test_a_smaller_draft_vocabulary_serves_sampled_requests(tmp_path: Path) -> None:
    """Real pairs differ by a few hundred ids: the draft's distributions are padded to the
    target's vocabulary (zeros), through the worker's own loading path."""
    target = save_tiny("llama", 3, tmp_path / "target")
    draft = save_tiny("llama", 4, tmp_path / "draft", layers=1, vocab=VOCAB - 8)
    cfg = parse_args(
        [
            *("--model", str(target), "--draft-model", str(draft), "--drafter", "draft_model"),
            *("--num-speculative-tokens", str(K), "--device", "cpu"),
            *("--max-num-seqs", "2", "--max-model-len", str(MAX_LEN), "--enforce-eager"),
        ]
    )
    runner, ready = build_runner(cfg)
    assert ready.vocab_size == VOCAB
    reqs = [
        Req("s", PROMPT, 20, k=K, sampling=SamplingParams(temperature=0.9, seed=7)),
        Req("g", PROMPT, 20, k=K),
    ]
    got = run(runner, reqs)
    assert len(got["s"]) == 20 and len(got["g"]) == 20
    assert all(0 <= t < VOCAB for t in got["s"] + got["g"])
    assert sum(r.verified for r in reqs) > 0, "no drafts were verified"
