"""#6 item 2: overlap (async) scheduling against sync, end to end: a scheduler and a launched worker
process over ipc://, the same prompts, greedy, n-gram drafts.

    python bench/overlap_bench.py --model SmolLM2.gguf --device cuda --batches 1 8 64 \
        --max-tokens 128 --json-out overlap.json

For each batch size and mode: output tokens/s over the whole run (every request queued at once),
whether the outputs equal the sync engine's, and, for a JSON-schema batch (structured greedy
requests, whose grammar rows are deferred in overlap mode), the same. Ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.prompts import PROMPTS
from scheduler_client import Engine, EngineConfig, SchedulerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
}


def workload(batch: int, max_tokens: int, structured: bool) -> list[dict[str, Any]]:
    texts = list(PROMPTS.values())
    out = []
    for i in range(max(batch, len(texts)) if batch > 1 else len(texts)):
        text = texts[i % len(texts)]
        req: dict[str, Any] = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
        }
        if structured:
            req["messages"] = [{"role": "user", "content": f"Answer as JSON. {text}"}]
            req["structured"] = {"json": SCHEMA}
        out.append(req)
    return out


def timed(engine: Engine, work: list[dict[str, Any]], batch: int) -> tuple[float, list[list[int]]]:
    """Tokens/s with ``batch`` requests at a time (batch 1: one after another)."""
    engine.generate([dict(w, max_tokens=8) for w in work[:batch]])  # warm-up
    outs: list[list[int]] = []
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        reqs = engine.generate([dict(w) for w in work[i : i + batch]])
        for r in reqs:
            if r.error:
                raise RuntimeError(r.error)
            outs.append(r.output_ids)
            tokens += len(r.output_ids)
    return tokens / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--device", default=None)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    rows = []
    engines = {}
    for overlap in (False, True):
        engines[overlap] = Engine(
            EngineConfig(
                model=a.model,
                drafter=a.drafter,
                num_speculative_tokens=4,
                device=a.device,
                max_model_len=1024,
                worker_max_num_seqs=max(a.batches),
                scheduler=SchedulerConfig(
                    max_num_seqs=max(a.batches),
                    max_num_batched_tokens=max(2048, 5 * max(a.batches)),
                    async_scheduling=overlap,
                ),
                # sync against overlap alone, as before a CUDA worker pipelined by default
                worker_args=("--no-pipeline-steps",),
            )
        )
    try:
        for structured in (False, True):
            for batch in a.batches:
                work = workload(batch, a.max_tokens, structured)
                tps_sync, out_sync = timed(engines[False], work, batch)
                tps_over, out_over = timed(engines[True], work, batch)
                rows.append(
                    {
                        "kind": "json-schema" if structured else "mix",
                        "batch": batch,
                        "sync_tps": round(tps_sync, 1),
                        "overlap_tps": round(tps_over, 1),
                        "overlap_over_sync": round(tps_over / tps_sync, 3),
                        "equal_outputs": sum(
                            x == y for x, y in zip(out_sync, out_over, strict=True)
                        )
                        / len(out_sync),
                        "deferred_bitmasks": engines[True].num_deferred_bitmasks,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for e in engines.values():
            e.close()
    print("| prompts | batch | sync tok/s | overlap tok/s | overlap / sync | equal outputs |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['batch']} | {r['sync_tps']} | {r['overlap_tps']} | "
            f"{r['overlap_over_sync']} | {r['equal_outputs']:.2f} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
