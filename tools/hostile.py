"""``make hostile``: start ``specd-scheduler`` on a tiny random model, send it generated hostile
requests (types, ranges, nesting, sizes, encodings, HTTP framing) while a good greedy request
repeats alongside, and report 5xx answers, unanswered requests, the slowest answer and whether
the good request's output ever differed from its undisturbed run. Exit 1 on any of those, or if
the daemon exited.

    python tools/hostile.py [--count 10000] [--seed N]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import hostile
from tests.models import save_byte_model
from tests.procs import reap
from tests.test_scheduler_daemon import KEY, start_daemon


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(2**32)
    with tempfile.TemporaryDirectory(prefix="specd-hostile-") as tmp:
        model = save_byte_model("llama", 31, Path(tmp) / "model")
        d = start_daemon(Path(tmp), model)
        try:
            t0 = time.monotonic()
            report = hostile.run(d.port, KEY, a.count, seed, a.threads)
            alive = d.proc.poll() is None
            health = d.call("/health", key=None)[0] if alive else None
            print(report.line())
            print(f"{time.monotonic() - t0:.0f} s; daemon alive: {alive}, /health {health}")
        finally:
            reap(d.proc)
    bad = report.num_5xx or report.num_unanswered or report.good_mismatches
    return 1 if bad or not alive or report.max_latency_s > hostile.DEADLINE_S else 0


if __name__ == "__main__":
    sys.exit(main())
