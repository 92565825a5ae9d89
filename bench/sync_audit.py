"""Where the worker's step loop makes the host wait for the GPU: every synchronizing CUDA call
(torch's sync debug mode) that a step of the in-process runner makes, with the line of specd that
made it, per drafter.

    python bench/sync_audit.py [--drafters none ngram draft_model eagle parallel] [--steps 60]

The design allows one wait a step for the sampled tokens (``ModelRunner.accept``'s copy) and one
for drafts (``DraftTokensHandler.get_draft_tokens``, structured batches only); any other line in
the table is a hidden sync. A tiny random Llama on the GPU with CUDA graphs, six requests (one of
them sampled, one prefilled in chunks) with four drafts each; the first run warms up (graph
captures), the second is audited. Event waits (``Event.synchronize``, the graphs' staging
buffers, open steps) are not synchronizing calls to torch and are not listed. On a machine
without CUDA it runs the same steps and lists nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from protocol.messages import SamplingParams
from tests.drafting import KINDS, K, drafting_runner
from tests.driver import Req, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requests(k: int) -> list[Req]:
    phrase = [5, 6, 7, 8, 9, 10]
    reqs = [
        Req(f"r{i}", (phrase * 8)[: 12 + 5 * i], 24, k=k, arrive=i, chunk=7 if i == 2 else 0)
        for i in range(6)
    ]
    reqs[3].sampling = SamplingParams(temperature=0.8, seed=4)
    return reqs


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of specd (not the benchmark, not the test driver)."""
    for frame in reversed(stack):
        path = os.path.relpath(frame.filename, ROOT)
        if path.startswith(("worker", "protocol")):
            return f"{path}:{frame.lineno} ({frame.name})"
    return "elsewhere"


def audit(kind: str, device: torch.device, steps: int) -> tuple[int, collections.Counter[str]]:
    runner, _ = drafting_runner(kind, 31, device=device.type, max_num_seqs=8, max_model_len=256)
    k = 0 if kind == "none" else K
    run(runner, requests(k), max_steps=steps)  # warm-up: graph captures, first-use allocations
    found: collections.Counter[str] = collections.Counter()
    before = runner.num_steps

    def record(message: object, category: type, *args: object, **kwargs: object) -> None:
        # called at the warning, inside the torch call: the stack names the line that made it
        if "synchroniz" in str(message):
            found[where(traceback.extract_stack()[:-1])] += 1

    cuda = device.type == "cuda"
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record  # type: ignore[assignment]
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            run(runner, requests(k), max_steps=steps)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return runner.num_steps - before, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--drafters",
        nargs="+",
        default=list(KINDS),
        choices=KINDS,
    )
    ap.add_argument("--steps", type=int, default=60, help="the most steps a run may take")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"device {device}; synchronizing calls per audited step, by the line of specd that made it"
    )
    print("| drafter | steps | line | calls | per step |")
    print("|---|---:|---|---:|---:|")
    for kind in a.drafters:
        steps, found = audit(kind, device, a.steps)
        if not found:
            print(f"| {kind} | {steps} | (none) | 0 | 0 |")
        for line, n in found.most_common():
            print(f"| {kind} | {steps} | {line} | {n} | {n / max(steps, 1):.2f} |")


if __name__ == "__main__":
    main()
