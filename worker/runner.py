"""The step loop's body: execute one ``SchedulerOutput``.

What belongs here: sequencing (update the batch, one target forward, grammar rows, verify, commit,
draft). What does not: the step's layout and the checks that keep the scheduler and the worker in
agreement (step_batch.py), placing grammar rows (grammar_rows.py), attention (attention.py), sampling
math (rejection.py, sampling.py), drafting (drafters/), the host copy of drafts (draft_tokens.py),
sockets (service.py).

A step for request r with ``num_computed`` c, committed length L, scheduled n tokens of which w are
drafts: the worker runs tokens[c : c + n - w] plus the w drafts at positions c .. c + n - 1. When
c + n - w == L the request samples: its last w + 1 positions are verified and 1 + num_accepted tokens
are committed; otherwise it was a prefill chunk and nothing is sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from protocol.messages import DraftTokenIds, ModelRunnerOutput, SchedulerOutput, StepBitmask
from worker.chain import ACCEPTED, FOUND, HEAD, START, USED, DeviceMirror
from worker.draft_tokens import DraftTokensHandler
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.ngram import NgramDrafter
from worker.grammar_rows import apply_grammar, plan_deferred, plan_grammar
from worker.host_copy import HostCopy, to_device
from worker.model_executor import ModelExecutor
from worker.model_loader import eos_token_ids
from worker.rejection import VerifyInput, verify, verify_greedy
from worker.requests import RequestStates, SamplingState, WorkerRequestError
from worker.spec_utils import get_drafter_hidden_states
from worker.step_batch import StepBatch, StepError, build_step_batch, flat_ranges
from worker.step_checks import StepLimits, check_bitmask, check_step


class DraftPlan(NamedTuple):
    """What is proposed after a step (``ModelRunner._draft_plan``): the requests that sampled
    (slots), their lengths after the step, the widths to propose, and whether a request left
    while the step was open (then every width is 0)."""

    slots: list[int]
    lengths: np.ndarray
    widths: list[int]
    left: bool


@dataclass(eq=False)
class LaunchedStep:
    """A step launched by ``ModelRunner.launch``, for ``ModelRunner.finish`` to answer.

    A closed step has its tokens on the host and committed. An open one (``launch(hold=True)``)
    has them on the device (``device_tokens`` [S]) with their copy to the host queued behind the
    kernels; ``owners`` [S, 3] names where each goes: (slot, the slot's generation, position; -1
    where the request was already at its length limit)."""

    sched: SchedulerOutput
    batch: StepBatch
    rejected: list[WorkerRequestError]
    tokens: np.ndarray | None = None  # [S, K + 1]
    num_accepted: np.ndarray | None = None  # [S]
    num_sampled: list[int] = field(default_factory=list)  # [B]
    committed: list[int] = field(default_factory=list)  # [S] (open) each sampler's length after it
    plan: DraftPlan | None = None  # what is proposed after it (``read_output`` sets it)
    open: bool = False
    # an open step that verifies or proposes drafts (``--chain-drafts``): its copy is packed
    # (``worker.chain``) and the host committed it as if every draft were accepted
    chained: bool = False
    quiet: bool = False  # (chained) it verified and proposed no drafts
    exact: bool = False  # (quiet, and nothing open before it leaves bounds) the host is exact
    widths: np.ndarray | None = None  # [S] (chained) the widths proposed after it, upper bounds
    found: np.ndarray | None = None  # [S] (chained, once read) the drafts found at those widths
    device_tokens: torch.Tensor | None = None
    owners: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    _copy: HostCopy | None = None

    @property
    def bounds(self) -> bool:
        """A chained step that leaves upper bounds on the host: only a chained step may be laid
        out behind it."""
        return self.chained and not self.exact

    def hold(self, sampled: torch.Tensor) -> None:
        """Keep ``sampled`` [S] on the device and queue its copy into pinned host memory."""
        self.open = True
        self.device_tokens = sampled
        self._copy = HostCopy(sampled)

    def ready(self) -> bool:
        """True once the step's kernels and its tokens' copy have run (finishing won't wait)."""
        return self._copy is None or self._copy.ready()

    def read_tokens(self) -> np.ndarray:
        """[S, 1] on the host: the one designed sync for an open step's sampled tokens."""
        return self.read_copy()[:, None]

    def read_copy(self) -> np.ndarray:
        """What ``hold`` queued, on the host (int64): a chained step's packed rows."""
        assert self._copy is not None
        return self._copy.read().astype(np.int64)


class ModelRunner:
    def __init__(
        self,
        target: ModelExecutor,
        drafter: Drafter,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_draft_tokens: int,
        chain_drafts: bool = False,
    ) -> None:
        self.target = target
        self.drafter = drafter
        drafter.bind(target)
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.max_num_draft_tokens = max_num_draft_tokens
        self.states = RequestStates(
            vocab_size=target.vocab_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_draft_tokens=max_num_draft_tokens,
            device=self.device,
            eos_token_ids=eos_token_ids(target.model),
        )
        self.limits = StepLimits(
            vocab_size=target.vocab_size, max_num_draft_tokens=max_num_draft_tokens
        )
        self.draft_tokens = DraftTokensHandler(self.device)
        self.num_steps = 0
        # Draft distributions from the last proposal, for sampled verification: [P, K, V] and
        # slot -> row. None when the drafter has none (n-gram) or every request is greedy.
        self._last_probs: torch.Tensor | None = None
        self._last_row_of: dict[int, int] = {}
        self._open: list[LaunchedStep] = []  # launched with hold, not finished yet
        # what a step that asks for no drafts hands the DraftTokensHandler (never read there)
        self._no_drafts = torch.zeros((0, 1), dtype=torch.long, device=self.device)
        # --chain-drafts: prompt lookup's drafting steps left open (worker/chain.py)
        self.mirror: DeviceMirror | None = None
        if chain_drafts and isinstance(drafter, NgramDrafter):
            self.mirror = DeviceMirror(self.states, max(max_num_draft_tokens, 1))
        # slot -> the step after which its drafts were last proposed on the device
        self._proposed_at = np.full(max_num_seqs, -1, np.int64)

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        wait_bitmask: Callable[[int], StepBitmask] | None = None,
    ) -> tuple[ModelRunnerOutput, list[WorkerRequestError]]:
        """Run one step. Requests the worker refuses come back as errors; the rest run.
        ``wait_bitmask(step_id)`` returns the step's deferred grammar rows (overlap scheduling):
        it is called after the forward has been launched, before anything is sampled.

        A refused step (``StepError``: ``check_step`` before anything is applied, or its deferred
        rows) leaves every running request as it was and keeps none of its new requests; its
        finished and aborted ids are released all the same (the scheduler has let them go)."""
        return self.finish(self.launch(sched, wait_bitmask))

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        wait_bitmask: Callable[[int], StepBitmask] | None = None,
        *,
        hold: bool = False,
    ) -> LaunchedStep:
        """The step up to its sampled tokens: checks, layout, forward, grammar rows, sampling.

        With ``hold`` a step that verifies and proposes no drafts (``may_hold``) is left open: its
        sampled tokens stay on the device, copied to the host behind the kernels, and its commit
        is done in advance (each sampling request's length moves on by one token whose value is
        still on the device). The next step may then be launched before this one is finished:
        its layout reads those tokens on the device. ``finish`` reads them and answers."""
        chained = hold and self.may_chain(sched)
        assert chained or not any(s.bounds for s in self._open), "answer the chained step first"
        try:
            rejected = check_step(
                sched,
                self.states,
                self.limits,
                can_defer=wait_bitmask is not None,
                blocks=self.target.kv_cache.blocks,
            )
        except StepError:
            self.release(sched)  # the scheduler has let them go and never names them again
            raise
        added = self.update_requests(sched, rejected)
        try:
            batch = build_step_batch(
                sched, self.states, {e.req_id for e in rejected}, self.vocab_size, self.device
            )
            step = LaunchedStep(sched, batch, rejected)
            if not batch.req_ids:  # a step that only finishes or adds requests
                return step
            starts = None
            if chained:
                assert self.mirror is not None
                starts = self.mirror.first_tokens(batch)
            else:
                self._fill_open_tokens(batch)
            logits, hidden = self.target.forward(
                batch.input_ids,
                batch.positions,
                batch.slots,
                batch.start_positions,
                batch.num_scheduled,
                batch.logits_indices,
                device_starts=starts,
            )  # logits [num_logit_rows, vocab]
            if self.drafter.needs_hidden_states:
                # queued behind the forward now, not after the step's tokens reach the host
                self.store_hidden_states(batch, hidden)
            apply_grammar(sched.grammar_bitmask, plan_grammar(sched, batch), logits)
            caps: dict[int, int] = {}
            if sched.deferred_req_ids:
                assert wait_bitmask is not None
                deferred = wait_bitmask(sched.step_id)  # the GPU computes meanwhile
                check_bitmask(deferred, sched, self.vocab_size)
                plan, caps = plan_deferred(deferred, batch)
                apply_grammar(deferred.grammar_bitmask, plan, logits)
        except StepError:
            # Nothing of a refused step stays applied: its new requests leave again (the KV the
            # forward wrote past each request's computed length is overwritten before it is read,
            # and the blocks it took past that length go back).
            for req_id in added:
                self._drop(req_id)
            for slot in self.states.slot_of.values():
                self.target.kv_cache.trim(slot, int(self.states.num_computed[slot]))
            raise
        if chained:
            self._chain(step, logits)
            return step
        if hold and self.may_hold(sched, batch):
            self._hold(step, logits, hidden)
            return step
        tokens, num_accepted = self.accept(sched, batch, logits)
        for j, cap in caps.items():  # at most the drafts the grammar allows (greedy only)
            num_accepted[j] = min(int(num_accepted[j]), cap)
        step.num_sampled = self.commit(batch, tokens, num_accepted)
        step.tokens, step.num_accepted = tokens, num_accepted
        if self.mirror is not None:
            self.mirror.from_host(np.asarray(batch.slots, np.int64)[batch.sample_idx])
        if self.drafter.needs_hidden_states:
            self.feed_hidden_states(batch, num_accepted)
        return step

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> tuple[ModelRunnerOutput, list[WorkerRequestError]]:
        """A launched step's tokens on the host (an open step's copy waited for), its drafts
        proposed, and its output: ``read_output`` then ``propose_after``."""
        out = self.read_output(step)
        self.propose_after(step)
        return out

    @torch.inference_mode()
    def read_output(self, step: LaunchedStep) -> tuple[ModelRunnerOutput, list[WorkerRequestError]]:
        """A launched step's tokens on the host (an open step's copy waited for) and its output.
        The drafts for the next step come after it (``propose_after``): the service sends the
        output first, so the scheduler commits the step's tokens while the drafter works."""
        self.draft_tokens.begin_step(step.sched.step_id)
        batch = step.batch
        live: list[bool] | None = None  # per sampler: still in its slot (open steps only)
        if step.chained:
            return self._read_chained(step)
        if step.open:
            self._open.remove(step)
            step.tokens = step.read_tokens()
            st = self.states
            slots, generations, positions = step.owners.T
            alive = st.generation[slots] == generations
            kept = alive & (positions >= 0)
            st.token_ids[slots[kept], positions[kept]] = step.tokens[kept, 0]
            live = alive.tolist()
        self.num_steps += 1
        if not batch.req_ids:
            return self.output(
                step.sched.step_id, batch, np.zeros((0, 1), np.int64), [], np.zeros(0, np.int64)
            ), step.rejected
        assert step.tokens is not None and step.num_accepted is not None
        committed = step.committed if step.open else None
        step.plan = self._draft_plan(batch, step.sched.max_draft_proposals, live, committed)
        return self.output(
            step.sched.step_id, batch, step.tokens, step.num_sampled, step.num_accepted
        ), step.rejected

    def will_propose(self, step: LaunchedStep) -> bool:
        """Whether ``propose_after`` asks the drafter for any draft (a request with a width): the
        output's ``drafts_follow``, known before the drafter runs."""
        return step.plan is not None and any(step.plan.widths)

    @torch.inference_mode()
    def propose_after(self, step: LaunchedStep) -> None:
        """The drafts proposed after a step whose output was read (``read_output``); a chained
        step's were proposed on the device at its launch, and only their counts are set."""
        if step.plan is None:
            return
        if step.chained:
            plan, batch = step.plan, step.batch
            req_ids = [batch.req_ids[i] for i in batch.sample_idx]
            found = np.zeros(len(plan.slots), np.int64) if plan.left else step.found
            self.draft_tokens.set_draft_tokens(
                req_ids, self._no_drafts, found, plan.lengths, np.zeros(len(found), bool)
            )
            return
        self.propose_drafts(step.batch, step.plan, step.sched.step_id)

    def may_chain(self, sched: SchedulerOutput) -> bool:
        """``--chain-drafts``: whether the step is launched chained (left open whatever it
        verifies or proposes; ``worker.chain``). Every request a greedy, unconstrained decode
        already running, whose drafts are the worker's own (placeholder caps), with room in its
        context for this step and the next one's widest, on the decode graphs' path; no new
        request and no grammar rows; and, unless a chained step is open, drafts to verify or to
        propose. A step that may not be chained is launched only once an
        open chained step is answered (``WorkerLoop.step``)."""
        if self.mirror is None or not sched.req_ids or sched.new_requests:
            return False
        if not sched.num_draft_tokens.any() and not any(s.bounds for s in self._open):
            # verifies nothing: held (``may_hold``) where it proposes nothing either, a plain
            # open step being the cheaper one; behind a chained step it is chained all the same
            st = self.states
            slots = [st.slot_of.get(r, -1) for r in sched.req_ids]
            if sched.max_draft_proposals == 0 or not st.num_speculative[slots].any():
                return False
        if sched.grammar_bitmask is not None or sched.deferred_req_ids or sched.structured_req_ids:
            return False
        if not sched.draft_widths_are_caps or (sched.draft_token_ids >= 0).any():
            return False
        st = self.states
        slots = [st.slot_of.get(r, -1) for r in sched.req_ids]
        if min(slots) < 0 or len(set(slots)) != len(slots):
            return False
        counts = sched.num_scheduled_tokens.astype(np.int64)
        if counts.shape != sched.num_draft_tokens.shape or len(counts) != len(slots):
            return False
        s = np.asarray(slots, np.int64)
        computed = st.num_computed[s]
        if ((counts - sched.num_draft_tokens) != 1).any() or (
            computed + 1 != st.num_tokens[s]
        ).any():
            return False
        if (
            st.structured[s].any()
            or (st.num_tokens[s] + counts + self.max_num_draft_tokens + 1 > st.max_model_len).any()
        ):
            return False
        if any(st.sampling[i].temperature != 0 for i in slots):  # type: ignore[union-attr]
            return False
        return self.target.decode.fits(counts.tolist(), computed.tolist())

    def _chain(self, step: LaunchedStep, logits: torch.Tensor) -> None:
        """Leave a drafting step open (``worker.chain``): verify, place the accepted tokens and
        propose on the device, queue the packed copy to the host, and commit on the host as if
        every draft were accepted. ``_read_chained`` puts the host right."""
        assert self.mirror is not None and isinstance(self.drafter, NgramDrafter)
        batch, st = step.batch, self.states
        slots = np.asarray(batch.slots, np.int64)
        counts = np.asarray(batch.num_scheduled, np.int64)
        packed = self.mirror.verify(logits, batch)
        after = st.num_tokens[slots] + counts  # every draft accepted: an upper bound
        # upper bounds here; the room on the true lengths is held on the device (``propose``)
        cap = step.sched.max_draft_proposals
        widths = np.zeros(len(slots), np.int64)
        if cap != 0:
            widths = (
                st.num_speculative[slots] if cap < 0 else np.minimum(st.num_speculative[slots], cap)
            )
        self.mirror.propose(
            packed,
            slots,
            widths,
            int(after.max()),
            self.drafter.min_n,
            self.drafter.max_n,
            st.draft_token_ids,
        )
        step.hold(packed)
        step.chained, step.widths = True, widths
        st.num_computed[slots] += counts
        st.num_tokens[slots] = after
        # the mirror holds what the host now counts (true or upper bound): nothing of it is
        # copied from the host, whose tokens come when the step is read
        self.mirror.known[slots] = after
        st.num_drafts[slots] = widths
        self._proposed_at[slots] = step.sched.step_id
        step.quiet = not any(batch.num_drafts) and not widths.any()
        step.owners = np.stack([slots, st.generation[slots], np.zeros_like(slots)], axis=1)
        self._open.append(step)
        self._settle()

    def _settle(self) -> None:
        """The last open step, chained, quiet (it verified and proposed nothing) and with no
        step before it leaving upper bounds, is exact: every length the host holds is, and a
        held step may be laid out behind it, its token read as an open step's
        (``_fill_open_tokens``). Checked when it is launched and when the step before it is
        read."""
        if not self._open:
            return
        step = self._open[-1]
        if not step.quiet or step.exact or any(s.bounds for s in self._open[:-1]):
            return
        st = self.states
        slots, generations = step.owners[:, 0], step.owners[:, 1]
        alive = st.generation[slots] == generations
        step.owners[:, 2] = np.where(alive, st.num_tokens[slots] - 1, -1)
        assert step.device_tokens is not None
        step.device_tokens = step.device_tokens[:, HEAD]
        step.exact = True

    def _read_chained(
        self, step: LaunchedStep
    ) -> tuple[ModelRunnerOutput, list[WorkerRequestError]]:
        """A chained step's packed copy read: the host's lengths put right (less the drafts not
        accepted), its tokens written, its blocks past the true length given back, and its
        output. The drafts proposed after it are counted (``FOUND``) where no later step has
        proposed for the request since."""
        assert self.mirror is not None and step.widths is not None
        self._open.remove(step)
        st, batch = self.states, step.batch
        rows = step.read_copy()
        start, accepted, used = rows[:, START], rows[:, ACCEPTED], rows[:, USED]
        tokens = rows[:, HEAD:]
        slots, generations = step.owners[:, 0], step.owners[:, 1]
        alive = st.generation[slots] == generations
        counts = np.asarray(batch.num_scheduled, np.int64)
        cols = np.arange(tokens.shape[1])[None, :]
        kept = cols <= accepted[:, None]
        s, a = slots[alive], alive[:, None] & kept
        over = (counts - accepted - 1)[alive]
        st.num_tokens[s] -= over
        st.num_computed[s] -= over
        r, c = np.nonzero(a)
        st.token_ids[slots[r], start[r] + c] = tokens[r, c]
        self.mirror.known[s] = st.num_tokens[s]  # (later open steps' upper bounds included)
        mine = alive & (self._proposed_at[slots] == step.sched.step_id)
        st.num_drafts[slots[mine]] = rows[mine, FOUND]
        blocks = self.target.kv_cache.blocks
        for j in np.flatnonzero(blocks.blocks_for(st.num_computed[s]) < blocks.num_held[s]):
            self.target.kv_cache.trim(int(s[j]), int(st.num_computed[s[j]]))
        self._settle()
        self.num_steps += 1
        step.tokens = np.where(kept, tokens, -1)
        step.num_accepted = accepted
        step.num_sampled = (accepted + 1).tolist()
        batch.num_drafts = used.tolist()  # the drafts verified: what the output reports
        step.found = rows[:, FOUND]
        left = not alive.all()
        step.plan = DraftPlan(
            slots.tolist(), start + accepted + 1, (step.widths * (not left)).tolist(), left
        )
        return self.output(
            step.sched.step_id, batch, step.tokens, step.num_sampled, step.num_accepted
        ), step.rejected

    def may_hold(self, sched: SchedulerOutput, batch: StepBatch) -> bool:
        """A step may be left open when it samples, verifies no drafts and proposes none after
        it: a drafter proposes from the committed tokens, which an open step has not read back
        yet. Nothing is proposed without a drafter, when the scheduler caps the proposals at zero
        (its tuner turned drafting down: the step then takes no drafter's path), or when no
        request that samples has a speculation length."""
        if not batch.sample_idx or any(batch.num_drafts):
            return False
        if isinstance(self.drafter, NoDrafter) or sched.max_draft_proposals == 0:
            return True
        return not self.states.num_speculative[[batch.slots[i] for i in batch.sample_idx]].any()

    def _hold(self, step: LaunchedStep, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Sample on the device, queue the tokens' copy to the host, and commit the lengths (and
        give a drafter that reads them the target's hidden states: nothing was drafted, so every
        position the step ran is committed)."""
        batch, st = step.batch, self.states
        params = [st.sampling[batch.slots[i]] for i in batch.sample_idx]
        if all(p.temperature == 0 for p in params):  # type: ignore[union-attr]
            sampled = logits.argmax(-1)  # one logit row per request: no drafts
        else:
            sampled = verify(
                self._verify_input(step.sched, batch, logits, params)
            ).output_token_ids[:, 0]
        step.hold(sampled)
        num_sampled = np.zeros(len(batch.req_ids), np.int64)
        num_sampled[batch.sample_idx] = 1
        self._advance(batch)
        slots = np.asarray(batch.slots, np.int64)[batch.sample_idx]
        n = st.num_tokens[slots]
        room = n < st.max_model_len  # as ``RequestStates.append``: past the end, not kept
        if self.mirror is not None:
            self.mirror.from_host(slots)
            self.mirror.held(slots, np.where(room, n, -1), sampled)
        st.num_tokens[slots] = n + room
        step.owners = np.stack([slots, st.generation[slots], np.where(room, n, -1)], axis=1)
        step.committed = (n + room).tolist()
        self._trim(batch)
        # What finish's empty proposal would leave, now: the next step may be launched first,
        # and with overlap scheduling its widths are caps that run the drafts held (drafts
        # proposed before this step, for the position it has just filled, must not run).
        st.num_drafts[slots] = 0
        step.num_sampled = num_sampled.tolist()
        step.num_accepted = np.zeros(len(batch.sample_idx), np.int64)
        if self.drafter.needs_hidden_states:
            self.feed_hidden_states(batch, step.num_accepted)
        self._open.append(step)

    def _fill_open_tokens(self, batch: StepBatch) -> None:
        """Tokens that open steps sampled and this step runs: read on the device, where the
        layout holds a stale host value."""
        if not self._open:
            return
        st = self.states
        where = np.full(st.max_num_seqs + 1, -1, np.int64)  # slot -> its index in the batch
        where[batch.slots] = np.arange(len(batch.slots))
        counts = np.asarray(batch.num_scheduled, np.int64)
        flat_start = np.cumsum(counts) - counts
        ran = counts - np.asarray(batch.num_drafts, np.int64)  # tokens run, drafts aside
        starts = np.asarray(batch.start_positions, np.int64)
        dst: list[np.ndarray] = []
        values: list[torch.Tensor] = []
        for step in self._open:
            slots, generations, positions = step.owners.T
            i = where[slots]
            offset = positions - starts[i]
            rows = np.flatnonzero(
                (i >= 0)
                & (positions >= 0)
                & (st.generation[slots] == generations)
                & (offset >= 0)
                & (offset < ran[i])
            )  # of step.device_tokens
            if rows.size:
                assert step.device_tokens is not None
                dst.append(flat_start[i[rows]] + offset[rows])
                values.append(step.device_tokens[to_device(rows, self.device)])
        if dst:
            batch.input_ids[to_device(np.concatenate(dst), self.device)] = torch.cat(values).to(
                batch.input_ids.dtype
            )

    def reset(self) -> None:
        """Drop every request (a new scheduler took over)."""
        self._open.clear()
        for req_id in list(self.states.slot_of):
            self._drop(req_id)
        self.draft_tokens.begin_step(-1)

    def take_draft_tokens(self) -> DraftTokenIds | None:
        return self.draft_tokens.get_draft_tokens()

    # -- parts ----------------------------------------------------------------------------------
    def release(self, sched: SchedulerOutput) -> None:
        """The step's finished and aborted requests leave (unknown ids are ignored)."""
        gone = [*sched.finished_req_ids, *sched.aborted_req_ids]
        for req_id in gone:
            self._drop(req_id)
        self.draft_tokens.discard(gone)

    def _drop(self, req_id: str) -> None:
        """A request leaves: its slot, its KV blocks and the drafter's state for it."""
        slot = self.states.remove(req_id)
        if slot is not None:
            self.target.kv_cache.free(slot)
            self.drafter.remove(slot)

    def update_requests(
        self, sched: SchedulerOutput, rejected: list[WorkerRequestError]
    ) -> list[str]:
        """Apply a checked step's request changes: release, then add every new request that was
        not refused. Returns the ids added."""
        self.release(sched)
        refused = {e.req_id for e in rejected}
        added = [r.req_id for r in sched.new_requests if r.req_id not in refused]
        slots = [
            self.states.add(req, self.max_num_draft_tokens)
            for req in sched.new_requests
            if req.req_id not in refused
        ]
        if self.mirror is not None and slots:
            self.mirror.add(slots)
        return added

    def accept(
        self, sched: SchedulerOutput, batch: StepBatch, logits: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Verify drafts. The one designed host sync for sampled tokens is the copy at the end."""
        if not batch.sample_idx:
            return np.zeros((0, 1), np.int64), np.zeros(0, np.int64)
        params = [self.states.sampling[batch.slots[i]] for i in batch.sample_idx]
        if all(p.temperature == 0 for p in params):  # type: ignore[union-attr]
            return self._accept_greedy(batch, logits)
        out = verify(self._verify_input(sched, batch, logits, params))
        return out.output_token_ids.cpu().numpy(), out.num_accepted.cpu().numpy()

    def _verify_input(
        self,
        sched: SchedulerOutput,
        batch: StepBatch,
        logits: torch.Tensor,
        params: list[SamplingState | None],
    ) -> VerifyInput:
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
        return VerifyInput(
            logits=logits,
            cu_rows=batch.cu_rows,
            num_drafts=[batch.num_drafts[i] for i in batch.sample_idx],
            draft_token_ids=batch.draft_token_ids,
            draft_probs=self._draft_probs(batch, sched),
            temperature=to_device([p.temperature for p in params], device, torch.float32),  # type: ignore[union-attr]
            top_k=to_device([p.top_k for p in params], device),  # type: ignore[union-attr]
            top_p=to_device([p.top_p for p in params], device, torch.float32),  # type: ignore[union-attr]
            greedy=to_device([p.temperature == 0 for p in params], device, torch.bool),  # type: ignore[union-attr]
            uniforms=uniforms,
            all_greedy=all(p.temperature == 0 for p in params),  # type: ignore[union-attr]
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),  # type: ignore[union-attr]
        )

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
            own = to_device(batch.own(i)[:w], probs.device, dtype=None)
            out[j, :w] = probs[r, :w] * own[:, None]
        return out

    def commit(self, batch: StepBatch, tokens: np.ndarray, num_accepted: np.ndarray) -> list[int]:
        """Append sampled tokens; move each request's computed length past its accepted drafts.
        Rejected positions stay in the cache and are overwritten later."""
        st = self.states
        num_sampled = [0] * len(batch.req_ids)
        self._advance(batch)
        if batch.sample_idx:
            # every sampling request's tokens appended at once (as ``RequestStates.append``:
            # past max_model_len they are not kept)
            slots = np.asarray(batch.slots, np.int64)[batch.sample_idx]
            accepted = np.asarray(num_accepted, np.int64)
            length = st.num_tokens[slots]
            take = np.minimum(accepted + 1, st.max_model_len - length)
            offsets = flat_ranges(0, take)
            rows = np.repeat(np.arange(len(slots)), take)
            st.token_ids[np.repeat(slots, take), np.repeat(length, take) + offsets] = tokens[
                rows, offsets
            ]
            st.num_tokens[slots] = length + take
            st.num_computed[slots] += accepted
            sampled = np.zeros(len(batch.req_ids), np.int64)
            sampled[batch.sample_idx] = accepted + 1
            num_sampled = sampled.tolist()
        self._trim(batch)
        return num_sampled

    def _advance(self, batch: StepBatch) -> None:
        """Each request's computed length past the tokens it ran, less its drafts (a slot is
        scheduled at most once a step)."""
        self.states.num_computed[batch.slots] += np.subtract(
            batch.num_scheduled, batch.num_drafts, dtype=np.int64
        )

    def _trim(self, batch: StepBatch) -> None:
        """Blocks wholly past the computed length (rejected drafts) go back: between steps a
        request holds ceil(num_computed / block_size) blocks, as the scheduler counts them."""
        blocks = self.target.kv_cache.blocks
        slots = np.asarray(batch.slots, np.int64)
        computed = self.states.num_computed[slots]
        over = blocks.blocks_for(computed) < blocks.num_held[slots]
        for j in np.flatnonzero(over).tolist():
            self.target.kv_cache.trim(int(slots[j]), int(computed[j]))

    def store_hidden_states(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """The target's hidden states of every token the forward ran go to the drafter, at their
        KV-cache rows (a rejected draft's state is overwritten when its position runs again, as
        its keys are). Device work only, queued right behind the forward."""
        total = sum(batch.num_scheduled)  # the forward's real tokens (padding after them)
        states = get_drafter_hidden_states(self.target.model, hidden)  # [num_tokens, H]
        self.drafter.observe(self.target.last_cache_rows()[:total], states[:total])

    def feed_hidden_states(self, batch: StepBatch, num_accepted: np.ndarray) -> None:
        """Each request's committed length after the step, whose positions' hidden states the
        drafter now holds (prefill tokens, the last token and the accepted drafts count)."""
        valid = np.subtract(batch.num_scheduled, batch.num_drafts, dtype=np.int64)
        valid[batch.sample_idx] += num_accepted
        self.drafter.committed(
            np.asarray(batch.slots, np.int64), np.asarray(batch.start_positions, np.int64) + valid
        )

    def _draft_plan(
        self,
        batch: StepBatch,
        cap: int,
        live: list[bool] | None,
        committed: list[int] | None,
    ) -> DraftPlan:
        """What is proposed after the step: for every request that sampled, at most its own
        width, the room left in its context, and ``cap`` (the scheduler's
        ``max_draft_proposals``; -1: no cap). ``committed`` [S] each one's length after the step
        (default: its length now); ``live`` [S] (an open step's): False for a request that left
        while the step was open."""
        st = self.states
        slots = [batch.slots[i] for i in batch.sample_idx]
        lengths = st.num_tokens[slots] if committed is None else np.asarray(committed, np.int64)
        # only an open step sees its requests leave, and a step is held only when it proposes
        # nothing (may_hold): there are no drafts to keep, and a slot taken since is not touched
        # (``_hold`` cleared the drafts of every request still in its slot)
        left = live is not None and not all(live)
        widths: list[int] = []
        # without a drafter requests still have widths (the scheduler's grammar-forced drafts),
        # and nothing is proposed for them: no DraftTokenIds follows
        drafting = not left and bool(slots) and not isinstance(self.drafter, NoDrafter)
        if drafting and cap == 0:
            widths = [0] * len(slots)  # the tuner keeps drafting off: no width to weigh
        elif drafting:
            room = np.minimum(st.num_speculative[slots], st.max_model_len - st.num_tokens[slots])
            # no more than the scheduler verifies (its output one token short of max_tokens),
            # and nothing for a request that this step ended (its length, a stop or
            # end-of-sequence token): the scheduler would wait for drafts nobody verifies before
            # it schedules the request that takes its place (a draft model's proposal, h100-s27)
            room = np.minimum(room, np.maximum(st.end_len[slots] - lengths - 1, 0))
            last = st.token_ids[slots, np.maximum(lengths, 1) - 1].tolist()
            for j, slot in enumerate(slots):
                if last[j] in st.end_ids[slot]:
                    room[j] = 0
            widths = (room if cap < 0 else np.minimum(room, cap)).tolist()
        return DraftPlan(slots, lengths, widths, left)

    def propose_drafts(self, batch: StepBatch, plan: DraftPlan, step_id: int = -1) -> None:
        """Drafts for every request that sampled, at the widths of ``plan``.

        Every request that sampled is listed in the step's ``DraftTokenIds`` (the scheduler
        waits for one after an output that sampled), with its length after the step; after an
        open step that a request left, every request is listed with width 0. ``step_id``: the
        step proposed after (a request a later chained step has proposed for keeps those)."""
        st = self.states
        slots, lengths, widths, left = plan
        req_ids = [batch.req_ids[i] for i in batch.sample_idx]
        self._last_probs, self._last_row_of = None, {}
        if not slots:
            return
        if not any(widths):
            # nothing to propose (a request left, the tuner keeps drafting at zero, or no
            # request has room): every drafter would return an empty proposal; the prompt-lookup
            # one built it in a loop over the requests and copied it to the device, 41 us a step
            # at batch 64 (CPU)
            none = np.zeros(len(slots), np.int64)
            if not left:
                st.num_drafts[np.asarray(slots)[self._proposed_at[slots] <= step_id]] = 0
            self.draft_tokens.set_draft_tokens(
                req_ids, self._no_drafts, none, lengths, none.astype(bool)
            )
            return
        proposal = self.drafter.propose(st, slots, widths)
        num = np.asarray(proposal.num_drafts, np.int64)
        st.num_drafts[slots] = num
        if self.mirror is not None:  # what a chained step behind verifies at the most
            both = to_device(np.concatenate([slots, num]), self.device)
            self.mirror.found[both[: len(slots)]] = both[len(slots) :]
        if num.any():
            # one scatter for the batch; columns past a request's num_drafts are never read
            width = min(proposal.token_ids.shape[1], st.draft_token_ids.shape[1])
            index = to_device(slots, self.device)
            st.draft_token_ids[index, :width] = proposal.token_ids[:, :width]
        if proposal.probs is not None:
            self._last_probs = proposal.probs
            self._last_row_of = {s: j for j, s in enumerate(slots)}
        self.draft_tokens.set_draft_tokens(
            req_ids, proposal.token_ids, num, lengths, st.structured[slots]
        )

    def output(
        self,
        step_id: int,
        batch: StepBatch,
        tokens: np.ndarray,
        num_sampled: list[int],
        num_accepted: np.ndarray,
    ) -> ModelRunnerOutput:
        # over the batch as arrays: a request at a time this was two loops of the batch a step
        sample = np.asarray(batch.sample_idx, np.int64)
        sampled = np.asarray(num_sampled, np.int32)
        accepted = np.zeros(len(batch.req_ids), np.int32)
        drafts = np.zeros(len(batch.req_ids), np.int32)
        accepted[sample] = num_accepted
        drafts[sample] = np.asarray(batch.num_drafts, np.int32)[sample]
        # each sampling request's first num_sampled tokens, row by row
        kept = np.arange(tokens.shape[1])[None, :] < sampled[sample][:, None]
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=batch.req_ids,
            num_sampled=sampled,
            sampled_token_ids=tokens[kept].astype(np.int32),
            num_draft_tokens=drafts,
            num_accepted=accepted,
        )
