"""The one gate every step passes before anything of it is applied.

``check_step`` reads every field of a ``SchedulerOutput`` against the worker's request state and
changes nothing: the shape, dtype and length of every array, widths in 0..k, draft and prompt ids
in the vocabulary, ids unique within each list, every scheduled request known (running, or new in
this step), token counts that fit each request's state, the grammar bitmask's layout and the
deferred ids. A fault refuses the whole step (``StepError`` naming the field, with its index); a new
request the worker cannot serve is refused alone (a returned ``WorkerRequestError``, also naming
its field) and the rest of the step runs. ``check_bitmask`` does the same for the deferred rows of
overlap scheduling (``StepBitmask``), which arrive after the step's forward has been launched.

Step-level refusals use the codes the scheduler reads as "this step was refused" (``bad_step``,
``width_mismatch``, ``unknown_request``, ``too_long``, ``no_kv_blocks``); a refused request keeps its
own code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from protocol.messages import NewRequest, SchedulerOutput, StepBitmask
from worker.block_table import BlockTable
from worker.requests import RequestStates, WorkerRequestError
from worker.step_batch import StepError, placeholders_before, shrink_caps

Fault = Callable[..., StepError]


@dataclass(frozen=True)
class StepLimits:
    vocab_size: int
    max_num_draft_tokens: int  # k: no request verifies more drafts in one step


def _fault(step_id: int, prefix: str = "", what: str = "") -> Fault:
    """Faults of step ``step_id``; ``prefix`` qualifies field names, ``what`` leads messages."""

    def fault(
        field: str, message: str, code: str = "bad_step", req_id: str | None = None
    ) -> StepError:
        text = f"step {step_id}: {what}{prefix}{field}: {message}"
        return StepError(code, text, req_id, prefix + field)

    return fault


def _ints(a: object, field: str, length: int | None, fault: Fault) -> np.ndarray:
    """A 1-D integer array of ``length`` entries, as int64."""
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise fault(field, f"must be a 1-D integer array, got {got}")
    if length is not None and len(a) != length:
        raise fault(field, f"has {len(a)} entries, needs {length}")
    return a.astype(np.int64)


def _bitmask(a: object, field: str, words: int, fault: Fault) -> np.ndarray:
    """int32 [rows, words]."""
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.int32 or a.shape[1] != words:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise fault(field, f"must be int32 [rows, {words}], got {got}")
    return a


def _unique(ids: list[str], field: str, fault: Fault) -> None:
    first: dict[str, int] = {}
    for i, req_id in enumerate(ids):
        if req_id in first:
            raise fault(
                f"{field}[{i}]", f"{req_id!r} repeats {field}[{first[req_id]}]", req_id=req_id
            )
        first[req_id] = i


def _cu_rows(cu: np.ndarray, n: int, num_rows: int, field: str, fault: Fault) -> None:
    if len(cu) != n + 1 or cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] > num_rows:
        raise fault(
            field,
            f"must rise from 0 to at most {num_rows} in {n + 1} entries, got {cu.tolist()[:8]}",
        )


_NO_INDEX = np.zeros(0, np.intp)  # a request without drafts has no placeholders
# from this many requests a step checks its layout as arrays (``_layout_arrays``); below, a
# request at a time is cheaper (``bench/step_layout_bench.py --drafts 4``: 17 against 54 us at
# batch 1, 40 against 55 at batch 8)
ARRAY_CHECK_MIN_BATCH = 16


def check_step(
    sched: SchedulerOutput,
    states: RequestStates,
    limits: StepLimits,
    *,
    can_defer: bool = True,
    blocks: BlockTable | None = None,
) -> list[WorkerRequestError]:
    """Refuse the step (``StepError``) or return the new requests refused alone. Changes nothing.
    The step's finished and aborted ids count as gone (their slots and KV blocks free) before it
    adds requests. ``can_defer``: the caller can wait for deferred rows. ``blocks``: the target's
    KV block table; a step whose requests would need more blocks than are free is refused
    (``no_kv_blocks``) before anything is written."""
    fault = _fault(sched.step_id)
    vocab, k = limits.vocab_size, limits.max_num_draft_tokens
    if sched.step_id < 0:
        raise fault("step_id", f"negative step id {sched.step_id}")
    n_reqs = len(sched.req_ids)
    counts = _ints(sched.num_scheduled_tokens, "num_scheduled_tokens", n_reqs, fault)
    widths = _ints(sched.num_draft_tokens, "num_draft_tokens", n_reqs, fault)
    for i in np.flatnonzero(widths < 0).tolist()[:1]:
        raise fault(
            f"num_draft_tokens[{i}]", f"negative width {widths[i]}", req_id=sched.req_ids[i]
        )
    drafts = _ints(sched.draft_token_ids, "draft_token_ids", int(widths.sum()), fault)
    for j in np.flatnonzero((drafts < -1) | (drafts >= vocab)).tolist()[:1]:
        raise fault(
            f"draft_token_ids[{j}]",
            f"{drafts[j]} is neither -1 (the worker's own draft) nor in 0..{vocab - 1}",
        )
    if not -1 <= sched.max_draft_proposals <= k:
        raise fault(
            "max_draft_proposals",
            f"{sched.max_draft_proposals} is outside -1..{k} (-1: each request's own width)",
        )
    for name in (
        "req_ids",
        "finished_req_ids",
        "aborted_req_ids",
        "structured_req_ids",
        "deferred_req_ids",
    ):
        _unique(getattr(sched, name), name, fault)
    gone = {*sched.finished_req_ids, *sched.aborted_req_ids}

    def running(req_id: str) -> bool:
        return req_id in states.slot_of and req_id not in gone

    # New requests: ids free, then each one checked on its own, then a slot for each accepted.
    first: dict[str, int] = {}
    for i, req in enumerate(sched.new_requests):
        if req.req_id in first:
            raise fault(
                f"new_requests[{i}].req_id",
                f"{req.req_id!r} repeats new_requests[{first[req.req_id]}]",
                req_id=req.req_id,
            )
        first[req.req_id] = i
        if running(req.req_id):
            raise fault(
                f"new_requests[{i}].req_id",
                f"{req.req_id!r} is already running on this worker",
                req_id=req.req_id,
            )
    free = len(states.free_slots) + sum(1 for g in gone if g in states.slot_of)
    rejected: list[WorkerRequestError] = []
    accepted: dict[str, NewRequest] = {}
    for i, req in enumerate(sched.new_requests):
        try:
            states.check_new(req, k, f"new_requests[{i}]")
        except WorkerRequestError as e:
            rejected.append(e)
            continue
        if not free:
            rejected.append(
                WorkerRequestError(
                    req.req_id,
                    "no_free_slot",
                    f"request {req.req_id!r}: all {states.max_num_seqs} slots are busy "
                    "(max_num_seqs)",
                    field=f"new_requests[{i}]",
                )
            )
            continue
        free -= 1
        accepted[req.req_id] = req
    skip = {e.req_id for e in rejected}

    # The layout: every scheduled request's counts against its own state, checked over the
    # batch as arrays; a step that fails that goes a request at a time, which names what is
    # wrong.
    layout = None
    if len(sched.req_ids) >= ARRAY_CHECK_MIN_BATCH:  # (fewer are cheaper a request at a time)
        layout = _layout_arrays(
            sched, states, counts, widths, drafts, k, skip, accepted, gone, blocks
        )
    if layout is not None:
        grow, rows_of, greedy = layout
    else:
        grow, rows_of, greedy = _layout_any(
            sched, states, counts, widths, drafts, k, skip, accepted, running, blocks, fault
        )
    if blocks is not None:
        _check_blocks(sched, states, blocks, gone, grow, fault)
    _check_grammar(sched, rows_of, skip, vocab, fault)
    _check_deferred(sched, rows_of, greedy, can_defer, fault)
    return rejected


def _layout_arrays(
    sched: SchedulerOutput,
    states: RequestStates,
    counts: np.ndarray,
    widths: np.ndarray,
    drafts: np.ndarray,
    k: int,
    skip: set[str],
    accepted: dict[str, NewRequest],
    gone: set[str],
    blocks: BlockTable | None,
) -> tuple[int, dict[str, int], dict[str, bool]] | None:
    """``_layout_any``'s answer over the batch as arrays (``gone``: the step's finished and
    aborted ids); None where any request breaks a rule (``_layout_any`` then names it). Before
    46696ee a drafting step's checks went a request at a time: 0.18-0.19 ms at batch 54 with 4
    drafts each on the 2-core CPU machine (``bench/step_layout_bench.py --drafts 4``)."""
    if (counts < 1).any() or (widths > k).any():
        return None
    old, new = [], []  # batch indices of running and new requests
    slot_of = states.slot_of
    for i, req_id in enumerate(sched.req_ids):
        if req_id in skip:
            continue
        if req_id in accepted:
            new.append(i)
        elif req_id in slot_of and req_id not in gone:
            old.append(i)
        else:
            return None  # not running on this worker
    ids = sched.req_ids
    slot_list = [slot_of[ids[i]] for i in old]
    slots = np.asarray(slot_list, np.int64)
    c, length = states.num_computed[slots], states.num_tokens[slots]
    held_blocks = blocks.num_held[slots] if blocks is not None else None
    order = old
    if len(old) == len(counts):  # every request running (a decode's batch): in batch order
        n, w = counts, widths
    else:
        order = old + new
        n, w = counts[order], widths[order]
        zeros = np.zeros(len(new), np.int64)
        c = np.concatenate([c, zeros])
        prompts = [len(accepted[ids[i]].prompt_token_ids) for i in new]
        length = np.concatenate([length, np.asarray(prompts, np.int64)])
        if held_blocks is not None:
            held_blocks = np.concatenate([held_blocks, zeros])
    # no sums before the bounds hold: a count near the int64 limit would wrap past them (a
    # width of placeholders may still shrink by up to k below: the context is checked after)
    if (n > states.max_model_len + k).any():
        return None
    if w.any():
        proposed = np.zeros(len(order), np.int64)
        proposed[: len(old)] = states.num_drafts[slots]
        first = (np.cumsum(widths) - widths)[order]  # into drafts
        held = placeholders_before(drafts)
        if sched.draft_widths_are_caps:  # (as build_step_batch lays it out)
            n, w = shrink_caps(n, w, first, held, proposed) or (n, w)
        # a placeholder past what the worker proposed: no draft of its own to run
        if (held[first + w] - held[first + np.minimum(proposed, w)] > 0).any():
            return None
        if not (c + n - w == length)[w > 0].all():
            return None  # drafts scheduled during prefill
    m = n - w
    if (m < 1).any() or (c + m > length).any() or (c + n > states.max_model_len).any():
        return None
    grow = 0
    if held_blocks is not None and blocks is not None:
        grow = int(np.maximum(blocks.blocks_for(c + n) - held_blocks, 0).sum())
    rows_of: dict[str, int] = {}
    greedy: dict[str, bool] = {}
    rows = (w + 1).tolist()
    sampling = states.sampling
    for j in np.flatnonzero(c + m == length).tolist():
        req_id = ids[order[j]]
        rows_of[req_id] = rows[j]
        params = sampling[slot_list[j]] if j < len(old) else accepted[req_id].sampling
        greedy[req_id] = params.temperature == 0  # type: ignore[union-attr]
    return grow, rows_of, greedy


def _layout_any(
    sched: SchedulerOutput,
    states: RequestStates,
    counts: np.ndarray,
    widths: np.ndarray,
    drafts: np.ndarray,
    k: int,
    skip: set[str],
    accepted: dict[str, NewRequest],
    running: Callable[[str], bool],
    blocks: BlockTable | None,
    fault: Fault,
) -> tuple[int, dict[str, int], dict[str, bool]]:
    """Every scheduled request's counts against its own state, a request at a time: the KV
    blocks the forward takes, and per sampling request its logit rows (w + 1) and whether it is
    greedy. Raises ``StepError`` naming the first request at fault."""
    grow = 0  # KV blocks the step's forward takes
    rows_of: dict[str, int] = {}  # req_id -> logit rows it samples (w + 1), for sampling requests
    greedy: dict[str, bool] = {}
    d_end = 0
    counts_l, widths_l = counts.tolist(), widths.tolist()  # plain ints: a request a step
    for i, req_id in enumerate(sched.req_ids):
        n, w = counts_l[i], widths_l[i]
        own, d_end = drafts[d_end : d_end + w], d_end + w
        if n < 1:
            raise fault(f"num_scheduled_tokens[{i}]", f"{n} tokens (at least 1)", req_id=req_id)
        if req_id in skip:
            if w > k:
                raise fault(f"num_draft_tokens[{i}]", f"{w} drafts (at most {k})", req_id=req_id)
            continue
        if req_id in accepted:
            new = accepted[req_id]
            is_running, slot = False, -1
            c, length, proposed = 0, len(new.prompt_token_ids), 0
            temperature = new.sampling.temperature
        elif is_running := running(req_id):
            slot = states.slot_of[req_id]
            c, length = int(states.num_computed[slot]), int(states.num_tokens[slot])
            proposed = int(states.num_drafts[slot])
            temperature = states.sampling[slot].temperature  # type: ignore[union-attr]
        else:
            raise fault(
                f"req_ids[{i}]",
                f"request {req_id!r} is not running on this worker",
                "unknown_request",
                req_id,
            )
        if w > k:
            raise fault(
                f"num_draft_tokens[{i}]",
                f"request {req_id!r} scheduled {w} drafts but the worker proposed {proposed} "
                f"(at most {k} per step)",
                "width_mismatch",
                req_id,
            )
        if w and sched.draft_widths_are_caps and w > proposed and (own < 0).all():
            n, w, own = n - w + proposed, proposed, own[:proposed]  # as build_step_batch does
        m = n - w
        if m < 1 or c + m > length:
            raise fault(
                f"num_scheduled_tokens[{i}]",
                f"request {req_id!r} scheduled {n} tokens with {w} drafts, but has "
                f"{length - c} uncomputed tokens",
                req_id=req_id,
            )
        if w and c + m != length:
            raise fault(
                f"num_draft_tokens[{i}]",
                f"request {req_id!r}: drafts scheduled during prefill",
                req_id=req_id,
            )
        placeholders = np.flatnonzero(own < 0) if w else _NO_INDEX
        if placeholders.size and int(placeholders[-1]) >= proposed:
            raise fault(
                f"num_draft_tokens[{i}]",
                f"request {req_id!r} scheduled {w} drafts but the worker proposed {proposed}",
                "width_mismatch",
                req_id,
            )
        if c + n > states.max_model_len:
            raise fault(
                f"num_scheduled_tokens[{i}]",
                f"request {req_id!r} would reach position {c + n}, over max_model_len "
                f"{states.max_model_len}",
                "too_long",
                req_id,
            )
        if blocks is not None:
            grow += blocks.needed(slot, c + n) if is_running else blocks.blocks_for(c + n)
        if c + m == length:
            rows_of[req_id] = w + 1
            greedy[req_id] = temperature == 0
    return grow, rows_of, greedy


def _check_blocks(
    sched: SchedulerOutput,
    states: RequestStates,
    blocks: BlockTable,
    gone: set[str],
    grow: int,
    fault: Fault,
) -> None:
    """The blocks the forward takes must be free once the step's gone requests have left."""
    free = blocks.num_free + sum(
        int(blocks.num_held[states.slot_of[g]]) for g in gone if g in states.slot_of
    )
    if grow > free:
        raise fault(
            "num_scheduled_tokens",
            f"the step needs {grow} more KV blocks of {blocks.block_size} tokens but {free} of "
            f"{blocks.num_blocks} are free (the scheduler must count blocks as "
            "ceil((num_computed + num_scheduled) / kv_block_size) per request)",
            "no_kv_blocks",
        )


