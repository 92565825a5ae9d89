"""The step loop's body: execute one ``SchedulerOutput``.

What belongs here: sequencing (update the batch, one target forward, verify, commit, draft) and the
checks that keep the scheduler and the worker in agreement. What does not: attention (attention.py),
sampling math (rejection.py, sampling.py), drafting (drafters/), the host copy of drafts
(draft_tokens.py), sockets (daemon.py).

A step for request r with ``num_computed`` c, committed length L, scheduled n tokens of which w are
drafts: the worker runs tokens[c : c + n - w] plus the w drafts at positions c .. c + n - 1. When
c + n - w == L the request samples: its last w + 1 positions are verified and 1 + num_accepted tokens
are committed; otherwise it was a prefill chunk and nothing is sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import DraftTokenIds, ModelRunnerOutput, SchedulerOutput, StepBitmask
from worker.draft_tokens import DraftTokensHandler
from worker.drafters.base import Drafter
from worker.model_executor import ModelExecutor
from worker.rejection import VerifyInput, verify, verify_greedy
from worker.requests import RequestStates, WorkerRequestError
from worker.sampling import apply_bitmask_
from worker.spec_utils import get_drafter_hidden_states


class StepError(ValueError):
    """The scheduler's step disagrees with the worker's state; nothing of the step was applied."""

    def __init__(self, code: str, message: str, req_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id


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
    own_drafts: list[np.ndarray]  # batch_idx -> [w] bool: True where the worker's draft is used


class ModelRunner:
    def __init__(
        self,
        target: ModelExecutor,
        drafter: Drafter,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_draft_tokens: int,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.max_num_draft_tokens = max_num_draft_tokens
        self.states = RequestStates(
            vocab_size=target.vocab_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_draft_tokens=max_num_draft_tokens,
            device=self.device,
        )
        self.draft_tokens = DraftTokensHandler(self.device)
        self.num_steps = 0
        # Draft distributions from the last proposal, for sampled verification: [P, K, V] and
        # slot -> row. None when the drafter has none (n-gram) or every request is greedy.
        self._last_probs: torch.Tensor | None = None
        self._last_row_of: dict[int, int] = {}

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        wait_bitmask: Callable[[int], StepBitmask] | None = None,
    ) -> tuple[ModelRunnerOutput, list[WorkerRequestError]]:
        """Run one step. Requests the worker refuses come back as errors; the rest run.
        ``wait_bitmask(step_id)`` returns the step's deferred grammar rows (overlap scheduling):
        it is called after the forward has been launched, before anything is sampled."""
        self.draft_tokens.begin_step(sched.step_id)
        rejected = self.update_requests(sched)
        try:
            batch = self.prepare(sched, {e.req_id for e in rejected})
            grammar_plan = self.plan_grammar(sched, batch)
            self.check_deferred(sched, batch, wait_bitmask)
        except StepError:
            # Nothing of a refused step stays applied: its new requests leave again.
            for req in sched.new_requests:
                if req.req_id not in {e.req_id for e in rejected}:
                    self.states.remove(req.req_id)
            raise
        if not batch.req_ids:  # a step that only finishes or adds requests
            self.num_steps += 1
            return self.output(
                sched.step_id, batch, np.zeros((0, 1), np.int64), [], np.zeros(0, np.int64)
            ), rejected
        logits, hidden = self.target.forward(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.start_positions,
            batch.num_scheduled,
            batch.logits_indices,
        )  # logits [num_logit_rows, vocab]
        self.apply_grammar(sched.grammar_bitmask, grammar_plan, logits)
        caps: dict[int, int] = {}
        if sched.deferred_req_ids:
            assert wait_bitmask is not None
            deferred = wait_bitmask(sched.step_id)  # the GPU computes meanwhile
            plan, caps = self.plan_deferred(sched, deferred, batch)
            self.apply_grammar(deferred.grammar_bitmask, plan, logits)
        tokens, num_accepted = self.accept(sched, batch, logits)
        for j, cap in caps.items():  # at most the drafts the grammar allows (greedy only)
            num_accepted[j] = min(int(num_accepted[j]), cap)
        num_sampled = self.commit(batch, tokens, num_accepted)
        if self.drafter.needs_hidden_states:
            self.feed_hidden_states(batch, hidden, num_accepted)
        self.propose_drafts(batch)
        self.num_steps += 1
        return self.output(sched.step_id, batch, tokens, num_sampled, num_accepted), rejected

    def reset(self) -> None:
        """Drop every request (a new scheduler took over)."""
        for req_id in list(self.states.slot_of):
            slot = self.states.remove(req_id)
            if slot is not None:
                self.drafter.remove(slot)
        self.draft_tokens.begin_step(-1)

    def take_draft_tokens(self) -> DraftTokenIds | None:
        return self.draft_tokens.get_draft_tokens()

    # -- parts ----------------------------------------------------------------------------------
    def update_requests(self, sched: SchedulerOutput) -> list[WorkerRequestError]:
        gone = [*sched.finished_req_ids, *sched.aborted_req_ids]
        for req_id in gone:
            slot = self.states.remove(req_id)
            if slot is not None:
                self.drafter.remove(slot)
        self.draft_tokens.discard(gone)
        rejected = []
        for req in sched.new_requests:
            try:
                self.states.add(req, self.max_num_draft_tokens)
            except WorkerRequestError as e:
                rejected.append(e)
        return rejected

    def prepare(self, sched: SchedulerOutput, skip: set[str]) -> StepBatch:
        st = self.states
        n_reqs = len(sched.req_ids)
        if not (len(sched.num_scheduled_tokens) == len(sched.num_draft_tokens) == n_reqs):
            raise StepError(
                "bad_step",
                f"step {sched.step_id}: {n_reqs} req_ids but "
                f"{len(sched.num_scheduled_tokens)} token counts and "
                f"{len(sched.num_draft_tokens)} draft widths",
            )
        if int(sched.num_draft_tokens.sum()) != len(sched.draft_token_ids):
            raise StepError(
                "bad_step",
                f"step {sched.step_id}: draft widths sum to "
                f"{int(sched.num_draft_tokens.sum())} but {len(sched.draft_token_ids)} "
                "draft ids were sent",
            )
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
        for i, req_id in enumerate(sched.req_ids):
            n = int(sched.num_scheduled_tokens[i])
            w = int(sched.num_draft_tokens[i])
            d_off, sched_off = sched_off, sched_off + w
            if req_id in skip:
                continue
            slot = st.slot_of.get(req_id)
            if slot is None:
                raise StepError(
                    "unknown_request",
                    f"step {sched.step_id}: request {req_id!r} is not running on this worker",
                    req_id,
                )
            if (
                sched.draft_widths_are_caps
                and w > int(st.num_drafts[slot])
                and (sched.draft_token_ids[d_off : d_off + w] < 0).all()
            ):
                # overlap: the width was chosen before the drafts existed; run the ones we have
                # (a width with real ids in it was built from drafts the scheduler saw: exact)
                n, w = n - w + int(st.num_drafts[slot]), int(st.num_drafts[slot])
            c, length = int(st.num_computed[slot]), int(st.num_tokens[slot])
            m = n - w
            if m < 1 or c + m > length:
                raise StepError(
                    "bad_step",
                    f"step {sched.step_id}: request {req_id!r} scheduled "
                    f"{n} tokens with {w} drafts, but has {length - c} uncomputed "
                    "tokens",
                    req_id,
                )
            if w and c + m != length:
                raise StepError(
                    "bad_step", f"request {req_id!r}: drafts scheduled during prefill", req_id
                )
            placeholders = sched.draft_token_ids[d_off : d_off + w] < 0
            if (sched.draft_token_ids[d_off : d_off + w] >= self.vocab_size).any():
                raise StepError(
                    "bad_step",
                    f"request {req_id!r}: a draft id is outside the "
                    f"vocabulary of {self.vocab_size}",
                    req_id,
                )
            proposed = int(st.num_drafts[slot])
            if placeholders.any() and int(np.flatnonzero(placeholders).max()) >= proposed:
                raise StepError(
                    "width_mismatch",
                    f"step {sched.step_id}: request {req_id!r} scheduled {w} drafts but the "
                    f"worker proposed {proposed}",
                    req_id,
                )
            if c + n > st.max_model_len:
                raise StepError(
                    "too_long",
                    f"request {req_id!r} would reach position {c + n}, "
                    f"over max_model_len {st.max_model_len}",
                    req_id,
                )
            ids_np.append(st.token_ids[slot, c : c + m])
            ids_np.append(np.where(placeholders, 0, sched.draft_token_ids[d_off : d_off + w]))
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
        device = self.device
        input_ids = (
            torch.from_numpy(np.concatenate(ids_np).astype(np.int64))
            if ids_np
            else torch.zeros(0, dtype=torch.long)
        )
        input_ids = input_ids.to(device, non_blocking=True)
        if own_flat:
            # Drafts the worker kept on its device fill the placeholders (scheduler ids stay):
            # one index copy and one scatter for the whole batch.
            idx = torch.from_numpy(np.array([own_flat, own_slot, own_col], np.int64)).to(
                device, non_blocking=True
            )  # [3, num_placeholders]
            input_ids[idx[0]] = st.draft_token_ids[idx[1], idx[2]]
        positions = torch.from_numpy(
            np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
            if counts
            else np.zeros(0, np.int64)
        ).to(device, non_blocking=True)
        kmax = max((widths[i] for i in sample_idx), default=0)
        drafts = torch.zeros((len(sample_idx), max(kmax, 1)), dtype=torch.long, device=device)
        # [S, K] drafts of the sampling requests, gathered from the flat input in one go
        ends = np.cumsum(counts)
        rows = [j for j, i in enumerate(sample_idx) for _ in range(widths[i])]
        cols = [c for i in sample_idx for c in range(widths[i])]
        src = [int(ends[i]) - widths[i] + c for i in sample_idx for c in range(widths[i])]
        if rows:
            gather = torch.from_numpy(np.array([rows, cols, src], np.int64)).to(
                device, non_blocking=True
            )  # [3, num_drafts]
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
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=device),
            cu_rows=cu_rows,
            draft_token_ids=drafts,
            own_drafts=own,
        )

    def plan_grammar(self, sched: SchedulerOutput, batch: StepBatch) -> tuple[list[int], list[int]]:
        """Check the bitmask layout before anything runs; returns (logit rows, bitmask rows): each
        structured request's rows go onto exactly its own logit rows."""
        if not sched.structured_req_ids:
            return [], []
        cu, bitmask = sched.cu_bitmask_rows, sched.grammar_bitmask
        words = (self.vocab_size + 31) // 32
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
        self,
        sched: SchedulerOutput,
        batch: StepBatch,
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
            if self.states.sampling[slot].temperature != 0:  # type: ignore[union-attr]
                raise StepError(
                    "bad_step",
                    f"step {sched.step_id}: deferred bitmask for sampled request {req_id!r} "
                    "(only greedy requests may be deferred)",
                    req_id,
                )

    def plan_deferred(
        self, sched: SchedulerOutput, msg: StepBitmask, batch: StepBatch
    ) -> tuple[tuple[list[int], list[int]], dict[int, int]]:
        """Logit rows <- deferred bitmask rows: request position i takes row min(i, valid), and
        acceptance is capped at ``valid`` (positions past it are never accepted, so their row
        does not matter). Returns the plan and {sampling index: cap}."""
        words = (self.vocab_size + 31) // 32
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
        self,
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

    def accept(
        self, sched: SchedulerOutput, batch: StepBatch, logits: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Verify drafts. The one designed host sync for sampled tokens is the copy at the end."""
        if not batch.sample_idx:
            return np.zeros((0, 1), np.int64), np.zeros(0, np.int64)
        params = [self.states.sampling[batch.slots[i]] for i in batch.sample_idx]
        if all(p.temperature == 0 for p in params):  # type: ignore[union-attr]
            return self._accept_greedy(batch, logits)
        device = self.device
        k = batch.draft_token_ids.shape[1]
        # A fixed number of draws per request and step, whatever the batch's widest draft: a
        # seeded request's output must not depend on who shares its batch.
        draws = self.max_num_draft_tokens + 2
        uniforms = torch.stack(
            [
                torch.rand(draws, generator=p.generator, device=device)[: k + 2]  # type: ignore[union-attr]
                for p in params
            ]
        )
        inp = VerifyInput(
            logits=logits,
            cu_rows=batch.cu_rows,
            num_drafts=[batch.num_drafts[i] for i in batch.sample_idx],
            draft_token_ids=batch.draft_token_ids,
            draft_probs=self._draft_probs(batch, sched),
            temperature=torch.tensor([p.temperature for p in params], device=device),  # type: ignore[union-attr]
            top_k=torch.tensor([p.top_k for p in params], device=device),  # type: ignore[union-attr]
            top_p=torch.tensor([p.top_p for p in params], device=device),  # type: ignore[union-attr]
            greedy=torch.tensor([p.temperature == 0 for p in params], device=device),  # type: ignore[union-attr]
            uniforms=uniforms,
            all_greedy=all(p.temperature == 0 for p in params),  # type: ignore[union-attr]
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),  # type: ignore[union-attr]
        )
        out = verify(inp)
        return out.output_token_ids.cpu().numpy(), out.num_accepted.cpu().numpy()

    def _accept_greedy(
        self, batch: StepBatch, logits: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        # The draft verified at logit row r is the input token right after row r's position;
        # the bonus row's successor is read too (clamped) and never compared.
        succ = (batch.logits_indices + 1).clamp(max=len(batch.input_ids) - 1)
        return verify_greedy(
            logits, batch.input_ids[succ], batch.cu_rows, batch.draft_token_ids.shape[1]
        )

    def _draft_probs(self, batch: StepBatch, sched: SchedulerOutput) -> torch.Tensor | None:
        """q for each verified draft: the drafter's distribution where the worker's own draft is
        used; an all-zero row (read as one-hot by ``verify``) where the scheduler supplied the id."""
        probs = self._last_probs
        if probs is None:
            return None
        k = batch.draft_token_ids.shape[1]
        out = torch.zeros((len(batch.sample_idx), k, probs.shape[-1]), device=probs.device)
        for j, i in enumerate(batch.sample_idx):
            r = self._last_row_of.get(batch.slots[i], -1)
            w = min(batch.num_drafts[i], probs.shape[1])
            if r < 0 or w == 0:
                continue
            own = torch.from_numpy(batch.own_drafts[i][:w]).to(probs.device)
            out[j, :w] = probs[r, :w] * own[:, None]
        return out

    def commit(self, batch: StepBatch, tokens: np.ndarray, num_accepted: np.ndarray) -> list[int]:
        """Append sampled tokens; move each request's computed length past its accepted drafts.
        Rejected positions stay in the cache and are overwritten later."""
        st = self.states
        num_sampled = [0] * len(batch.req_ids)
        for i, slot in enumerate(batch.slots):
            c = st.num_computed[slot]
            st.num_computed[slot] = c + batch.num_scheduled[i] - batch.num_drafts[i]
        for j, i in enumerate(batch.sample_idx):
            slot = batch.slots[i]
            a = int(num_accepted[j])
            st.append(slot, tokens[j, : a + 1].tolist())
            st.num_computed[slot] += a
            num_sampled[i] = a + 1
        return num_sampled

    def feed_hidden_states(
        self, batch: StepBatch, hidden: torch.Tensor, num_accepted: np.ndarray
    ) -> None:
        """The target's hidden states of the positions this step committed (prefill tokens, the
        last token and the accepted drafts; never a rejected draft's) go to the drafter."""
        accepted = dict(zip(batch.sample_idx, num_accepted.tolist(), strict=True))
        rows: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        flat = 0
        for i, slot in enumerate(batch.slots):
            n, w, c = batch.num_scheduled[i], batch.num_drafts[i], batch.start_positions[i]
            valid = n - w + accepted.get(i, 0)
            rows.extend(range(flat, flat + valid))
            slots.extend([slot] * valid)
            positions.extend(range(c, c + valid))
            flat += n
        states = get_drafter_hidden_states(self.target.model, hidden)  # [num_tokens, H]
        self.drafter.observe(
            np.asarray(slots, np.int64),
            np.asarray(positions, np.int64),
            states[torch.tensor(rows, device=hidden.device)],
        )

    def propose_drafts(self, batch: StepBatch) -> None:
        st = self.states
        slots = [batch.slots[i] for i in batch.sample_idx]
        req_ids = [batch.req_ids[i] for i in batch.sample_idx]
        widths = [
            int(min(st.num_speculative[s], st.max_model_len - st.num_tokens[s])) for s in slots
        ]
        self._last_probs, self._last_row_of = None, {}
        if not slots:
            return
        proposal = self.drafter.propose(st, slots, widths)
        num = np.asarray(proposal.num_drafts, np.int64)
        st.num_drafts[slots] = num
        if num.any():
            # one scatter for the batch; columns past a request's num_drafts are never read
            width = min(proposal.token_ids.shape[1], st.draft_token_ids.shape[1])
            index = torch.from_numpy(np.asarray(slots, np.int64)).to(self.device, non_blocking=True)
            st.draft_token_ids[index, :width] = proposal.token_ids[:, :width]
        if proposal.probs is not None:
            self._last_probs = proposal.probs
            self._last_row_of = {s: j for j, s in enumerate(slots)}
        self.draft_tokens.set_draft_tokens(
            req_ids,
            proposal.token_ids,
            num,
            st.num_tokens[slots],
            st.structured[slots],
        )

    def output(
        self,
        step_id: int,
        batch: StepBatch,
        tokens: np.ndarray,
        num_sampled: list[int],
        num_accepted: np.ndarray,
    ) -> ModelRunnerOutput:
        flat = [tokens[j, : num_sampled[i]] for j, i in enumerate(batch.sample_idx)]
        accepted = np.zeros(len(batch.req_ids), np.int32)
        drafts = np.zeros(len(batch.req_ids), np.int32)
        for j, i in enumerate(batch.sample_idx):
            accepted[i] = num_accepted[j]
            drafts[i] = batch.num_drafts[i]
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=batch.req_ids,
            num_sampled=np.asarray(num_sampled, np.int32),
            sampled_token_ids=np.concatenate(flat).astype(np.int32)
            if flat
            else np.zeros(0, np.int32),
            num_draft_tokens=drafts,
            num_accepted=accepted,
        )
