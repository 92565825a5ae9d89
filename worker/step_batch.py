"""One step's layout: which tokens of which requests run where, and which logit rows sample.

``build_step_batch`` turns a ``SchedulerOutput`` that ``worker.step_checks.check_step`` passed
into a ``StepBatch`` against the worker's own request state (the checks live there, in one place).
With ``draft_widths_are_caps`` (overlap scheduling) a placeholder width larger than the worker's
proposal shrinks to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from protocol.messages import SchedulerOutput
from worker.host_copy import to_device
from worker.requests import RequestStates


def flat_ranges(starts: object, counts: object) -> np.ndarray:
    """``starts[i] .. starts[i] + counts[i] - 1`` for each i, laid flat (int64): each request's
    positions in a flat batch."""
    c = np.asarray(counts, np.int64)
    ends = np.cumsum(c)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(
        ends - c - np.asarray(starts, np.int64), c
    )


def placeholders_before(drafts: np.ndarray) -> np.ndarray:
    """[len(drafts) + 1]: how many of ``drafts`` (a step's, flat) before each index are
    placeholders (-1, the worker's own drafts)."""
    return np.concatenate([[0], np.cumsum(drafts < 0)])


def shrink_caps(
    counts: np.ndarray,
    widths: np.ndarray,
    first_draft: np.ndarray,
    held: np.ndarray,
    have: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Overlap scheduling: a width of placeholders only was chosen before the drafts existed,
    and runs the drafts the worker has (``have``); a width with real ids in it was built from
    drafts the scheduler saw and stands. Each request's (tokens, width) after that, or None
    where none shrinks. ``first_draft``: each request's first draft in the step's flat drafts;
    ``held``: ``placeholders_before`` of those drafts."""
    shrink = (widths > have) & (held[first_draft + widths] - held[first_draft] == widths)
    if not shrink.any():
        return None
    return np.where(shrink, counts - widths + have, counts), np.where(shrink, have, widths)


class StepError(ValueError):
    """The scheduler's step disagrees with the worker's state; nothing of the step was applied.
    ``field`` names the message field at fault (``WorkerError.field``)."""

    def __init__(
        self, code: str, message: str, req_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id
        self.field = field


_NO_OWN = np.zeros(0, bool)  # a request without drafts has no placeholders


@dataclass
class StepBatch:
    """The per-step layout. B = scheduled requests; S = those that sample this step."""

    req_ids: list[str]
    slots: list[int]  # batch_idx -> slot
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    start_positions: list[int]
    num_scheduled: list[int]
    num_drafts: list[int]
    sample_idx: list[int]  # S batch indices that sample
    logits_indices: torch.Tensor  # [sum over S of (w + 1)]
    cu_rows: list[int]  # [S + 1] logit rows of each sampling request
    draft_token_ids: torch.Tensor  # [S, K]
    # [sum of num_drafts] bool, request-major: True where the worker's own draft is used
    own_drafts: np.ndarray

    def own(self, i: int) -> np.ndarray:
        """[w] bool of the request at batch index ``i``: where its drafts are the worker's."""
        first = sum(self.num_drafts[:i])
        return self.own_drafts[first : first + self.num_drafts[i]]


def build_step_batch(
    sched: SchedulerOutput,
    st: RequestStates,
    skip: set[str],
    vocab_size: int,
    device: torch.device,
) -> StepBatch:
    """The step's flat layout, for a step that ``worker.step_checks.check_step`` passed.
    ``skip``: new requests the worker refused this step. Built over the batch as arrays with one
    host-to-device copy (``_build_arrays``); ``_build_any`` states the same layout a request at
    a time, and the tests hold the two equal."""
    return _build_arrays(sched, st, skip, device)


def _build_any(
    sched: SchedulerOutput, st: RequestStates, skip: set[str], device: torch.device
) -> StepBatch:
    """``build_step_batch``'s layout stated a request at a time: what ``_build_arrays`` must
    equal (tests/test_step_batch.py), kept as the readable form of its rules."""
    req_ids, slots, starts, counts, widths = [], [], [], [], []
    ids_np: list[np.ndarray] = []
    # flat position <- (slot, column) of the worker's own draft, for every -1 placeholder
    own_flat: list[int] = []
    own_slot: list[int] = []
    own_col: list[int] = []
    sample_idx: list[int] = []
    own: list[np.ndarray] = []
    logit_rows: list[int] = []
    cu_rows = [0]
    flat = 0
    sched_off = 0
    # plain lists and locals: this loop runs once a request a step on the worker's host path
    sched_counts = sched.num_scheduled_tokens.tolist()
    sched_widths = sched.num_draft_tokens.tolist()
    sched_drafts = sched.draft_token_ids
    caps = sched.draft_widths_are_caps
    slot_of, token_ids = st.slot_of, st.token_ids
    num_computed, num_tokens = st.num_computed, st.num_tokens
    no_drafts = np.zeros(0, bool)
    for i, req_id in enumerate(sched.req_ids):
        n, w = sched_counts[i], sched_widths[i]
        d_off, sched_off = sched_off, sched_off + w
        if req_id in skip:
            continue
        slot = slot_of[req_id]
        c, length = int(num_computed[slot]), int(num_tokens[slot])
        if not w:
            m = n
            ids_np.append(token_ids[slot, c : c + m])
            own.append(no_drafts)
        else:
            drafts_i = sched_drafts[d_off : d_off + w]
            placeholders = drafts_i < 0
            have = int(st.num_drafts[slot])
            if caps and w > have and placeholders.all():
                # overlap: the width was chosen before the drafts existed; run the ones we
                # have (a width with real ids in it was built from drafts the scheduler saw)
                n, w = n - w + have, have
                drafts_i, placeholders = drafts_i[:w], placeholders[:w]
            m = n - w
            ids_np.append(token_ids[slot, c : c + m])
            ids_np.append(np.where(placeholders, 0, drafts_i))
            for k in np.flatnonzero(placeholders).tolist():
                own_flat.append(flat + m + k)
                own_slot.append(slot)
                own_col.append(k)
            own.append(placeholders)
        req_ids.append(req_id)
        slots.append(slot)
        starts.append(c)
        counts.append(n)
        widths.append(w)
        if c + m == length:
            sample_idx.append(len(req_ids) - 1)
            logit_rows.extend(range(flat + m - 1, flat + n))
            cu_rows.append(cu_rows[-1] + w + 1)
        flat += n
    input_ids = to_device(np.concatenate(ids_np) if ids_np else np.zeros(0, np.int64), device)
    if own_flat:
        # Drafts the worker kept on its device fill the placeholders (scheduler ids stay):
        # one index copy and one scatter for the whole batch.
        idx = to_device([own_flat, own_slot, own_col], device)  # [3, num_placeholders]
        input_ids[idx[0]] = st.draft_token_ids[idx[1], idx[2]]
    positions = to_device(flat_ranges(starts, counts), device)
    ends = np.cumsum(counts)
    kmax = max((widths[i] for i in sample_idx), default=0)
    drafts = torch.zeros((len(sample_idx), max(kmax, 1)), dtype=torch.long, device=device)
    # [S, K] drafts of the sampling requests, gathered from the flat input in one go
    rows = [j for j, i in enumerate(sample_idx) for _ in range(widths[i])]
    cols = [c for i in sample_idx for c in range(widths[i])]
    src = [int(ends[i]) - widths[i] + c for i in sample_idx for c in range(widths[i])]
    if rows:
        gather = to_device([rows, cols, src], device)  # [3, num_drafts]
        drafts[gather[0], gather[1]] = input_ids[gather[2]]
    return StepBatch(
        req_ids=req_ids,
        slots=slots,
        input_ids=input_ids,
        positions=positions,
        start_positions=starts,
        num_scheduled=counts,
        num_drafts=widths,
        sample_idx=sample_idx,
        logits_indices=to_device(logit_rows, device),
        cu_rows=cu_rows,
        draft_token_ids=drafts,
        own_drafts=np.concatenate(own) if own else _NO_OWN,
    )


def _build_arrays(
    sched: SchedulerOutput, st: RequestStates, skip: set[str], device: torch.device
) -> StepBatch:
    """``_build_any``'s layout over the batch as arrays, with one host-to-device copy. Before
    46696ee a drafting step's layout went a request at a time with five copies (``_build_any``):
    0.52-0.71 ms at batch 54 with 4 drafts each on the 2-core CPU machine, on the host path
    between a drafting step's output and the next step's launch
    (``bench/step_layout_bench.py --drafts 4``)."""
    counts = sched.num_scheduled_tokens.astype(np.int64)
    all_widths = widths = sched.num_draft_tokens.astype(np.int64)
    req_ids: list[str] = sched.req_ids
    if skip:
        keep = [i for i, req_id in enumerate(req_ids) if req_id not in skip]
        req_ids = [req_ids[i] for i in keep]
        counts, widths = counts[keep], widths[keep]
    slots = [st.slot_of[req_id] for req_id in req_ids]
    slots_np = np.asarray(slots, np.int64)
    starts = st.num_computed[slots_np]
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    if not widths.any():
        positions = flat_ranges(starts, counts)
        ids = st.token_ids[np.repeat(slots_np, counts), positions]
        sample = np.flatnonzero(starts + counts == st.num_tokens[slots_np])
        flat = to_device(np.concatenate([ids, positions, ends[sample] - 1]), device)
        return StepBatch(
            req_ids=req_ids,
            slots=slots,
            input_ids=flat[:total],
            positions=flat[total : 2 * total],
            start_positions=starts.tolist(),
            num_scheduled=counts.tolist(),
            num_drafts=[0] * len(req_ids),
            sample_idx=sample.tolist(),
            logits_indices=flat[2 * total :],
            cu_rows=list(range(len(sample) + 1)),
            draft_token_ids=torch.zeros((len(sample), 1), dtype=torch.long, device=device),
            own_drafts=_NO_OWN,
        )
    first_draft = np.cumsum(all_widths) - all_widths  # into sched.draft_token_ids
    if skip:
        first_draft = first_draft[keep]
    sched_drafts = sched.draft_token_ids.astype(np.int64)
    if sched.draft_widths_are_caps:
        have = st.num_drafts[slots_np].astype(np.int64)
        shrunk = shrink_caps(counts, widths, first_draft, placeholders_before(sched_drafts), have)
        if shrunk is not None:
            counts, widths = shrunk
            ends = np.cumsum(counts)
            total = int(ends[-1])
    ran = counts - widths  # committed tokens each request runs, before its drafts
    samples = starts + ran == st.num_tokens[slots_np]
    # per token, its request's: slot, start, tokens run before its drafts, first draft in
    # sched.draft_token_ids, first row in the flat input, and whether it samples
    tok_slot, tok_start, tok_ran, tok_first, tok_flat, tok_samples = np.repeat(
        np.array([slots_np, starts, ran, first_draft, ends - counts, samples]), counts, axis=1
    )
    offset = np.arange(total) - tok_flat  # within its request
    positions = tok_start + offset
    ids = st.token_ids[tok_slot, positions]  # (a draft's position holds a stale token: replaced)
    column = offset - tok_ran  # >= 0: that draft of its request; -1: its last token
    logit_rows = np.flatnonzero((column >= -1) & (tok_samples > 0))
    draft_rows = np.flatnonzero(column >= 0)  # into the flat input
    column = column[draft_rows]
    values = sched_drafts[tok_first[draft_rows] + column]
    # the scheduler's ids stay; placeholders (-1) take the worker's own drafts on the device
    own = values < 0
    ids[draft_rows] = np.where(own, 0, values)
    own_rows = draft_rows[own]
    sample = np.flatnonzero(samples)
    sw = widths[sample]  # the sampling requests' widths (every request with drafts samples)
    width = max(int(sw.max(initial=0)), 1)
    k = st.draft_token_ids.shape[1]
    parts = [
        ids,
        positions,
        logit_rows,
        own_rows,
        tok_slot[own_rows] * k + column[own],  # the worker's drafts, st.draft_token_ids flat
        # [S, width] drafts of the sampling requests, gathered from the flat input: each one's
        # place there (row-major; every draft belongs to a sampling request), and its row
        np.repeat(np.arange(len(sample)), sw) * width + column,
        draft_rows,
    ]
    flat = to_device(np.concatenate(parts), device)  # everything in one copy
    (input_ids, positions_d, logits_indices, own_dst, own_src, draft_dst, draft_src) = torch.split(
        flat, [len(p) for p in parts]
    )
    if len(own_rows):
        input_ids[own_dst] = st.draft_token_ids.view(-1)[own_src]
    drafts = torch.zeros((len(sample), width), dtype=torch.long, device=device)
    drafts.view(-1)[draft_dst] = input_ids[draft_src]
    return StepBatch(
        req_ids=req_ids,
        slots=slots,
        input_ids=input_ids,
        positions=positions_d,
        start_positions=starts.tolist(),
        num_scheduled=counts.tolist(),
        num_drafts=widths.tolist(),
        sample_idx=sample.tolist(),
        logits_indices=logits_indices,
        cu_rows=[0, *accumulate(w + 1 for w in sw.tolist())],
        draft_token_ids=drafts,
        own_drafts=own,
    )
