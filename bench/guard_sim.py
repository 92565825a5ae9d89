"""The speculation guard (``scheduler_client/spec_guard.py``) on a simulated clock: the real
``Scheduler``, its tuner and its guard run a closed loop of B requests (prompts of 32-127 tokens,
outputs of 96-159, replaced as they end), and each step's time comes from a cost model instead of a worker. Part of a
drafting step's cost can be hidden from the tuner (``--hidden-ms``: what a drafting step that a
``--pipeline-steps`` worker cannot leave open costs more, or a slow host's scheduler work, which
the tuner's model does not weigh) while the guard sees the whole cycle, as it does served. Reports
output tokens per simulated second with no drafter, with the drafter and the tuner alone, and
with the guard too. Deterministic (seeded), so it needs no quiet machine.

    python bench/guard_sim.py [--batch 8] [--alpha 0.3] [--hidden-ms 1.0] [--steps 4000]

A step costs ``--base-ms`` plus ``--token-ms`` per token it runs (drafts included), plus
``--hidden-ms`` where it verifies drafts; each draft is accepted with probability ``--alpha``
(drafts after a rejected one are not); ``--noise S`` multiplies each step's time by a seeded
lognormal factor of sigma S, as a served step's time varies; ``--drift D`` multiplies every
step's time by ``1 + D sin(2 pi step / --drift-steps)``, the slow swings of a served row's steps
(h100-s30: 1.45-1.54 ms a step and then 2.1-2.2 ms at one load).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.zero_width_bench import answer_drafts, worker_step
from protocol.messages import SamplingParams
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.spec_tuner import StepShape


def run(a: argparse.Namespace, k: int, guard: bool) -> tuple[float, int, int]:
    """(output tokens per simulated second, steps that verified drafts, guard switches)."""
    limits = WorkerLimits(
        vocab_size=1000, eos_token_ids=(0,), max_model_len=4096, max_num_speculative_tokens=k,
        max_num_seqs=a.batch,
    )  # fmt: skip
    config = SchedulerConfig(max_num_seqs=a.batch, async_scheduling=False, speculation_guard=guard)
    s = Scheduler(config, limits, None, None)
    added = 0

    lengths = np.random.default_rng(1)

    def add() -> None:
        # prompts of 32-127 tokens and outputs of 96-159: requests begin and end out of step,
        # as served ones do (all alike, they would end and prefill in waves)
        nonlocal added
        prompt = list(range(1, int(lengths.integers(32, 128))))
        sampling = SamplingParams(max_tokens=int(lengths.integers(96, 160)))
        s.add(Request(f"r{added}", prompt, sampling, k))
        added += 1

    for _ in range(a.batch):
        add()
    rng = np.random.default_rng(0)
    noise = np.random.default_rng(2)
    clock, tokens, drafting = 0.0, 0, 0
    for step in range(a.steps):
        sched = s.schedule()
        if sched is None:
            break
        out, sampling = worker_step(s, sched, rng, a.alpha)
        ran = sched.num_draft_tokens
        seen = 1e-3 * (a.base_ms + a.token_ms * int(sched.num_scheduled_tokens.sum()))
        hidden = 1e-3 * a.hidden_ms if ran.any() else 0.0
        if a.drift:  # a slow swing of every step's time, drafting or not
            swing = 1.0 + a.drift * np.sin(2.0 * np.pi * step / a.drift_steps)
            seen, hidden = seen * swing, hidden * swing
        if a.noise:  # a step's time spread by this factor (lognormal, seeded): the guard sees it
            jitter = float(noise.lognormal(0.0, a.noise))
            seen, hidden = seen * jitter, hidden * jitter
        drafting += bool(ran.any())
        clock += seen + hidden
        tokens += int(out.num_sampled.sum())
        ended = s.update(out)
        if s.tuner is not None:  # as the engine feeds them (Engine._step, Engine._observe)
            s.tuner.observe_shape(StepShape.of(sched, out), seen)
        if s.guard is not None:
            s.guard.observe(seen + hidden, s.last_committed, len(s.running))
        answer_drafts(s, sched, out, sampling, max(sched.max_draft_proposals, 0) if k else 0)
        for _ in ended:
            add()
    return tokens / clock, drafting, s.guard.num_switches if s.guard is not None else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--base-ms", type=float, default=1.0)
    ap.add_argument("--token-ms", type=float, default=0.01)
    ap.add_argument("--hidden-ms", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument(
        "--noise", type=float, default=0.0, help="sigma of a lognormal step-time factor"
    )
    ap.add_argument("--drift", type=float, default=0.0, help="amplitude of a slow step-time swing")
    ap.add_argument("--drift-steps", type=int, default=2000, help="the swing's period in steps")
    a = ap.parse_args()
    base, _, _ = run(a, 0, False)
    print(
        f"batch {a.batch}, alpha {a.alpha}, k {a.k}, hidden {a.hidden_ms} ms a drafting step: "
        f"no drafter {base:.0f} tok/s"
    )
    for guard in (False, True):
        rate, drafting, switches = run(a, a.k, guard)
        print(
            f"  drafter, {'tuner and guard' if guard else 'tuner alone'}: {rate:.0f} tok/s "
            f"({rate / base:.3f}x no drafter), {drafting} of {a.steps} steps verified drafts"
            + (f", {switches} guard switches" if guard else "")
        )


if __name__ == "__main__":
    main()
