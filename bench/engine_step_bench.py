"""The scheduler's CPU time a step on the served path: ``Engine`` driving a launched worker, 64
requests running with more waiting, the mixed workload (JSON, regex and choice grammars among
them), overlap scheduling. The worker serves a 2-layer random model (``--load-format dummy``) with
SmolLM2's tokenizer, so its steps are short and the scheduler does a real model's bookkeeping
(detokenization, grammar rows, drafts) on the CPU. Reports the engine process's CPU ms a step.

    python bench/engine_step_bench.py [--drafter none|ngram|draft_model] [--zero-width] [--no-guard]
        [--full-width] [--sync] [--k K] [--root DIR]

``--k``: each request's drafts; 0 with ``--drafter none`` (as ``serve_bench.py`` serves it: no
grammar-forced drafts either), else 4. Figures before 2026-12-07 ran ``none`` at 4 (``--k 4``).

``--zero-width`` pins the tuner's proposals at zero (as it keeps a losing drafter): what a
drafter held at zero width costs the scheduler against ``--drafter none``. ``--full-width`` runs
without the tuner (every step drafts at the worker's width; ``draft_model`` drafts with the
same dummy as the target, so the two agree), ``--sync`` without overlap scheduling,
``--no-guard`` without the speculation guard (``scheduler_client/spec_guard.py``). The line
ends with the drafts verified and accepted, the output tokens a second (every request runs to
``--max-tokens``), and what the guard did.

``--root`` runs another checkout's code (scheduler and worker alike: a git worktree of an older
commit), so two trees are compared in one run on one machine. Its figures are this process's CPU,
not a served row's: the HTTP door, the client and the GPU are not in them. "committing outputs"
is the wall time in ``Scheduler.update`` a step (the early deferred rows it sends included):
work begun off the GIL there shortens it and not the CPU figure.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tiny_model_dir(directory: Path) -> Path:
    """bench/configs/llama-tiny with SmolLM2's vocabulary, tokenizer and chat template."""
    from worker.model_loader import resolve_model_dir

    _, smol = resolve_model_dir("embedded:smollm2")
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smol) / name).is_file():
            shutil.copy(Path(smol) / name, directory / name)
    config = json.loads((HERE / "configs" / "llama-tiny" / "config.json").read_text())
    smol_config = json.loads((Path(smol) / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        config[key] = smol_config[key]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(HERE.parent))
    ap.add_argument("--drafter", default="none", choices=("none", "ngram", "draft_model"))
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--zero-width", action="store_true", help="the tuner proposes no drafts")
    ap.add_argument("--k", type=int, default=None, help="drafts a request (0 with --drafter none)")
    ap.add_argument("--sync", action="store_true", help="no overlap scheduling")
    ap.add_argument("--no-guard", action="store_true", help="no speculation guard (spec_guard.py)")
    ap.add_argument(
        "--full-width", action="store_true", help="no tuner: every step drafts at full width"
    )
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="profile the run (cProfile) and print its N dearest functions, own time a step",
    )
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    sys.path.insert(0, root)
    os.chdir(root)  # the worker starts as ``python -m worker.daemon`` from here
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    from scheduler_client import Engine, EngineConfig
    from scheduler_client.bench_serve import load_workload
    from scheduler_client.scheduler import SchedulerConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model_dir(Path(tmp) / "m"))
        config = EngineConfig(
            model=model,
            device="cpu",
            drafter=a.drafter,
            num_speculative_tokens=(0 if a.drafter == "none" else 4) if a.k is None else a.k,
            # the same dummy as its own draft: the two agree on every token (dummy_weights)
            draft_model=model if a.drafter == "draft_model" else None,
            max_model_len=1024,
            worker_args=("--load-format", "dummy", "--max-num-seqs", "64"),
            scheduler=SchedulerConfig(
                max_num_seqs=64,
                async_scheduling=not a.sync,
                adaptive_speculation=not a.full_width,
                **({"speculation_guard": False} if a.no_guard else {}),
            ),
        )
        workload = load_workload(str(HERE / "workloads" / "mixed.jsonl"), a.requests)
        with Engine(config) as engine:
            if a.zero_width and engine.scheduler.tuner is not None:
                engine.scheduler.tuner.propose = lambda *_: 0  # type: ignore[method-assign]
            engine.generate([dict(w, max_tokens=8, ignore_eos=True) for w in workload[:8]])
            for w in workload:
                engine.add_request(**dict(w, max_tokens=a.max_tokens, ignore_eos=True))
            # the wall time of committing outputs (``Scheduler.update``, the early deferred rows
            # it sends among them): what the engine thread spends on an output, waits included
            commit_s = [0.0]
            update = engine.scheduler.update

            def timed_update(*args: object, **kwargs: object) -> object:
                t = time.perf_counter()
                try:
                    return update(*args, **kwargs)  # type: ignore[arg-type]
                finally:
                    commit_s[0] += time.perf_counter() - t

            engine.scheduler.update = timed_update  # type: ignore[assignment,method-assign]
            steps0, cpu0, t0 = engine.scheduler.step_id, time.process_time(), time.perf_counter()
            prof = cProfile.Profile() if a.cprofile else None
            if prof is not None:
                prof.enable()
            engine.run_until_done()
            if prof is not None:
                prof.disable()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            steps = engine.scheduler.step_id - steps0
            m = engine.scheduler.metrics
            guard = getattr(engine.scheduler, "guard", None)  # (a --root tree may lack it)
            tokens = len(workload) * a.max_tokens  # ignore_eos: every request runs to the end
    name = (
        a.drafter
        + f" k={config.num_speculative_tokens}"
        + (" at zero width" if a.zero_width else "")
    )
    name += (" at full width" if a.full_width else "") + (", sync" if a.sync else "")
    name += ", no guard" if a.no_guard else ""
    print(
        f"{name}: {steps} steps, scheduler CPU {cpu / steps * 1e3:.2f} ms a step "
        f"(wall {wall / steps * 1e3:.2f} ms a step; committing outputs {commit_s[0] / steps * 1e3:.2f} "
        f"ms a step, wall); drafts {m.num_draft_tokens}, accepted "
        f"{m.num_accepted}; {tokens / wall:.0f} output tok/s"
        + (
            f"; guard: {guard.num_switches} switches, drafting preferred by batch bucket "
            f"{ {k: b.prefer for k, b in sorted(guard.buckets.items())} }"
            if guard
            else ""
        )
    )
    if prof is not None:
        print_profile(prof, steps, a.cprofile, root)


def print_profile(prof: cProfile.Profile, steps: int, top: int, root: str) -> None:
    """cProfile's ``top`` dearest functions by own time, in microseconds a step (its overhead
    inflates every figure alike), files under ``root`` named from there."""
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    for (file, line, func), (_, calls, own, _cum, _) in rows[:top]:
        where = f"{os.path.relpath(file, root) if file.startswith(root) else file}:{line}"
        print(f"{own / steps * 1e6:9.1f} us {calls / steps:7.2f} calls  {func} ({where})")


if __name__ == "__main__":
    main()
