"""Drafts verified against drafts accepted, sync against overlap scheduling, with a draft model
that agrees with its target on every token (the dummy pair: one random-weight config loaded twice),
on plain requests and on a batch where half the requests follow a regex. Everything a verified
draft fails on is then the grammar's doing. An ``Engine`` with a launched worker on the CPU, the
tuner off (every step drafts).

    python bench/overlap_drafts_bench.py [--model bench/configs/llama-tiny] [--requests 8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from scheduler_client.engine import Engine, EngineConfig
from scheduler_client.scheduler import SchedulerConfig


def run(model: str, n: int, overlap: bool, structured: bool) -> dict[str, int]:
    cfg = EngineConfig(
        model=model,
        drafter="draft_model",
        draft_model=model,
        device="cpu",
        max_model_len=512,
        worker_max_num_seqs=n,
        worker_args=("--load-format", "dummy", "--dtype", "float32"),
        scheduler=SchedulerConfig(
            max_num_seqs=n,
            async_scheduling=overlap,
            max_steps_in_flight=3,
            adaptive_speculation=False,
        ),
    )
    with Engine(cfg) as e:
        reqs = []
        for i in range(n):
            kw: dict[str, object] = {
                "prompt": list(range(5 + i, 40 + i)),
                "max_tokens": 48,
                "ignore_eos": True,
            }
            if structured and i % 2 == 0:
                kw["structured"] = {"regex": "[a-z ]{40}"}
            reqs.append(e.add_request(**kw))
        e.run_until_done()
        bad = [r.error for r in reqs if r.error]
        if bad:
            raise SystemExit(f"requests failed: {bad}")
        keys = ("num_draft_tokens", "num_accepted", "num_grammar_invalid")
        return {k: sum(getattr(r.metrics, k) for r in reqs) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench/configs/llama-tiny")
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args()
    print("| requests | mode | drafts verified | accepted | acceptance | cut by the grammar |")
    print("|---|---|---:|---:|---:|---:|")
    for structured in (False, True):
        for overlap in (False, True):
            m = run(a.model, a.requests, overlap, structured)
            acc = m["num_accepted"] / m["num_draft_tokens"] if m["num_draft_tokens"] else 0.0
            print(
                f"| {'half structured' if structured else 'plain'} | "
                f"{'overlap' if overlap else 'sync'} | {m['num_draft_tokens']} | "
                f"{m['num_accepted']} | {acc:.2f} | {m['num_grammar_invalid']} |"
            )


if __name__ == "__main__":
    main()
