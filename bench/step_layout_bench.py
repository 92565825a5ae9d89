"""The worker's per-step host checks and layout for a decode step without drafts:
``check_step`` and ``build_step_batch`` at batch 54 (the served c=64 rows' batch), on the CPU.

    python bench/step_layout_bench.py [--root DIR] [--batch 54]

``--root`` imports the worker from another checkout (a git worktree of an older commit), so two
trees are compared in one run on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--batch", type=int, default=54)
    ap.add_argument("--number", type=int, default=3000)
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.root))
    import numpy as np
    import torch

    from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
    from worker.requests import RequestStates
    from worker.step_batch import build_step_batch
    from worker.step_checks import StepLimits, check_step

    cpu = torch.device("cpu")
    st = RequestStates(
        vocab_size=1000, max_num_seqs=64, max_model_len=512, max_num_draft_tokens=4, device=cpu
    )
    ids = []
    for i in range(a.batch):
        prompt = np.arange(1, 40 + i, dtype=np.int32)
        st.add(NewRequest(f"r{i}", prompt, SamplingParams(), 0), 4)
        slot = st.slot_of[f"r{i}"]
        st.num_computed[slot] = st.num_tokens[slot] - 1  # decoding: one token to run
        ids.append(f"r{i}")
    sched = SchedulerOutput(
        step_id=1,
        new_requests=[],
        req_ids=ids,
        num_scheduled_tokens=np.ones(a.batch, np.int32),
        num_draft_tokens=np.zeros(a.batch, np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )
    limits = StepLimits(vocab_size=1000, max_num_draft_tokens=4)
    for name, f in (
        ("check_step", lambda: check_step(sched, st, limits)),
        ("build_step_batch", lambda: build_step_batch(sched, st, set(), 1000, cpu)),
    ):
        f()
        best = min(timeit.repeat(f, number=a.number, repeat=5)) / a.number
        print(f"{name}: {1e6 * best:.1f} us a step at batch {a.batch} ({a.root})")


if __name__ == "__main__":
    main()
