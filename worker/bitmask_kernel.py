"""The grammar bitmask applied to logits in one Triton launch, as vLLM does with xgrammar's
``apply_token_bitmask_inplace`` kernel.

The torch version (``sampling.apply_bitmask_``) unpacks the bits into a [rows, vocab] bool tensor
and writes the masked rows back: an arange, a shift, an and, a cast, an inversion, a gather, a
masked fill and a scatter, eight launches on the step's host path. Here each program reads one mask row's
words for a block of the vocabulary and stores -inf where a bit is clear. Only the disallowed
logits are written, so the result is bit for bit the torch version's (an elementwise rule: batch
invariant whatever the rows launched together).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton run the torch version
    triton = None
    tl = None

BLOCK = 1024  # vocabulary entries a program covers (32 words of the mask)


if triton is not None:

    @triton.jit
    def _apply_bitmask(
        logits_ptr,
        rows_ptr,
        mask_ptr,
        vocab,
        num_words,
        stride_l,
        stride_m,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)  # the mask row
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(rows_ptr + i).to(tl.int64)  # the logit row it masks
        word = offs // 32
        inside = offs < vocab
        # a token past the mask's words is not allowed (other=0: its bit is clear)
        bits = tl.load(mask_ptr + i * stride_m + word, mask=inside & (word < num_words), other=0)
        allowed = ((bits >> (offs % 32)) & 1) != 0
        tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=inside & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [R, V] (last dimension contiguous), rows [M] the logit rows that
    bitmask int32 [M, words] belongs to."""
    assert triton is not None and logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    m = rows.shape[0]
    if not m:
        return  # no rows: no launch (a grid of 0 programs)
    vocab = logits.shape[1]
    _apply_bitmask[(m, triton.cdiv(vocab, BLOCK))](
        logits,
        rows,
        bitmask,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=BLOCK,
    )
