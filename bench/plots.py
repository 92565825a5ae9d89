"""PNG plots for docs/performance.md from the GPU suite's JSON results.

    pip install matplotlib   # or: pip install -e '.[bench]'
    python bench/plots.py bench/results/h200-s2-run2 docs/img

acceptance_per_position.png: SmolLM2 n-gram drafts, share accepted at each draft position, per batch.
speedup_vs_batch.png: speculative over no-draft tokens/s against batch size, for SmolLM2 (n-gram,
fixed and adaptive width) and the synthetic 1B/8B targets (oracle drafter, alpha 0.7).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    lossless = json.loads((src / "lossless_bf16_pad.json").read_text())
    synthetic = json.loads((src / "synthetic.json").read_text())

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for row in lossless["rows"]:
        if row["drafter"] == "ngram" and row["acceptance_per_position"]:
            pos = range(1, len(row["acceptance_per_position"]) + 1)
            ax.plot(pos, row["acceptance_per_position"], marker="o", label=f"batch {row['batch']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share accepted")
    ax.set_title("SmolLM2-135M, n-gram drafts, H200 bf16")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=120)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in ("ngram", "ngram+adaptive"):
        rows = [r for r in lossless["rows"] if r["drafter"] == name]
        ax.plot(
            [r["batch"] for r in rows],
            [r["x_none"] for r in rows],
            marker="o",
            label=f"SmolLM2 {name}",
        )
    for size in ("1b", "8b"):
        rows = [r for r in synthetic if r["size"] == size and r["alpha"] == 0.7]
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
    print("wrote", out / "acceptance_per_position.png", out / "speedup_vs_batch.png")


if __name__ == "__main__":
    main()
