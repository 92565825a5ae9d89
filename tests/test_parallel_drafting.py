"""Parallel drafting with a mask token: k drafts from one draft-model forward, lossless, with the
mask id taken from each of the config fields the seed checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, tiny_model
from worker.drafters.parallel import ParallelDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner

K = 4
MASK = 61  # a token id inside the tiny vocabulary
FIELDS: list[tuple[str, Any]] = [
    ("dflash_config", {"mask_token_id": MASK}),
    ("mask_token_id", MASK),
    ("dspark_noise_token_id", MASK),
    ("pard_token", MASK),
    ("ptd_token_id", MASK),
]


def drafter_with(field: str, value: Any, arch: str = "llama") -> ParallelDrafter:
    draft = tiny_model(arch, seed=5, layers=1)
    setattr(draft.config, field, value)
    return ParallelDrafter(
        ModelExecutor(draft, max_num_seqs=4, max_model_len=256, decode_width=1 + K),
        max_num_tokens=K,
    )


@pytest.mark.parametrize(("field", "value"), FIELDS, ids=[f for f, _ in FIELDS])
def test_greedy_output_equals_target_greedy_for_each_mask_field(field: str, value: Any) -> None:
    drafter = drafter_with(field, value)
    assert drafter.mask_token_id == MASK
    fed: list[torch.Tensor] = []
    forward = drafter.executor.forward

    def spy(input_ids: torch.Tensor, *args: Any) -> Any:
        fed.append(input_ids.clone())
        return forward(input_ids, *args)

    drafter.executor.forward = spy  # type: ignore[method-assign]
    target = tiny_model("llama", seed=11)
    ref = reference_copy(target)
    runner = ModelRunner(
        ModelExecutor(target, max_num_seqs=4, max_model_len=256, decode_width=1 + K),
        drafter,
        max_num_seqs=4,
        max_model_len=256,
        max_num_draft_tokens=K,
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13], [3, 4, 3, 4, 3]]
    reqs = [Req(f"r{i}", p, 16 + 2 * i, k=[K, 2, 0][i], arrive=i) for i, p in enumerate(prompts)]
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    assert sum(r.verified for r in reqs) > 0
    # one draft forward per proposal, each carrying w - 1 masks per request drafting w tokens
    assert drafter.num_proposals == len(fed) > 0
    masks = [int((ids == MASK).sum()) for ids in fed]
    assert max(masks) >= K - 1


def test_a_config_without_a_mask_token_is_refused_with_the_seed_error() -> None:
    draft = tiny_model("llama", seed=5, layers=1)
    with pytest.raises(ValueError, match=r"dflash_config\.mask_token_id"):
        ParallelDrafter(ModelExecutor(draft, max_num_seqs=2, max_model_len=64), max_num_tokens=K)


def test_a_mask_token_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the draft model's vocabulary"):
        drafter_with("mask_token_id", 10_000)


def test_seeded_sampling_through_parallel_drafts_is_reproducible() -> None:
    from protocol.messages import SamplingParams

    outs = []
    for _ in range(2):
        target = tiny_model("qwen2", seed=12)
        runner = ModelRunner(
            ModelExecutor(target, max_num_seqs=2, max_model_len=128, decode_width=1 + K),
            drafter_with("pard_token", MASK, "qwen2"),
            max_num_seqs=2,
            max_model_len=128,
            max_num_draft_tokens=K,
        )
        sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20)
        r = Req("s", [4, 5, 6, 4, 5], 20, k=K, sampling=sp)
        outs.append(run(runner, [r])["s"])
    assert outs[0] == outs[1] and len(outs[0]) == 20


def test_a_draft_near_the_target_gets_some_drafts_accepted() -> None:
    """The target plus a little noise as the parallel draft: its first draft (at the last committed
    token) often agrees with the target and the drafts read at masks rarely do, so acceptance is
    partial, and the output is still the target's greedy output."""
    from tests.models import near_copy

    target = tiny_model("llama", seed=11)
    ref = reference_copy(target)
    draft = near_copy(target, seed=12)
    draft.config.mask_token_id = MASK
    runner = ModelRunner(
        ModelExecutor(target, max_num_seqs=4, max_model_len=256, decode_width=1 + K),
        ParallelDrafter(
            ModelExecutor(draft, max_num_seqs=4, max_model_len=256, decode_width=1 + K),
            max_num_tokens=K,
        ),
        max_num_seqs=4,
        max_model_len=256,
        max_num_draft_tokens=K,
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13], [3, 4, 3, 4, 3]]
    reqs = [Req(f"r{i}", p, 16 + 2 * i, k=[K, 2, 3][i], arrive=i) for i, p in enumerate(prompts)]
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    accepted, verified = sum(r.accepted for r in reqs), sum(r.verified for r in reqs)
    print(f"accepted {accepted} of {verified}")
    assert 0 < accepted < verified, (accepted, verified)
