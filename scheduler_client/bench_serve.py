"""``specd bench-serve``: replay a JSONL workload at a given request rate through a scheduler and a
worker, and report latency percentiles, throughput and acceptance metrics.

Requests arrive on a Poisson clock (``--rate`` requests/s; ``inf`` sends them all at once); the
engine steps continuously, so arrivals join running batches as they would in production.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from scheduler_client.engine import Engine
from scheduler_client.request import Request


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)

    return {
        "p50_ms": pick(0.50),
        "p90_ms": pick(0.90),
        "p99_ms": pick(0.99),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


def bench_serve(
    engine: Engine,
    workload: list[dict[str, Any]],
    rate: float,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in workload:
        arrivals.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    start = time.monotonic()
    sent: list[tuple[Request, float]] = []
    nxt = 0
    done = 0
    while nxt < len(workload) or engine.scheduler.has_work():
        now = time.monotonic() - start
        while nxt < len(workload) and arrivals[nxt] <= now:
            sent.append((engine.add_request(**workload[nxt]), start + arrivals[nxt]))
            nxt += 1
        if not engine.scheduler.has_work():
            time.sleep(min(0.005, max(0.0, arrivals[nxt] - now)) if nxt < len(workload) else 0)
            continue
        done += len(engine.step())
        if progress:
            print(f"\r{done}/{len(workload)} finished", end="", file=sys.stderr, flush=True)
    wall = time.monotonic() - start
    if progress:
        print(file=sys.stderr)
    ttft = [r.metrics.first_token_s - t0 for r, t0 in sent if r.metrics.first_token_s]
    e2e = [(r.metrics.end_s or 0) - t0 for r, t0 in sent if r.metrics.end_s]
    tokens = sum(len(r.output_ids) for r, _ in sent)
    errors = [r.error for r, _ in sent if r.error]
    return {
        "requests": len(sent),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "rate_rps": rate if rate != float("inf") else "all at once",
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(sent) / wall, 2),
        "throughput_tok_s": round(tokens / wall, 2),
        "ttft": percentiles(ttft),
        "e2e": percentiles(e2e),
        "spec": engine.metrics(),
    }


def load_workload(path: str, num: int | None = None) -> list[dict[str, Any]]:
    """The JSONL workload (``Engine.add_request`` arguments a line), cycled to ``num`` requests."""
    with open(path) as f:
        workload = [json.loads(line) for line in f if line.strip()]
    if num:
        workload = (workload * (num // max(len(workload), 1) + 1))[:num]
    return workload


def main_bench_serve(engine: Engine, path: str, rate: float, num: int | None) -> int:
    workload = load_workload(path, num)
    for i, w in enumerate(workload):
        w = dict(w)
        w.setdefault("req_id", f"bench-{i}")
        workload[i] = w
    report = bench_serve(engine, workload, rate)
    print(json.dumps(report))
    return 1 if report["errors"] else 0