def _check_grammar(
    sched: SchedulerOutput, rows_of: dict[str, int], skip: set[str], vocab: int, fault: Fault
) -> None:
    """Each structured request's rows are exactly the logit rows it samples (1 + its width)."""
    words = (vocab + 31) // 32
    bitmask, cu = sched.grammar_bitmask, sched.cu_bitmask_rows
    if bitmask is not None:
        bitmask = _bitmask(bitmask, "grammar_bitmask", words, fault)
    cu_ = None if cu is None else _ints(cu, "cu_bitmask_rows", None, fault)
    structured = sched.structured_req_ids
    if not structured:
        return
    if bitmask is None:
        raise fault("grammar_bitmask", f"int32 [rows, {words}] is needed for structured requests")
    if cu_ is None:
        raise fault("cu_bitmask_rows", "is needed for structured requests")
    _cu_rows(cu_, len(structured), bitmask.shape[0], "cu_bitmask_rows", fault)
    for j, req_id in enumerate(structured):
        have, need = int(cu_[j + 1] - cu_[j]), rows_of.get(req_id)
        if req_id in skip:
            continue  # refused on its own: its rows are not read
        if need is None:
            if have:
                raise fault(
                    f"cu_bitmask_rows[{j + 1}]",
                    f"bitmask rows for {req_id!r}, which does not sample this step",
                    req_id=req_id,
                )
        elif have != need:
            raise fault(
                f"cu_bitmask_rows[{j + 1}]",
                f"request {req_id!r} has {have} bitmask rows but {need - 1} drafts scheduled "
                f"(needs {need} rows)",
                "width_mismatch",
                req_id,
            )


