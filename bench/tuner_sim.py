"""The speculation tuner under served arrivals, in a step-cost model (no model runs, no GPU).

    python bench/tuner_sim.py [--concurrency 64] [--requests 2000] [--seed 0] [--seeds 1]

A closed loop at concurrency c, as ``serve_bench`` runs it: a new request (prompt 100..600 tokens,
128 output tokens) arrives as one finishes, so most steps carry a prompt chunk. Each step costs
what the profile says: a decode step of the batch, each extra verified width, each prompt token,
and each proposed draft. The real ``SpeculationTuner`` chooses the widths; its step times come
either from every step with its prefill tokens (as ``Engine._observe`` now feeds it) or from
decode-only steps alone (as it did before: under arrivals it then hardly ever measured). The
``draft model`` profile is fitted to the H200 figures of h200-s10 run 5 (1B target, 135M draft,
dummies: no drafts 7.2 ms a step at batch 54; drafting 4 at batch 42, 48 ms a step with a mean
acceptance length of 3.78; in process at c=1, 18.1 ms a step of 5 tokens against 3.4). A profile
may charge a step with any prompt chunk a premium of its own (``mixed_ms``). Output
tokens per simulated second, as a ratio to no drafts. This is a model of the costs, not a
measurement: it shows what the tuner decides under them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.spec_tuner import SpeculationTuner

K = 4
PREFILL_BUDGET = 2048  # prompt tokens a step (the scheduler's token budget less the decodes)


@dataclass(frozen=True)
class Profile:
    name: str
    alpha: float  # per-draft acceptance
    decode_ms: tuple[float, float]  # a decode step: a + b * batch
    verify_ms: float  # each extra verified width, per decoding request
    draft_ms: tuple[float, float]  # each proposed draft: a + b * batch
    prefill_ms: float  # per prompt token
    mixed_ms: float = 0.0  # once a step that carries a prompt chunk (the ragged path's premium)
    # once a step that proposes any drafts: a + b * batch (a head's catch-up forward, padded to
    # k + 1 pairs whatever the number of drafts)
    draft_fixed_ms: tuple[float, float] = (0.0, 0.0)
    catch_ms: float = 0.0  # per pair a drafter catches up past the step's own (a new prompt,
    # or the tokens of the steps that proposed nothing)


PROFILES = (
    Profile("draft model (h200-s10 run 5 fit)", 0.85, (3.0, 0.07), 0.02, (3.3, 0.15), 0.002),
    Profile("cheap drafter that pays", 0.85, (3.0, 0.07), 0.02, (0.05, 0.0), 0.002),
    # SmolLM2's EAGLE head on an H100 (h100-s17: no drafts 1.9 ms a step at c=1, 2.9 at c=64;
    # full width 0.5 ms more at c=1, 2.3x at c=64; acceptance ~0.3), and a step with a prompt
    # chunk paying the ragged path's premium (3 ms: a made-up figure, as large as a decode step)
    Profile("EAGLE-like, losing at c=64", 0.3, (1.9, 0.02), 0.012, (0.1, 0.004), 0.001),
    Profile(
        "EAGLE-like + 3 ms mixed-step premium", 0.3, (1.9, 0.02), 0.012, (0.1, 0.004), 0.001, 3.0
    ),
    # the EAGLE head's drafting as it runs since 41d9b8c: one padded catch-up forward whatever
    # the number of drafts (most of the drafting cost), then cheap draft forwards, and the
    # catch-up of a new prompt or of the tokens since drafting was last on (made-up split of
    # h100-s17 sm-4's c=64 figures: no drafts 2.3 ms, full width 4.7 ms)
    Profile(
        "EAGLE, fixed drafting cost + catch-up",
        0.3,
        (1.4, 0.014),
        0.01,
        (0.05, 0.002),
        0.001,
        draft_fixed_ms=(0.4, 0.015),
        catch_ms=0.002,
    ),
)


@dataclass
class _Req:
    prompt: int
    out: int = 0
    computed: int = 0  # prompt tokens done
    drafts: int = 0  # drafts the last proposal gave it
    behind: int = 0  # pairs a catching-up drafter has not seen
    judged: int = 0
    accepted: int = 0


def simulate(
    profile: Profile, policy: str, concurrency: int, num_requests: int, seed: int = 0
) -> float:
    """Output tokens per simulated second. ``policy``: none, always (every draft, no tuner),
    tuner (every step observed, with its prefill tokens), decode-only (the tuner fed only
    steps without prompt chunks)."""
    rng = random.Random(seed)
    tuner = SpeculationTuner(K) if policy in ("tuner", "decode-only") else None
    k = 0 if policy == "none" else K
    started = 0
    running: list[_Req] = []
    clock = tokens = 0.0
    while started < num_requests or running:
        while len(running) < concurrency and started < num_requests:
            running.append(_Req(rng.randrange(100, 600)))
            started += 1
        budget, prefill, decoding, sampling = PREFILL_BUDGET, 0, [], []
        for r in running:
            if r.computed < r.prompt:
                n = min(r.prompt - r.computed, budget)
                budget -= n
                prefill += n
                r.computed += n
                r.behind += n
                if r.computed == r.prompt:
                    sampling.append(r)
            else:
                decoding.append(r)
        width = K if tuner is None else 0
        if tuner is not None and decoding:
            width = tuner.choose(
                [tuner.alpha(r.judged, r.accepted) for r in decoding], [r.drafts for r in decoding]
            )
        sampling += decoding
        proposals = k if tuner is None else 0
        if tuner is not None and sampling:
            alphas = [tuner.alpha(r.judged, r.accepted) for r in sampling]
            proposals = tuner.propose(alphas, [k] * len(sampling))
        ran = 0
        for r in decoding:
            w = min(width, r.drafts) if k else 0
            ran = max(ran, w)
            a = 0
            while a < w and rng.random() < profile.alpha:
                a += 1
            r.out += a + 1
            r.behind += a + 1
            r.judged += min(w, a + 1)
            r.accepted += a
            if tuner is not None and w:
                tuner.observe_judged(min(w, a + 1), a)
        backlog = 0
        for r in sampling:
            r.out += r not in decoding  # the prompt's last chunk samples one token
            r.drafts = proposals
            if proposals:  # the drafter catches up what it has not seen, past k + 1 pairs
                backlog += max(r.behind - (K + 1), 0)
                r.behind = 0
        b = len(running)
        seconds = 1e-3 * (
            profile.decode_ms[0]
            + profile.decode_ms[1] * b
            + profile.verify_ms * ran * len(decoding)
            + profile.prefill_ms * prefill
            + profile.mixed_ms * (prefill > 0)
            + (profile.draft_ms[0] + profile.draft_ms[1] * b) * proposals
            + (profile.draft_fixed_ms[0] + profile.draft_fixed_ms[1] * b) * (proposals > 0)
            + profile.catch_ms * backlog
        )
        if tuner is not None and (policy == "tuner" or prefill == 0):
            tuner.observe_step(b, 1 + ran, seconds, proposals, prefill)
        clock += seconds
        for r in [r for r in running if r.out >= 128]:
            tokens += 128
            running.remove(r)
    return tokens / clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds", type=int, default=1, help="runs from --seed on: each ratio is their mean"
    )
    a = ap.parse_args()
    print(
        "| profile | c | no drafts tok/s | every draft | tuner, decode-only steps | tuner, every step |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for profile in PROFILES:
        for c in a.concurrency:
            n = a.requests if c > 1 else max(a.requests // 20, 16)
            seeds = range(a.seed, a.seed + max(a.seeds, 1))
            runs = [
                {
                    p: simulate(profile, p, c, n, s)
                    for p in ("none", "always", "decode-only", "tuner")
                }
                for s in seeds
            ]
            base = sum(r["none"] for r in runs) / len(runs)

            def ratio(policy: str, runs: list[dict[str, float]] = runs) -> float:
                return sum(r[policy] / r["none"] for r in runs) / len(runs)

            print(
                f"| {profile.name} | {c} | {base:,.0f} | {ratio('always'):.3f}x | "
                f"{ratio('decode-only'):.3f}x | {ratio('tuner'):.3f}x |"
            )


if __name__ == "__main__":
    main()
