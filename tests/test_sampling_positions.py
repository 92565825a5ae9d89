"""The rejection sampler's output law at every position, not only the first emitted token.

A synthetic target ``p_j`` (positions j = 0..K) and draft ``q_j`` (j < K), different at every
position so that reading the wrong position shows. Drafts are drawn from ``q_j`` (or fixed, one-hot,
as an n-gram drafter proposes them), N independent trials go through ``verify`` in one batch, and:

- conditioned on ``num_accepted == j``, the token emitted at position j follows
  ``norm(max(0, p_j - q_j))`` for j < K, and ``p_K`` (the bonus) for j == K;
- the number accepted follows P(accept j | accepted j - 1) = alpha_j = sum(min(p_j, q_j));
- an accepted draft at position i follows ``min(p_i, q_i) / alpha_i``.

``planted_verify`` is a plain sampler with one deliberate bug at a time; the power tests run the
same statistics on it and require them to reject it, so a pass above means something.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.stats import ALPHA, POWER_ALPHA, chi_square
from worker.rejection import VerifyInput, verify

V = 8
K = 4
N = 40_000
SEED = 16_001
CASES = ("peaked", "flat", "one-hot")
BASE = torch.tensor([2.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])


def target_laws() -> torch.Tensor:
    """[K + 1, V]: p_j, its mode at token 3j mod V."""
    return torch.stack([BASE.roll(3 * j).softmax(-1) for j in range(K + 1)])


def draft_laws(case: str) -> torch.Tensor:
    """[K, V]: q_j. Peaked: sharper than p_j with the same mode; flat: close to uniform, its
    shape rolled differently from p's; one-hot: the mode of p_j, as an n-gram drafter that is
    right about half of the time."""
    p = target_laws()
    if case == "peaked":
        return torch.stack([(3.0 * BASE.roll(3 * j)).softmax(-1) for j in range(K)])
    if case == "flat":
        return torch.stack([(0.3 * BASE.roll(5 * j + 2)).softmax(-1) for j in range(K)])
    assert case == "one-hot", case
    return torch.nn.functional.one_hot(p[:K].argmax(-1), V).float()


def residual_laws(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[K + 1, V]: the law of the final token after exactly j accepted drafts."""
    res = (p[:K] - q).clamp(min=0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p[:K])
    return torch.cat([res / res.sum(-1, keepdim=True), p[K:]])


def acceptance_rates(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[K]: alpha_j = sum(min(p_j, q_j))."""
    return torch.minimum(p[:K], q).sum(-1)


@functools.cache
def trial_inputs(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [N, K], uniforms [N, K + 2]), drawn from a generator seeded per case."""
    seed = SEED + CASES.index(case)
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    q = draft_laws(case)
    drafts = torch.stack(
        [torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(K)], 1
    )
    return drafts, torch.rand(N, K + 2, generator=gen)


@functools.cache
def sampled(case: str) -> tuple[np.ndarray, np.ndarray]:
    """(output_token_ids [N, K + 1], num_accepted [N]) of ``verify`` on N independent trials."""
    drafts, uniforms = trial_inputs(case)
    p = target_laws()
    out = verify(
        VerifyInput(
            logits=p.log().repeat(N, 1),  # softmax(log p) = p at temperature 1
            cu_rows=list(range(0, (K + 1) * N + 1, K + 1)),
            num_drafts=[K] * N,
            draft_token_ids=drafts,
            draft_probs=None if case == "one-hot" else draft_laws(case).expand(N, K, V),
            temperature=torch.ones(N),
            top_k=torch.zeros(N, dtype=torch.long),
            top_p=torch.ones(N),
            greedy=torch.zeros(N, dtype=torch.bool),
            uniforms=uniforms,
            filtered=False,
        )
    )
    return out.output_token_ids.numpy(), out.num_accepted.numpy()


# -- the statistics ---------------------------------------------------------------------------


def final_token_p_value(case: str, tokens: np.ndarray, num_accepted: np.ndarray, j: int) -> float:
    """Chi-square p-value of the token at position j among trials that accepted exactly j."""
    rows = num_accepted == j
    assert rows.sum() >= 500, f"only {rows.sum()} trials accepted exactly {j}"
    observed = np.bincount(tokens[rows, j], minlength=V)
    law = residual_laws(target_laws(), draft_laws(case))[j].numpy()
    return chi_square(observed, law)[2]


def acceptance_p_value(num_accepted: np.ndarray, case: str) -> float:
    """Chi-square p-value of the number accepted against prod(alpha_<j) * (1 - alpha_j)."""
    alpha = acceptance_rates(target_laws(), draft_laws(case)).double()
    reach = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])  # [K + 1]
    law = reach * torch.cat([1 - alpha, torch.ones(1, dtype=torch.float64)])
    return chi_square(np.bincount(num_accepted, minlength=K + 1), law.numpy())[2]