def _check_deferred(
    sched: SchedulerOutput,
    rows_of: dict[str, int],
    greedy: dict[str, bool],
    can_defer: bool,
    fault: Fault,
) -> None:
    """Deferred rows only for greedy requests that sample this step without rows of their own (a
    cap on acceptance is exact for greedy verification only), and only with a way to get them."""
    if sched.deferred_req_ids and not can_defer:
        raise fault("deferred_req_ids", "deferred bitmasks are not supported here")
    for i, req_id in enumerate(sched.deferred_req_ids):
        if req_id not in rows_of or req_id in sched.structured_req_ids:
            raise fault(
                f"deferred_req_ids[{i}]",
                f"deferred bitmask for {req_id!r}, which does not sample this step or already "
                "has rows",
                req_id=req_id,
            )
        if not greedy[req_id]:
            raise fault(
                f"deferred_req_ids[{i}]",
                f"deferred bitmask for sampled request {req_id!r} (only greedy requests may be "
                "deferred)",
                req_id=req_id,
            )


def check_bitmask(msg: StepBitmask, sched: SchedulerOutput, vocab_size: int) -> None:
    """The deferred rows of ``sched``: for its step, for exactly its deferred ids in order, one
    ``num_valid_drafts`` each (>= 0) and that many rows plus one. Faults name
    ``StepBitmask.<field>``."""
    fault = _fault(sched.step_id, "StepBitmask.", "the deferred bitmask does not fit the step: ")
    if msg.step_id != sched.step_id:
        raise fault("step_id", f"rows of step {msg.step_id}, this step is {sched.step_id}")
    if list(msg.req_ids) != list(sched.deferred_req_ids):
        raise fault(
            "req_ids",
            f"{list(msg.req_ids)[:8]} are not the step's deferred_req_ids "
            f"{list(sched.deferred_req_ids)[:8]}",
        )
    n = len(msg.req_ids)
    bitmask = _bitmask(msg.grammar_bitmask, "grammar_bitmask", (vocab_size + 31) // 32, fault)
    valid = _ints(msg.num_valid_drafts, "num_valid_drafts", n, fault)
    cu = _ints(msg.cu_bitmask_rows, "cu_bitmask_rows", n + 1, fault)
    for i in np.flatnonzero(valid < 0).tolist()[:1]:
        raise fault(f"num_valid_drafts[{i}]", f"negative count {valid[i]}")
    _cu_rows(cu, n, bitmask.shape[0], "cu_bitmask_rows", fault)
    for i in np.flatnonzero(np.diff(cu) != valid + 1).tolist()[:1]:
        raise fault(
            f"cu_bitmask_rows[{i + 1}]",
            f"request {msg.req_ids[i]!r} has {int(cu[i + 1] - cu[i])} rows for "
            f"{valid[i]} valid drafts (needs {valid[i] + 1})",
        )
