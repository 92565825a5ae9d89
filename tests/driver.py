"""A minimal in-process scheduler for worker tests: it builds real ``SchedulerOutput`` messages,
feeds them to a ``ModelRunner`` and commits what comes back, as the real scheduler does."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from protocol.messages import DraftTokenIds, NewRequest, SamplingParams, SchedulerOutput
from scheduler_client.spec_tuner import SpeculationTuner, StepShape
from worker.runner import ModelRunner


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    k: int = 0
    arrive: int = 0  # step at which it joins
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk: int = 0  # prefill chunk size (0: whole prompt)
    stop_ids: tuple[int, ...] = ()  # the output ends at (and keeps) the first of these
    # the most drafts verified at the n-th decode step is verify_caps[n % len] (as the real
    # scheduler's tuner or a grammar may verify fewer than the worker proposed); () = no cap
    verify_caps: tuple[int, ...] = ()
    # (committed tokens, width) -> the scheduler's own draft ids for this step (as grammar-forced
    # tokens are), or None for the worker's drafts (-1 placeholders); None: always the worker's
    supplied_drafts: Callable[[list[int], int], list[int] | None] | None = None
    out: list[int] = field(default_factory=list)
    computed: int = 0
    drafts: int = 0  # width the worker proposed for the next step
    accepted: int = 0
    verified: int = 0
    spec_steps: int = 0  # steps that verified at least one draft
    sample_steps: int = 0  # steps that sampled (with or without drafts)
    judged: int = 0  # drafts the target judged (accepted + the first rejected)
    # position i -> how often a draft stood there / was accepted (for acceptance per position)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)


def run(
    runner: ModelRunner,
    reqs: list[Req],
    max_steps: int = 500,
    tuner: SpeculationTuner | None = None,
    step_log: list[tuple[float, bool, int]] | None = None,
) -> dict[str, list[int]]:
    """Run ``reqs`` to completion; with ``tuner``, each decode step's draft width is its choice
    (as the real scheduler does). ``step_log`` gets (seconds in ``execute``, whether the step
    held prompt tokens, tokens sampled) per step."""
    pending = sorted(reqs, key=lambda r: r.arrive)
    running: dict[str, Req] = {}
    finished: list[str] = []
    step = 0
    while (pending or running or finished) and step < max_steps:
        new = []
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            running[r.req_id] = r
            new.append(NewRequest(r.req_id, np.array(r.prompt, np.int32), r.sampling, r.k))
        ids, counts, widths = [], [], []
        sampling: list[Req] = []
        draft_ids: list[int] = []
        cap = 1 << 30
        if tuner is not None:
            deciding = [r for r in running.values() if r.computed >= len(r.prompt)]
            cap = tuner.choose(
                [tuner.alpha(r.judged, r.accepted) for r in deciding],
                [r.drafts for r in deciding],
            )
        for r in running.values():
            total = len(r.prompt) + len(r.out)
            if r.computed < len(r.prompt):
                n = len(r.prompt) - r.computed
                if r.chunk:
                    n = min(n, r.chunk)
                w = 0
            else:
                w = min(r.drafts, cap)
                if r.verify_caps:
                    w = min(w, r.verify_caps[r.sample_steps % len(r.verify_caps)])
                n = total - r.computed + w
            supplied = r.supplied_drafts(r.prompt + r.out, w) if r.supplied_drafts and w else None
            assert supplied is None or len(supplied) == w
            if r.computed + n - w == total:
                sampling.append(r)
            ids.append(r.req_id)
            counts.append(n)
            widths.append(w)
            draft_ids.extend([-1] * w if supplied is None else supplied)
        sched = SchedulerOutput(
            step_id=step,
            new_requests=new,
            req_ids=ids,
            num_scheduled_tokens=np.array(counts, np.int32),
            num_draft_tokens=np.array(widths, np.int32),
            draft_token_ids=np.array(draft_ids, np.int32),
            finished_req_ids=finished,
            aborted_req_ids=[],
            structured_req_ids=[],
            max_draft_proposals=-1
            if tuner is None
            else tuner.propose(
                [tuner.alpha(r.judged, r.accepted) for r in sampling], [r.k for r in sampling]
            ),
        )
        t0 = time.perf_counter()
        out, rejected = runner.execute(sched)
        if tuner is not None and counts:  # as the engine feeds it (Engine._observe)
            tuner.observe_shape(StepShape.of(sched, out), time.perf_counter() - t0)
        assert not rejected, rejected
        if step_log is not None:
            prefill = any(c - w > 1 for c, w in zip(counts, widths, strict=True)) or bool(new)
            step_log.append(
                (time.perf_counter() - t0, prefill, int(np.asarray(out.num_sampled).sum()))
            )
        drafts = runner.take_draft_tokens()
        finished = []
        off = 0
        for i, req_id in enumerate(out.req_ids):
            r = running[req_id]
            n = int(out.num_sampled[i])
            toks = out.sampled_token_ids[off : off + n].tolist()
            off += n
            if n == 0:
                r.computed += counts[ids.index(req_id)]
                continue
            r.computed = len(r.prompt) + len(r.out) + int(out.num_accepted[i])
            r.accepted += int(out.num_accepted[i])
            r.verified += int(out.num_draft_tokens[i])
            r.spec_steps += int(out.num_draft_tokens[i] > 0)
            r.sample_steps += 1
            w, a = int(out.num_draft_tokens[i]), int(out.num_accepted[i])
            r.judged += min(w, a + 1)
            if tuner is not None:
                tuner.observe_judged(min(w, a + 1), a)
            if len(r.drafted_at) < w:
                r.drafted_at += [0] * (w - len(r.drafted_at))
                r.accepted_at += [0] * (w - len(r.accepted_at))
            for j in range(w):
                r.drafted_at[j] += 1
                r.accepted_at[j] += j < a
            start = len(r.out)
            r.out.extend(toks)
            r.drafts = 0
            stop = next((j for j in range(start, len(r.out)) if r.out[j] in r.stop_ids), None)
            if stop is not None:
                r.out = r.out[: stop + 1]
            if stop is not None or len(r.out) >= r.max_tokens:
                r.out = r.out[: r.max_tokens]
                finished.append(req_id)
        if drafts is not None:
            check_drafts(drafts, step, running)
        for req_id in finished:
            del running[req_id]
        step += 1
    assert not pending and not running, f"unfinished after {max_steps} steps"
    return {r.req_id: r.out for r in reqs}


def check_drafts(drafts: DraftTokenIds, step: int, running: dict[str, Req]) -> None:
    assert drafts.step_id == step
    for i, req_id in enumerate(drafts.req_ids):
        r = running[req_id]
        if len(r.out) >= r.max_tokens or (r.out and r.out[-1] in r.stop_ids):
            continue  # finishing: the worker may hold tokens past the end
        assert int(drafts.num_committed_tokens[i]) == len(r.prompt) + len(r.out)
        w = int(drafts.num_draft_tokens[i])
        assert w <= r.k
        r.drafts = w
