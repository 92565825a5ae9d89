"""The worker's host cost a step: ``check_step``, ``build_step_batch`` and the runner's host-only
parts (request updates, commit, drafting, the output message) timed around every call of a run at batch ~54 with arrivals (a tiny random Llama on the CPU; the model's own time is not
in these figures).

    python bench/host_step_bench.py [--drafter none|ngram|ngram0|eagle0|draft_model] [--requests 200]

``eagle0`` is a random EAGLE head with every proposal capped at zero, as the scheduler's tuner
leaves a head that loses: the runner still stores the target's hidden states for it
(``store_hidden_states``, ``feed_hidden_states``). ``ngram0`` is prompt lookup capped at zero the
same way. ``draft_model`` drafts 4 with a tiny random draft model.

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

import torch

import worker.runner as runner_module
from bench.lossless_bench import MAX_LEN, make_drafter, make_runner
from tests.driver import Req, run
from tests.models import VOCAB, tiny_model
from worker.attention import ATTN_IMPLEMENTATION
from worker.drafters.base import Drafter
from worker.drafters.eagle import EagleDrafter
from worker.eagle_head import EagleHead, head_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--drafter", default="none", choices=("none", "ngram", "ngram0", "eagle0", "draft_model")
    )
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
    drafter: Drafter
    if a.drafter == "eagle0":
        torch.manual_seed(1)
        head = EagleHead(head_config(model.config), ATTN_IMPLEMENTATION).eval()
        drafter = EagleDrafter(
            head, model, vocab_size=VOCAB, max_num_seqs=64, max_model_len=MAX_LEN, max_num_tokens=k
        )
    else:
        draft = tiny_model("llama", 4, layers=1) if a.drafter == "draft_model" else None
        drafter = make_drafter(a.drafter.rstrip("0"), k, model, 64, None, draft, "off", False)
    runner = make_runner(model, drafter, k, 64, "off", False)
    if a.drafter.endswith("0"):  # the tuner's answer for a losing drafter: propose nothing
        plan = runner._draft_plan
        runner._draft_plan = lambda batch, cap, *rest: plan(batch, 0, *rest)  # type: ignore[method-assign]
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
    for name in (
        "update_requests",
        "commit",
        "propose_drafts",
        "store_hidden_states",
        "feed_hidden_states",
        "output",
    ):
        setattr(runner, name, timed(name, getattr(runner, name)))
    run(runner, reqs, max_steps=100_000)
    for name in spent:
        print(f"{name}: {1e6 * spent[name] / calls[name]:.1f} us a step over {calls[name]} steps")


if __name__ == "__main__":
    main()
