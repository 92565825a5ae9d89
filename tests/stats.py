"""Pearson's chi-square goodness of fit, for the sampling-distribution tests (no SciPy needed)."""

from __future__ import annotations

import math

import numpy as np
import torch

ALPHA = 1e-3  # the correct sampler must not be rejected at this level (every test is seeded)
POWER_ALPHA = 1e-12  # a planted bug must be rejected at this level


def chi_square(
    observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts ``observed`` [C] against ``probs`` [C].

    Cells expected below ``min_expected`` are pooled into one; a count in a cell of probability 0
    (a token the law forbids) makes the statistic infinite."""
    observed = np.asarray(observed, np.float64)
    probs = np.asarray(probs, np.float64)
    assert observed.shape == probs.shape, (observed.shape, probs.shape)
    n = observed.sum()
    assert n > 0, "no observations"
    impossible = probs <= 0
    if observed[impossible].sum() > 0:
        return math.inf, 0, 0.0
    expected = probs / probs.sum() * n
    small = (expected < min_expected) & ~impossible
    big = ~small & ~impossible
    obs = list(observed[big])
    exp = list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    o, e = np.array(obs), np.array(exp)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    return stat, df, p_value(stat, df)


def p_value(stat: float, df: int) -> float:
    """P(chi2_df >= stat): the regularized upper incomplete gamma function."""
    if df <= 0:
        return 1.0 if stat == 0 else 0.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )
