"""Lossless with partial acceptance: the target accepts some drafts and rejects others.

An unrelated random draft is rejected at its first draft almost every step, which leaves the
paths that only run after an acceptance (committing accepted drafts, rolling the draft cache back
over the rejected tail, counting the accepted prefix) untested. Here the draft is the target with
a little seeded noise (``tests.models.near_copy``), and n-gram drafts come from prompts that repeat
themselves; every test asserts ``0 < accepted < verified`` besides token-for-token equality with
target-only greedy decoding (fp32, CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.messages import SamplingParams
from scheduler_client import Engine
from tests.driver import Req, run
from tests.models import (
    BYTE_MODEL_SEED,
    BYTE_VOCAB,
    VOCAB,
    greedy_reference,
    near_copy,
    reference_copy,
    tiny_model,
)
from worker.drafters.base import Drafter, Proposal
from worker.drafters.draft_model import DraftModelDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.runner import ModelRunner

MAX_LEN = 160
K = 4


def checked_draft_model(draft: torch.nn.Module, max_num_seqs: int) -> DraftModelDrafter:
    """A draft-model drafter whose every proposal must equal the draft's own greedy continuation
    of the committed tokens, computed with no cache: a draft cache that kept a rejected draft's
    keys (a missed roll-back) proposes something else."""
    drafter = DraftModelDrafter(
        ModelExecutor(draft, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN, decode_width=1 + K),
        max_num_tokens=K,
    )
    ref = reference_copy(draft)
    propose = drafter.propose

    def spy(states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        proposal = propose(states, slots, widths)
        token_ids = proposal.token_ids.cpu().numpy()  # [B, K]
        for i, (slot, w) in enumerate(zip(slots, widths, strict=True)):
            if states.sampling[slot].temperature > 0:  # type: ignore[union-attr]
                continue  # sampled drafts: a draw from q, not the argmax
            committed = states.tokens(slot).tolist()
            want = greedy_reference(ref, committed, w)
            assert token_ids[i, :w].tolist() == want, (
                f"slot {slot}: drafts after {len(committed)} committed tokens"
            )
        return proposal

    drafter.propose = spy  # type: ignore[method-assign]
    return drafter


def make_runner(target: torch.nn.Module, drafter: Drafter, max_num_seqs: int) -> ModelRunner:
    return ModelRunner(
        ModelExecutor(target, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN, decode_width=1 + K),
        drafter,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
    )


def requests(batch: int, seed: int) -> list[Req]:
    """Prompts that repeat a random phrase (n-gram hits); at batch > 1 mixed k (one request
    without drafts), staggered arrivals and one chunked prefill. At batch 8 the last request
    samples (seeded), so the greedy rows of its steps are verified by ``verify``'s greedy branch
    rather than by ``verify_greedy``."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(batch):
        phrase = rng.integers(3, VOCAB, int(rng.integers(3, 7))).tolist()
        prompt = (phrase * 4)[: 8 + 3 * i]
        if batch == 1:
            reqs.append(Req("r0", prompt, 32, k=K))
            continue
        reqs.append(
            Req(
                f"r{i}",
                prompt,
                16 + 2 * (i % 3),
                k=[K, 2, 3, 0, 1][i % 5],
                arrive=i // 2,
                chunk=5 if i == 1 else 0,
            )
        )
    if batch == 8:
        reqs[-1].k = K
        reqs[-1].sampling = SamplingParams(temperature=0.8, seed=seed)
    return reqs


CASES = [  # (batch, arch)
    (1, "llama"),
    (3, "qwen2"),
    (8, "llama"),
]


@pytest.mark.parametrize("drafter_kind", ["draft_model", "ngram"])
@pytest.mark.parametrize(("batch", "arch"), CASES, ids=[f"batch{b}-{a}" for b, a in CASES])
def test_partial_acceptance_equals_target_greedy(batch: int, arch: str, drafter_kind: str) -> None:
    seed = 700 + batch
    print(f"seed={seed}")
    target = tiny_model(arch, seed=seed)
    ref = reference_copy(target)
    drafter: Drafter
    if drafter_kind == "draft_model":
        drafter = checked_draft_model(near_copy(target, seed + 1), max_num_seqs=8)
    else:
        drafter = NgramDrafter(min_n=1, max_n=3, max_num_tokens=K)
    runner = make_runner(target, drafter, max_num_seqs=8)
    reqs = requests(batch, seed)
    got = run(runner, reqs)
    for r in reqs:
        if r.sampling.temperature > 0:
            assert len(got[r.req_id]) == r.max_tokens
            continue
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    accepted, verified = sum(r.accepted for r in reqs), sum(r.verified for r in reqs)
    print(f"accepted {accepted} of {verified}")
    assert 0 < accepted < verified, (accepted, verified)
    assert len(runner.states.free_slots) == runner.states.max_num_seqs


