"""The worker's per-step host checks, layout and acceptance count for a decode step:
``check_step``, ``build_step_batch`` and ``verify_greedy`` at batch 54 (the served c=64 rows'
batch), on the CPU.

    python bench/step_layout_bench.py [--root DIR] [--batch 54] [--drafts W] [--device cuda]

``--device cuda`` lays the step out for a GPU (its host-to-device copies included; the timing
waits for the stream at the end of each call). ``--drafts W``: each request verifies W drafts of the worker's own, sent as overlap scheduling
sends them (placeholders, the widths caps); 0 (the default): a step without drafts.

``--root`` imports the worker from another checkout (a git worktree of an older commit), so two
trees are compared in one run on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from collections.abc import Callable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--batch", type=int, default=54)
    ap.add_argument("--drafts", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--number", type=int, default=3000)
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.root))
    import numpy as np
    import torch

    from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
    from worker.rejection import verify_greedy
    from worker.requests import RequestStates
    from worker.step_batch import build_step_batch
    from worker.step_checks import StepLimits, check_step

    device = torch.device(a.device)
    st = RequestStates(
        vocab_size=1000, max_num_seqs=64, max_model_len=512, max_num_draft_tokens=4, device=device
    )
    ids = []
    for i in range(a.batch):
        prompt = np.arange(1, 40 + i, dtype=np.int32)
        st.add(NewRequest(f"r{i}", prompt, SamplingParams(), a.drafts), 4)
        slot = st.slot_of[f"r{i}"]
        st.num_computed[slot] = st.num_tokens[slot] - 1  # decoding: one token to run
        st.num_drafts[slot] = a.drafts  # proposed after the step before
        ids.append(f"r{i}")
    sched = SchedulerOutput(
        step_id=1,
        new_requests=[],
        req_ids=ids,
        num_scheduled_tokens=np.full(a.batch, 1 + a.drafts, np.int32),
        num_draft_tokens=np.full(a.batch, a.drafts, np.int32),
        draft_token_ids=np.full(a.batch * a.drafts, -1, np.int32),
        draft_widths_are_caps=True,
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )
    limits = StepLimits(vocab_size=1000, max_num_draft_tokens=4)
    batch = build_step_batch(sched, st, set(), 1000, device)
    # the verification of the step's logits (argmax, its copy to the host, the accepted runs)
    logits = torch.randn((len(batch.logits_indices), 1000), device=device)
    succ = (batch.logits_indices + 1).clamp(max=len(batch.input_ids) - 1)
    for name, f in (
        ("check_step", lambda: check_step(sched, st, limits)),
        ("build_step_batch", lambda: build_step_batch(sched, st, set(), 1000, device)),
        (
            "verify_greedy",
            lambda: verify_greedy(logits, batch.input_ids[succ], batch.cu_rows, a.drafts),
        ),
    ):
        if device.type == "cuda":
            f = _synced(f, device)
        f()
        best = min(timeit.repeat(f, number=a.number, repeat=5)) / a.number
        print(
            f"{name}: {1e6 * best:.1f} us a step at batch {a.batch}, {a.drafts} drafts each "
            f"({a.root})"
        )


def _synced(f: Callable[[], object], device: object) -> Callable[[], object]:
    import torch

    def run() -> object:
        out = f()
        torch.cuda.synchronize(device)  # type: ignore[arg-type]
        return out

    return run


if __name__ == "__main__":
    main()
