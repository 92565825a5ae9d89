"""Untrusted work off the engine thread (issue #15 item 2): how long a huge request stalls the
other streams of a running ``specd-scheduler``.

    python bench/prep_bench.py --json-out bench/results/prep.json

A real daemon launches a real worker on a tiny random byte-level Llama (tests/models.py, CPU).
A probe (tests/gaps.py) streams 300-token completions one after another; while it does, one huge
request is sent and the probe's largest inter-token gap around it is recorded, against the
probe alone. Two daemons: the default limits, and limits raised so that nothing is refused before
the expensive work (the 10 MB prompt is then tokenized off-thread and refused as too long for
the model; the 5,000-branch schema is compiled off-thread and served).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.gaps import GapProbe, timed_call
from tests.models import save_byte_model
from tests.procs import reap
from tests.test_scheduler_daemon import KEY, start_daemon

RAISED = ("--max-prompt-chars", "20000000", "--max-schema-nodes", "1000000")


def cases(prompt_mb: float, alternatives: int) -> dict[str, dict[str, Any]]:
    text = "hello world " * int(prompt_mb * 1e6 / 12)
    anyof = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(alternatives)
        ]
    }
    enum = {"enum": [f"value-{i}" for i in range(alternatives)]}

    def schema(s: dict[str, Any]) -> dict[str, Any]:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
        return {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "response_format": rf,
        }

    return {
        f"prompt {prompt_mb:g} MB": {"prompt": text, "max_tokens": 4},
        f"anyOf {alternatives} objects": schema(anyof),
        f"enum {alternatives} strings": schema(enum),
    }


def measure(port: int, name: str, body: dict[str, Any], path: str) -> dict[str, Any]:
    data = json.dumps(body).encode()
    with GapProbe(port, KEY) as probe:
        time.sleep(1.0)
        base_start = time.perf_counter()
        time.sleep(2.0)
        base_end = time.perf_counter()
        status, answer, t0, t1 = timed_call(port, KEY, path, data)
        time.sleep(0.5)  # the stream's next token after the answer counts too
    msg = answer.get("error", {}).get("message", "") if isinstance(answer, dict) else ""
    return {
        "case": name,
        "status": status,
        "answer_s": round(t1 - t0, 3),
        "gap_ms": round(probe.largest_gap(t0, t1) * 1e3, 1),
        "baseline_gap_ms": round(probe.largest_gap(base_start, base_end) * 1e3, 1),
        "tokens_meanwhile": probe.num_events(t0, t1),
        "error": msg[:120],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-mb", type=float, default=10.0)
    ap.add_argument("--alternatives", type=int, default=5000)
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--default-limits-only",
        action="store_true",
        help="skip the raised-limits daemon (for a scheduler without the limit flags: the "
        "'before' run, with PYTHONPATH naming an older scheduler_client)",
    )
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prep-bench-") as d:
        tmp = Path(d)
        model = save_byte_model("llama", 31, tmp / "model")
        runs: list[tuple[str, tuple[str, ...]]] = [("default limits", ())]
        if not a.default_limits_only:
            runs.append(("raised limits", RAISED))
        for label, flags in runs:
            run = tmp / label.replace(" ", "-")
            run.mkdir()
            daemon = start_daemon(run, model, *flags)
            try:
                for name, body in cases(a.prompt_mb, a.alternatives).items():
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    row = {"limits": label, **measure(daemon.port, name, body, path)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                reap(daemon.proc)
    print(
        "\n| limits | request | answer | time to answer | largest gap of another stream "
        "(probe alone) | its tokens meanwhile |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['limits']} | {r['case']} | {r['status']} {r['error'][:60]} | {r['answer_s']} s "
            f"| {r['gap_ms']} ms ({r['baseline_gap_ms']} ms) | {r['tokens_meanwhile']} |"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
