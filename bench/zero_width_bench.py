"""The scheduler's CPU a step with a drafter the tuner keeps at zero width, against no drafter:
``schedule`` + ``update`` + ``take_drafts`` (empty drafts) for 64 running requests that end after
128 tokens and are replaced by new ones (200-token prompts), the tuner's ``propose`` pinned at
zero. No worker, no grammar, no detokenization: the scheduler's own bookkeeping only. Served
at c=64, EAGLE held at width zero cost the scheduler 0.36-0.54 ms more CPU a step than no drafter
(h100-s17); this isolates what of that its core loop makes.

    python bench/zero_width_bench.py [--overlap] [--steps 600] [--live] [--profile N]
    python bench/zero_width_bench.py --proposals [--steps 300]
    python bench/zero_width_bench.py --kv-blocks 4096   # the scheduler's block accounting too

``--live``: the tuner decides instead, on step times where drafting loses (a step of width w
costs w ms) and drafts each accepted with probability ALPHA, so its own weighing of the widths
is in the figure; ``--profile N``: cProfile's N dearest functions, own time a step;
``--proposals``: the time of the scheduler's proposal decision alone (``time_proposals``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine_step_bench import print_profile
from protocol.messages import DraftTokenIds, ModelRunnerOutput, SamplingParams, SchedulerOutput
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.spec_tuner import StepShape

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
B = 64
ALPHA = 0.2  # --live: each draft accepted with this probability (EAGLE's, on SmolLM2)


def worker_step(
    s: Scheduler, sched: SchedulerOutput, rng: np.random.Generator, alpha: float
) -> tuple[ModelRunnerOutput, list[str]]:
    """A worker's output for ``sched`` without a worker (sync): every request that samples
    verifies its drafts, each accepted with probability ``alpha`` (none after a rejected one);
    and the requests that sampled."""
    ids = list(sched.req_ids)
    own = (sched.num_scheduled_tokens - sched.num_draft_tokens).tolist()  # drafts aside
    sampling = [
        r
        for r, c in zip(ids, own, strict=True)
        if s.requests[r].num_tokens - s.requests[r].num_computed == c
    ]
    ran = sched.num_draft_tokens  # sync: the drafts each request verifies
    on = np.array([r in sampling for r in ids])
    acc = np.minimum(rng.geometric(1.0 - alpha, len(ids)) - 1, ran) * on
    out = ModelRunnerOutput(
        step_id=sched.step_id, req_ids=ids,
        num_sampled=(on * (1 + acc)).astype(np.int32),
        sampled_token_ids=np.full(int((on * (1 + acc)).sum()), 7, np.int32),
        num_draft_tokens=(ran * on).astype(np.int32),
        num_accepted=acc.astype(np.int32),
    )  # fmt: skip
    return out, sampling


def answer_drafts(
    s: Scheduler, sched: SchedulerOutput, out: ModelRunnerOutput, sampling: list[str], k: int
) -> None:
    """After ``s.update(out)``: ``k`` drafts for each request that sampled (the worker's
    ``DraftTokenIds``), or none (``no_drafts``, as after an output without drafts)."""
    if sampling and k:
        s.take_drafts(
            DraftTokenIds(
                step_id=sched.step_id, req_ids=sampling,
                num_draft_tokens=np.full(len(sampling), k, np.int32),
                draft_token_ids=np.full(k * len(sampling), 9, np.int32),
                num_committed_tokens=np.array(
                    [s.requests[r].num_tokens for r in sampling], np.int32
                ),
            )
        )  # fmt: skip
    elif sampling:
        s.no_drafts(out)


def loop(
    k: int,
    steps: int,
    overlap: bool,
    live: bool = False,
    profile: int = 0,
    keep: list[Scheduler] | None = None,
    kv_blocks: int = 0,
) -> float:
    """CPU ms a step of a closed loop at batch B, with ``k`` speculative tokens a request.
    ``live``: the tuner decides, on step times where drafting loses (a step of width w costs w
    ms) and drafts accepted each with probability ALPHA; ``profile``: print that many of the
    dearest functions (cProfile, own time a step); ``keep``: the scheduler is appended to it;
    ``kv_blocks``: the worker's paged cache in blocks of 16 tokens (0: a slot a request)."""
    limits = WorkerLimits(
        vocab_size=49152, eos_token_ids=(0,), max_model_len=4096,
        max_num_speculative_tokens=k, max_num_seqs=B,
        num_kv_blocks=kv_blocks, kv_block_size=16 if kv_blocks else 0,
    )  # fmt: skip
    s = Scheduler(SchedulerConfig(async_scheduling=overlap, max_num_seqs=B), limits, None, None)
    added = 0

    def add() -> None:
        nonlocal added
        s.add(Request(f"r{added}", list(range(1, 200)), SamplingParams(max_tokens=128), k))
        added += 1

    for _ in range(B):
        add()
    if s.tuner is not None and not live:
        s.tuner.propose = lambda *a: 0  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    t0, done, drafting = time.process_time(), 0, 0
    for _ in range(steps):
        sched = s.schedule()
        if sched is None:
            break
        out, sampling = worker_step(s, sched, rng, ALPHA)
        ended = s.update(out)
        if s.tuner is not None and live:  # as the engine feeds it (Engine._observe)
            shape = StepShape.of(sched, out)
            s.tuner.observe_shape(shape, 1e-3 * shape.width)
        k_next = max(sched.max_draft_proposals, 0) if k else 0
        drafting += bool(k_next)
        answer_drafts(s, sched, out, sampling, k_next)
        for _ in ended:
            add()
        done += 1
    cpu = 1e3 * (time.process_time() - t0) / max(done, 1)
    if keep is not None:
        keep.append(s)
    if live and k:
        print(f"  {done} steps, {drafting} proposing drafts")
    if prof is not None:
        prof.disable()
        print_profile(prof, max(done, 1), profile, ROOT)
    return cpu


def time_proposals(steps: int) -> None:
    """The scheduler's proposal decision (``Scheduler._proposals``: the tuner's ``propose`` and
    what it is given) for the B requests running after ``steps`` steps of a --live --overlap run:
    the best of five timings of 2,000 calls, in microseconds a call."""
    keep: list[Scheduler] = []
    loop(4, steps, True, live=True, keep=keep)
    s = keep[0]
    sampling = {r.req_id for r in s.running}
    n = 2000
    best = min(timeit.repeat(lambda: s._proposals(sampling, False), number=n, repeat=5))
    print(f"Scheduler._proposals, {len(sampling)} requests: {best / n * 1e6:.1f} us a call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--overlap", action="store_true", help="async scheduling (steps not answered)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--live", action="store_true", help="the tuner decides (drafting loses)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's N dearest")
    ap.add_argument(
        "--proposals",
        action="store_true",
        help="after a --live run, time the scheduler's proposal decision at batch B alone",
    )
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="the worker's paged cache in blocks of 16 tokens (0: a slot a request)",
    )
    a = ap.parse_args()
    if a.proposals:
        time_proposals(a.steps)
        return
    what = "tuner deciding" if a.live else "tuner at zero"
    for k in (0, 4, 0, 4):  # alternated
        cpu = loop(k, a.steps, a.overlap, a.live, a.profile, kv_blocks=a.kv_blocks)
        print(f"k={k} ({'no drafter' if k == 0 else what}): {cpu:.3f} ms CPU a step")


if __name__ == "__main__":
    main()
