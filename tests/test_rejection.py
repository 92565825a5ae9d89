"""The rejection sampler on hand-built logits, and its output distribution against the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.rejection import VerifyInput, verify
from worker.sampling import apply_bitmask_

V = 8


def one_request(
    logits_rows: list[list[float]],
    drafts: list[int],
    *,
    greedy: bool = True,
    uniforms: list[float] | None = None,
    draft_probs: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[list[int], int]:
    k = max(len(drafts), 1)
    d = torch.zeros((1, k), dtype=torch.long)
    d[0, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
    u = torch.tensor([uniforms or [0.5] * (k + 2)])
    out = verify(
        VerifyInput(
            logits=torch.tensor(logits_rows),
            cu_rows=[0, len(logits_rows)],
            num_drafts=[len(drafts)],
            draft_token_ids=d,
            draft_probs=draft_probs,
            temperature=torch.tensor([temperature]),
            top_k=torch.tensor([0]),
            top_p=torch.tensor([1.0]),
            greedy=torch.tensor([greedy]),
            uniforms=u,
        )
    )
    row = out.output_token_ids[0].tolist()
    return [t for t in row if t >= 0], int(out.num_accepted[0])


def peaked(*argmaxes: int) -> list[list[float]]:
    rows = []
    for a in argmaxes:
        r = [0.0] * V
        r[a] = 10.0
        rows.append(r)
    return rows


def test_perfect_match_accepts_all_and_adds_bonus() -> None:
    assert one_request(peaked(3, 4, 5, 6), [3, 4, 5]) == ([3, 4, 5, 6], 3)


def test_early_mismatch_corrects_and_stops() -> None:
    assert one_request(peaked(3, 1, 5, 6), [3, 4, 5]) == ([3, 1], 1)


def test_empty_draft_samples_one_token() -> None:
    assert one_request(peaked(7), []) == ([7], 0)


def test_all_rejected() -> None:
    assert one_request(peaked(2, 2, 2), [3, 3]) == ([2], 0)


def test_bitmask_forbids_a_draft_the_target_prefers() -> None:
    logits = torch.tensor(peaked(3, 4))
    logits[0, 5] = 9.0  # second choice
    bitmask = torch.tensor([[0xFF & ~(1 << 3)], [0xFF]], dtype=torch.int32)  # row 0 forbids 3
    apply_bitmask_(logits, torch.tensor([0, 1]), bitmask)
    assert one_request(logits.tolist(), [3]) == ([5], 0)


def test_batched_rows_are_independent() -> None:
    rows = peaked(1, 2, 3) + peaked(4) + peaked(5, 6)
    d = torch.tensor([[1, 9], [0, 0], [7, 0]])
    out = verify(
        VerifyInput(
            logits=torch.tensor(rows),
            cu_rows=[0, 3, 4, 6],
            num_drafts=[2, 0, 1],
            draft_token_ids=d,
            draft_probs=None,
            temperature=torch.ones(3),
            top_k=torch.zeros(3, dtype=torch.long),
            top_p=torch.ones(3),
            greedy=torch.tensor([True, True, True]),
            uniforms=torch.rand(3, 4),
        )
    )
    assert out.num_accepted.tolist() == [1, 0, 0]
    assert out.output_token_ids.tolist() == [[1, 2, -1], [4, -1, -1], [5, -1, -1]]


def test_sampled_forbidden_draft_is_always_rejected() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = float("-inf")
    for u in (0.0, 0.3, 0.99):
        toks, acc = one_request(logits.tolist(), [3], greedy=False, uniforms=[u, 0.5, 0.5])
        assert acc == 0 and toks[0] != 3


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
def test_sampled_output_follows_the_target_distribution(drafter: str) -> None:
    """Chi-square: the first emitted token's frequencies match softmax(target logits)."""
    seed = 1234
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.5]] * 3)
    p = target_logits[0].softmax(-1)
    q = torch.tensor([0.05, 0.4, 0.05, 0.2, 0.05, 0.05, 0.15, 0.05])
    n = 20_000
    k = 2
    # each trial: drafts drawn from q (or fixed for one-hot), verified against p
    drafts = torch.multinomial(q, n * k, replacement=True, generator=gen).view(n, k)
    if drafter == "one-hot":
        drafts[:] = torch.tensor([1, 3])
        draft_probs = None
    else:
        draft_probs = q.expand(n, k, V).contiguous()
    out = verify(
        VerifyInput(
            logits=target_logits.repeat(n, 1),
            cu_rows=list(range(0, 3 * n + 1, 3)),
            num_drafts=[k] * n,
            draft_token_ids=drafts,
            draft_probs=draft_probs,
            temperature=torch.ones(n),
            top_k=torch.zeros(n, dtype=torch.long),
            top_p=torch.ones(n),
            greedy=torch.zeros(n, dtype=torch.bool),
            uniforms=torch.rand(n, k + 2, generator=gen),
        )
    )
    first = out.output_token_ids[:, 0].numpy()
    observed = np.bincount(first, minlength=V)
    expected = p.numpy() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: p = 0.001 at 24.3. A sampler that returned drafts unverified scores ~1e4.
    assert chi2 < 24.3, (chi2, observed, expected)


