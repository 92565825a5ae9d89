"""Where a decode step's time goes: torch.profiler over batch-1 steps of a random-weight target
(SmolLM2's shape by default, no model file needed), without drafts and with oracle drafts.

    python bench/step_profile.py --size smollm2 --compile --steps 40

Prints, per configuration, the mean step time, the graph replay alone, and the host-side calls
that cost most (self CPU time per step: Python-issued kernels, copies, synchronisations).

    python bench/step_profile.py --size smollm2-narrow --prefill-check

times a 40-token prefill forward with the plain layers and with the compiled ones put in place
(what the first compiled variant did; prefill now runs the plain layers), then exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.synthetic_bench import OracleDrafter, random_target, size_names
from tests.driver import Req, run
from worker.drafters.base import NoDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner


def phase_timers(runner: ModelRunner) -> dict[str, float]:
    """Host wall time per phase of ``execute`` (no device syncs added: ``accept`` holds the
    designed wait for the GPU), and the whole step including the in-process scheduler."""
    import worker.runner as runner_module

    spent: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    for name in ("execute", "update_requests", "accept", "commit", "propose_drafts", "output"):
        setattr(runner, name, timed(name, getattr(runner, name)))
    runner.target.forward = timed("forward (launch)", runner.target.forward)  # type: ignore[method-assign]
    runner_module.build_step_batch = timed("build_step_batch", runner_module.build_step_batch)
    return spent


def prefill_check(model: Any, device: torch.device) -> None:
    ex = ModelExecutor(model, max_num_seqs=2, max_model_len=512, compile_layers=True)
    assert ex.compiled is not None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def prefill(n: int) -> None:
        ids = torch.randint(0, 32000, (n,), device=device)
        pos = torch.arange(n, device=device)
        ex.forward(ids, pos, [0], [0], [n], torch.tensor([n - 1], device=device))

    out = {}
    for name in ("plain", "compiled"):
        ctx = ex.compiled.active() if name == "compiled" else contextlib.nullcontext()
        with ctx:
            for n in (40, 41, 57, 40):  # compile, then the dynamic-shape recompile
                prefill(n)
            sync()
            t0 = time.perf_counter()
            for i in range(20):
                prefill(40 + i % 3)
            sync()
        out[name] = round((time.perf_counter() - t0) / 20 * 1e3, 2)
    print("prefill forward ms:", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="smollm2", choices=size_names())
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--prefill-check", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = random_target(a.size, device)
    if a.prefill_check:
        prefill_check(model, device)
        return
    prompt = np.random.default_rng(1).integers(0, 32000, 64).tolist()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    truth: dict[str, tuple[int, list[int]]] = {}
    truth["h"] = (0, [])
    for k in (0, a.k):
        runner = ModelRunner(
            ModelExecutor(
                model,
                max_num_seqs=1,
                max_model_len=1024,
                batch_invariant="pad",
                decode_width=1 + k,
                compile_layers=a.compile,
            ),
            OracleDrafter(truth, 0.7, k, 32000) if k else NoDrafter(),
            max_num_seqs=1,
            max_model_len=1024,
            max_num_draft_tokens=max(k, 1),
        )
        runner.target.decode.capture_all(64 + 4 * a.steps)
        n = 4 * a.steps
        got = run(runner, [Req("w", prompt, n, k=k)], 100_000)
        if not k:
            truth.update({rid: (len(prompt), got["w"]) for rid in ("w", "t", "p", "h")})
        sync()
        s0, t0 = runner.num_steps, time.perf_counter()
        run(runner, [Req("t", prompt, n, k=k)], 100_000)
        sync()
        step_ms = (time.perf_counter() - t0) / (runner.num_steps - s0) * 1e3
        shape = next(
            (s for (b, w, _), s in sorted(runner.target.decode._shapes.items()) if w == 1 + k),
            None,
        )
        replay_ms = float("nan")
        if shape is not None and shape.graph is not None:
            sync()
            t0 = time.perf_counter()
            for _ in range(100):
                shape.graph.replay()
            sync()
            replay_ms = (time.perf_counter() - t0) / 100 * 1e3
        import worker.runner as runner_module

        original = runner_module.build_step_batch
        spent = phase_timers(runner)
        s0, t0 = runner.num_steps, time.perf_counter()
        run(runner, [Req("h", prompt, n, k=k)], 100_000)
        sync()
        wall = time.perf_counter() - t0
        runner_module.build_step_batch = original
        steps = runner.num_steps - s0
        phases = {name: round(v / steps * 1e3, 3) for name, v in spent.items()}
        phases["scheduler (driver)"] = round((wall - spent["execute"]) / steps * 1e3, 3)
        print(f"host ms per step, k={k}: {phases}")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        s0 = runner.num_steps
        with profile(activities=acts) as prof:
            run(runner, [Req("p", prompt, n, k=k)], 100_000)
            sync()
        steps = runner.num_steps - s0
        print(
            f"== k={k} compiled={a.compile}: step {step_ms:.3f} ms, replay of width {1 + k} "
            f"{replay_ms:.3f} ms, {steps} profiled steps"
        )
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows)
        print(table, flush=True)


if __name__ == "__main__":
    main()
