"""The grammar bitmask's Triton kernel (``worker/bitmask_kernel.py``; on CPU in triton's
interpreter) against the torch version: the same logits bit for bit, -inf exactly where a bit is
clear, every other logit and every row without a mask untouched."""

from __future__ import annotations

import pytest
import torch

from worker import bitmask_kernel
from worker.sampling import apply_bitmask_


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [40, bitmask_kernel.BLOCK + 77])  # one block; two, one partial
def test_the_kernel_masks_what_the_torch_version_masks(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(device(), dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
    bitmask[0] = -1  # a row that allows everything
    bitmask[1, 0] = 0  # and a word that allows nothing
    bitmask = bitmask.to(torch.int32).to(device())
    rows = torch.tensor([4, 0, 2], device=device())
    want, got = logits.clone(), logits.clone()
    apply_bitmask_(want, rows, bitmask, use_triton=False)
    apply_bitmask_(got, rows, bitmask, use_triton=True)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask
    assert torch.equal(got[4], logits[4])  # the allow-all row
    assert torch.isinf(got[0, :32]).all()
    assert (got[2] == float("-inf")).sum() > 0


@pytest.mark.gpu
@pytest.mark.triton
def test_the_kernel_forbids_tokens_past_the_masks_words_and_takes_no_rows() -> None:
    logits = torch.zeros(2, 70, device=device())
    bitmask = torch.full((1, 2), -1, dtype=torch.int32, device=device())  # covers 64 tokens
    apply_bitmask_(logits, torch.tensor([1], device=device()), bitmask, use_triton=True)
    assert torch.equal(logits[0], torch.zeros(70, device=device()))
    assert (logits[1, :64] == 0).all() and torch.isinf(logits[1, 64:]).all()
    empty = torch.zeros(0, 2, dtype=torch.int32, device=device())
    apply_bitmask_(
        logits, torch.zeros(0, dtype=torch.long, device=device()), empty, use_triton=True
    )


@pytest.mark.gpu
@pytest.mark.triton
def test_cuda_logits_take_the_kernel_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with triton, ``apply_bitmask_`` runs the kernel; on CPU the torch version."""
    calls: list[int] = []
    real = bitmask_kernel.apply_bitmask_triton
    monkeypatch.setattr(
        bitmask_kernel, "apply_bitmask_triton", lambda *a: calls.append(1) or real(*a)
    )
    logits = torch.zeros(1, 64, device=device())
    bitmask = torch.full((1, 2), -1, dtype=torch.int32, device=device())
    apply_bitmask_(logits, torch.tensor([0], device=device()), bitmask)
    assert calls == ([1] if device().type == "cuda" else [])
