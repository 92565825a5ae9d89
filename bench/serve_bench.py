"""The served path at the worker's speed: ``specd-scheduler`` over HTTP against the in-process runner.

    python bench/serve_bench.py --model embedded:smollm2 --device cuda --dtype bfloat16 \
        --concurrencies 1 8 32 64 --rate 8 --num-requests 128 --max-tokens 128 \
        --drafters none ngram eagle --modes sync overlap --json-out serve.json

For each drafter (none, ngram, eagle with ``--eagle-head``, ``embedded`` for the embedded SmolLM2)
and each mode (sync, overlap = ``--async-scheduling``, pipelined = overlap and the worker's
``--pipeline-steps``, chained = pipelined and the worker's ``--chain-drafts``, default = neither
flag given: what the worker's handshake makes of it) a worker is launched with ``--max-num-seqs``
the largest concurrency, and a ``specd-scheduler`` is connected to it (its caps come from the
worker's handshake). The mixed workload (bench/workloads/mixed.jsonl: JSON, regex and choice
constrained; bench/prompts.py: edit tasks and open chat, ``--max-tokens`` each, EOS ignored) is sent
as streamed chat completions, closed loop at each concurrency (a new request as one finishes) and
open loop at ``--rate`` requests/s (Poisson). Rows: output tok/s, steady tok/s (the tokens made
from the first request sent to the last one sent: a closed loop without the drain after its last
request), TTFT and TPOT p50/p99, and acceptance from the scheduler's /metrics. A drafter named
twice in ``--drafters`` (``none ngram none``) runs twice: rows before and after the others show
how far the host drifted. Then the in-process runner (bench/lossless_bench.py's
functions, no scheduler, no sockets) decodes the same unconstrained prompts, ``c`` at once for
each concurrency ``c``: the ceiling the served rows are measured against. Last, transformers' own
static-cache decode step replayed from a CUDA graph (bench/hf_graph.py) at batch 1 and at the
largest concurrency: the plain-HF loop the no-drafts rows must beat.
``--load-format dummy`` serves seeded random weights for a config.json folder
(bench/configs/llama-1b, llama-8b, smollm2-135m); there the EAGLE rows run only where the head was
trained for the config's shape (``--eagle-head embedded`` on bench/configs/smollm2-135m: SmolLM2's
shape and vocabulary, random weights), and measure what the head costs, not what it gains: it
drafts for a target it was not trained on, and its acceptance is not the trained pair's.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.prompts import PROMPTS
from bench.serve_load import (
    chat_body,
    closed_loop,
    cpu_seconds,
    poisson,
    scrape,
    scrape_guard,
    scrape_tuner,
    step_stats,
    summarize,
)
from scheduler_client.bench_serve import load_workload
from tests.daemons import wait_ready

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "mixed.jsonl"


def head_fits(a: argparse.Namespace) -> bool:
    """The EAGLE head can run on ``--model``: its own weights, or random weights of the shape and
    vocabulary the head was trained for (``--load-format dummy``: what it costs, not what it gains)."""
    if a.load_format != "dummy":
        return True
    from worker.eagle_head import CONFIG_FILE, resolve_head_dir

    head = json.loads((resolve_head_dir(a.eagle_head) / CONFIG_FILE).read_text())
    model = json.loads((Path(a.model) / "config.json").read_text())
    return (head.get("eagle_target_hidden_size"), head.get("eagle_target_vocab_size")) == (
        model.get("hidden_size"),
        model.get("vocab_size"),
    )


def workload(num: int, max_tokens: int, kind: str = "mixed") -> list[dict[str, Any]]:
    """mixed.jsonl plus one chat per bench prompt, cycled to ``num`` requests; ``kind`` "free":
    the chats alone (the run's in-process rows then decode the same prompts)."""
    mixed = load_workload(str(WORKLOAD)) if kind == "mixed" else []
    chats = [
        {"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens}
        for p in PROMPTS.values()
    ]
    base = mixed + chats
    return (base * (num // len(base) + 1))[:num]


def wait_health(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specd-scheduler exited {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.5)
    raise RuntimeError(f"specd-scheduler not ready within {timeout_s:.0f} s")


def profile(a: argparse.Namespace, pid: int, name: str) -> subprocess.Popen[bytes] | None:
    """--profile-scheduler S: py-spy samples the scheduler's (or the worker's) threads for S
    seconds from the start of the phase (raw stacks into --log-dir, for a flame graph or a count by frame)."""
    if not a.profile_scheduler or not a.log_dir:
        return None
    dirs = [Path(sys.executable).parent] + [Path(d) / "bin" for d in sys.path]  # venv, --target
    spy = shutil.which("py-spy") or next(
        (str(d / "py-spy") for d in dirs if (d / "py-spy").exists()), None
    )
    if spy is None:
        return None
    out = Path(a.log_dir) / f"pyspy-{name.replace('=', '')}.txt"  # c=64 -> c64
    cmd = [spy, "record", "-p", str(pid), "-d", str(a.profile_scheduler), "-r", "250"]
    cmd += ["--format", "raw", "--threads", "--nonblocking", "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def kernel_profile(a: argparse.Namespace, pid: int, name: str) -> threading.Thread | None:
    """--profile-scheduler S: the worker's kernels over S seconds from the phase's start
    (worker.step_profiler; SIGUSR1 starts and stops it), kept as LOG_DIR/kernels-NAME.txt."""
    if not a.profile_scheduler or not a.log_dir:
        return None
    out = Path(a.log_dir) / f"kernels-{name.replace('=', '')}.txt"

    def run() -> None:
        before = set(Path(a.log_dir).glob("worker-profile-*.txt"))
        os.kill(pid, signal.SIGUSR1)
        time.sleep(a.profile_scheduler)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            new = set(Path(a.log_dir).glob("worker-profile-*.txt")) - before
            if new:
                time.sleep(0.5)  # written in one go, but let it finish
                new.pop().rename(out)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def client_procs(a: argparse.Namespace, c: int) -> int:
    """--client-procs, or by default one client process per 16 streams (at most 8)."""
    return a.client_procs or max(1, min(8, c // 16))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_process(sched_pid: int) -> int:
    """The scheduler's HTTP process (``--api-server-count 1``), or 0."""
    kids = subprocess.run(["pgrep", "-P", str(sched_pid)], capture_output=True, text=True)
    for pid in kids.stdout.split():
        with contextlib.suppress(FileNotFoundError):
            if b"http.api_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    return 0


def worker_cmd(
    a: argparse.Namespace, drafter: str, mode: str, addr: str, metrics_port: int
) -> list[str]:
    cmd = [sys.executable, "-m", "worker.daemon", "--model", a.model, "--listen", addr]
    # each mode but "default" pins both flags: left unset, a CUDA worker pipelines and its
    # scheduler overlaps with three steps in flight (a CPU worker: neither, and sync)
    if mode != "default":
        piped = mode in ("pipelined", "chained")
        cmd += ["--pipeline-steps" if piped else "--no-pipeline-steps"]
    if mode == "chained":
        cmd += ["--chain-drafts"]
    cmd += ["--metrics-port", str(metrics_port)]
    cmd += ["--load-format", a.load_format, "--drafter", drafter, "--log-level", "WARNING"]
    cmd += ["--max-num-seqs", str(max(a.concurrencies)), "--max-model-len", str(a.max_model_len)]
    cmd += ["--num-speculative-tokens", str(0 if drafter == "none" else a.k)]
    if drafter == "eagle":
        cmd += ["--eagle-head", a.eagle_head]
    if drafter == "draft_model":
        cmd += ["--draft-model", a.draft_model]
    if a.compile:
        cmd += ["--enable-torch-compile"]
    if a.device:
        cmd += ["--device", a.device]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    return cmd


_TRACED: set[Path] = set()  # step traces begun in this run


def served(
    a: argparse.Namespace, drafter: str, mode: str, bodies: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One worker and one scheduler; a row per concurrency and one for the Poisson rate."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="specd-serve-") as tmp:
        addr = f"ipc://{tmp}/worker.sock"
        log = open(os.path.join(a.log_dir or tmp, f"serve-{drafter}-{mode}.log"), "ab")  # noqa: SIM115
        sched_log = Path(a.log_dir or tmp) / f"serve-{drafter}-{mode}-scheduler.log"
        wport = free_port()  # the worker's /metrics: its step times beside the scheduler's
        env = dict(os.environ)
        if a.profile_scheduler and a.log_dir:  # SIGUSR1 brackets a torch profile of its steps
            env["SPECD_PROFILE_DIR"] = str(Path(a.log_dir).resolve())
        worker = subprocess.Popen(worker_cmd(a, drafter, mode, addr, wport), stderr=log, env=env)
        # --port 0: the scheduler binds a free port and names it in its "ready" line
        sched_cmd = [sys.executable, "-m", "scheduler_client.daemon", "--worker", addr]
        sched_cmd += ["--port", "0"]
        if mode != "default":
            overlap = mode in ("overlap", "pipelined", "chained")
            sched_cmd += ["--async-scheduling" if overlap else "--no-async-scheduling"]
        sched_cmd += shlex.split(a.scheduler_args)
        if a.log_dir:  # every step's sizes, widths and time (bench/step_trace.py reads it)
            trace = Path(a.log_dir) / f"trace-{drafter}-{mode}.jsonl"
            if trace not in _TRACED:  # a drafter named twice (--drafters none ngram none)
                trace.unlink(missing_ok=True)  # appends: step_trace.py splits rows by span
                _TRACED.add(trace)
            sched_cmd += ["--step-trace", str(trace)]
        # a new file: wait_ready reads the first "ready" line in it (an old run's would name
        # another port when --log-dir is reused)
        sched = subprocess.Popen(sched_cmd, stderr=open(sched_log, "wb"))  # noqa: SIM115
        try:
            port = wait_ready(sched, sched_log, 900.0)
            wait_health(port, sched)
            # warm-up: graph capture for every width, the allocator, the grammar caches
            top = max(a.concurrencies)
            closed_loop(port, bodies[:top], top, client_procs(a, top))
            phases: list[tuple[str, Any]] = [(f"c={c}", c) for c in a.concurrencies]
            phases += [(f"rate={a.rate}", None)] if a.rate else []
            runs: dict[str, int] = {}  # a concurrency named again: its profiles' file names
            for name, c in phases:
                runs[name] = runs.get(name, 0) + 1
                tag = name if runs[name] == 1 else f"{name}-pass{runs[name]}"
                spies = (
                    [
                        profile(a, sched.pid, f"{drafter}-{mode}-{tag}"),
                        profile(a, worker.pid, f"worker-{drafter}-{mode}-{tag}"),
                    ]
                    if c
                    else []
                )
                torch_profile = (
                    kernel_profile(a, worker.pid, f"{drafter}-{mode}-{tag}") if c else None
                )
                before, wbefore = scrape(port), scrape(wport, "specd_worker_")
                http = http_process(sched.pid)  # --api-server-count 1: the HTTP door's own
                cpu0 = cpu_seconds(sched.pid), cpu_seconds(worker.pid), http and cpu_seconds(http)
                # --requests-per-client: c clients send K requests each (at least 16 in all), so
                # a concurrency keeps arrivals coming without the low ones running for minutes
                some = (
                    bodies[: max(16, a.requests_per_client * c)]
                    if a.requests_per_client and c
                    else bodies
                )
                t0 = time.time()
                results, wall, client_cpu = (
                    closed_loop(port, some, c, client_procs(a, c))
                    if c
                    else poisson(port, bodies, a.rate, a.seed)
                )
                row = {"path": "served", "drafter": drafter, "mode": mode, "load": name}
                row["span"] = [round(t0, 3), round(time.time(), 3)]  # the step trace's lines
                after, wafter = scrape(port), scrape(wport, "specd_worker_")
                cpu = cpu_seconds(sched.pid) - cpu0[0], cpu_seconds(worker.pid) - cpu0[1]
                http_cpu = (http and cpu_seconds(http)) - cpu0[2]
                rows.append({**row, **summarize(results, wall, before, after)})
                # where a step's time goes: the worker executing it (busy: its share of the
                # wall), the scheduler's round trip (its own work and the sockets included), and
                # each process's CPU time a step (the scheduler's HTTP thread included)
                rows[-1]["worker"] = step_stats(wall, wbefore, wafter, "specd_worker_", cpu[1])
                rows[-1]["scheduler"] = step_stats(wall, before, after, "specd_scheduler_", cpu[0])
                steps = rows[-1]["worker"]["steps"]
                rows[-1]["client_cpu_ms"] = round(1000 * client_cpu / steps, 3) if steps else None
                if http:
                    rows[-1]["http_cpu_ms"] = round(1000 * http_cpu / steps, 3) if steps else None
                if drafter != "none":  # what the speculation tuner measured: "batch/width"
                    rows[-1]["tuner"] = scrape_tuner(port)
                    rows[-1]["guard"] = scrape_guard(port)
                print(json.dumps(rows[-1]), flush=True)
                for spy in spies:
                    if spy is not None:
                        spy.wait()
                if torch_profile is not None:
                    torch_profile.join()
        finally:
            for p in (sched, worker):
                p.terminate()
            for p in (sched, worker):
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)
            log.close()
    return rows


def in_process(a: argparse.Namespace, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runner without scheduler or sockets on the same unconstrained prompts, ``c`` at once."""
    import torch

    from bench.lossless_bench import decode, floors, make_drafter, make_runner
    from scheduler_client.tokenizer import TokenizerInfo
    from worker.model_loader import load_model

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype) if a.dtype else None
    loaded = load_model(a.model, device=device, dtype=dtype, load_format=a.load_format)
    draft = (
        load_model(a.draft_model, device=device, dtype=dtype, load_format=a.load_format).model
        if "draft_model" in a.drafters
        else None
    )
    tok = TokenizerInfo(loaded.tokenizer_directory)
    free = [w for w in bodies if not w.get("structured")]
    prompts = [tok.encode(tok.apply_chat_template(w["messages"])) for w in free]
    mode = "pad" if device.type == "cuda" else "off"  # the worker's default
    rows = []
    for drafter in a.drafters:
        if drafter == "eagle" and not head_fits(a):
            continue
        k = 0 if drafter == "none" else a.k
        for c in dict.fromkeys(a.concurrencies):  # (once each: passes repeat served rows)
            group = (prompts * (c // len(prompts) + 1))[:c]
            head = a.eagle_head if drafter == "eagle" else None
            graphs = device.type == "cuda"
            runner = make_runner(
                loaded.model, make_drafter(drafter, k, loaded.model, c, head, draft, mode, graphs),
                k, c, mode, graphs=graphs, compile_layers=a.compile,
            )  # fmt: skip
            out = decode(runner, group, a.max_tokens, k)
            seconds, steps, tokens = out["decode"]  # decode steps only, no prefill in them
            rows.append(
                {
                    "path": "in-process",
                    "drafter": drafter,
                    "mode": "-",
                    "load": f"c={c}",
                    "output_tok_s": round(out["tps"], 2),
                    # what a served TPOT compares with: ms per decode step, and per token sampled
                    # by one request in them (more than one a step with accepted drafts); the
                    # TPOT column shows the step without drafts (a token a step), else per token
                    "decode_step_ms": round(1000 * seconds / max(steps, 1), 3),
                    "decode_ms_per_token": round(1000 * seconds * c / max(tokens, 1), 3),
                    "tpot": {
                        "p50_ms": round(1000 * seconds / max(steps, 1), 3)
                        if k == 0
                        else round(1000 * seconds * c / max(tokens, 1), 3),
                        "p99_ms": "-",
                    },
                    "mean_acceptance_length": round(out["mean_len"], 3) if k else None,
                }
            )
            if c == 1 and k == 0:
                # the batch-1 step against the weight-read floor (on CUDA: weight bytes over HBM
                # bandwidth) and its own graph's replay: the 8B criterion's denominator
                rows[-1]["floors"] = {
                    key: round(v, 4)
                    for key, v in floors(loaded.model, runner, seconds / max(steps, 1)).items()
                }
            print(json.dumps(rows[-1]), flush=True)
            del runner
    return rows


def hf_graph(a: argparse.Namespace) -> list[dict[str, Any]]:
    """transformers' own static-cache decode step replayed from a CUDA graph (bench/hf_graph.py),
    at batch 1 and at the largest concurrency: the plain-HF ceiling the no-drafts rows must beat."""
    import torch

    from bench.hf_graph import check_against_generate, load_sdpa, measure

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype) if a.dtype else None
    model = load_sdpa(a.model, device, dtype, a.load_format)
    check_against_generate(model, 32, 16)
    rows = []
    for c in sorted({1, max(a.concurrencies)}):
        r = measure(model, c, 256, a.max_tokens)
        rows.append(
            {
                "path": "hf-graph",
                "drafter": "none",
                "mode": "-",
                "load": f"c={c}",
                "output_tok_s": round(c * 1000 / r["step_ms"], 2),
                "tpot": {"p50_ms": round(r["step_ms"], 3), "p99_ms": "-"},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    del model
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def ms(r: dict[str, Any], key: str, q: str) -> str:
        return str(r.get(key, {}).get(q, "-"))

    def st(r: dict[str, Any], key: str, q: str) -> str:
        v = (r.get(key) or {}).get(q)
        return "-" if v is None else str(v)

    lines = [
        "| path | drafter | mode | load | out tok/s | steady tok/s | TTFT p50 | TTFT p99 | TPOT p50 "
        "| TPOT p99 "
        "| acceptance | mean acc. len | errors | steps | wall ms/step | worker ms/step "
        "| worker busy | batch | sched. CPU ms/step | HTTP proc. CPU ms/step | client CPU ms/step |",
        "|---|---|---|---|" + "---:|" * 17,
    ]
    for r in rows:
        lines.append(
            f"| {r['path']} | {r['drafter']} | {r['mode']} | {r['load']} | {r['output_tok_s']} "
            f"| {r.get('steady_tok_s') or '-'} | {ms(r, 'ttft', 'p50_ms')} "
            f"| {ms(r, 'ttft', 'p99_ms')} | {ms(r, 'tpot', 'p50_ms')} "
            f"| {ms(r, 'tpot', 'p99_ms')} | {r.get('acceptance_rate', '-')} "
            f"| {r.get('mean_acceptance_length') or '-'} | {r.get('errors', '-')} "
            f"| {st(r, 'worker', 'steps')} | {st(r, 'worker', 'wall_ms')} "
            f"| {st(r, 'worker', 'step_ms')} | {st(r, 'worker', 'busy')} "
            f"| {st(r, 'worker', 'batch')} | {st(r, 'scheduler', 'cpu_ms')} "
            f"| {r.get('http_cpu_ms') or '-'} | {r.get('client_cpu_ms') or '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when present)")
    ap.add_argument(
        "--dtype", default=None, help="the worker's (default bf16 on CUDA, fp32 on CPU)"
    )
    ap.add_argument(
        "--concurrencies",
        nargs="+",
        type=int,
        default=[1, 8, 32, 64],
        help="closed-loop rows; one named again runs again in the same workers (a pass; the "
        "in-process rows run once each)",
    )
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson requests/s (0: no such row)")
    ap.add_argument("--num-requests", type=int, default=128, help="requests per load row")
    ap.add_argument("--max-tokens", type=int, default=128, help="for the unconstrained chats")
    ap.add_argument(
        "--workload",
        default="mixed",
        choices=("mixed", "free"),
        help="mixed: bench/workloads/mixed.jsonl (JSON, regex and choice requests, a code edit) "
        "among the chats; free: the chats alone, the prompts the in-process rows decode",
    )
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=0,
        help="closed loop at concurrency c: the first max(16, K * c) requests (0: all)",
    )
    ap.add_argument("--drafters", nargs="+", default=["none", "ngram", "eagle"])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "overlap"],
        choices=("sync", "overlap", "pipelined", "chained", "default"),
    )
    ap.add_argument("--eagle-head", default="embedded", help="with the eagle drafter")
    ap.add_argument(
        "--draft-model",
        default=None,
        help="with the draft_model drafter: its model (with --load-format dummy a config folder, "
        "e.g. bench/configs/llama-1b for the 8B target)",
    )
    ap.add_argument("--k", type=int, default=4, help="drafts per step")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="of the Poisson arrivals")
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["served", "in-process", "hf-graph"],
        choices=("served", "in-process", "hf-graph"),
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile'd decoder layers: the workers' --enable-torch-compile, and the same "
        "for the in-process runner (the hf-graph rows stay transformers' own layers)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="processes the closed-loop clients run on (0: one per 16 streams, at most 8)",
    )
    ap.add_argument("--scheduler-args", default="", help="more specd-scheduler flags, one string")
    ap.add_argument(
        "--profile-scheduler",
        type=int,
        default=0,
        metavar="S",
        help="py-spy the scheduler and the worker for S seconds at each concurrency (needs "
        "--log-dir)",
    )
    ap.add_argument("--log-dir", default=None, help="keep the worker/scheduler logs here")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    if "draft_model" in a.drafters and not a.draft_model:
        ap.error("--drafters draft_model needs --draft-model")
    bodies = workload(a.num_requests, a.max_tokens, a.workload)
    print(f"seed {a.seed}; {len(bodies)} requests a row", flush=True)
    rows: list[dict[str, Any]] = []
    for drafter in a.drafters if "served" in a.paths else []:
        if drafter == "eagle" and not head_fits(a):
            print("eagle skipped: the head was trained for another shape of target", flush=True)
            continue
        for mode in a.modes:
            rows += served(a, drafter, mode, [chat_body(w) for w in bodies])
    if "in-process" in a.paths:
        rows += in_process(a, bodies)
    if "hf-graph" in a.paths:
        rows += hf_graph(a)
    print(table(rows))
    for r in rows:
        if r.get("floors"):
            print(f"floors ({r['path']} {r['drafter']} {r['load']}): {json.dumps(r['floors'])}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