def test_biased_sampler_would_fail_the_chi_square() -> None:
    """The same statistic rejects q itself, so the test above has power."""
    gen = torch.Generator().manual_seed(7)
    p = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.5]).softmax(-1)
    q = torch.tensor([0.05, 0.4, 0.05, 0.2, 0.05, 0.05, 0.15, 0.05])
    n = 20_000
    observed = np.bincount(torch.multinomial(q, n, True, generator=gen).numpy(), minlength=V)
    chi2 = float(((observed - p.numpy() * n) ** 2 / (p.numpy() * n)).sum())
    assert chi2 > 1000


def test_top_k_and_top_p_restrict_the_support() -> None:
    from worker.sampling import probs_from_logits

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)
    pr = probs_from_logits(logits, torch.ones(2), torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert (pr[0, 2:] == 0).all() and pr[0, :2].sum() == pytest.approx(1.0)
    # top_p 0.7: softmax is [0.64, 0.24, 0.09, 0.03]; the smallest prefix reaching 0.7 is 2 tokens
    assert (pr[1, 2:] == 0).all() and (pr[1, :2] > 0).all()


def test_greedy_fast_path_equals_the_batched_verifier() -> None:
    """``verify_greedy`` (one argmax, acceptance counted on the host) against ``verify`` on random
    batches: widths 0..K, drafts right by construction or at random, ties included; batches
    small enough to be counted a request at a time and large enough to be counted as arrays."""
    from worker.rejection import ARRAY_ACCEPT_MIN_BATCH, verify_greedy

    rng = np.random.default_rng(9)
    for trial in range(300):
        b, k = int(rng.integers(1, 3 * ARRAY_ACCEPT_MIN_BATCH)), int(rng.integers(1, 5))
        widths = rng.integers(0, k + 1, b).tolist()
        cu = np.concatenate([[0], np.cumsum([w + 1 for w in widths])]).tolist()
        logits = torch.from_numpy(rng.integers(0, 3, (cu[-1], V)).astype(np.float32))  # ties
        argmax = logits.argmax(-1)
        drafts = torch.zeros((b, k), dtype=torch.long)
        by_row = torch.zeros(cu[-1], dtype=torch.long)
        for j, w in enumerate(widths):
            for i in range(w):
                right = rng.random() < 0.7
                t = int(argmax[cu[j] + i]) if right else int(rng.integers(0, V))
                drafts[j, i] = t
                by_row[cu[j] + i] = t
        ref = verify(
            VerifyInput(
                logits=logits,
                cu_rows=cu,
                num_drafts=widths,
                draft_token_ids=drafts,
                draft_probs=None,
                temperature=torch.zeros(b),
                top_k=torch.zeros(b, dtype=torch.long),
                top_p=torch.ones(b),
                greedy=torch.ones(b, dtype=torch.bool),
                uniforms=torch.full((b, k + 2), 0.5),
                all_greedy=True,
            )
        )
        tokens, accepted = verify_greedy(logits, by_row, cu, k)
        assert accepted.tolist() == ref.num_accepted.tolist(), trial
        assert tokens.tolist() == ref.output_token_ids.tolist(), trial
