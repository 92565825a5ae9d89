"""The scheduler on its own (no worker): queueing, budgets, and taking back a refused step."""

from __future__ import annotations

import dataclasses
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


def test_admission_and_preemption_by_kv_blocks_never_overcommit_the_worker() -> None:
    """12 blocks of 4 tokens; 4 requests of 10 prompt tokens that grow by 12 outputs each need
    6 blocks apiece at the end. A stand-in worker keeps its own books from what it was sent: no
    step ever needs more blocks than it has, the newest request is preempted (aborted, queued at
    the front, recomputed from prompt + output) when an older one grows, and every request ends
    with all its tokens."""
    bs, num_blocks = 4, 12
    limits = dataclasses.replace(LIMITS, num_kv_blocks=num_blocks, kv_block_size=bs)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, adaptive_speculation=False), limits, None, None
    )
    for i in range(4):
        s.add(Request(f"r{i}", list(range(3, 13)), SamplingParams(max_tokens=12), 0))
    computed: dict[str, int] = {}  # the worker's books: req_id -> KV positions computed
    length: dict[str, int] = {}
    aborted: list[str] = []
    for _ in range(200):
        out = s.schedule()
        if out is None:
            break
        for r in [*out.finished_req_ids, *out.aborted_req_ids]:
            computed.pop(r, None)
        aborted += out.aborted_req_ids
        for new in out.new_requests:
            computed[new.req_id] = 0
            length[new.req_id] = len(new.prompt_token_ids)
        step = dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True))
        need = sum(-(-(c + step.get(r, 0)) // bs) for r, c in computed.items())
        assert need <= num_blocks, f"step {out.step_id} needs {need} blocks of {num_blocks}"
        sampled = []
        for r, n in step.items():
            computed[r] += n
            if computed[r] == length[r]:
                sampled.append(r)
                length[r] += 1
        s.update(
            ModelRunnerOutput(
                step_id=out.step_id,
                req_ids=out.req_ids,
                num_sampled=np.array([int(r in sampled) for r in out.req_ids], np.int32),
                sampled_token_ids=np.full(len(sampled), 7, np.int32),
                num_draft_tokens=np.zeros(len(out.req_ids), np.int32),
                num_accepted=np.zeros(len(out.req_ids), np.int32),
            )
        )
    assert not s.has_work()
    assert s.num_preemptions > 0 and aborted, "the workload must not fit without preemption"
    for i in range(4):
        r = s.requests[f"r{i}"]
        assert r.error is None and r.output_ids == [7] * 12, r.req_id


@pytest.mark.parametrize(("watermark", "second"), [(0.0, 60), (0.25, 20)])
def test_a_new_request_leaves_the_kv_watermark_free(watermark: float, second: int) -> None:
    """40 blocks of 4 tokens; three 100-token prompts. The first takes 25 blocks; the second
    takes what is left but the watermark's share (10 blocks at 0.25): 15 blocks (60 tokens) at
    0, 5 (20 tokens) at 0.25; the third waits. The running requests grow into the rest."""
    limits = dataclasses.replace(LIMITS, max_model_len=256, num_kv_blocks=40, kv_block_size=4)
    config = SchedulerConfig(
        max_num_batched_tokens=512, adaptive_speculation=False, kv_watermark=watermark
    )
    s = Scheduler(config, limits, None, None)
    for i in range(3):
        s.add(Request(f"r{i}", [5] * 100, SamplingParams(max_tokens=4), 0))
    out = s.schedule()
    assert out is not None
    assert out.req_ids == ["r0", "r1"]
    assert out.num_scheduled_tokens.tolist() == [100, second]


def test_a_kv_watermark_outside_0_to_1_is_refused() -> None:
    with pytest.raises(ValueError, match="--kv-watermark must be >= 0 and < 1"):
        SchedulerConfig(kv_watermark=1.0)
