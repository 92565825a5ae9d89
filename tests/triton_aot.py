"""Compile the fused layers' Triton kernels and the grammar bitmask's for a Hopper GPU (sm_90)
without one: triton's own compiler and the ptxas its wheel ships, in a process without triton's
interpreter (conftest.py sets it for the test session, and an interpreted kernel cannot be
compiled).

    python -m tests.triton_aot

Prints one line per compiled kernel variant; exits non-zero on the first that fails."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from worker import bitmask_kernel as bk  # noqa: E402
from worker import fused_kernels as fk  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(
    fn: object, signature: dict[str, str], constexprs: dict[str, object]
) -> None:
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER)
    assert "cubin" in kernel.asm, f"{fn}: no cubin"
    print(f"{getattr(fn, '__name__', fn)} {constexprs}: compiled for sm_90")


def main() -> None:
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        i32 = "i32"
        for has_res in (False, True):
            sig = dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"), p)
            sig |= dict.fromkeys(("n", "stride_x", "stride_r", "stride_o", "stride_ro"), i32)
            sig |= {"eps": "fp32", "HAS_RES": "constexpr", "BLOCK": "constexpr"}
            compile_for_hopper(fk._add_rms_norm, sig, {"HAS_RES": has_res, "BLOCK": 1024})
        for head_dim in (64, 128):
            sig = dict.fromkeys(("qkv_ptr", "cos_ptr", "sin_ptr"), p) | {"slot_ptr": "*i64"}
            sig |= dict.fromkeys(("q_out_ptr", "k_cache_ptr", "v_cache_ptr"), p)
            strides = ("stride_qkv", "stride_cs", "stride_qo_t", "stride_qo_h", "stride_kc")
            sig |= dict.fromkeys((*strides, "stride_kh"), i32)
            sig |= dict.fromkeys(("NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM"), "constexpr")
            consts = {"NUM_HEADS": 9, "NUM_KV_HEADS": 3, "HEAD_DIM": head_dim}
            compile_for_hopper(fk._rope_and_cache, sig, consts)
        sig = {"gu_ptr": p, "out_ptr": p} | dict.fromkeys(("n", "stride_gu", "stride_o"), i32)
        compile_for_hopper(fk._silu_and_mul, sig | {"BLOCK": "constexpr"}, {"BLOCK": 1024})
        # the grammar bitmask on the logits (bf16 or float32 logits, int64 rows, int32 words)
        sig = {"logits_ptr": p, "rows_ptr": "*i64", "mask_ptr": "*i32"}
        sig |= dict.fromkeys(("vocab", "num_words", "stride_l", "stride_m"), i32)
        consts = {"BLOCK": bk.BLOCK}
        compile_for_hopper(bk._apply_bitmask, sig | {"BLOCK": "constexpr"}, consts)


if __name__ == "__main__":
    main()
