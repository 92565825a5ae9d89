"""PNG plots for docs/performance.md from the GPU suite's JSON results.

    pip install matplotlib   # or: pip install -e '.[bench]'
    python bench/plots.py bench/results/h200-s4 docs/img

acceptance_per_position.png: SmolLM2 n-gram drafts, share accepted at each draft position, per batch.
speedup_vs_batch.png: speculative over no-draft tokens/s against batch size, for SmolLM2 (n-gram,
fixed and adaptive width; EAGLE head; n-gram with torch.compile'd layers when
lossless_bf16_pad_compiled.json is there) and the synthetic 1B/8B targets (oracle drafter, alpha 0.7).
overlap_vs_batch.png: overlap (async) scheduling over sync, end to end, against batch size.

    python bench/plots.py bench/results/h200-s25/sm/serve_smollm2.json docs/img

serve_vs_concurrency.png, from a ``bench/serve_bench.py`` JSON: output tokens/s of the served path
(sync and overlap) and of the in-process runner against concurrency, and each drafter's speedup
over no drafts on each path.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def serve_plot(src: Path, out: Path) -> None:
    """serve_vs_concurrency.png from one serve_bench.py JSON (closed-loop rows only)."""
    rows = [r for r in json.loads(src.read_text())["rows"] if r["load"].startswith("c=")]
    passes: dict[tuple[str, str, str], dict[int, list[float]]] = {}
    for r in rows:
        key = (r["path"], r["drafter"], r.get("mode") or "-")
        passes.setdefault(key, {}).setdefault(int(r["load"][2:]), []).append(r["output_tok_s"])
    # a concurrency run in several passes (serve_bench --concurrencies 8 64 8 64): their median
    tok_s = {k: {c: statistics.median(v) for c, v in by_c.items()} for k, by_c in passes.items()}
    styles = {"served sync": ":", "served overlap": "-", "in-process -": "--", "hf-graph -": "-."}
    marks = {"none": "o", "ngram": "s", "eagle": "^", "draft_model": "D"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (path, drafter, mode), by_c in sorted(tok_s.items()):
        cs = sorted(by_c)
        label = f"{path} {drafter}" + ("" if mode == "-" else f" {mode}")
        style = dict(linestyle=styles.get(f"{path} {mode}", "-"), marker=marks.get(drafter, "x"))
        left.plot(cs, [by_c[c] for c in cs], label=label, **style)
        base = tok_s.get((path, "none", mode))
        if drafter != "none" and base:
            cs = [c for c in cs if c in base]
            right.plot(cs, [by_c[c] / base[c] for c in cs], label=label, **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s")
    left.set_yscale("log")
    right.set_ylabel("speedup over no drafts, same path")
    right.axhline(1.0, color="grey", linewidth=0.8)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle(src.parent.parent.name + "/" + src.parent.name + ": " + src.name)
    fig.tight_layout()
    fig.savefig(out / "serve_vs_concurrency.png", dpi=110)


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".json":
        serve_plot(src, out)
        return
    lossless = json.loads((src / "lossless_bf16_pad.json").read_text())
    synthetic = json.loads((src / "synthetic.json").read_text())

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for row in lossless["rows"]:
        if row["drafter"] in ("ngram", "eagle") and row["acceptance_per_position"]:
            pos = range(1, len(row["acceptance_per_position"]) + 1)
            ax.plot(
                pos,
                row["acceptance_per_position"],
                marker="o" if row["drafter"] == "ngram" else "^",
                linestyle="-" if row["drafter"] == "ngram" else ":",
                label=f"{row['drafter']}, batch {row['batch']}",
            )
    ax.set_xlabel("draft position")
    ax.set_ylabel("share accepted")
    ax.set_title("SmolLM2-135M drafts, H200 bf16")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=120)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in ("ngram", "ngram+adaptive", "eagle"):
        rows = [r for r in lossless["rows"] if r["drafter"] == name]
        if not rows:
            continue
        ax.plot(
            [r["batch"] for r in rows],
            [r["x_none"] for r in rows],
            marker="o",
            label=f"SmolLM2 {name}",
        )
    compiled_file = src / "lossless_bf16_pad_compiled.json"
    if compiled_file.exists():
        rows = [r for r in json.loads(compiled_file.read_text())["rows"] if r["drafter"] == "ngram"]
        ax.plot(
            [r["batch"] for r in rows],
            [r["x_none"] for r in rows],
            marker="o",
            linestyle="-.",
            label="SmolLM2 ngram, compiled layers",
        )
    for size in ("1b", "8b"):
        rows = [r for r in synthetic if r["size"] == size and r["alpha"] == 0.7]
        if not rows:
            continue
        ax.plot(
            [r["batch"] for r in rows],
            [r["speedup"] for r in rows],
            marker="s",
            linestyle="--",
            label=f"synthetic {size}, oracle α=0.7",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("× tokens/s of no drafts")
    ax.set_title("Speculative speedup vs batch size, H200 bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_batch.png", dpi=120)
    overlap_file = src / "overlap.json"
    if overlap_file.exists():
        overlap = json.loads(overlap_file.read_text())
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for kind in ("mix", "json-schema"):
            rows = [r for r in overlap if r["kind"] == kind]
            ax.plot(
                [r["batch"] for r in rows],
                [r["overlap_over_sync"] for r in rows],
                marker="o",
                label=f"{kind} prompts",
            )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("overlap / sync tokens/s")
        ax.set_title("Overlap scheduling, SmolLM2 n-gram, H200 bf16")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "overlap_vs_batch.png", dpi=120)
    print("wrote PNGs to", out)


if __name__ == "__main__":
    main()
