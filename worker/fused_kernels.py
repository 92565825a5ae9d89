"""The elementwise kernels of a decoder layer, fused: RMSNorm (with the residual add before it),
rotary embedding with the KV-cache write, and SiLU-and-multiply (vLLM's and SGLang's custom ops
``fused_add_rms_norm``, ``rotary_embedding`` + ``reshape_and_cache``, ``silu_and_mul``).

Eager transformers runs each of these as several kernels (RMSNorm alone is eight: casts, pow, mean,
add, rsqrt, two multiplies); a small model's decode step is launch-bound even inside a CUDA graph,
so the kernel count is its cost. On CUDA with triton each op here is one Triton launch; elsewhere
(the CPU tests, triton missing) it is the same arithmetic in torch ops, written as transformers
writes it. Every kernel works one token row at a time with a fixed reduction order, so a row's
result never depends on how many rows share its launch (batch invariance, attention.py).

Rounding follows transformers' bf16 steps where they are cheap to keep: the residual sum is rounded
to the activation dtype before it is normalised, the normalised row is rounded before the weight
multiplies it, SiLU is rounded before the multiply. Reductions and the rotary products run in
float32 and round once. Speculative and plain steps run these same kernels, so their outputs stay
equal whatever the rounding (the lossless tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton run the torch versions
    triton = None
    tl = None

SILU_BLOCK = 1024


if triton is not None:

    @triton.jit
    def _add_rms_norm(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        n,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # transformers' bf16 add
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=inside)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rope_and_cache(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_qkv,
        stride_cs,
        stride_qo_t,
        stride_qo_h,
        stride_kc,
        stride_kh,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # 0..H-1 queries, H..H+KVH-1 keys (and their values)
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, half)
        cos_lo = tl.load(cos_ptr + tok * stride_cs + d).to(tl.float32)
        cos_hi = tl.load(cos_ptr + tok * stride_cs + half + d).to(tl.float32)
        sin_lo = tl.load(sin_ptr + tok * stride_cs + d).to(tl.float32)
        sin_hi = tl.load(sin_ptr + tok * stride_cs + half + d).to(tl.float32)
        src = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
        x_lo = tl.load(src + d).to(tl.float32)
        x_hi = tl.load(src + half + d).to(tl.float32)
        # rotate_half: (x_lo, x_hi) -> (-x_hi, x_lo)
        y_lo = x_lo * cos_lo - x_hi * sin_lo
        y_hi = x_hi * cos_hi + x_lo * sin_hi
        if head < NUM_HEADS:
            dst = q_out_ptr + tok * stride_qo_t + head * stride_qo_h
            tl.store(dst + d, y_lo.to(q_out_ptr.dtype.element_ty))
            tl.store(dst + half + d, y_hi.to(q_out_ptr.dtype.element_ty))
        else:
            kv_head = head - NUM_HEADS
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            at = slot * stride_kc + kv_head * stride_kh
            tl.store(k_cache_ptr + at + d, y_lo.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_cache_ptr + at + half + d, y_hi.to(k_cache_ptr.dtype.element_ty))
            v_src = qkv_ptr + tok * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            full = tl.arange(0, HEAD_DIM)
            tl.store(v_cache_ptr + at + full, tl.load(v_src + full))

    @triton.jit
    def _silu_and_mul(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=inside, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # F.silu rounds to bf16
        tl.store(
            out_ptr + row * stride_o + cols,
            (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=inside,
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (RMSNorm(x + residual) [T, N], x + residual [T, N]).
    Without ``residual`` the second is ``x`` itself."""
    if not use_triton:
        if residual is not None:
            x = residual + x
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), x
    assert triton is not None and x.stride(-1) == 1
    t, n = x.shape
    block = triton.next_power_of_2(n)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    if not t:  # no rows: no launch (a grid of 0 programs)
        return out, res_out
    _add_rms_norm[(t,)](
        x,
        res,
        weight,
        out,
        res_out,
        n,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        res_out.stride(0),
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),  # 2k: 4 warps; 8k: 16
    )
    return out, res_out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    use_triton: bool,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] (a fused projection's output); cos, sin [T, D]. Rotates the
    queries and keys (transformers' ``rotate_half`` layout), writes the keys and values into cache
    rows ``slot_mapping`` [T] of ``key_cache``/``value_cache`` [rows, KVH, D] and returns the
    rotated queries [T, H, D]."""
    t = qkv.shape[0]
    d = key_cache.shape[-1]
    if not use_triton:
        q, k, v = qkv.view(t, -1, d).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        c, s = cos[:, None], sin[:, None]  # [T, 1, D]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return (x * c) + (torch.cat((-x2, x1), dim=-1) * s)

        key_cache.index_copy_(0, slot_mapping, rotate(k))
        value_cache.index_copy_(0, slot_mapping, v)
        return rotate(q)
    assert triton is not None and qkv.stride(-1) == 1 and cos.stride() == sin.stride()
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    q_out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if not t:
        return q_out
    _rope_and_cache[(t, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        slot_mapping,
        q_out,
        key_cache,
        value_cache,
        qkv.stride(0),
        cos.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=d,
    )
    return q_out


def silu_and_mul(gate_up: torch.Tensor, *, use_triton: bool) -> torch.Tensor:
    """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
    n = gate_up.shape[1] // 2
    if not use_triton:
        return F.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert triton is not None and gate_up.stride(-1) == 1
    t = gate_up.shape[0]
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if not t:
        return out
    _silu_and_mul[(t, triton.cdiv(n, SILU_BLOCK))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK
    )
    return out
