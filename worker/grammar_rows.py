"""Grammar bitmask rows onto logit rows: each structured request's rows land on exactly its own
logit rows, checked before anything runs; deferred rows (overlap scheduling, ``StepBitmask``) are
planned once they arrive, with acceptance capped at the drafts the grammar allows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from protocol.messages import SchedulerOutput, StepBitmask
from worker.requests import RequestStates
from worker.sampling import apply_bitmask_
from worker.step_batch import StepBatch, StepError


def plan_grammar(
    sched: SchedulerOutput, batch: StepBatch, vocab_size: int
) -> tuple[list[int], list[int]]:
    """Check the bitmask layout before anything runs; returns (logit rows, bitmask rows): each
    structured request's rows go onto exactly its own logit rows."""
    if not sched.structured_req_ids:
        return [], []
    cu, bitmask = sched.cu_bitmask_rows, sched.grammar_bitmask
    words = (vocab_size + 31) // 32
    if bitmask is None or bitmask.ndim != 2 or bitmask.shape[1] != words:
        raise StepError(
            "bad_step",
            f"step {sched.step_id}: grammar_bitmask must be int32 "
            f"[rows, {words}] for structured requests",
        )
    if (
        cu is None
        or len(cu) != len(sched.structured_req_ids) + 1
        or cu[0] != 0
        or (np.diff(cu) < 0).any()
        or cu[-1] > bitmask.shape[0]
    ):
        raise StepError(
            "bad_step",
            f"step {sched.step_id}: cu_bitmask_rows must rise from 0 "
            f"to at most {bitmask.shape[0]} in "
            f"{len(sched.structured_req_ids) + 1} entries",
        )
    where = {batch.req_ids[i]: j for j, i in enumerate(batch.sample_idx)}
    rows: list[int] = []
    mask_rows: list[int] = []
    for k, req_id in enumerate(sched.structured_req_ids):
        j = where.get(req_id)
        have = int(cu[k + 1] - cu[k])
        if j is None:
            if have:
                raise StepError(
                    "bad_step",
                    f"bitmask rows for {req_id!r}, which does not sample this step",
                    req_id,
                )
            continue
        need = batch.cu_rows[j + 1] - batch.cu_rows[j]
        if have != need:
            raise StepError(
                "width_mismatch",
                f"step {sched.step_id}: request {req_id!r} has {have} bitmask rows but "
                f"{need - 1} drafts scheduled (needs {need} rows)",
                req_id,
            )
        rows.extend(range(batch.cu_rows[j], batch.cu_rows[j + 1]))
        mask_rows.extend(range(int(cu[k]), int(cu[k + 1])))
    return rows, mask_rows


def check_deferred(
    sched: SchedulerOutput,
    batch: StepBatch,
    states: RequestStates,
    wait_bitmask: Callable[[int], StepBitmask] | None,
) -> None:
    """Deferred rows only for greedy requests that sample this step (a cap on acceptance is
    exact for greedy verification only), and only with a way to receive them."""
    if not sched.deferred_req_ids:
        return
    if wait_bitmask is None:
        raise StepError(
            "bad_step", f"step {sched.step_id}: deferred bitmasks are not supported here"
        )
    sampling = {batch.req_ids[i]: batch.slots[i] for i in batch.sample_idx}
    for req_id in sched.deferred_req_ids:
        slot = sampling.get(req_id)
        if slot is None or req_id in sched.structured_req_ids:
            raise StepError(
                "bad_step",
                f"step {sched.step_id}: deferred bitmask for {req_id!r}, which does not "
                "sample this step or already has rows",
                req_id,
            )
        if states.sampling[slot].temperature != 0:  # type: ignore[union-attr]
            raise StepError(
                "bad_step",
                f"step {sched.step_id}: deferred bitmask for sampled request {req_id!r} "
                "(only greedy requests may be deferred)",
                req_id,
            )


def plan_deferred(
    sched: SchedulerOutput, msg: StepBitmask, batch: StepBatch, vocab_size: int
) -> tuple[tuple[list[int], list[int]], dict[int, int]]:
    """Logit rows <- deferred bitmask rows: request position i takes row min(i, valid), and
    acceptance is capped at ``valid`` (positions past it are never accepted, so their row
    does not matter). Returns the plan and {sampling index: cap}."""
    words = (vocab_size + 31) // 32
    cu, bm, valid = msg.cu_bitmask_rows, msg.grammar_bitmask, msg.num_valid_drafts
    if (
        msg.step_id != sched.step_id
        or list(msg.req_ids) != list(sched.deferred_req_ids)
        or bm.ndim != 2
        or bm.shape[1] != words
        or len(cu) != len(msg.req_ids) + 1
        or len(valid) != len(msg.req_ids)
        or cu[0] != 0
        or cu[-1] > bm.shape[0]
        or (np.diff(cu) != valid + 1).any()
        or (valid < 0).any()
    ):
        raise StepError(
            "bad_step",
            f"step {sched.step_id}: the deferred bitmask does not fit the step (step "
            f"{msg.step_id}, requests {list(msg.req_ids)} for {list(sched.deferred_req_ids)}, "
            f"rows {bm.shape}, cu {cu.tolist()}, valid {valid.tolist()})",
        )
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
    bitmask = torch.from_numpy(np.ascontiguousarray(grammar_bitmask[mask_rows]))
    apply_bitmask_(
        logits,
        torch.tensor(rows, device=logits.device),
        bitmask.to(logits.device, non_blocking=True),
    )
