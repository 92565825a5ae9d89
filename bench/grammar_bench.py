"""Grammar cost on the scheduler: compile time, bitmask rows per second, draft validation.

    python bench/grammar_bench.py

Uses the embedded SmolLM2 tokenizer (vocab 49152) and llguidance. Rows are filled the way a step
fills them: per structured request, 1 + 5 drafts rows (state after each validated draft).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.grammar import LLGuidanceBackend, StructuredSpec, fill_rows_many
from scheduler_client.tokenizer import TokenizerInfo
from worker.model_loader import EMBEDDED_MODEL, resolve_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "address", "active", "score"],
}
INSTANCE = {
    "id": 7,
    "name": "Maria Lopez",
    "tags": ["a", "bb", "ccc"],
    "address": {"street": "Rua Augusta 12", "city": "Lisbon", "zip": "11000"},
    "active": True,
    "score": 3.5,
}


def one_and_many(jobs: list[tuple[Any, int, list[int]]], out: np.ndarray) -> tuple[float, float]:
    """Seconds for a step's rows one matcher at a time, then through ``fill_rows_many``."""
    t0 = time.perf_counter()
    for m, start, drafts in jobs:
        m.fill_rows(out, start, drafts)
    t1 = time.perf_counter()
    fill_rows_many(out, jobs)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    _, directory = resolve_model_dir(EMBEDDED_MODEL)
    tok = TokenizerInfo(directory)
    backend = LLGuidanceBackend(tok.json_text, 49152, (2,))
    # compile: a fresh schema each time (different property name defeats the cache), then a hit
    fresh = []
    for i in range(20):
        s = dict(SCHEMA, properties=dict(SCHEMA["properties"], **{f"extra{i}": {"type": "string"}}))
        t0 = time.perf_counter()
        backend.compile(StructuredSpec("json", s))
        fresh.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(1000):
        backend.compile(StructuredSpec("json", SCHEMA))
    hit = (time.perf_counter() - t0) / 1000
    ids = tok.encode(json.dumps(INSTANCE))
    words = (49152 + 31) // 32
    # walk the instance; at each position fill 6 rows for the next 5 tokens, as a step does
    m = backend.matcher(StructuredSpec("json", SCHEMA))
    bitmask = np.empty((6, words), np.int32)
    fills, validates = [], []
    for pos in range(len(ids) - 5):
        drafts = ids[pos : pos + 5]
        t0 = time.perf_counter()
        n = m.validate(drafts)
        validates.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.fill_rows(bitmask, 0, drafts[:n])
        fills.append((time.perf_counter() - t0, n + 1))
        assert m.accept(ids[pos])
    rows = sum(r for _, r in fills)
    total = sum(t for t, _ in fills)
    per_step = [t for t, _ in fills]
    print("| measure | value |")
    print("|---|---:|")
    print(f"| compile, new JSON schema (median of 20) | {statistics.median(fresh) * 1e3:.2f} ms |")
    print(f"| compile, cache hit | {hit * 1e6:.1f} µs |")
    print(f"| validate 5 drafts (median) | {statistics.median(validates) * 1e6:.1f} µs |")
    print(
        f"| 6 rows for a 5-token draft (median / p99) | {statistics.median(per_step) * 1e6:.0f} / "
        f"{np.percentile(per_step, 99) * 1e6:.0f} µs |"
    )
    print(f"| bitmask rows per second (one core) | {rows / total:,.0f} |")
    print(
        f"| 64 requests × 6 rows, one step (from the median) | "
        f"{statistics.median(per_step) * 64 * 1e3:.1f} ms |"
    )
    print(f"| instance length | {len(ids)} tokens |")
    # a step at batch 64: 64 requests at spread positions of the instance, one row each (no
    # drafts) and 6 rows each (5 drafts), one matcher at a time against fill_rows_many
    ms = []
    for i in range(64):
        mi = backend.matcher(StructuredSpec("json", SCHEMA))
        for t in ids[: (i * 7) % (len(ids) - 6)]:
            assert mi.accept(t)
        ms.append(mi)
    pos = [(i * 7) % (len(ids) - 6) for i in range(64)]
    for k in (0, 5):
        jobs = [
            (mi, i * (k + 1), ids[p : p + k]) for i, (mi, p) in enumerate(zip(ms, pos, strict=True))
        ]
        out = np.empty((64 * (k + 1), words), np.int32)
        times = [one_and_many(jobs, out) for _ in range(20)]
        one, many = [t for t, _ in times], [t for _, t in times]
        print(
            f"| 64 requests × {k + 1} row{'s' if k else ''}, one step: one at a time / fill_rows_many "
            f"({os.cpu_count()} cores; median of 20) | {statistics.median(one) * 1e3:.2f} / "
            f"{statistics.median(many) * 1e3:.2f} ms |"
        )
    # the same 6-row step beside a Python thread that never blocks (the HTTP thread streaming
    # tokens, at its worst): every call that releases the GIL waits up to the switch interval
    # to take it back
    jobs = [(mi, i * 6, ids[p : p + 5]) for i, (mi, p) in enumerate(zip(ms, pos, strict=True))]
    out = np.empty((64 * 6, words), np.int32)
    busy = threading.Event()

    def spin() -> None:
        while not busy.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        one_s, many_s = one_and_many(jobs, out)
    finally:
        busy.set()
        spinner.join()
    print(
        f"| the same 6 rows beside a thread that never blocks (switch interval "
        f"{sys.getswitchinterval() * 1e3:.0f} ms): one at a time / fill_rows_many | "
        f"{one_s * 1e3:.0f} / {many_s * 1e3:.1f} ms |"
    )


if __name__ == "__main__":
    main()
