"""The scheduler on its own (no worker): queueing, budgets, and taking back a refused step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocol.messages import ModelRunnerOutput, SamplingParams
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits

LIMITS = WorkerLimits(
    vocab_size=100,
    eos_token_ids=(2,),
    max_model_len=64,
    max_num_speculative_tokens=4,
    max_num_seqs=4,
)


def req(i: int, n: int = 10) -> Request:
    return Request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=5), 2)


def test_budget_chunks_prefill_and_limits_the_batch() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_prefill_chunk=8),
        LIMITS,
        None,
        None,
    )
    for i in range(5):
        s.add(req(i))
    out = s.schedule()
    assert out is not None
    assert out.req_ids == ["r0", "r1"] and out.num_scheduled_tokens.tolist() == [8, 8]
    assert [r.req_id for r in out.new_requests] == ["r0", "r1"]


def test_unsend_puts_a_refused_steps_new_requests_back_in_front() -> None:
    s = Scheduler(SchedulerConfig(), LIMITS, None, None)
    for i in range(3):
        s.add(req(i))
    first = s.schedule()
    assert first is not None and len(first.new_requests) == 3
    s.fail("r1", "refused")
    s.unsend(["r0", "r2"])
    assert [r.req_id for r in s.waiting] == ["r0", "r2"] and not s.running
    again = s.schedule()
    assert again is not None and [r.req_id for r in again.new_requests] == ["r0", "r2"]
    assert again.num_scheduled_tokens.tolist() == [10, 10]


def test_final_text_does_not_depend_on_how_tokens_were_chunked(tmp_path: Path) -> None:
    """Random byte tokens (invalid UTF-8 included): the text at the end is the same whether the
    tokens came one at a time or in steps of several (speculative steps commit several)."""
    import random

    from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo
    from tests.models import save_byte_model

    tok = TokenizerInfo(str(save_byte_model("llama", 1, tmp_path / "m")))
    rng = random.Random(5)
    for trial in range(50):
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        texts = []
        for chunk in (1, 2, 3, 5):
            d = IncrementalDetokenizer(tok)
            parts = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
            for j, part in enumerate(parts):
                d.add(part, final=j == len(parts) - 1)
            texts.append(d.text)
        assert len(set(texts)) == 1, (trial, ids, texts)


def _output(step_id: int, tokens: list[int], drafts: int, accepted: int) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        step_id=step_id,
        req_ids=["r0"],
        num_sampled=np.array([len(tokens)], np.int32),
        sampled_token_ids=np.array(tokens, np.int32),
        num_draft_tokens=np.array([drafts], np.int32),
        num_accepted=np.array([accepted], np.int32),
    )


def test_overlap_books_steps_in_flight_and_stops_at_max_tokens() -> None:
    """Two steps in flight: the second runs the pending token plus placeholder drafts as a cap;
    the books settle as outputs arrive; a request the steps in flight surely finish is not
    scheduled again."""
    s = Scheduler(
        SchedulerConfig(async_scheduling=True, adaptive_speculation=False), LIMITS, None, None
    )
    s.add(Request("r0", list(range(3, 13)), SamplingParams(max_tokens=6), 4))
    s0 = s.schedule()
    s1 = s.schedule()
    assert s0 is not None and s1 is not None
    assert s0.num_scheduled_tokens.tolist() == [10] and s0.draft_widths_are_caps
    assert s1.num_scheduled_tokens.tolist() == [5] and s1.num_draft_tokens.tolist() == [4]
    assert s1.draft_token_ids.tolist() == [-1] * 4 and s1.draft_widths_are_caps
    r = s.requests["r0"]
    assert (r.num_inflight, r.pending_samples, r.inflight_max_new) == (11, 2, 6)
    s.update(_output(0, [50], 0, 0))
    assert (r.num_computed, r.num_inflight, r.pending_samples) == (10, 1, 1)
    # the worker ran 2 of its drafts (fewer than the cap of 4) and accepted both
    s.update(_output(1, [51, 52, 53], 2, 2))
    assert r.output_ids == [50, 51, 52, 53] and (r.num_computed, r.num_inflight) == (13, 0)
    s2 = s.schedule()
    assert s2 is not None and s2.num_scheduled_tokens.tolist() == [1]  # no drafts known yet
    s3 = s.schedule()  # 4 committed + 1 pending of max_tokens 6: room for one more step
    assert s3 is not None and s3.num_scheduled_tokens.tolist() == [5]
    assert s.schedule() is None  # 4 + 2 pending samples >= 6: surely finished
    with pytest.raises(ValueError, match="expected step 2"):
        s.update(_output(3, [1], 0, 0))
