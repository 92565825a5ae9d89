"""What the speculation tuner chose, step by step, in a served run: reads the step traces
(``specd-scheduler --step-trace``) that ``bench/serve_bench.py --log-dir`` writes beside its rows,
and prints per row where the steps and their time went, by the width they ran.

    python bench/step_trace.py serve_smollm2.json [--log-dir DIR]

A row's steps are the trace lines inside its ``span`` (its wall-clock start and end). Per width
(1 + the widest drafts run): steps, their share of the row's step time, mean time with and without
a prompt chunk, the steps that waited for deferred grammar rows and their mean time (and the mean
of the others without a prompt chunk), the drafts asked for after them and, for a width with drafts, the share of its
draft slots (width - 1 a request) that held a draft and the tokens a request made a step; then
how often the width changed and the longest run of each width; last, over the steps that verified
a tuner's choice, the drafts accepted for each token the tuner's model expected them to add
(``made_per_expected``: what its calibration follows). Widths are what the worker ran,
not what the tuner chose: a step verifies at most what was proposed after the one before it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per width: steps, time share, mean ms (decode-only and with prefill), proposals after."""
    total = sum(s["ms"] for s in steps) or 1.0
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        by[s["width"]].append(s)
    widths = {}
    for w, ss in sorted(by.items()):
        plain = [s["ms"] for s in ss if not s["prefill"]]
        mixed = [s["ms"] for s in ss if s["prefill"]]
        # steps that waited for deferred grammar rows, and the others without a prompt chunk
        late = [s["ms"] for s in ss if s.get("deferred")]
        free = [s["ms"] for s in ss if not s.get("deferred") and not s["prefill"]]
        asked: dict[int, int] = defaultdict(int)
        for s in ss:
            asked[s["proposals"]] += 1
        widths[w] = {
            "steps": len(ss),
            "share": round(sum(s["ms"] for s in ss) / total, 3),
            "ms_decode": round(sum(plain) / len(plain), 3) if plain else None,
            "ms_mixed": round(sum(mixed) / len(mixed), 3) if mixed else None,
            "deferred": len(late),
            "ms_deferred": round(sum(late) / len(late), 3) if late else None,
            "ms_decode_not_deferred": round(sum(free) / len(free), 3) if free else None,
            "proposals": dict(sorted(asked.items())),
            "reqs": round(sum(s["reqs"] for s in ss) / len(ss), 1),
        }
        reqs = sum(s["reqs"] for s in ss)
        if w > 1 and reqs and all("drafts" in s for s in ss):
            # of the drafts the width let its requests verify, the share they had (a request
            # without: its first step after its prompt, its grammar cut them, its last tokens),
            # and the tokens each request made a step (accepted drafts + 1)
            widths[w]["filled"] = round(sum(s["drafts"] for s in ss) / ((w - 1) * reqs), 3)
            widths[w]["tokens_per_req"] = round(
                (reqs + sum(s.get("accepted", 0) for s in ss)) / reqs, 3
            )
    changes = sum(1 for a, b in itertools.pairwise(steps) if a["width"] != b["width"])
    longest: dict[int, int] = defaultdict(int)
    run = 0
    for i, s in enumerate(steps):
        run = run + 1 if i and steps[i - 1]["width"] == s["width"] else 1
        longest[s["width"]] = max(longest[s["width"]], run)
    drafts = sum(s.get("drafts", 0) for s in steps)
    accepted = sum(s.get("accepted", 0) for s in steps)
    # the steps that verified a tuner's choice: the tokens its model expected their drafts to add
    # (``predicted``, uncalibrated) against the drafts they accepted
    chosen = [s for s in steps if s.get("predicted", 0) > 0]
    expected = sum(s["predicted"] for s in chosen)
    return {
        "steps": len(steps),
        "ms_mean": round(total / max(len(steps), 1), 3),
        "widths": widths,
        "width_changes": changes,
        "longest_run": dict(sorted(longest.items())),
        "acceptance": round(accepted / drafts, 3) if drafts else None,
        "made_per_expected": (
            round(sum(s["accepted"] for s in chosen) / expected, 3) if expected else None
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="serve_bench.py's --json-out")
    ap.add_argument("--log-dir", type=Path, default=None, help="default: the run's own")
    a = ap.parse_args()
    data = json.loads(a.json.read_text())
    log_dir = a.log_dir or Path(data["args"]["log_dir"])
    traces: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in data["rows"]:
        if r.get("path") != "served" or "span" not in r:
            continue
        key = (r["drafter"], r["mode"])
        if key not in traces:
            f = log_dir / f"trace-{key[0]}-{key[1]}.jsonl"
            traces[key] = load(f) if f.exists() else []
        t0, t1 = r["span"]
        steps = [s for s in traces[key] if t0 <= s["t"] <= t1]
        print(f"{r['drafter']} {r['mode']} {r['load']}: {r['output_tok_s']} tok/s")
        print("  " + json.dumps(summarize(steps)))


if __name__ == "__main__":
    main()
