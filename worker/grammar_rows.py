"""Grammar bitmask rows onto logit rows: each structured request's rows land on exactly its own
logit rows (the layout is checked before anything runs, in ``worker.step_checks``); deferred rows
(overlap scheduling, ``StepBitmask``) are planned once they arrive and pass ``check_bitmask``, with
acceptance capped at the drafts the grammar allows."""

from __future__ import annotations

import numpy as np
import torch

from protocol.messages import SchedulerOutput, StepBitmask
from worker.host_copy import to_device
from worker.sampling import apply_bitmask_
from worker.step_batch import StepBatch


def plan_grammar(sched: SchedulerOutput, batch: StepBatch) -> tuple[list[int], list[int]]:
    """(logit rows, bitmask rows) of a step that ``check_step`` passed: each structured request's
    rows go onto exactly its own logit rows."""
    if not sched.structured_req_ids:
        return [], []
    cu = sched.cu_bitmask_rows
    assert cu is not None and sched.grammar_bitmask is not None
    where = {batch.req_ids[i]: j for j, i in enumerate(batch.sample_idx)}
    rows: list[int] = []
    mask_rows: list[int] = []
    for k, req_id in enumerate(sched.structured_req_ids):
        j = where.get(req_id)
        if j is None:  # no rows (checked), or a request refused on its own
            continue
        assert int(cu[k + 1] - cu[k]) == batch.cu_rows[j + 1] - batch.cu_rows[j], req_id
        rows.extend(range(batch.cu_rows[j], batch.cu_rows[j + 1]))
        mask_rows.extend(range(int(cu[k]), int(cu[k + 1])))
    return rows, mask_rows


def plan_deferred(
    msg: StepBitmask, batch: StepBatch
) -> tuple[tuple[list[int], list[int]], dict[int, int]]:
    """Logit rows <- deferred bitmask rows (``check_bitmask`` passed): request position i takes
    row min(i, valid), and acceptance is capped at ``valid`` (positions past it are never
    accepted, so their row does not matter). Returns the plan and {sampling index: cap}."""
    cu, valid = msg.cu_bitmask_rows, msg.num_valid_drafts
    where = {batch.req_ids[i]: j for j, i in enumerate(batch.sample_idx)}
    rows: list[int] = []
    mask_rows: list[int] = []
    caps: dict[int, int] = {}
    for k, req_id in enumerate(msg.req_ids):
        j = where[req_id]
        v = int(valid[k])
        for pos, row in enumerate(range(batch.cu_rows[j], batch.cu_rows[j + 1])):
            rows.append(row)
            mask_rows.append(int(cu[k]) + min(pos, v))
        caps[j] = v
    return (rows, mask_rows), caps


def apply_grammar(
    grammar_bitmask: np.ndarray | None,
    plan: tuple[list[int], list[int]],
    logits: torch.Tensor,
) -> None:
    rows, mask_rows = plan
    if not rows:
        return
    assert grammar_bitmask is not None
    # pinned copies: the forward is in flight here, and a pageable copy would wait for it
    bitmask = grammar_bitmask[mask_rows]
    device = logits.device
    apply_bitmask_(logits, to_device(rows, device), to_device(bitmask, device, dtype=None))
