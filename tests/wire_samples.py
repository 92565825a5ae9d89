"""One instance of every wire message, with arrays, for round-trip and fuzz tests."""

from __future__ import annotations

import numpy as np

from protocol import messages as m

VOCAB = 49152
WORDS = (VOCAB + 31) // 32


def sched_output(
    num_reqs: int, num_drafts: int = 4, step_id: int = 7, seed: int = 0, structured_every: int = 2
) -> m.SchedulerOutput:
    """A decode step for ``num_reqs`` requests, each with ``num_drafts`` drafts; every
    ``structured_every``-th request is structured (0: none)."""
    rng = np.random.default_rng(seed)
    structured = [f"r{i}" for i in range(0, num_reqs, structured_every)] if structured_every else []
    rows = len(structured) * (num_drafts + 1)
    return m.SchedulerOutput(
        step_id=step_id,
        new_requests=[],
        req_ids=[f"r{i}" for i in range(num_reqs)],
        num_scheduled_tokens=np.full(num_reqs, num_drafts + 1, np.int32),
        num_draft_tokens=np.full(num_reqs, num_drafts, np.int32),
        draft_token_ids=np.full(num_reqs * num_drafts, -1, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=structured,
        cu_bitmask_rows=np.arange(0, rows + 1, num_drafts + 1, dtype=np.int32) if rows else None,
        grammar_bitmask=(
            rng.integers(-(2**31), 2**31 - 1, (rows, WORDS), dtype=np.int32) if rows else None
        ),
    )


def draft_ids(num_reqs: int, num_drafts: int = 4, step_id: int = 7) -> m.DraftTokenIds:
    return m.DraftTokenIds(
        step_id=step_id,
        req_ids=[f"r{i}" for i in range(num_reqs)],
        num_draft_tokens=np.full(num_reqs, num_drafts, np.int32),
        draft_token_ids=np.arange(num_reqs * num_drafts, dtype=np.int32),
        num_committed_tokens=np.arange(num_reqs, dtype=np.int32) + 100,
    )


def all_messages() -> list[m.Message]:
    new = m.NewRequest(
        req_id="new-1",
        prompt_token_ids=np.array([1, 2, 3, 49151], np.int32),
        sampling=m.SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, seed=5, max_tokens=9, stop_token_ids=(2,)
        ),
        num_speculative_tokens=3,
        structured=True,
    )
    with_new = sched_output(3)
    with_new = m.SchedulerOutput(
        step_id=1,
        new_requests=[new],
        req_ids=["new-1", *with_new.req_ids],
        num_scheduled_tokens=np.array([4, 5, 5, 5], np.int32),
        num_draft_tokens=np.array([0, 4, 4, 4], np.int32),
        draft_token_ids=np.array([-1] * 8 + [11, 12, 13, 14], np.int32),
        finished_req_ids=["old"],
        aborted_req_ids=["gone"],
        structured_req_ids=with_new.structured_req_ids,
        cu_bitmask_rows=with_new.cu_bitmask_rows,
        grammar_bitmask=with_new.grammar_bitmask,
        pending_structured_output_tokens=True,
        draft_widths_are_caps=True,
        deferred_req_ids=["new-1"],
    )
    return [
        m.SchedulerHello(
            protocol_major=m.PROTOCOL_MAJOR, protocol_minor=m.PROTOCOL_MINOR, scheduler_id="s"
        ),
        m.WorkerReady(
            protocol_major=1,
            protocol_minor=0,
            model_name="smollm2",
            vocab_size=VOCAB,
            eos_token_ids=(2,),
            max_model_len=2048,
            drafter="ngram",
            max_num_speculative_tokens=4,
            kv_capacity_tokens=16384,
            max_num_seqs=8,
            tokenizer_path="/tmp/tok",
            max_num_batched_tokens=2048,
        ),
        with_new,
        sched_output(5),
        m.ModelRunnerOutput(
            step_id=3,
            req_ids=["a", "b"],
            num_sampled=np.array([2, 1], np.int32),
            sampled_token_ids=np.array([5, 6, 7], np.int32),
            num_draft_tokens=np.array([3, 0], np.int32),
            num_accepted=np.array([1, 0], np.int32),
            logprobs=np.array([-0.1, -0.2, -3.0], np.float32),
        ),
        draft_ids(4),
        m.StepBitmask(
            step_id=4,
            req_ids=["a"],
            num_valid_drafts=np.array([1], np.int32),
            cu_bitmask_rows=np.array([0, 2], np.int32),
            grammar_bitmask=np.full((2, (VOCAB + 31) // 32), -1, np.int32),
        ),
        m.Ping(seq=1),
        m.Pong(seq=1, num_steps=10),
        m.WorkerError(code="bad_message", message="x", step_id=None, req_id="a", fatal=False),
        m.WorkerError(code="bad_step", message="y", step_id=7, field="num_draft_tokens[0]"),
        m.Shutdown(reason="drain"),
    ]
