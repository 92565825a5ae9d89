"""The worker lays out every step and checks it as arrays: the layout (``_build_arrays``) is what
the request-at-a-time statement of it (``_build_any``) gives, drafts or not, and the checks
(``_layout_arrays``) agree with ``_layout_any`` and leave every refusal to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
from worker.block_table import BlockTable
from worker.requests import RequestStates
from worker.step_batch import StepBatch, StepError, _build_any, _build_arrays, build_step_batch
from worker.step_checks import StepLimits, _fault, _layout_any, _layout_arrays, check_step


def test_the_array_layout_equals_the_request_at_a_time_one() -> None:
    st = RequestStates(
        vocab_size=100,
        max_num_seqs=8,
        max_model_len=64,
        max_num_draft_tokens=3,
        device=torch.device("cpu"),
    )
    rng = np.random.default_rng(0)
    # (prompt length, computed so far): decoding, mid-prefill, about to finish its prompt
    for i, (n, done) in enumerate([(9, 8), (30, 10), (12, 4), (5, 4), (20, 0)]):
        prompt = rng.integers(1, 100, n).astype(np.int32)
        st.add(NewRequest(f"r{i}", prompt, SamplingParams(), 3), 3)
        st.num_computed[st.slot_of[f"r{i}"]] = done
    # r1 runs a prefill chunk that samples nothing; "x" is a new request the worker refused
    ids = ["r0", "r1", "x", "r2", "r3", "r4"]
    sched = SchedulerOutput(
        step_id=3,
        new_requests=[],
        req_ids=ids,
        num_scheduled_tokens=np.array([1, 16, 7, 8, 1, 20], np.int32),
        num_draft_tokens=np.zeros(len(ids), np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )
    skip = {"x"}
    cpu = torch.device("cpu")
    fast, slow = _build_arrays(sched, st, skip, cpu), _build_any(sched, st, skip, cpu)
    assert build_step_batch(sched, st, skip, 100, cpu).req_ids == fast.req_ids
    assert fast.req_ids == slow.req_ids == ["r0", "r1", "r2", "r3", "r4"]
    _assert_same_layout(fast, slow)
    assert fast.sample_idx == [0, 2, 3, 4]  # all but r1, mid-prompt


def _assert_same_layout(fast: StepBatch, slow: StepBatch) -> None:
    for name in (
        "req_ids",
        "slots",
        "start_positions",
        "num_scheduled",
        "num_drafts",
        "sample_idx",
        "cu_rows",
    ):
        assert getattr(fast, name) == getattr(slow, name), name
    for name in ("input_ids", "positions", "logits_indices", "draft_token_ids"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist(), name
    assert fast.own_drafts.tolist() == slow.own_drafts.tolist()
    for i, w in enumerate(fast.num_drafts):
        assert len(fast.own(i)) == w


def _drafting_step(
    rng: np.random.Generator, trial: int
) -> tuple[RequestStates, BlockTable, SchedulerOutput, dict[str, NewRequest], set[str]]:
    """A random step with drafts: decodes verifying the worker's drafts (placeholders), the
    scheduler's ids or both, widths as caps or not and proposals shorter than them, prefill
    chunks, new requests, one the worker refused, a finished one, and now and then a rule
    broken (a width past k, drafts during prefill, a placeholder past the proposal, a count
    past the context, an unknown request)."""
    cpu = torch.device("cpu")
    k = 3
    st = RequestStates(
        vocab_size=100, max_num_seqs=8, max_model_len=48, max_num_draft_tokens=k, device=cpu
    )
    blocks = BlockTable(
        num_blocks=96, block_size=4, max_num_seqs=8, max_blocks_per_seq=12, device=cpu
    )
    ids: list[str] = []
    counts: list[int] = []
    widths: list[int] = []
    drafts: list[int] = []
    for i in range(int(rng.integers(1, 7))):
        n = int(rng.integers(2, 40))
        temperature = float(rng.choice([0.0, 0.7]))
        st.add(
            NewRequest(
                f"r{i}", rng.integers(1, 100, n).astype(np.int32), SamplingParams(temperature), k
            ),
            k,
        )
        slot = st.slot_of[f"r{i}"]
        decoding = rng.random() < 0.7
        c = n - 1 if decoding else int(rng.integers(0, n - 1))
        st.num_computed[slot] = c
        st.num_drafts[slot] = int(rng.integers(0, k + 1))
        st.draft_token_ids[slot] = torch.as_tensor(rng.integers(1, 100, k))
        blocks.grow(slot, c)
        ids.append(f"r{i}")
        if decoding:
            w = int(rng.integers(0, k + 1))
            row = np.where(rng.random(w) < 0.6, -1, rng.integers(1, 100, w)).tolist()
            counts.append(1 + w)
            widths.append(w)
            drafts += row
        else:
            counts.append(int(rng.integers(1, n - c + 1)))
            widths.append(0)
    new = {
        f"n{i}": NewRequest(
            f"n{i}", np.ones(int(rng.integers(1, 30)), np.int32), SamplingParams(), k
        )
        for i in range(int(rng.integers(0, 3)))
    }
    for req_id, req in new.items():
        ids.append(req_id)
        counts.append(int(rng.integers(1, len(req.prompt_token_ids) + 1)))
        widths.append(0)
    if trial % 9 == 0:
        widths[0] += 1  # one draft more than the counts say, or past k
        counts[0] += 1
        drafts.insert(0, -1)
    if trial % 13 == 0:
        ids.append("ghost")
        counts.append(1)
        widths.append(0)
    if trial % 17 == 0:
        counts[-1] = 60  # past max_model_len
    order = rng.permutation(len(ids))
    starts = np.cumsum([0, *widths])
    sched = SchedulerOutput(
        step_id=trial,
        new_requests=list(new.values()),
        req_ids=[ids[j] for j in order],
        num_scheduled_tokens=np.asarray([counts[j] for j in order], np.int32),
        num_draft_tokens=np.asarray([widths[j] for j in order], np.int32),
        draft_token_ids=np.asarray(
            [d for j in order for d in drafts[starts[j] : starts[j + 1]]], np.int32
        ),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
        draft_widths_are_caps=trial % 2 == 0,
    )
    skip = {"n1"} if "n1" in new else set()
    return st, blocks, sched, {r: q for r, q in new.items() if r not in skip}, skip


def test_the_array_layout_and_check_agree_with_a_request_at_a_time_for_drafting_steps() -> None:
    """Steps with drafts: ``_layout_arrays`` gives ``_layout_any``'s answer or declines what it
    refuses, and every step that passes lays out the same both ways."""
    rng = np.random.default_rng(7)
    cpu = torch.device("cpu")
    agreed = refused = shrunk = 0
    for trial in range(600):
        st, blocks, sched, accepted, skip = _drafting_step(rng, trial)
        widths = sched.num_draft_tokens.astype(np.int64)
        drafts = sched.draft_token_ids.astype(np.int64)

        if not _checks_agree(sched, st, widths, drafts, 3, skip, accepted, set(), blocks):
            refused += 1
            continue
        agreed += 1
        for req in sched.new_requests:
            if req.req_id not in skip:
                st.add(req, 3)
        a, b = _build_arrays(sched, st, skip, cpu), _build_any(sched, st, skip, cpu)
        _assert_same_layout(a, b)
        shrunk += int(sum(a.num_drafts) < int(widths.sum()))
    assert agreed > 150 and refused > 100 and shrunk > 20, (agreed, refused, shrunk)


def test_the_array_check_agrees_with_the_request_at_a_time_one() -> None:
    """``_layout_arrays`` gives ``_layout_any``'s blocks and sampling rows for valid steps
    without drafts, and declines (None) every step that ``_layout_any`` refuses."""
    rng = np.random.default_rng(1)
    cpu = torch.device("cpu")
    agreed = refused = 0
    for trial in range(300):
        st = RequestStates(
            vocab_size=100, max_num_seqs=6, max_model_len=48, max_num_draft_tokens=2, device=cpu
        )
        blocks = BlockTable(
            num_blocks=64, block_size=4, max_num_seqs=6, max_blocks_per_seq=12, device=cpu
        )
        for i in range(int(rng.integers(0, 5))):
            n = int(rng.integers(1, 40))
            temperature = float(rng.choice([0.0, 0.7]))
            st.add(NewRequest(f"r{i}", np.ones(n, np.int32), SamplingParams(temperature), 0), 2)
            slot = st.slot_of[f"r{i}"]
            st.num_computed[slot] = int(rng.integers(0, n))
            blocks.grow(slot, int(st.num_computed[slot]))
        new = {
            f"n{i}": NewRequest(
                f"n{i}", np.ones(int(rng.integers(1, 50)), np.int32), SamplingParams(), 0
            )
            for i in range(int(rng.integers(0, 3)))
        }
        ids = [*st.slot_of, *new, *(["ghost"] if trial % 10 == 0 else [])]
        counts = rng.integers(0 if trial % 7 == 0 else 1, 20, len(ids)).astype(np.int64)
        gone = {ids[0]} if ids and trial % 11 == 0 else set()
        sched = SchedulerOutput(
            step_id=trial,
            new_requests=list(new.values()),
            req_ids=ids,
            num_scheduled_tokens=counts.astype(np.int32),
            num_draft_tokens=np.zeros(len(ids), np.int32),
            draft_token_ids=np.zeros(0, np.int32),
            finished_req_ids=sorted(gone),
            aborted_req_ids=[],
            structured_req_ids=[],
        )
        skip = {"n1"} if "n1" in new else set()
        accepted = {r: q for r, q in new.items() if r not in skip}

        no_drafts = np.zeros(0, np.int64)
        if not _checks_agree(sched, st, counts * 0, no_drafts, 2, skip, accepted, gone, blocks):
            refused += 1
            continue
        agreed += 1
    assert agreed > 50 and refused > 50, (agreed, refused)


def test_a_count_near_the_int64_limit_is_refused_not_wrapped() -> None:
    """``c + n`` of a count near 2**63 wraps negative in numpy: the array path must decline
    it before adding, so ``check_step`` refuses the step by name."""
    cpu = torch.device("cpu")
    st = RequestStates(
        vocab_size=100, max_num_seqs=2, max_model_len=64, max_num_draft_tokens=2, device=cpu
    )
    st.add(NewRequest("r", np.ones(8, np.int32), SamplingParams(), 0), 2)
    st.num_computed[st.slot_of["r"]] = 5
    sched = SchedulerOutput(
        step_id=0,
        new_requests=[],
        req_ids=["r"],
        num_scheduled_tokens=np.array([2**63 - 3], np.int64),
        num_draft_tokens=np.zeros(1, np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )
    with pytest.raises(StepError, match="num_scheduled_tokens"):
        check_step(sched, st, StepLimits(vocab_size=100, max_num_draft_tokens=2))


def test_a_count_past_the_context_that_its_caps_shrink_back_is_checked_as_arrays() -> None:
    """A new request's 15-token prompt with 2 placeholder drafts as caps (17 tokens, past
    max_model_len 16) shrinks to its prompt: both checks accept it alike."""
    cpu = torch.device("cpu")
    st = RequestStates(
        vocab_size=100, max_num_seqs=2, max_model_len=16, max_num_draft_tokens=2, device=cpu
    )
    new = NewRequest("n", np.ones(15, np.int32), SamplingParams(), 2)
    sched = SchedulerOutput(
        step_id=0,
        new_requests=[new],
        req_ids=["n"],
        num_scheduled_tokens=np.array([17], np.int32),
        num_draft_tokens=np.array([2], np.int32),
        draft_token_ids=np.array([-1, -1], np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
        draft_widths_are_caps=True,
    )
    counts, widths = np.array([17]), np.array([2])
    drafts = np.array([-1, -1])
    fast = _layout_arrays(sched, st, counts, widths, drafts, 2, set(), {"n": new}, set(), None)
    slow = _layout_any(
        sched, st, counts, widths, drafts, 2, set(), {"n": new}, lambda _: False, None, _fault(0)
    )
    assert fast == slow == (0, {"n": 1}, {"n": True})


def _checks_agree(
    sched: SchedulerOutput,
    st: RequestStates,
    widths: np.ndarray,
    drafts: np.ndarray,
    k: int,
    skip: set[str],
    accepted: dict[str, NewRequest],
    gone: set[str],
    blocks: BlockTable | None,
) -> bool:
    """Whether ``_layout_any`` accepts the step; either way ``_layout_arrays`` must agree:
    the same answer, or None where it refuses."""
    counts = sched.num_scheduled_tokens.astype(np.int64)
    fast = _layout_arrays(sched, st, counts, widths, drafts, k, skip, accepted, gone, blocks)

    def running(req_id: str) -> bool:
        return req_id in st.slot_of and req_id not in gone

    try:
        slow = _layout_any(
            sched, st, counts, widths, drafts, k, skip, accepted, running, blocks, _fault(0)
        )
    except StepError:
        assert fast is None, sched.step_id
        return False
    assert fast == slow, sched.step_id
    return True
