"""Preemption through a real worker process with a paged KV cache too small for its batch: the
scheduler admits by free blocks and preempts the newest request when an older one grows; the
preempted request is recomputed from its prompt and committed tokens. Every output equals the
target's own greedy output (what an unconstrained run produces) and nothing fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import BYTE_MODEL_SEED, greedy_reference, reference_copy, tiny_model
from tests.test_scheduler_e2e import engine, prompts

MAX_TOKENS = 32
# max_model_len 384 takes 24 blocks of 16, the least a worker accepts; the 8 prompts with their
# 32 outputs need 31 at the end
NUM_KV_BLOCKS = 24


# the plain reference (a full forward per token, 8 x 32 of them) takes minutes on a busy CPU
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("drafter", "async_scheduling"), [("ngram", False), ("draft_model", True)])
def test_few_kv_blocks_preempt_and_outputs_stay_equal(
    target_dir: Path, draft_dir: Path, drafter: str, async_scheduling: bool
) -> None:
    ref = reference_copy(tiny_model("llama", BYTE_MODEL_SEED, vocab=259))
    ps = prompts(8)
    eng = engine(
        target_dir,
        drafter,
        draft_dir if drafter == "draft_model" else None,
        async_scheduling=async_scheduling,
        worker_args=("--num-kv-blocks", str(NUM_KV_BLOCKS), "--kv-block-size", "16"),
    )
    try:
        assert eng.ready.num_kv_blocks == NUM_KV_BLOCKS and eng.ready.kv_block_size == 16
        reqs = eng.generate(
            [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
        )
        preemptions = eng.scheduler.num_preemptions
    finally:
        eng.close()
    assert preemptions > 0, "the batch must not fit in the blocks without preemption"
    for r, p in zip(reqs, ps, strict=True):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, MAX_TOKENS), r.req_id
