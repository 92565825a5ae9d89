"""Prompt lookup on the device (``ngram_lookup_device``) gives what the host's ``ngram_lookup``
gives, row by row: random token rows over small vocabularies (many matches), every n range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.drafters.ngram import ngram_lookup, ngram_lookup_device


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_device_lookup_equals_host(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n)
    for vocab in (2, 3, 5, 50):
        batch, width, k = 24, 40, 4
        lengths = rng.integers(0, width + 1, size=batch)
        rows = rng.integers(0, vocab, size=(batch, width))
        drafts, num = ngram_lookup_device(
            torch.from_numpy(rows), torch.from_numpy(lengths), min_n, max_n, k
        )
        for b in range(batch):
            want = ngram_lookup(rows[b, : lengths[b]], min_n, max_n, k)
            got = drafts[b, : int(num[b])].numpy()
            assert got.tolist() == want.tolist(), (vocab, b, rows[b, : lengths[b]].tolist())
