"""A Triton kernel that attends straight from the paged KV cache: any mix of prefill chunks,
decodes and drafts in one launch per layer, no gather, no mask tensor.

The flat batch holds B requests, request b owning query tokens ``query_start[b] ..
query_start[b + 1] - 1``; each token attends to its request's keys at positions ``0 ..
positions[token]``, found through row b of ``block_table``. The grid is fixed by the token count
and the request count alone (``num_tokens // BLOCK_M + B`` query tiles × heads), so a CUDA graph
captures it for a token bucket and replays it for any layout of that size: each program finds its
request by a binary search over ``query_start`` (the scheme of vLLM's unified Triton attention)
and returns at once when its tile is past its request's tokens.

Batch invariance: a query row's numbers depend only on its own request's keys and position. Tiles
are a fixed ``BLOCK_M`` rows whatever the request's token count (rows never mix in a matrix
product), the key loop walks fixed ``BLOCK_N`` tiles from position 0, and a key tile wholly past a
row's position (run because another row of the tile reaches further) is an exact no-op for it:
its scores are -inf, so the running maximum stays, the rescale is exp2(0) = 1 and the added mass
is 0. So a token comes out the same alone, with drafts after it, inside a longer prefill chunk or
beside any other request.

Programs whose tile holds no token of their request write nothing: rows no request owns (token
padding) keep what the caller put in ``out``.
"""

from __future__ import annotations

import math
import os

import torch

from worker.config import attention_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton take the SDPA path
    triton = None
    tl = None

BLOCK_M = 16
BLOCK_N = 64


def available(head_dim: int) -> bool:
    """triton is installed and the head dim is a power of two >= 16 (the kernel's tiles)."""
    return triton is not None and head_dim >= 16 and not head_dim & (head_dim - 1)


def use_kernel(device: torch.device, head_dim: int, fp32: bool = False) -> bool:
    """Whether attention on ``device`` runs this kernel: ``SPECD_ATTENTION_BACKEND`` (vLLM's
    ``VLLM_ATTENTION_BACKEND``) is ``auto`` (the default: on CUDA where ``available``, unless
    attention must run in float32), ``triton`` (required: an error where it cannot run; CPU
    tensors need ``TRITON_INTERPRET=1`` set before triton is imported, for tests) or ``sdpa``."""
    backend = attention_backend()
    if backend == "sdpa":
        return False
    ok = available(head_dim) and not fp32
    if backend == "triton" and not ok:
        raise ValueError(
            "SPECD_ATTENTION_BACKEND=triton needs triton installed, a power-of-two head dim >= 16 "
            f"and attention not in float32 (here: triton "
            f"{'installed' if triton is not None else 'missing'}, head dim {head_dim}"
            f"{', --batch-invariant pad-fp32' if fp32 else ''})"
        )
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"SPECD_ATTENTION_BACKEND=triton on {device.type} runs only in triton's interpreter: "
            "set TRITON_INTERPRET=1 (for tests: it is slow)"
        )
    return ok and (backend == "triton" or device.type == "cuda")


if triton is not None:
    # the request count and table width change from step to step: one compiled kernel for all
    @triton.jit(do_not_specialize=["num_reqs", "table_width"])
    def _paged_attention(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        block_table_ptr,
        query_start_ptr,
        positions_ptr,
        num_reqs,
        table_width,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_bt,
        scale_log2,
        GROUP: tl.constexpr,
        KV_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        # the request of this tile: the last b with query_start[b] // BLOCK_M + b <= tile
        lo = 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(query_start_ptr + mid) // BLOCK_M + mid
            if first <= tile:
                lo = mid + 1
            else:
                hi = mid
        req = lo - 1
        q_begin = tl.load(query_start_ptr + req)
        q_end = tl.load(query_start_ptr + req + 1)
        row0 = q_begin + (tile - (q_begin // BLOCK_M + req)) * BLOCK_M
        if row0 < q_end:
            rows = row0 + tl.arange(0, BLOCK_M)
            live = rows < q_end
            d = tl.arange(0, HEAD_DIM)
            q = tl.load(
                q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=live[:, None],
                other=0.0,
            )
            pos = tl.load(positions_ptr + rows, mask=live, other=0)
            end = tl.max(pos, axis=0) + 1
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            table = block_table_ptr + req * stride_bt
            for start in range(0, end, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                inside = (keys < end) & (keys // KV_BLOCK < table_width)
                block = tl.load(table + keys // KV_BLOCK, mask=inside, other=0)
                row = (block * KV_BLOCK + keys % KV_BLOCK).to(tl.int64)
                at = row[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
                k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            acc = acc / l_i[:, None]
            tl.store(
                out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=live[:, None],
            )


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """query [T, heads, D] (any strides with D contiguous); keys, values: one layer's cache
    [rows, kv_heads, D]; block_table [B, nb]; query_start [B + 1] (int32 or int64, the tokens of
    request b are query_start[b] .. query_start[b + 1] - 1); positions [T]. Writes the rows of
    every request's tokens into ``out`` [T, heads, D] and returns it. Launches no host sync."""
    assert triton is not None
    if query.stride(-1) != 1:
        query = query.contiguous()
    t, heads, d = query.shape
    kv_heads = keys.shape[1]
    b = block_table.shape[0]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    grid = (t // BLOCK_M + b, heads)
    _paged_attention[grid](
        query,
        keys,
        values,
        out,
        block_table,
        query_start,
        positions,
        b,
        block_table.shape[1],
        query.stride(0),
        query.stride(1),
        keys.stride(0),
        keys.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
        GROUP=heads // kv_heads,
        KV_BLOCK=block_size,
        HEAD_DIM=d,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        # float32 models get float32 products (tensor cores would round them to tf32)
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
