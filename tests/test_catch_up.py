"""A drafter's catch-up runs in forwards of at most the worker's token budget
(``worker/drafters/catch_up.py``): the split itself; then the draft model, parallel drafting and
the EAGLE head with a budget far below their backlog (every prompt is longer than it). Every
forward stays within the budget, the drafts are the draft model's own greedy continuation (or,
for parallel drafting and EAGLE, the drafts of the same drafter with no budget), and the output
is target-only greedy (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.driver import Req, run
from tests.models import VOCAB, greedy_reference, near_copy, reference_copy, tiny_model
from tests.test_partial_acceptance import checked_draft_model, make_runner
from worker.attention import ATTN_IMPLEMENTATION
from worker.drafters.base import Drafter, Proposal
from worker.drafters.catch_up import forward_in_chunks
from worker.drafters.eagle import EagleDrafter
from worker.drafters.parallel import ParallelDrafter
from worker.eagle_head import EagleHead, head_config
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates

K = 4
BUDGET = 7
MASK = 61


def check_one_split(rng: np.random.Generator) -> None:
    n = int(rng.integers(1, 6))
    counts = rng.integers(1, 12, n).tolist()
    starts = rng.integers(0, 50, n).tolist()
    total = sum(counts)
    rows = np.sort(rng.choice(total, size=int(rng.integers(0, total + 1)), replace=False))
    budget = int(rng.integers(0, total + 3))
    ran: list[tuple[int, int]] = []  # (request, position) in the order the forwards ran

    def forward(
        tokens: slice, idx: list[int], c_starts: list[int], c_counts: list[int], r: np.ndarray
    ) -> torch.Tensor:
        size = tokens.stop - tokens.start
        assert sum(c_counts) == size and min(c_counts) > 0
        assert budget <= 0 or size <= budget
        assert ((r >= 0) & (r < size)).all()
        for j, s, c in zip(idx, c_starts, c_counts, strict=True):
            ran.extend((j, p) for p in range(s, s + c))
        return torch.as_tensor(r + tokens.start)

    out = forward_in_chunks(forward, starts, counts, rows, budget)
    assert out.tolist() == rows.tolist()
    assert ran == [(j, p) for j in range(n) for p in range(starts[j], starts[j] + counts[j])]


def test_the_split_runs_every_token_once_in_order_within_the_budget() -> None:
    seed = 5
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    for _ in range(300):
        check_one_split(rng)


def requests(seed: int) -> list[Req]:
    """Prompts of 12..30 tokens that repeat a phrase, arriving two at a time (so one proposal
    catches up two prompts at once), one of them prefilled in chunks."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(4):
        phrase = rng.integers(3, VOCAB, int(rng.integers(3, 6))).tolist()
        prompt = (phrase * 10)[: 12 + 6 * i]
        reqs.append(Req(f"r{i}", prompt, 14, k=K, arrive=2 * (i // 2), chunk=5 if i == 3 else 0))
    return reqs


def sizes_of(executor: ModelExecutor) -> list[int]:
    """The token count of each forward ``executor`` runs from now on."""
    sizes: list[int] = []
    forward = executor.forward

    def spy(input_ids: torch.Tensor, *args: Any) -> Any:
        sizes.append(len(input_ids))
        return forward(input_ids, *args)

    executor.forward = spy  # type: ignore[method-assign]
    return sizes


def drafts_of(drafter: Drafter) -> list[list[int]]:
    """Each proposal's drafts (per request, its width's worth), in order."""
    seen: list[list[int]] = []
    propose = drafter.propose

    def spy(states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        p = propose(states, slots, widths)
        ids = p.token_ids.cpu().numpy()
        seen.extend(ids[i, :w].tolist() for i, w in enumerate(widths))
        return p

    drafter.propose = spy  # type: ignore[method-assign]
    return seen


def run_lossless(target: torch.nn.Module, drafter: Drafter, seed: int) -> None:
    ref = reference_copy(target)
    reqs = requests(seed)
    got = run(make_runner(target, drafter, max_num_seqs=4), reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id


def test_a_draft_model_catches_up_within_the_budget() -> None:
    """Each proposal is checked against the draft's greedy continuation computed without a cache
    (``checked_draft_model``): a chunk that lost or repeated a key would propose otherwise."""
    seed = 761
    print(f"seed={seed}")
    target = tiny_model("llama", seed=seed)
    drafter = checked_draft_model(near_copy(target, seed + 1), max_num_seqs=4)
    drafter.executor.max_num_tokens = BUDGET
    sizes = sizes_of(drafter.executor)
    run_lossless(target, drafter, seed)
    assert max(sizes) <= BUDGET < 12 + 12  # the first proposal's backlog: two prompts


def check_budget_changes_nothing(
    make: Callable[[torch.nn.Module, int], tuple[Drafter, list[int]]],
) -> None:
    """``make(target, budget)`` -> (a fresh drafter, the sizes of its forwards): the same drafts
    with a budget of ``BUDGET`` as with none, every forward within it, and the output lossless."""
    seed = 771
    print(f"seed={seed}")
    target = tiny_model("llama", seed=seed)
    drafts = {}
    for budget in (0, BUDGET):
        drafter, sizes = make(target, budget)
        drafts[budget] = drafts_of(drafter)
        run_lossless(target, drafter, seed)
        if budget:
            assert max(sizes) <= budget
        else:
            assert max(sizes) > BUDGET  # without a budget the backlog ran in one forward
    assert drafts[BUDGET] == drafts[0] and drafts[0]


def test_parallel_drafting_catches_up_within_the_budget() -> None:
    def make(_: torch.nn.Module, budget: int) -> tuple[Drafter, list[int]]:
        draft = tiny_model("llama", seed=5, layers=1)
        draft.config.mask_token_id = MASK
        ex = ModelExecutor(draft, max_num_seqs=4, max_model_len=160, decode_width=1 + K)
        ex.max_num_tokens = budget
        return ParallelDrafter(ex, max_num_tokens=K), sizes_of(ex)

    check_budget_changes_nothing(make)


def test_an_eagle_head_catches_up_within_the_budget() -> None:
    def make(target: torch.nn.Module, budget: int) -> tuple[Drafter, list[int]]:
        torch.manual_seed(3)
        head = EagleHead(head_config(target.config), ATTN_IMPLEMENTATION).eval()
        drafter = EagleDrafter(
            head,
            target,
            vocab_size=VOCAB,
            max_num_seqs=4,
            max_model_len=160,
            max_num_tokens=K,
            max_num_batched_tokens=budget,
        )
        sizes: list[int] = []
        run_head = drafter._run

        def spy(slots: list[int], starts: list[int], counts: list[int], *rest: Any) -> Any:
            sizes.append(sum(counts))
            return run_head(slots, starts, counts, *rest)

        drafter._run = spy  # type: ignore[method-assign]
        return drafter, sizes

    check_budget_changes_nothing(make)
