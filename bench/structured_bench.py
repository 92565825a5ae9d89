"""(f) JSON-schema-constrained vs unconstrained speculative decoding, through the real scheduler
and worker processes, with llguidance and with xgrammar.

    python bench/structured_bench.py --model PATH --device cuda --json-out out.json

The same JSON-extraction prompts (repeated to --num-requests, all submitted at once) run without a
constraint and with a JSON schema, n-gram drafts, greedy. Reports tokens/s of each, the ratio
constrained / unconstrained, mean acceptance length, grammar-invalid and grammar-forced drafts, and
whether every constrained output validates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client import Engine, EngineConfig, SchedulerConfig
from scheduler_client.metrics import RequestMetrics

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "skills"],
}
PEOPLE = [
    "Maria Lopez is a 34 year old engineer from Lisbon who knows Python, Rust and SQL.",
    "Tom Becker, 51, lives in Hamburg; he is good at sailing and welding.",
    "Aiko Tanaka (27) is a designer in Osaka who draws, codes and speaks French.",
    "Samuel Okoro is 45, a teacher in Lagos, and plays chess and the piano.",
]


def workload(n: int, structured: bool, tag: str) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        msg = f"Extract the person as JSON with keys name, age, city, skills: {PEOPLE[i % 4]}"
        req: dict[str, Any] = {
            "messages": [{"role": "user", "content": msg}],
            "max_tokens": 128,
            "req_id": f"{tag}{'s' if structured else 'u'}{i}",
        }
        if structured:
            req["structured"] = {"json": SCHEMA}
        out.append(req)
    return out


def measure(engine: Engine, n: int, structured: bool) -> dict[str, Any]:
    engine.generate(workload(min(n, 2), structured, "warm-"))  # warm-up (graphs, grammar compile)
    engine.scheduler.metrics = RequestMetrics()
    t0 = time.perf_counter()
    done = engine.generate(workload(n, structured, ""))
    dt = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in done)
    valid = 0
    for r in done:
        try:
            json.loads(r.text)
            valid += 1
        except json.JSONDecodeError:
            pass
    m = engine.scheduler.metrics
    return {
        "tps": tokens / dt,
        "tokens": tokens,
        "valid_json": valid / len(done),
        "errors": sum(r.error is not None for r in done),
        "mean_acceptance_length": round(m.mean_acceptance_length, 3),
        "grammar_invalid_drafts": m.num_grammar_invalid,
        "grammar_forced_drafts": m.num_forced,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"])
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    res: dict[str, Any] = {}
    for backend in a.backends:
        cfg = EngineConfig(
            model=a.model,
            device=a.device,
            drafter="ngram",
            num_speculative_tokens=4,
            grammar_backend=backend,
            max_model_len=1024,
            worker_max_num_seqs=max(8, a.num_requests),
            scheduler=SchedulerConfig(max_num_seqs=max(8, a.num_requests)),
            worker_args=("--no-pipeline-steps",),  # sync, as before a CUDA worker pipelined
            worker_log=os.devnull,
        )
        try:
            with Engine(cfg) as engine:
                free = measure(engine, a.num_requests, structured=False)
                constrained = measure(engine, a.num_requests, structured=True)
        except Exception as e:  # report, do not hide
            res[backend] = {"error": repr(e)}
            continue
        res[backend] = {
            "unconstrained": free,
            "constrained": constrained,
            "ratio": constrained["tps"] / free["tps"],
        }
    print(
        "| backend | unconstrained tok/s | constrained tok/s | ratio | valid JSON | acceptance length (u / c) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for backend, r in res.items():
        if "error" in r:
            print(f"| {backend} | error: {r['error']} | | | | |")
            continue
        u, c = r["unconstrained"], r["constrained"]
        print(
            f"| {backend} | {u['tps']:.1f} | {c['tps']:.1f} | {r['ratio']:.3f} | {c['valid_json']:.2f} "
            f"| {u['mean_acceptance_length']} / {c['mean_acceptance_length']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
