"""The scheduler on its own (no worker): queueing, budgets, and taking back a refused step."""

from __future__ import annotations

from pathlib import Path

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