def accepted_token_p_value(
    case: str, tokens: np.ndarray, num_accepted: np.ndarray, i: int
) -> float:
    """Chi-square p-value of the accepted draft at position i against min(p_i, q_i) / alpha_i."""
    rows = num_accepted > i
    law = torch.minimum(target_laws()[i], draft_laws(case)[i]).numpy()
    return chi_square(np.bincount(tokens[rows, i], minlength=V), law)[2]


# -- the sampler under test -------------------------------------------------------------------


@pytest.mark.parametrize("j", range(K + 1))
@pytest.mark.parametrize("case", CASES)
def test_the_token_after_j_accepted_drafts_follows_its_conditional_law(case: str, j: int) -> None:
    tokens, num_accepted = sampled(case)
    pv = final_token_p_value(case, tokens, num_accepted, j)
    assert pv > ALPHA, (case, j, pv, np.bincount(tokens[num_accepted == j, j], minlength=V))
    assert (tokens[num_accepted == j, j + 1 :] == -1).all(), "tokens past the final one"


@pytest.mark.parametrize("case", CASES)
def test_the_number_of_accepted_drafts_follows_the_acceptance_rates(case: str) -> None:
    _, num_accepted = sampled(case)
    pv = acceptance_p_value(num_accepted, case)
    assert pv > ALPHA, (case, pv, np.bincount(num_accepted, minlength=K + 1))


@pytest.mark.parametrize("case", CASES)
def test_an_accepted_draft_follows_min_p_q(case: str) -> None:
    tokens, num_accepted = sampled(case)
    drafts, _ = trial_inputs(case)
    for i in range(K):
        rows = num_accepted > i
        assert (tokens[rows, i] == drafts.numpy()[rows, i]).all(), "an accepted token is its draft"
        pv = accepted_token_p_value(case, tokens, num_accepted, i)
        assert pv > ALPHA, (case, i, pv)


# -- power: the same statistics reject planted bugs -------------------------------------------


