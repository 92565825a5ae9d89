"""What grammar-forced drafts add on a JSON workload (embedded SmolLM2, CPU, n-gram drafter).

    python bench/forced_bench.py

Runs the same JSON-schema requests twice through worker + scheduler (two processes): with forced
drafts and without, the four requests batched together. Reports target steps, tokens/s and
acceptance, both in this run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client import Engine, EngineConfig, SchedulerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "occupation": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "occupation", "city", "country"],
}
TEXTS = [
    "Maria Lopez is a 34 year old engineer who lives in Lisbon, Portugal.",
    "Kenji Sato, 51, works as a chef in Osaka, Japan.",
    "Amara Okafor is a 28-year-old doctor based in Lagos, Nigeria.",
    "Lars Nilsson (45) is a carpenter in Uppsala, Sweden.",
]


def run(forced: bool) -> dict[str, float]:
    cfg = EngineConfig(
        model="embedded:smollm2",
        drafter="ngram",
        device="cpu",
        max_model_len=1024,
        worker_max_num_seqs=4,
        worker_log=os.devnull,
        scheduler=SchedulerConfig(max_num_seqs=4, forced_drafts=forced),
    )
    with Engine(cfg) as e:
        e.generate([{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}])  # warm up
        first_step = e.scheduler.step_id
        t0 = time.perf_counter()
        reqs = [
            e.add_request(
                messages=[{"role": "user", "content": f"Extract as JSON: {t}"}],
                max_tokens=120,
                structured={"json": SCHEMA},
            )
            for t in TEXTS
        ]
        for r in reqs:  # the four run together (batch 4)
            while not r.finished:
                e.step()
        dt = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) for r in reqs)
        steps = e.scheduler.step_id - first_step
        forced_n = sum(r.metrics.num_forced for r in reqs)
        acc = sum(r.metrics.num_accepted for r in reqs)
        drafts = sum(r.metrics.num_drafts for r in reqs)
        assert all(r.error is None for r in reqs)
        return {
            "tokens": tokens,
            "steps": steps,
            "tok_s": tokens / dt,
            "tokens_per_step": tokens / steps,
            "forced": forced_n,
            "mean_acceptance_length": 1 + acc / max(drafts, 1),
        }


def main() -> None:
    off = run(False)
    on = run(True)
    print(
        "| forced drafts | output tokens | target steps | tokens/step | tok/s | forced offered | "
        "mean acceptance length |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in (("off", off), ("on", on)):
        print(
            f"| {name} | {r['tokens']:.0f} | {r['steps']:.0f} | {r['tokens_per_step']:.2f} | "
            f"{r['tok_s']:.1f} | {r['forced']:.0f} | {r['mean_acceptance_length']:.2f} |"
        )
    print(
        f"steps saved by forced drafts: {1 - on['steps'] / off['steps']:.1%}; "
        f"tok/s ratio on/off: {on['tok_s'] / off['tok_s']:.2f}"
    )


if __name__ == "__main__":
    main()
