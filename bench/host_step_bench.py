"""The worker's host cost a step: ``check_step``, ``build_step_batch`` and the runner's host-only
parts (request updates, commit, drafting, the output message) timed around every call of a run at batch ~54 with arrivals (a tiny random Llama on the CPU; the model's own time is not
in these figures).

    python bench/host_step_bench.py [--drafter none|ngram] [--requests 200]

54 requests start together, then one arrives about every 1.25 steps as others finish (64 output
tokens each), so most steps carry a prefill beside ~54 decodes, as the served c=64 rows do.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import worker.runner as runner_module
from bench.lossless_bench import make_drafter, make_runner
from tests.driver import Req, run
from tests.models import tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="none", choices=("none", "ngram"))
    ap.add_argument("--requests", type=int, default=200)
    a = ap.parse_args()
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = f(*args, **kwargs)
            spent[name] += time.perf_counter() - t
            calls[name] += 1
            return out

        return wrapper

    for name in ("check_step", "build_step_batch"):
        setattr(runner_module, name, timed(name, getattr(runner_module, name)))
    k = 0 if a.drafter == "none" else 4
    model = tiny_model("llama", 3)
    drafter = make_drafter(a.drafter, k, model, 64, None, None, "off", False)
    runner = make_runner(model, drafter, k, 64, "off", False)
    rng = random.Random(0)
    reqs = [
        Req(
            f"r{i}",
            [rng.randrange(3, 120) for _ in range(rng.randrange(20, 120))],
            64,
            k=k,
            arrive=0 if i < 54 else 70 + int((i - 54) * 1.25),
        )
        for i in range(a.requests)
    ]
    for name in ("update_requests", "commit", "propose_drafts", "output"):
        setattr(runner, name, timed(name, getattr(runner, name)))
    run(runner, reqs, max_steps=100_000)
    for name in spent:
        print(f"{name}: {1e6 * spent[name] / calls[name]:.1f} us a step over {calls[name]} steps")


if __name__ == "__main__":
    main()
