"""The step layout's array path for steps without drafts (``_build_without_drafts``) lays out
exactly what the request-at-a-time path (``_build_any``) does: prefill chunks, decodes, a
finished prompt's last chunk and a refused new request in one step."""

from __future__ import annotations

import numpy as np
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
from worker.requests import RequestStates
from worker.step_batch import _build_any, _build_without_drafts, build_step_batch


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
    fast, slow = _build_without_drafts(sched, st, skip, cpu), _build_any(sched, st, skip, cpu)
    assert build_step_batch(sched, st, skip, 100, cpu).req_ids == fast.req_ids
    assert fast.req_ids == slow.req_ids == ["r0", "r1", "r2", "r3", "r4"]
    for name in (
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
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert [o.tolist() for o in fast.own_drafts] == [o.tolist() for o in slow.own_drafts]
    assert fast.sample_idx == [0, 2, 3, 4]  # all but r1, mid-prompt
