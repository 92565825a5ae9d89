"""The HTTP load generator of bench/serve_bench.py: streamed OpenAI chat completions against a
running ``specd-scheduler``, closed loop at a fixed concurrency (a new request is sent as one
finishes) or open loop at a Poisson rate. Per request: time to first token (the first streamed
event), time per output token after it, end-to-end time and output tokens (from the stream's
usage). Counters from ``/metrics`` give acceptance over a phase."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from scheduler_client.bench_serve import percentiles

# Engine.add_request's structured kinds -> the request field of the OpenAI door (vLLM's names)
GUIDED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}


@dataclass
class Result:
    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    error: str | None = None
    sent: float = 0.0  # time.time() when it was sent (processes share that clock)
    kind: str = "free"  # its structured kind (json, regex, choice), or free (unconstrained)


def chat_body(w: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat body from ``Engine.add_request`` arguments (``messages`` form): greedy,
    streamed with usage. Unconstrained requests ignore EOS, so every row does the same work;
    structured ones end where their grammar does."""
    body: dict[str, Any] = {
        "messages": w["messages"],
        "max_tokens": w["max_tokens"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    structured = w.get("structured")
    if structured:
        ((kind, value),) = structured.items()
        body[GUIDED[kind]] = value
    else:
        body["ignore_eos"] = True
    return body


def body_kind(body: dict[str, Any]) -> str:
    """A chat body's structured kind (json, regex, choice), or free."""
    return next((kind for kind, key in GUIDED.items() if key in body), "free")


def post_stream(port: int, body: dict[str, Any], timeout_s: float = 600.0) -> Result:
    sent, t0 = time.time(), time.perf_counter()
    kind = body_kind(body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    ttft: float | None = None
    tokens = 0
    error: str | None = None
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return Result(
                None,
                time.perf_counter() - t0,
                0,
                f"HTTP {resp.status}: {resp.read()!r}",
                sent,
                kind,
            )
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            # only the events whose bytes name an error or the usage are decoded (a token's
            # text that spells one costs a decode, nothing more: the keys are checked below);
            # a client decoding every event fell behind the server at 64 streams
            if b'"error"' not in line and b'"usage"' not in line:
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = str(event["error"])
                continue
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    except (OSError, http.client.HTTPException) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return Result(ttft, time.perf_counter() - t0, tokens, error, sent, kind)


def steady_tok_s(results: list[Result]) -> float | None:
    """Output tokens a second from the first request sent to the last one sent: a closed loop's
    throughput while all its clients are busy, the drain after its last request left out (with
    4 requests a client, a quarter of a row). A request's tokens count as made evenly from its
    first token to its end; None with fewer than two requests or no such window."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None and r.output_tokens]
    if len(ok) < 2:
        return None
    w0, w1 = min(r.sent for r in results), max(r.sent for r in results)
    if w1 <= w0:
        return None
    made = 0.0
    for r in ok:
        first, end = r.sent + r.ttft_s, r.sent + r.e2e_s  # type: ignore[operator]
        if end <= first:  # one event: every token at once
            made += r.output_tokens if w0 <= end <= w1 else 0
            continue
        inside = max(0.0, min(end, w1) - max(first, w0))
        made += r.output_tokens * inside / (end - first)
    return made / (w1 - w0)


def closed_loop(
    port: int, bodies: list[dict[str, Any]], concurrency: int, procs: int = 1
) -> tuple[list[Result], float, float]:
    """``concurrency`` clients, each sending its next request when the last one finished, on
    ``procs`` processes (the clients split evenly, the bodies dealt round): one Python process
    reading 64 streams under one GIL can fall behind the server it measures. Returns the
    results, the wall time from the first request sent to the last answer read, and the
    clients' CPU seconds (every process and thread)."""
    procs = max(1, min(procs, concurrency))
    if procs == 1:
        results, start, end, cpu = _clients(port, bodies, concurrency)
        return results, end - start, cpu
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    ctx = multiprocessing.get_context("fork")  # the clients touch no CUDA, only sockets
    with ctx.Pool(procs) as pool:
        parts = pool.starmap(_clients, [(port, bodies[i::procs], shares[i]) for i in range(procs)])
    results = [r for part in parts for r in part[0]]
    wall = max(p[2] for p in parts) - min(p[1] for p in parts)
    return results, wall, sum(p[3] for p in parts)


def _clients(
    port: int, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[Result], float, float, float]:
    """One process's share of ``closed_loop``: results, start and end (``time.time()``, which
    processes share) and its CPU seconds."""
    results: list[Result] = []
    lock = threading.Lock()
    todo = iter(bodies)

    def client() -> None:
        while True:
            with lock:
                body = next(todo, None)
            if body is None:
                return
            r = post_stream(port, body)
            with lock:
                results.append(r)

    cpu0, t0 = time.process_time(), time.time()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, t0, time.time(), time.process_time() - cpu0


def poisson(
    port: int, bodies: list[dict[str, Any]], rate: float, seed: int = 0
) -> tuple[list[Result], float, float]:
    """Requests arrive at ``rate`` per second (exponential gaps, seeded), whatever is running.
    Returns the results, the wall time and this process's CPU seconds."""
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()

    def one(body: dict[str, Any]) -> None:
        r = post_stream(port, body)
        with lock:
            results.append(r)

    cpu0, t0 = time.process_time(), time.perf_counter()
    threads = []
    due = 0.0
    for body in bodies:
        time.sleep(max(0.0, due - (time.perf_counter() - t0)))
        threads.append(threading.Thread(target=one, args=(body,)))
        threads[-1].start()
        due += rng.expovariate(rate)
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0, time.process_time() - cpu0


def metrics_text(port: int) -> str:
    """A local /metrics page."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def scrape(port: int, prefix: str = "specd_scheduler_") -> dict[str, float]:
    """Unlabelled counters (``*_total``) and histogram sums and counts (``*_sum``, ``*_count``)
    whose names start with ``prefix``: the scheduler's by default, ``specd_worker_`` for a
    worker's ``--metrics-port``."""
    text = metrics_text(port)
    out = {}
    pat = rf"^({re.escape(prefix)}\w+_(?:total|sum|count)) ([0-9.e+-]+)$"
    for m in re.finditer(pat, text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def scrape_tuner(port: int) -> dict[str, dict[str, float]]:
    """The scheduler's speculation tuner as /metrics shows it: "batch/width" -> its step time
    (ms, at no prefill) and samples ("8d/1": steps with deferred grammar rows)."""
    text = metrics_text(port)
    out: dict[str, dict[str, float]] = {}
    # (several workers add a worker label: their buckets are keyed together, the last wins)
    pat = r'^specd_scheduler_tuner_(step_seconds|samples)\{batch="(\d+d?)",width="(\d+)"[^}]*\} (\S+)$'
    for m in re.finditer(pat, text, re.M):
        entry = out.setdefault(f"{m.group(2)}/{m.group(3)}", {})
        value = float(m.group(4))
        if m.group(1) == "step_seconds":
            entry["ms"] = round(1000 * value, 3)
        else:
            entry["samples"] = value
    return out


def scrape_guard(port: int) -> dict[str, float]:
    """The speculation guard as /metrics shows it (cumulative over the scheduler's rows): its
    switches, each batch bucket's preference ("64/preferred": 1 drafting, 0 off) and its
    windows' output tokens a second ("64/drafting", "64/off")."""
    text = metrics_text(port)
    out: dict[str, float] = {}
    m = re.search(
        r"^specd_scheduler_speculation_guard_switches_total(?:\{[^}]*\})? (\S+)$", text, re.M
    )
    if m:
        out["switches"] = float(m.group(1))
    pat = r'^specd_scheduler_speculation_guard_preferred\{batch="(\d+)"[^}]*\} (\S+)$'
    for m in re.finditer(pat, text, re.M):
        out[f"{m.group(1)}/preferred"] = float(m.group(2))
    pat = r'^specd_scheduler_speculation_guard_tokens_per_second\{batch="(\d+)",kind="(\w+)"[^}]*\} (\S+)$'
    for m in re.finditer(pat, text, re.M):
        out[f"{m.group(1)}/{m.group(2)}"] = round(float(m.group(3)), 1)
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """A scraped counter's growth over a phase."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def step_stats(
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
    prefix: str,
    cpu_s: float | None = None,
) -> dict[str, float | None]:
    """Steps in a phase from one process's step histogram: how many, mean ms, the share of the
    phase's wall time spent in them, (a worker's) mean requests a step, and the process's CPU
    ms a step (``cpu_s``: its CPU seconds over the phase, every thread). A CPU time a step near
    the wall time a step says the process is the bottleneck (a GIL runs one thread at a time).
    ``gc_ms``: the process's garbage-collector pauses a step; ``gc_full``: its full collections."""
    steps = delta(before, after, prefix + "step_seconds_count")
    seconds = delta(before, after, prefix + "step_seconds_sum")
    batch = delta(before, after, prefix + "batch_size_sum")
    held = delta(before, after, prefix + "pipelined_steps_total")  # a worker's open steps
    gc_s = delta(before, after, prefix + "gc_pause_seconds_total")  # protocol/gc_heap.py
    gc_full = delta(before, after, prefix + "gc_full_collections_total")
    return {
        "steps": int(steps),
        "step_ms": round(1000 * seconds / steps, 3) if steps else None,
        "wall_ms": round(1000 * wall_s / steps, 3) if steps else None,
        "busy": round(seconds / wall_s, 3) if wall_s else None,
        "batch": round(batch / steps, 2) if steps and batch else None,
        "cpu_ms": round(1000 * cpu_s / steps, 3) if steps and cpu_s is not None else None,
        "pipelined": round(held / steps, 3) if steps and held else None,
        "gc_ms": round(1000 * gc_s / steps, 4) if steps else None,
        "gc_full": int(gc_full),
    }


def summarize(
    results: list[Result], wall_s: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    tpot = _tpots(ok)

    drafted = delta(before, after, "specd_scheduler_draft_tokens_total")
    accepted = delta(before, after, "specd_scheduler_accepted_tokens_total")
    verifications = delta(before, after, "specd_scheduler_drafts_total")
    errors = [r.error for r in results if r.error]
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall_s, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 2),
        "steady_tok_s": None if (v := steady_tok_s(results)) is None else round(v, 2),
        "ttft": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": percentiles(tpot),
        "e2e": percentiles([r.e2e_s for r in ok]),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / verifications, 3) if verifications else None,
        "phases_ms": phases_ms(before, after),
        "by_kind": by_kind(ok),
    }


def _tpots(results: list[Result]) -> list[float]:
    return [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in results
        if r.ttft_s is not None and r.output_tokens > 1
    ]


def by_kind(ok: list[Result]) -> dict[str, dict[str, float]]:
    """Per kind of request (free, json, regex, choice): how many finished, their output tokens,
    mean end-to-end time and TPOT p50. A drafter that speeds the free chats may slow a
    structured request whose drafts its grammar cuts, which still pays for the batch's wide
    step: the row's throughput mixes the two."""
    out = {}
    for kind in sorted({r.kind for r in ok}):
        mine = [r for r in ok if r.kind == kind]
        tpot = percentiles(_tpots(mine))
        out[kind] = {
            "requests": len(mine),
            "output_tokens": sum(r.output_tokens for r in mine),
            "e2e_mean_ms": round(1000 * sum(r.e2e_s for r in mine) / len(mine), 2),
            "tpot_p50_ms": tpot.get("p50_ms") if tpot else None,
        }
    return out


def phases_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms a request finished in the phase spent in each of the scheduler's phases (prep,
    queue, prefill, decode: ``specd_scheduler_request_*_seconds``)."""
    out = {}
    for name in ("prep", "queue", "prefill", "decode"):
        metric = f"specd_scheduler_request_{name}_seconds"
        n = delta(before, after, metric + "_count")
        if n:
            out[name] = round(1000 * delta(before, after, metric + "_sum") / n, 3)
    return out
