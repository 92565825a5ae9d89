"""The fused decoder forward (``worker/fused_layers.py``) and its kernels (``worker/fused_kernels.py``):
the forward equals the model's own on CPU in float32 for Llama and Qwen2 shapes (biases
included), falls back where it does not apply, and each Triton kernel (on CUDA, or on CPU in
triton's interpreter) matches the torch version and is batch invariant: a row's bits do not
depend on the rows beside it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import worker.attention  # noqa: F401  (registers the specd attention)
from tests.drafting import KINDS, K, drafting_runner
from tests.driver import Req
from tests.driver import run as drive
from tests.models import VOCAB, tiny_config, tiny_model
from tests.test_catch_up import drafts_of
from worker import fused_kernels
from worker.model_executor import ModelExecutor

ROOT = Path(__file__).resolve().parent.parent


def model(kind: str) -> torch.nn.Module:
    """A tiny Llama, a tiny Qwen2 (q/k/v biases) or a tiny Qwen3 (q/k norms: not fused)."""
    if kind != "qwen3":
        return tiny_model(kind, 0)
    torch.manual_seed(0)
    cfg = Qwen3Config(**tiny_config("qwen2").to_dict() | {"head_dim": 16})
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation="specd").eval()


def run(ex: ModelExecutor, ids: torch.Tensor) -> torch.Tensor:
    """A 9-token prefill, then 3 tokens in one forward: all logits [12, vocab]."""
    d = ids.device
    with torch.inference_mode():
        a, _ = ex.forward(
            ids[:9], torch.arange(9, device=d), [0], [0], [9], torch.arange(9, device=d)
        )
        b, _ = ex.forward(
            ids[9:], torch.arange(9, 12, device=d), [0], [9], [3], torch.arange(3, device=d)
        )
    return torch.cat([a, b])


def executors(kind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelExecutor, ModelExecutor]:
    m = model(kind)
    m_off = copy.deepcopy(m)
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "off")
    off = ModelExecutor(m_off, max_num_seqs=2, max_model_len=64, cuda_graphs=False)
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "auto")
    on = ModelExecutor(m, max_num_seqs=2, max_model_len=64, cuda_graphs=False)
    return off, on


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_forward_equals_the_models_own(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    off, on = executors(kind, monkeypatch)
    assert off.fused is None and on.fused is not None and not on.fused.use_triton
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(run(on, ids), run(off, ids), rtol=0, atol=1e-5)
    # the model's own projections are views into the fused weights: its forward still works
    attn = on.model.get_decoder().layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == (
        attn.q_proj.weight.untyped_storage().data_ptr()
    )


def test_fused_forward_stays_off_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "auto")
    q3 = ModelExecutor(model("qwen3"), max_num_seqs=1, max_model_len=32, cuda_graphs=False)
    assert q3.fused is None  # q/k norms
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "off")
    assert ModelExecutor(model("llama"), max_num_seqs=1, max_model_len=32).fused is None
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "sometimes")
    with pytest.raises(ValueError, match="SPECD_FUSED_LAYERS must be one of auto, off"):
        ModelExecutor(model("llama"), max_num_seqs=1, max_model_len=32)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_kernel(dtype: torch.dtype, residual: bool, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=g).to(device(), dtype)
    r = torch.randn(7, n, generator=g).to(device(), dtype) if residual else None
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device(), dtype)
    want, want_sum = fused_kernels.rms_norm(x, w, 1e-6, r, use_triton=False)
    got, got_sum = fused_kernels.rms_norm(x, w, 1e-6, r, use_triton=True)
    if device().type == "cuda":  # the residual add rounds as transformers' does
        assert torch.equal(got_sum, want_sum)
    else:  # triton's interpreter casts to bfloat16 by truncating: one unit in the last place
        torch.testing.assert_close(got_sum, want_sum, rtol=1e-2, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # a row alone comes out with the same bits as among others
    one, _ = fused_kernels.rms_norm(x[3:4], w, 1e-6, None if r is None else r[3:4], use_triton=True)
    assert torch.equal(one[0], got[3])


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_kernel(dtype: torch.dtype) -> None:
    heads, kv_heads, d, t = 4, 2, 16, 5
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(device(), dtype)
    angles = torch.randn(t, d // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(device(), dtype), angles.sin().to(device(), dtype)
    slots = torch.tensor([9, 2, 4, 0, 7], device=device())
    results = []
    for use_triton in (False, True):
        keys = torch.zeros(12, kv_heads, d, dtype=dtype, device=device())
        values = torch.zeros_like(keys)
        q = fused_kernels.rope_and_cache(
            qkv, cos, sin, slots, keys, values, heads, kv_heads, use_triton=use_triton
        )
        results.append((q, keys, values))
    (q0, k0, v0), (q1, k1, v1) = results
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q1, q0, rtol=tol, atol=tol)
    torch.testing.assert_close(k1, k0, rtol=tol, atol=tol)
    assert torch.equal(v1, v0)  # values are copied as they are
    assert not k1[[1, 3, 5, 6, 8, 10, 11]].any()  # rows outside the slot mapping untouched


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_kernel(dtype: torch.dtype) -> None:
    n = fused_kernels.SILU_BLOCK + 40  # two column blocks, the second partial
    gate_up = torch.randn(3, 2 * n, generator=torch.Generator().manual_seed(4)).to(device(), dtype)
    want = fused_kernels.silu_and_mul(gate_up, use_triton=False)
    got = fused_kernels.silu_and_mul(gate_up, use_triton=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.triton
def test_fused_forward_with_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole forward with every Triton kernel (the paged attention's too, padded to 64
    tokens so the attention output's padding rows are shared by the layers) against the model's
    own forward (float32)."""
    monkeypatch.setenv("SPECD_ATTENTION_BACKEND", "triton")
    m = model("llama").to(device())
    m_off = copy.deepcopy(m)
    kw = dict(max_num_seqs=2, max_model_len=64, cuda_graphs=False, batch_invariant="pad")
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "off")
    off = ModelExecutor(m_off, **kw)  # type: ignore[arg-type]
    monkeypatch.setenv("SPECD_FUSED_LAYERS", "auto")
    on = ModelExecutor(m, **kw)  # type: ignore[arg-type]
    assert on.fused is not None and on.kernel
    on.fused.use_triton = True
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).to(device())
    torch.testing.assert_close(run(on, ids), run(off, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_drafts_the_same_through_the_fused_forward(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs and every proposal's drafts, fused forward against the model's own (float32):
    the target, the draft model, the parallel draft and the EAGLE head all run fused."""
    seen = []
    for setting in ("off", "auto"):
        monkeypatch.setenv("SPECD_FUSED_LAYERS", setting)
        r, _ = drafting_runner(kind, 17)
        assert (r.target.fused is None) == (setting == "off")
        proposals = drafts_of(r.drafter)
        reqs = [
            Req("a", [5, 6, 7, 5, 6, 7, 5, 6], 12, k=K),
            Req("b", [9, 10, 11, 12, 9, 10], 10, k=K, arrive=2, chunk=4),
        ]
        seen.append((drive(r, reqs), proposals))
    assert seen[0] == seen[1]
    assert kind == "none" or seen[1][1]


@pytest.mark.triton
def test_the_kernels_compile_for_a_hopper_gpu() -> None:
    """triton's interpreter runs Python, not the compiler: a kernel it runs may still fail to
    compile. This compiles each variant to an sm_90 cubin (no GPU needed)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # the fused layers' 10 variants and the grammar bitmask kernel's 2 (bf16 and float32 logits)
    assert done.stdout.count("compiled for sm_90") == 12


@pytest.mark.gpu
@pytest.mark.triton
def test_the_kernels_take_no_rows() -> None:
    """An empty forward launches nothing and returns empty tensors."""
    x = torch.zeros((0, 64), device=device())
    out, res = fused_kernels.rms_norm(x, torch.ones(64, device=device()), 1e-6, x, use_triton=True)
    assert out.shape == res.shape == (0, 64)
    cache = torch.zeros((4, 2, 16), device=device())
    slots = torch.zeros(0, dtype=torch.long, device=device())
    q = fused_kernels.rope_and_cache(
        torch.zeros((0, 128), device=device()),
        torch.zeros((0, 16), device=device()),
        torch.zeros((0, 16), device=device()),
        slots,
        cache,
        torch.zeros_like(cache),
        4,
        2,
        use_triton=True,
    )
    assert q.shape == (0, 4, 16)
    assert fused_kernels.silu_and_mul(
        torch.zeros((0, 64), device=device()), use_triton=True
    ).shape == (
        0,
        32,
    )
