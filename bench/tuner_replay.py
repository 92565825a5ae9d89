"""What the speculation tuner's proposal costs the scheduler a step, on a served run's own steps:
replays a step trace (``specd-scheduler --step-trace``; ``serve_bench.py --log-dir`` keeps one per
drafter and mode) through ``SpeculationTuner.propose`` and ``observe_step``, each step with the
trace's batch size, width, time, proposals and prefill tokens, and times ``propose`` alone. The
requests' acceptance and hit rates are not in the trace: every request gets ``--alpha`` and
``--hits``. CPU time of this process, not a served figure.

    python bench/tuner_replay.py TRACE.jsonl [--alpha 0.15] [--hits 0.9] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.spec_tuner import SpeculationTuner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--alpha", type=float, default=0.15, help="every request's acceptance")
    ap.add_argument("--hits", type=float, default=0.9, help="every request's hit rate")
    ap.add_argument("--k", type=int, default=4, help="the most drafts a request has")
    a = ap.parse_args()
    with open(a.trace) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    tuner = SpeculationTuner(a.k)
    spent: list[float] = []
    for s in steps:
        n = s["reqs"]
        t0 = time.process_time()
        tuner.propose([a.alpha] * n, [a.k] * n, [a.hits] * n)
        spent.append(time.process_time() - t0)
        tuner.observe_step(n, s["width"], s["ms"] / 1e3, s["proposals"], s["prefill"])
    spent.sort()
    mean = sum(spent) / max(len(spent), 1)
    print(
        f"{len(spent)} steps: propose {1e6 * mean:.1f} us CPU a step on average, median "
        f"{1e6 * spent[len(spent) // 2]:.1f}, p99 {1e6 * spent[int(0.99 * (len(spent) - 1))]:.1f}"
    )


if __name__ == "__main__":
    main()
