"""The scheduler on its own (no worker): queueing, budgets, and taking back a refused step."""

from __future__ import annotations

from protocol.messages import SamplingParams
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
