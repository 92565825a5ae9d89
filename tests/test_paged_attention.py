"""The batched paged attention (``worker/attention.py``) against a naive per-request reference at
random layouts: prefill chunks, decodes with drafts and mixed steps, histories that start and end
on and off block boundaries, blocks scattered over the cache; the padded decode layout's builder
against the any-layout builder; and batch invariance (a request's output bit for bit the same
alone and among others). Each runs with the padded SDPA (any machine) and with the Triton kernel
(``worker/paged_kernel.py``: on CUDA, or on CPU in triton's interpreter where triton is
installed, as ``make setup`` does; conftest.py chooses the interpreter)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.attention import build_dense_metadata, build_metadata, specd_attention
from worker.decode_graphs import DecodeGraphs
from worker.kv_cache import KVCache

HEADS, KV_HEADS, D = 4, 2, 16
MAX_LEN = 96

# the Triton kernel's runs: marked gpu (the GPU suite runs them) and triton (conftest.py lets them
# run on CPU, interpreted, where triton is installed)
KERNELS = [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.triton], id="triton")]


def device_for(kernel: bool) -> torch.device:
    return torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")


class Layer(torch.nn.Module):
    layer_idx = 0


def cache(block_size: int, num_seqs: int = 6, kernel: bool = False) -> KVCache:
    return KVCache(
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=D,
        max_num_seqs=num_seqs,
        max_model_len=MAX_LEN,
        dtype=torch.float32,
        device=device_for(kernel),
        block_size=block_size,
    )


def reference(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, start: int
) -> torch.Tensor:
    """One request, no cache: q [n, heads, D] at positions start.., keys [start + n, kv_heads, D]
    -> [n, heads, D], causal."""
    n = q.shape[0]
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_all.transpose(0, 1)[None],
        v_all.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def run_step(
    kv: KVCache,
    slots: list[int],
    starts: list[int],
    counts: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_padding: int = 0,
    query_pad: int = 0,
    kernel: bool = False,
) -> torch.Tensor:
    """q [T, heads, D], k, v [T, kv_heads, D] (T includes the padding) -> [T, heads, D]."""
    kv.allocate(slots, [s + n for s, n in zip(starts, counts, strict=True)])
    dev = kv.keys[0].device
    meta = build_metadata(
        kv, slots, starts, counts, dev, num_padding=num_padding, query_pad=query_pad, kernel=kernel
    )
    out, _ = specd_attention(
        Layer(),
        q.transpose(0, 1)[None].to(dev),
        k.transpose(0, 1)[None].to(dev),
        v.transpose(0, 1)[None].to(dev),
        None,
        specd_meta=meta,
    )
    return out[0].cpu()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_paged_attention_matches_a_per_request_reference(
    block_size: int, kernel: bool
) -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv = cache(block_size, kernel=kernel)
    num = 5
    history = {s: (torch.zeros(0, KV_HEADS, D), torch.zeros(0, KV_HEADS, D)) for s in range(num)}
    for _step in range(6):
        slots = rng.sample(range(num), rng.randint(1, num))
        starts, counts = [], []
        for s in slots:
            start = len(history[s][0])
            kind = rng.choice(["prefill", "decode", "drafts"])
            n = {"prefill": rng.randint(1, 20), "decode": 1, "drafts": rng.randint(2, 6)}[kind]
            n = min(n, MAX_LEN - start)
            if n < 1:
                continue
            starts.append(start)
            counts.append(n)
        slots = slots[: len(counts)]
        if not slots:
            continue
        pad = rng.choice([0, 3])
        total = sum(counts) + pad
        q = torch.randn(total, HEADS, D)
        k = torch.randn(total, KV_HEADS, D)
        v = torch.randn(total, KV_HEADS, D)
        out = run_step(kv, slots, starts, counts, q, k, v, num_padding=pad, kernel=kernel)
        off = 0
        for s, start, n in zip(slots, starts, counts, strict=True):
            hk = torch.cat([history[s][0], k[off : off + n]])
            hv = torch.cat([history[s][1], v[off : off + n]])
            want = reference(q[off : off + n], hk, hv, start)
            torch.testing.assert_close(out[off : off + n], want, rtol=1e-5, atol=1e-5)
            # rejected drafts roll back by length: keep a random prefix of the new positions
            keep = n if rng.random() < 0.5 else rng.randint(0, n)
            history[s] = (hk[: start + keep], hv[: start + keep])
            kv.trim(s, start + keep)
            off += n
        assert torch.equal(out[off:], torch.zeros(pad, HEADS, D)), "padding tokens come out zero"
        if rng.random() < 0.3:  # a request finishes; its slot starts over
            s = rng.randrange(num)
            kv.free(s)
            history[s] = (torch.zeros(0, KV_HEADS, D), torch.zeros(0, KV_HEADS, D))
    held = sum(int(kv.blocks.num_held[s]) for s in range(num))
    assert held + kv.blocks.num_free == kv.num_blocks


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_requests_output_does_not_depend_on_its_batch(kernel: bool) -> None:
    """With query padding (``--batch-invariant pad``), or with the Triton kernel's fixed tiles, a
    request's rows are bit for bit the same alone, beside a long prefill chunk, and beside
    decodes with drafts."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    outs = []
    for neighbours in ([], [(30, 40)], [(10, 1), (50, 5)]):
        kv = cache(16, kernel=kernel)
        dev = kv.keys[0].device
        hist = torch.randn(37, KV_HEADS, D, generator=torch.Generator().manual_seed(1)).to(dev)
        # the request of interest, slot 2: 37 tokens of history, then 4 tokens (1 + 3 drafts)
        kv.allocate([2], [37])
        rows = kv.blocks.cache_rows(torch.full((37,), 2).numpy(), torch.arange(37).numpy())
        kv.write(0, torch.from_numpy(rows).to(dev), hist, hist)
        slots, starts, counts = [2], [37], [4]
        for j, (start, n) in enumerate(neighbours):
            slots.append(3 + j)
            starts.append(start)
            counts.append(n)
            kv.allocate([3 + j], [start])
        g = torch.Generator().manual_seed(2)
        q0 = torch.randn(4, HEADS, D, generator=g)
        k0 = torch.randn(4, KV_HEADS, D, generator=g)
        rest = sum(counts[1:])
        q = torch.cat([q0, torch.randn(rest, HEADS, D)])
        k = torch.cat([k0, torch.randn(rest, KV_HEADS, D)])
        outs.append(
            run_step(kv, slots, starts, counts, q, k, k.clone(), query_pad=16, kernel=kernel)[:4]
        )
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_padded_decode_layout_matches_the_any_layout_builder(kernel: bool) -> None:
    """``build_dense_metadata`` (device tensors, CUDA-graph safe) and ``build_metadata`` give the
    same outputs for a decode step of 3 requests of width 3, padded to a batch bucket of 4."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    outs = []
    for dense in (False, True):
        kv = cache(4, kernel=kernel)
        dev = kv.keys[0].device
        torch.manual_seed(seed)
        slots, starts, w = [0, 3, 5], [9, 16, 2], 3
        for s, st in zip(slots, starts, strict=True):
            kv.allocate([s], [st])
            h = torch.randn(st, KV_HEADS, D).to(dev)
            rows = kv.blocks.cache_rows(torch.full((st,), s).numpy(), torch.arange(st).numpy())
            kv.write(0, torch.from_numpy(rows).to(dev), h, h)
        q = torch.randn(4 * w, HEADS, D)
        k = torch.randn(4 * w, KV_HEADS, D)
        if not dense:
            args = (q[: 3 * w], k[: 3 * w], k[: 3 * w])
            outs.append(run_step(kv, slots, starts, [w] * 3, *args, kernel=kernel))
            continue
        kv.allocate(slots, [s + w for s in starts])
        pos = torch.tensor([s + j for s in [*starts, 0] for j in range(w)])
        slot_np = torch.tensor([*slots, kv.scratch_slot]).repeat_interleave(w).numpy()
        rows = torch.from_numpy(kv.blocks.cache_rows(slot_np, pos.numpy()))
        meta = build_dense_metadata(
            kv,
            pos.to(dev),
            rows.to(dev),
            torch.tensor([*slots, kv.scratch_slot]).to(dev),
            num_reqs=4,
            width=w,
            max_len=32,
            query_rows=0,
            fp32=False,
            kernel=kernel,
        )
        out, _ = specd_attention(
            Layer(),
            q.transpose(0, 1)[None].to(dev),
            k.transpose(0, 1)[None].to(dev),
            k.transpose(0, 1)[None].to(dev),
            None,
            specd_meta=meta,
        )
        outs.append(out[0, : 3 * w].cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_decode_graphs_without_length_buckets_have_one_length() -> None:
    """With the paged kernel (``length_buckets`` False) every context takes ``max_model_len``."""
    cache = KVCache(
        num_layers=1, num_kv_heads=1, head_dim=16, max_num_seqs=4, max_model_len=2048,
        dtype=torch.float32, device=torch.device("cpu"), block_size=16,
    )  # fmt: skip
    kw = {"width": 2, "device": torch.device("cpu"), "use_graphs": False}
    bucketed = DecodeGraphs(lambda *a: (torch.zeros(0), torch.zeros(0)), cache, **kw)
    flat = DecodeGraphs(
        lambda *a: (torch.zeros(0), torch.zeros(0)), cache, length_buckets=False, **kw
    )
    assert [bucketed._buckets(3, [s])[1] for s in (5, 300, 1500)] == [256, 512, 2048]
    assert [flat._buckets(3, [s])[1] for s in (5, 300, 1500)] == [2048] * 3
    assert flat._buckets(3, [5])[0] == bucketed._buckets(3, [5])[0] == 4
