"""A mixed step against a pure decode step of the same batch, per attention backend.

    python bench/mixed_step.py --model embedded:smollm2 --device cuda --dtype bfloat16 \
        --batches 1 64 --context 256 --chunk 256 --json-out mixed.json

For each backend (``sdpa``: the padded SDPA over gathered keys; ``triton``: worker/paged_kernel.py
reading the block table) and each batch B, one ``ModelExecutor`` (``--batch-invariant pad``, CUDA
graphs for decode-shaped steps, as the worker runs it) holds B requests of ``--context`` tokens.
Timed, each the median of ``--reps`` forwards with the device synchronised around each:

- decode: the B requests run one token each (the decode graph's path);
- mixed: the same B decodes plus one new request's prefill chunk of ``--chunk`` tokens in the
  same forward (what a step carries when a request arrives under load);
- prefill: that chunk alone.

Issue #14 asks for mixed <= 1.5 x decode at the served batch. ``--chunks`` takes several chunk
sizes (an arrival's prompt in the served workload is 40-92 tokens). ``--profile`` adds, per batch,
the device time of the decode and the mixed step by kernel kind (GEMMs, the attention kernel, the
rest), from torch.profiler over the graphs' replays, and the kernels that cost most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from worker.model_executor import ModelExecutor
from worker.model_loader import load_model


def timed(fn: Any, reps: int, device: torch.device) -> float:
    """Median ms of ``fn()`` over ``reps`` runs after 3 warm-ups."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def kind(name: str) -> str:
    n = name.lower()
    if "paged_attention" in n:
        return "attention"
    if any(t in n for t in ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "splitk", "cublas")):
        return "gemm"
    return "other"


def kernel_profile(fn: Any, reps: int, top: int) -> dict[str, Any]:
    """Device ms per call of ``fn`` by kernel kind, and the ``top`` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        k = kind(e.name)
        kinds[k] = kinds.get(k, 0.0) + us
        t, c = kernels.get(e.name, (0.0, 0))
        kernels[e.name] = (t + us, c + 1)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "device_ms": round(sum(kinds.values()) / reps / 1000, 3),
        "by_kind_ms": {k: round(v / reps / 1000, 3) for k, v in sorted(kinds.items())},
        "top": [
            {"kernel": n[:90], "ms": round(t / reps / 1000, 3), "calls": c // reps}
            for n, (t, c) in ranked
        ],
    }


def measure(
    model: Any,
    backend: str,
    batch: int,
    context: int,
    chunks: list[int],
    reps: int,
    profile_top: int = 0,
) -> list[dict[str, Any]]:
    os.environ["SPECD_ATTENTION_BACKEND"] = backend
    device = next(model.parameters()).device
    ex = ModelExecutor(
        model,
        max_num_seqs=batch + 1,
        max_model_len=context + max(chunks) + 64,
        batch_invariant="pad" if device.type == "cuda" else "off",
        decode_width=1,
        cuda_graphs=device.type == "cuda",
    )
    vocab = ex.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=gen).to(device)

    def pos(starts: list[int], counts: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)]).to(
            device
        )

    slots = list(range(batch))
    # the batch's contexts, prefilled once (eager)
    ex.forward(
        ids(batch * context),
        pos([0] * batch, [context] * batch),
        slots,
        [0] * batch,
        [context] * batch,
        torch.arange(batch, device=device) * context + context - 1,
    )
    d_ids, d_pos = ids(batch), pos([context] * batch, [1] * batch)
    last = torch.arange(batch, device=device)

    def decode() -> None:
        ex.forward(d_ids, d_pos, slots, [context] * batch, [1] * batch, last)

    decode_ms = round(timed(decode, reps, device), 3)
    rows = []
    for chunk in chunks:
        m_slots = [*slots, batch]
        m_starts, m_counts = [context] * batch + [0], [1] * batch + [chunk]
        m_ids, m_pos = ids(batch + chunk), pos(m_starts, m_counts)
        m_last = torch.cat([last, torch.tensor([batch + chunk - 1], device=device)])

        def mixed() -> None:
            ex.forward(m_ids, m_pos, m_slots, m_starts, m_counts, m_last)  # noqa: B023

        p_ids, p_pos = ids(chunk), pos([0], [chunk])
        p_last = torch.tensor([chunk - 1], device=device)

        def prefill() -> None:
            ex.forward(p_ids, p_pos, [batch], [0], [chunk], p_last)  # noqa: B023

        row: dict[str, Any] = {
            "backend": backend,
            "kernel": ex.kernel,
            "batch": batch,
            "context": context,
            "chunk": chunk,
            "decode_ms": decode_ms,
            "mixed_ms": round(timed(mixed, reps, device), 3),
            "prefill_ms": round(timed(prefill, reps, device), 3),
        }
        row["mixed_over_decode"] = round(row["mixed_ms"] / row["decode_ms"], 2)
        if profile_top and device.type == "cuda":
            if chunk == chunks[0]:
                row["decode_profile"] = kernel_profile(decode, reps, profile_top)
            row["mixed_profile"] = kernel_profile(mixed, reps, profile_top)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--backends", nargs="+", default=["sdpa", "triton"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--chunks", nargs="+", type=int, default=[256])
    ap.add_argument("--profile", type=int, default=0, help="kernel breakdown, top N kernels")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype) if a.dtype else None
    model = load_model(a.model, device=device, dtype=dtype, load_format=a.load_format).model
    rows = []
    for backend in a.backends:
        for b in a.batches:
            for row in measure(model, backend, b, a.context, a.chunks, a.reps, a.profile):
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("| backend | batch | chunk | decode ms | mixed ms | mixed / decode | prefill ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['batch']} | {r['chunk']} | {r['decode_ms']} | {r['mixed_ms']} "
            f"| {r['mixed_over_decode']} | {r['prefill_ms']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
