"""Grammar bitmask rows for a step: row i of a structured request is its grammar state after its
drafts 0..i-1 (consumed, then rolled back); in overlap mode, the deferred rows of a step sent before
its requests' previous tokens were committed (``StepBitmask``)."""

from __future__ import annotations

import numpy as np

from protocol.messages import SchedulerOutput, StepBitmask
from scheduler_client.grammar import Matcher, fill_rows_many
from scheduler_client.request import Request


def real_drafts(req: Request) -> np.ndarray:
    """The ids a structured request's rows are built over (placeholders stand for these)."""
    return req.grammar_drafts if req.grammar_drafts is not None else req.draft_ids


def step_rows(
    rows: list[tuple[Request, int]], words: int
) -> tuple[list[str], np.ndarray | None, np.ndarray | None]:
    """(structured ids, cu rows, bitmask) for requests that sample with these widths; the last row of
    each request is its bonus row."""
    if not rows:
        return [], None, None
    total = sum(w + 1 for _, w in rows)
    bitmask = np.empty((total, words), np.int32)
    cu = np.zeros(len(rows) + 1, np.int32)
    jobs: list[tuple[Matcher, int, list[int]]] = []
    for i, (req, w) in enumerate(rows):
        assert req.matcher is not None
        jobs.append((req.matcher, int(cu[i]), real_drafts(req)[:w].tolist()))
        cu[i + 1] = cu[i] + w + 1
    fill_rows_many(bitmask, jobs)
    return [r.req_id for r, _ in rows], cu, bitmask


def deferred_rows(
    sched: SchedulerOutput,
    widths: dict[str, int],
    requests: dict[str, Request],
    words: int,
) -> StepBitmask:
    """The rows ``sched`` deferred, once the previous step's tokens are committed: per request the
    drafts the worker proposed after that step (``Request.last_drafts``), validated up to the width
    the step allowed (``widths``); rows for the valid prefix only (the worker caps acceptance
    there). A request without fresh drafts gets 0 valid drafts (fail closed); one that has
    finished meanwhile gets an allow-all row (its output is discarded)."""
    valid = np.zeros(len(sched.deferred_req_ids), np.int32)
    jobs: list[tuple[Matcher, int, list[int]]] = []  # (matcher, first row, valid drafts)
    allow_all: list[int] = []
    cu = np.zeros(len(sched.deferred_req_ids) + 1, np.int32)
    for i, req_id in enumerate(sched.deferred_req_ids):
        req = requests.get(req_id)
        if req is None or req.finished or req.matcher is None:
            allow_all.append(int(cu[i]))
            cu[i + 1] = cu[i] + 1
            continue
        w = widths.get(req_id, 0)
        raw = req.last_drafts[:w].tolist() if req.last_drafts is not None else []
        v = req.matcher.validate(raw) if raw else 0
        req.metrics.num_grammar_invalid += len(raw) - v
        jobs.append((req.matcher, int(cu[i]), raw[:v]))
        valid[i] = v
        cu[i + 1] = cu[i] + v + 1
    bitmask = np.empty((int(cu[-1]), words), np.int32)
    bitmask[allow_all] = -1
    fill_rows_many(bitmask, jobs)
    return StepBitmask(
        step_id=sched.step_id,
        req_ids=list(sched.deferred_req_ids),
        num_valid_drafts=valid,
        cu_bitmask_rows=cu,
        grammar_bitmask=bitmask,
    )