def planted_verify(case: str, bug: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The textbook sampler on the same trials, vectorized over them, with one ``bug``:

    residual_prev / residual_next: the residual subtracts q of position j - 1 / j + 1;
    accept_without_q: accept when u < p(d), ignoring q; bonus_from_q / bonus_from_p_prev /
    bonus_from_residual: the bonus drawn from q_{K-1}, from p_{K-1}, or from max(0, p_K - q_{K-1});
    final_uniform_reused: the final token drawn with the first acceptance draw u_0."""
    drafts, u = trial_inputs(case)
    p, q = target_laws(), draft_laws(case)
    pos = torch.arange(K)
    p_d, q_d = p[pos, drafts], q[pos, drafts]  # [N, K]
    accept = u[:, :K] < p_d if bug == "accept_without_q" else u[:, :K] * q_d < p_d
    num = accept.int().cumprod(-1).sum(-1)  # [N]
    shift = {"residual_prev": -1, "residual_next": 1}.get(bug or "", 0)
    at_q = (num + shift).clamp(0, K - 1)
    law = (p[num] - q[at_q]).clamp(min=0)
    law = torch.where(law.sum(-1, keepdim=True) > 0, law, p[num])
    bonus = {
        "bonus_from_q": q[K - 1],
        "bonus_from_p_prev": p[K - 1],
        "bonus_from_residual": (p[K] - q[K - 1]).clamp(min=0),
    }.get(bug or "", p[K])
    law = torch.where((num == K)[:, None], bonus, law)
    uniform = u[:, 0] if bug == "final_uniform_reused" else u[:, K]
    cdf = law.cumsum(-1)
    final = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1).clamp(max=V - 1)
    tokens = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1)
    tokens = tokens.scatter(1, num[:, None], final[:, None])
    tokens = torch.where(torch.arange(K + 1) <= num[:, None], tokens, -1)
    return tokens.numpy(), num.numpy()


@pytest.mark.parametrize("case", CASES)
def test_the_planted_sampler_without_a_bug_passes(case: str) -> None:
    """It equals ``verify`` exactly on the same draws, so each power test below differs from the
    real sampler by its one bug alone."""
    tokens, num_accepted = planted_verify(case, None)
    want_tokens, want_accepted = sampled(case)
    assert (num_accepted == want_accepted).all() and (tokens == want_tokens).all()


# bug -> (the statistic that must reject it, at which positions, in which cases)
PLANTED = {
    "residual_prev": ("final", range(1, K), CASES),
    "residual_next": ("final", range(K - 1), CASES),
    "accept_without_q": ("acceptance", [None], ("peaked", "flat")),  # one-hot: q(d) = 1 anyway
    "bonus_from_q": ("final", [K], CASES),
    "bonus_from_p_prev": ("final", [K], CASES),
    "bonus_from_residual": ("final", [K], CASES),
    "final_uniform_reused": ("final", range(K + 1), CASES),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_statistics_reject_a_planted_bug(bug: str) -> None:
    statistic, positions, cases = PLANTED[bug]
    for case in cases:
        tokens, num_accepted = planted_verify(case, bug)
        for j in positions:
            if statistic == "final":
                assert j is not None
                pv = final_token_p_value(case, tokens, num_accepted, j)
            else:
                pv = acceptance_p_value(num_accepted, case)
            assert pv < POWER_ALPHA, (bug, case, j, pv)


def test_accepted_token_statistic_rejects_acceptance_without_q() -> None:
    tokens, num_accepted = planted_verify("peaked", "accept_without_q")
    assert max(accepted_token_p_value("peaked", tokens, num_accepted, i) for i in range(K)) < (
        POWER_ALPHA
    )


# -- greedy: the accepted run is a prefix ------------------------------------------------------


def peaked_rows(*argmaxes: int) -> torch.Tensor:
    rows = torch.zeros(len(argmaxes), V)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return rows


@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_acceptance_stops_at_the_first_mismatch_though_later_drafts_match(
    all_greedy: bool,
) -> None:
    """Row 0's drafts match at 0, 2 and 3 but not 1: one accepted, then the argmax at 1. Without
    ``all_greedy`` a sampled row shares the batch, so the mixed path decides too."""
    logits = torch.cat([peaked_rows(3, 4, 5, 6, 7), peaked_rows(1, 2, 3, 4, 5)])
    drafts = torch.tensor([[3, 0, 5, 6], [1, 2, 3, 4]])
    out = verify(
        VerifyInput(
            logits=logits,
            cu_rows=[0, 5, 10],
            num_drafts=[4, 4],
            draft_token_ids=drafts,
            draft_probs=None,
            temperature=torch.tensor([0.0, 1.0]),
            top_k=torch.zeros(2, dtype=torch.long),
            top_p=torch.ones(2),
            greedy=torch.tensor([True, all_greedy]),
            uniforms=torch.full((2, K + 2), 0.5),
            all_greedy=all_greedy,
        )
    )
    assert out.num_accepted[0] == 1
    assert out.output_token_ids[0].tolist() == [3, 4, -1, -1, -1]


def test_greedy_fast_path_stops_at_the_first_mismatch_though_later_drafts_match() -> None:
    from worker.rejection import verify_greedy

    # request 0: drafts 3, 0, 5 against argmax 3, 4, 5 (bonus 6); request 1: both right, bonus 7
    logits = torch.cat([peaked_rows(3, 4, 5, 6), peaked_rows(1, 2, 7)])
    by_row = torch.tensor([3, 0, 5, 0, 1, 2, 0])
    tokens, accepted = verify_greedy(logits, by_row, [0, 4, 7], 3)
    assert accepted.tolist() == [1, 2]
    assert tokens.tolist() == [[3, 4, -1, -1], [1, 2, 7, -1]]