def test_verifying_fewer_drafts_than_proposed_stays_lossless() -> None:
    """The scheduler may verify fewer drafts than the worker proposed (its tuner's width, a
    grammar cutting them), even none. A bonus token can then equal a draft the draft model was
    fed but nobody verified, and that draft's keys stay valid in the draft cache: the next
    proposal must still run the last committed token for its logits."""
    seed = 731
    print(f"seed={seed}")
    target = tiny_model("llama", seed=seed)
    ref = reference_copy(target)
    runner = make_runner(
        target, checked_draft_model(near_copy(target, seed + 1), max_num_seqs=4), max_num_seqs=4
    )
    reqs = requests(3, seed)
    for r, caps in zip(reqs, [(0, 1, 2), (1, 0), (2, 0, 3)], strict=True):
        r.k, r.verify_caps = K, caps
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    accepted, verified = sum(r.accepted for r in reqs), sum(r.verified for r in reqs)
    print(f"accepted {accepted} of {verified}")
    assert 0 < accepted < verified, (accepted, verified)


def test_drafts_the_scheduler_supplied_roll_the_draft_cache_back() -> None:
    """Some steps verify the scheduler's own draft ids (as grammar-forced tokens are) instead of
    the draft model's: the target accepts a run of them that differs from what the draft model
    was fed, so its cache must drop those fed drafts (the next proposals are checked against
    the draft's greedy continuation of the committed tokens, computed without a cache)."""
    seed = 741
    print(f"seed={seed}")
    target = tiny_model("llama", seed=seed)
    ref = reference_copy(target)
    runner = make_runner(
        target, checked_draft_model(near_copy(target, seed + 1), max_num_seqs=4), max_num_seqs=4
    )

    def supplied(tokens: list[int], w: int) -> list[int] | None:
        if len(tokens) % 3:
            return None  # the worker's own drafts
        # the target's next w - 1 tokens, then one it rejects
        want = greedy_reference(ref, tokens, w)
        return [*want[:-1], (want[-1] + 1) % VOCAB]

    reqs = requests(3, seed)
    for r in reqs:
        r.k, r.supplied_drafts = K, supplied
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    accepted, verified = sum(r.accepted for r in reqs), sum(r.verified for r in reqs)
    print(f"accepted {accepted} of {verified}")
    assert 0 < accepted < verified, (accepted, verified)


# -- through the two processes: an Engine driving a launched worker ------------------------------


@pytest.fixture(scope="module")
def near_eng(
    request: pytest.FixtureRequest, target_dir: Path, near_draft_dir: Path
) -> Iterator[Engine]:
    from tests.test_scheduler_e2e import engine

    drafter = str(request.param)
    # Fixed widths: the speculation tuner picks widths from measured step times, so with it the
    # drafts verified (and whether one is rejected) would depend on the machine's load.
    draft = near_draft_dir if drafter == "draft_model" else None
    e = engine(target_dir, drafter, draft, adaptive_speculation=False)
    yield e
    e.close()


TWO_PROCESS = [("draft_model", 1), ("draft_model", 8), ("ngram", 8)]


@pytest.mark.parametrize(
    ("near_eng", "batch"),
    TWO_PROCESS,
    indirect=["near_eng"],
    ids=[f"{d}-batch{b}" for d, b in TWO_PROCESS],
)
def test_partial_acceptance_through_two_processes(near_eng: Engine, batch: int) -> None:
    """The scheduler's metrics count drafts accepted and rejected, and the output is still the
    target's greedy output: the worker's commit of accepted drafts agrees with the scheduler's."""
    from tests.test_scheduler_e2e import prompts

    ref = reference_copy(tiny_model("llama", BYTE_MODEL_SEED, vocab=BYTE_VOCAB))
    ps = prompts(batch)
    reqs = near_eng.generate(
        [
            {
                "prompt": p,
                "max_tokens": 20,
                "ignore_eos": True,
                "num_speculative_tokens": K if batch == 1 else i % 5,
            }
            for i, p in enumerate(ps)
        ]
    )
    for r, p in zip(reqs, ps, strict=True):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, 20), r.req_id
    # a worker that failed and was relaunched replays to the same output: that must not hide it
    assert near_eng.num_worker_restarts == 0
    accepted = sum(r.metrics.num_accepted for r in reqs)
    verified = sum(r.metrics.num_draft_tokens for r in reqs)
    print(f"accepted {accepted} of {verified}")
    assert 0 < accepted < verified, (accepted, verified)
