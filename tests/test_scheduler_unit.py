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


def test_a_byte_level_tokenizer_detokenizes_from_its_bytes_as_decode_does(tmp_path: Path) -> None:
    """A byte-level tokenizer's ids are their bytes (``TokenizerInfo.token_bytes``): the text
    from them is the full decode's, whatever the chunks (invalid UTF-8, special and added tokens
    among the ids), and no delta shows what the decode of the ids so far does not begin with."""
    import random

    from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo
    from worker.byte_tokenizer import save_byte_tokenizer

    tok = TokenizerInfo(str(save_byte_tokenizer(tmp_path / "t", 300)))  # 41 added <|tN|> tokens
    assert tok.token_bytes() is not None
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(300) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tok)
        shown, i = "", 0
        while i < len(ids):
            k = rng.randrange(1, 6)
            shown += d.add(ids[i : i + k], final=i + k >= len(ids))
            i += k
            if i < len(ids) and "\ufffd" not in tok.decode(d.ids):
                assert tok.decode(d.ids).startswith(shown)
        assert shown == d.text == tok.decode(ids), ids


def test_a_byte_level_vocabulary_with_gaps_and_added_text_keeps_its_bytes(tmp_path: Path) -> None:
    """Ids past a gap in the vocabulary (a merge at id 300 of 259 tokens) and an added token
    whose text has a space (its own UTF-8, as ``ByteLevel`` decodes it) detokenize as decode
    does, on the bytes path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ab"] = 300
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|end|>"])
    t.add_tokens(["\u00e9 b"])
    (tmp_path / "m").mkdir()
    t.save(str(tmp_path / "m" / "tokenizer.json"))
    tok = TokenizerInfo(str(tmp_path / "m"))
    table = tok.token_bytes()
    assert table is not None and len(table) == 301
    ids = [*tok.encode("xaby \u00e9 b z"), 257]  # (257: the special token, shown as nothing)
    assert 300 in ids
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add([i]) for i in ids) + d.add([], final=True) == tok.decode(ids)
    assert d.text == "xaby \u00e9 b z"


def test_a_tokenizer_that_is_not_byte_level_detokenizes_through_decode(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "!": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    (tmp_path / "m").mkdir()
    t.save(str(tmp_path / "m" / "tokenizer.json"))
    tok = TokenizerInfo(str(tmp_path / "m"))
    assert tok.token_bytes() is None
    d = IncrementalDetokenizer(tok)
    text = "".join(d.add([i]) for i in (1, 2, 3)) + d.add([], final=True)
    assert text == tok.decode([1, 2, 3]) == "hello world!"


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
