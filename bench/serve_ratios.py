"""Each drafter's served output tok/s over no drafts', pass by pass, from serve_bench.py's JSON.

On a shared host one served row's throughput moves by 15-40% against the next (h100-s30: the
steps without drafts of one row took 1.45-1.54 ms a step and then 2.1-2.2 ms, at the same load),
so a drafter's ratio to no drafts is read over several passes: the same concurrencies again in
the same workers' lives (pass k of each drafter at the same point of its worker's life), or the
drafters named again (alternated, in new workers). Name
the drafters more than once to get passes (``--drafters none ngram none ngram``): the k-th row of
a drafter at a load is paired with the k-th row of ``none`` at that load and mode, in the same file
(a pass where either row had errors is left out, and so is a pass one side has more of: both are
counted in ``left out``).

    python bench/serve_ratios.py serve_a.json [serve_b.json ...]

prints, for each file, drafter, mode and load, the ratio of each pass, their median, and the
pooled ratio (the tokens over the seconds of all passes, against none's).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def passes(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Served rows by (drafter, mode, load), in the order they ran."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("path") == "served":
            out[(r["drafter"], r["mode"], r["load"])].append(r)
    return out


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per drafter, mode and load with a ``none`` row beside it."""
    by = passes(rows)
    out = []
    for (drafter, mode, load), mine in by.items():
        base = by.get(("none", mode, load), [])
        if drafter == "none" or not base:
            continue
        # k-th with k-th; a pass where either row had errors is left out, not shifted
        pairs = [
            (r, b)
            for r, b in zip(mine, base, strict=False)
            if not r.get("errors") and not b.get("errors") and b["output_tok_s"]
        ]
        each = [r["output_tok_s"] / b["output_tok_s"] for r, b in pairs]
        if not each:
            continue
        tok = sum(r["output_tokens"] for r, _ in pairs) / sum(r["wall_s"] for r, _ in pairs)
        base_tok = sum(b["output_tokens"] for _, b in pairs) / sum(b["wall_s"] for _, b in pairs)
        out.append(
            {
                "drafter": drafter,
                "mode": mode,
                "load": load,
                "passes": [round(x, 3) for x in each],
                "left_out": max(len(mine), len(base)) - len(pairs),
                "median": round(statistics.median(each), 3),
                "pooled": round(tok / base_tok, 3),
                "none_tok_s": [b["output_tok_s"] for _, b in pairs],
            }
        )
    return out


def table(label: str, entries: list[dict[str, Any]]) -> str:
    lines = [
        f"== {label}: served output tok/s over no drafts' (pass by pass)",
        "| drafter | mode | load | passes | median | pooled | none tok/s | left out |",
        "|---|---|---|---|---:|---:|---|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['drafter']} | {e['mode']} | {e['load']} | "
            f"{' '.join(f'{x:.3f}' for x in e['passes'])} | {e['median']:.3f} | "
            f"{e['pooled']:.3f} | {' '.join(str(round(x)) for x in e['none_tok_s'])} | "
            f"{e['left_out']} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for name in sys.argv[1:]:
        data = json.loads(Path(name).read_text())
        print(table(name, ratios(data["rows"] if isinstance(data, dict) else data)))


if __name__ == "__main__":
    main()
