"""Continuous batching with grammar-validated drafts and per-position bitmasks.

The scheduler owns requests: it picks each step's batch under a token budget and a request limit
(chunked prefill), validates every request's drafts against its grammar when they arrive, builds
``1 + width`` bitmask rows for each structured request that samples, commits what the worker
sampled (grammar, stop conditions, detokenization) and keeps the committed tokens: they are the
truth a restarted worker is replayed from.

One step, in order: ``schedule()`` -> worker -> ``update(ModelRunnerOutput)`` ->
``take_drafts(DraftTokenIds)`` (or ``no_drafts(ModelRunnerOutput)`` when the worker sent none:
``drafts_follow``) -> ``schedule()`` ...
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from protocol.messages import (
    DraftTokenIds,
    ModelRunnerOutput,
    NewRequest,
    SchedulerOutput,
    StepBitmask,
)
from scheduler_client.bitmask_rows import deferred_rows, step_rows
from scheduler_client.grammar import GrammarBackend, GrammarError
from scheduler_client.kv_blocks import KVBlocks
from scheduler_client.metrics import RequestMetrics
from scheduler_client.request import Request, Status
from scheduler_client.request_checks import request_problem
from scheduler_client.spec_guard import SpeculationGuard
from scheduler_client.spec_tuner import PLAIN_RUN, SpeculationTuner
from scheduler_client.stop_strings import StopStrings
from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo

_PLACEHOLDERS = [np.full(n, -1, np.int32) for n in range(65)]  # shared, never written
for _row in _PLACEHOLDERS:
    _row.flags.writeable = False
NO_DRAFTS = _PLACEHOLDERS[0]


def placeholders(n: int) -> np.ndarray:
    """``n`` draft placeholders (-1: the worker's own drafts), read-only; shared up to 64."""
    return _PLACEHOLDERS[n] if n < len(_PLACEHOLDERS) else np.full(n, -1, np.int32)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``max_num_seqs`` (running requests) and ``max_num_batched_tokens`` (tokens per step): None
    takes the worker's own value from its handshake; a value above the worker's is refused when
    the scheduler starts (``resolve_limits``)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int = 512
    forced_drafts: bool = True  # offer grammar-forced tokens as drafts
    # choose each decode step's draft width from measured goodput (spec_tuner.py); off: always
    # verify every draft the request has
    adaptive_speculation: bool = True
    # with adaptive speculation: windows of steps with drafting off are compared with those the
    # tuner drafts in, by their output tokens a second, and drafting that loses is turned off
    # (spec_guard.py)
    speculation_guard: bool = True
    # overlap (async) scheduling: the next step is sent before this one's output arrives, with
    # draft widths as caps and structured greedy requests' bitmasks deferred (StepBitmask);
    # None: from the worker's handshake, on when it leaves steps open (``resolve_mode``)
    async_scheduling: bool | None = None
    # with overlap: the most steps sent whose output has not arrived (2: the next step is sent
    # before this one's output; 3: a worker with --pipeline-steps has the step after that too
    # while the scheduler commits); None: 3 for a worker that leaves steps open, else 2
    max_steps_in_flight: int | None = None
    # with overlap: two steps in flight while the worker drafts and the scheduler's turnaround
    # is short against a step (a draft model's), max_steps_in_flight otherwise (... auto)
    steps_in_flight_auto: bool = False
    # the share of the KV blocks a new request may not take when admitted (vLLM's watermark):
    # growth room for the running ones. Admitted to the last block, every request's next token
    # preempted the newest; at 8192 x 4 slots of blocks and ~1k-token requests, 0 gave 269
    # preemptions for 96 requests and 0.04 gave 12, 35.8 against 35.0 running (performance.md)
    kv_watermark: float = 0.04

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1 (or None: the worker's)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1 (or None: the worker's)")
        if self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be >= 1")
        if self.max_steps_in_flight is not None and not 2 <= self.max_steps_in_flight <= 4:
            raise ValueError("--max-steps-in-flight must be between 2 and 4")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError("--kv-watermark must be >= 0 and < 1")


@dataclass(frozen=True)
class WorkerLimits:
    """What the worker's handshake told us."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    max_num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int = 0  # 0: the worker did not say (protocol minor < 2)
    num_kv_blocks: int = 0  # 0: the worker did not say (protocol minor < 4): slots only
    kv_block_size: int = 0
    pipeline_steps: bool = False  # it leaves steps without drafts open (protocol minor 7)


# the token budget when neither the user nor the worker (protocol minor < 2) names one
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DRAFT_HITS_EMA = 0.25  # weight of a step in a request's draft hit rate (Request.draft_hits)
HITS_POOL_KEEP = 0.995  # the pooled hit rate's counts kept this much a request's ask


def defers_rows(req: Request) -> bool:
    """Overlap: placed while its last token is still being sampled, a greedy structured request
    gets its grammar rows in a later message (``StepBitmask``); a sampled one is not placed."""
    return req.matcher is not None and req.sampling.temperature == 0


def resolve_mode(config: SchedulerConfig, limits: WorkerLimits) -> tuple[bool, int]:
    """(overlap scheduling, the most steps in flight): the user's, or where left unset (None)
    the worker's handshake's. A worker that leaves steps without drafts open (``--pipeline-steps``,
    its default on CUDA) gets overlap scheduling with three steps in flight, so that its next
    step is waiting when it answers one (a dummy SmolLM2 on an H100, h100-s26: c=1 TPOT 1.17 ms
    so against 1.71 in overlap alone in one call, and 1.80 in overlap against 2.17 in sync in
    another); any other worker sync, or two steps in flight with overlap (on the CPU the host
    runs the kernels, and overlap lost 7-16% there, cpu-s3)."""
    pipelined = limits.pipeline_steps
    overlap = pipelined if config.async_scheduling is None else config.async_scheduling
    depth = config.max_steps_in_flight
    if depth is None:
        depth = 3 if pipelined and overlap else 2
    return overlap, depth


def resolve_limits(config: SchedulerConfig, limits: WorkerLimits) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` the scheduler runs with: the user's where set,
    else the worker's. A user value above the worker's capacity is refused, not clamped: the
    worker would refuse those steps, and a silent clamp hides a misconfiguration."""
    seqs = limits.max_num_seqs if config.max_num_seqs is None else config.max_num_seqs
    if seqs > limits.max_num_seqs:
        raise ValueError(
            f"max_num_seqs {seqs} is above the worker's {limits.max_num_seqs} KV slots: lower "
            "it, leave it unset (the worker's value), or start the worker with a larger "
            "--max-num-seqs"
        )
    worker_tokens = limits.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    tokens = config.max_num_batched_tokens or worker_tokens
    if limits.max_num_batched_tokens and tokens > limits.max_num_batched_tokens:
        raise ValueError(
            f"max_num_batched_tokens {tokens} is above the worker's "
            f"{limits.max_num_batched_tokens}: lower it, leave it unset (the worker's value), "
            "or start the worker with a larger --max-num-batched-tokens"
        )
    return seqs, tokens


class Scheduler:
    """Not thread-safe: one thread calls add/abort/schedule/update/take_drafts."""

    def __init__(
        self,
        config: SchedulerConfig,
        limits: WorkerLimits,
        tokenizer: TokenizerInfo | None,
        grammar: GrammarBackend | None,
    ) -> None:
        self.config = config
        # the scheduling mode, the user's or the worker's (``resolve_mode``): read these, not the
        # config's, which may say None
        self.async_scheduling, self.max_steps_in_flight = resolve_mode(config, limits)
        self.limits = limits
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.max_num_seqs, self.max_num_batched_tokens = resolve_limits(config, limits)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.to_free: list[str] = []  # finished on our side, still holding worker state
        self.to_abort: list[str] = []
        self.step_id = 0
        self.last_done_step = -1
        # step_id -> ((tokens, drafts) per request, the requests it samples) for steps sent whose
        # output has not arrived: one in sync mode, up to max_steps_in_flight with overlap
        self.steps: dict[int, tuple[dict[str, tuple[int, int]], set[str]]] = {}
        self.metrics = RequestMetrics()
        # step_id -> the most drafts asked for after it (max_draft_proposals), while in flight;
        # then the last step settled's, for its drafts, which follow its output (draft_hits)
        self.proposal_caps: dict[int, int] = {}
        self.last_settled_asked = 0
        # asks of recent requests and the share of each the drafter found, decayed: the hit rate
        # of a request never asked yet (under arrivals at c=64 most are new, and with 1.0 each
        # a prompt-lookup drafter that finds little was asked again and again for drafts the
        # tuner would not verify)
        # (kept apart for structured requests: a drafter blind to grammars finds drafts that
        # plain requests verify and structured ones reject; pooled together, each short
        # structured request was asked on most of its steps before its own rate fell)
        self._hits_pool = {False: [0.0, 0.0], True: [0.0, 0.0]}  # structured -> [asked, found]
        # step_id -> (the tuner's verify width for it, -1: no choice made; the decoding requests
        # with drafts to verify; all decoding requests; why it proposed what it did), while in
        # flight (--step-trace)
        self.choices: dict[int, tuple[int, int, int, str]] = {}
        # step_id -> per request placed in it with drafts to verify, the tokens they were
        # expected to add (the tuner's model), while in flight: each paired with what its
        # drafts made when the output comes (a request skipped, finished or requeued meanwhile
        # counts in neither)
        self.predicted: dict[int, dict[str, float]] = {}
        self.on_finish: Callable[[Request], None] | None = None  # e.g. Prometheus counters
        self.tuner = (
            SpeculationTuner(
                limits.max_num_speculative_tokens,
                # a worker that leaves steps open does so only for steps sent ahead (overlap)
                PLAIN_RUN if limits.pipeline_steps and self.async_scheduling else 1,
            )
            if config.adaptive_speculation and limits.max_num_speculative_tokens
            else None
        )
        self.guard = (
            SpeculationGuard() if self.tuner is not None and config.speculation_guard else None
        )
        self.last_committed = 0  # output tokens the last ``update`` committed (the guard's)
        self.words = (limits.vocab_size + 31) // 32
        # the worker's paged KV cache, mirrored: admission and preemption count its blocks
        self.kv_blocks = (
            KVBlocks(limits.num_kv_blocks, limits.kv_block_size)
            if limits.num_kv_blocks and limits.kv_block_size
            else None
        )
        self.num_preemptions = 0

    # -- requests -------------------------------------------------------------------------------
    def add(self, req: Request) -> Request:
        """Queue ``req``. A request that cannot run finishes at once with a clear error."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        limit = self.limits.max_model_len
        problem = request_problem(req, self.limits.vocab_size)
        if not isinstance(req.prompt_ids, list | tuple):
            req.finish("error", problem or "the prompt must be a list of token ids")
        elif not req.prompt_ids:
            req.finish("error", "the prompt is empty")
        elif len(req.prompt_ids) >= limit:
            req.finish(
                "error",
                f"prompt of {len(req.prompt_ids)} tokens is too long: the model "
                f"takes at most {limit - 1} prompt tokens (max_model_len {limit})",
            )
        elif problem is not None:  # types, ids and the widths the wire carries
            req.finish("error", problem)
        elif not 0 <= req.num_speculative_tokens <= self.limits.max_num_speculative_tokens:
            req.finish(
                "error",
                f"num_speculative_tokens {req.num_speculative_tokens} is outside "
                f"0..{self.limits.max_num_speculative_tokens} (the worker's maximum)",
            )
        elif req.structured is not None and req.matcher is None:
            if self.grammar is None:
                req.finish("error", "structured outputs need a tokenizer and a grammar backend")
            else:
                try:
                    req.matcher = self.grammar.matcher(req.structured)
                except GrammarError as e:
                    req.finish("error", str(e))
                except Exception as e:
                    # an untrusted spec (a schema nested past the recursion limit, ...): this
                    # request's fault, never the engine's
                    req.finish("error", f"invalid {req.structured.kind} spec: {e!r:.300}")
        if self.tokenizer is not None and req.detok is None:
            req.detok = IncrementalDetokenizer(self.tokenizer)
            stops = tuple(s for s in req.stop if s)
            req.stop_strings = StopStrings(stops) if stops else None
        if not req.finished:
            self.waiting.append(req)
        return req

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return
        self._finish(req, "abort", None)

    def release(self, req_id: str) -> None:
        """Forget a finished request (a long-running server calls this once it has answered);
        anything the worker still reports for it is ignored."""
        req = self.requests.get(req_id)
        if req is not None and req.finished:
            del self.requests[req_id]

    def unsend(self, req_ids: list[str]) -> None:
        """The worker refused the step that brought these requests and kept none of them: they go
        back to the front of the queue, as if never sent."""
        for req_id in reversed(req_ids):
            req = self.requests.get(req_id)
            if req is None or req.finished or req not in self.running:
                continue
            self.running.remove(req)
            req.status = Status.WAITING
            req.num_computed = 0
            req.sent_to_worker = False
            _clear_inflight(req)
            self.waiting.appendleft(req)

    def requeue_all(self) -> None:
        """The worker was replaced: it holds nothing. Every running request goes back to the front
        of the queue, in order, to be replayed from its prompt plus committed tokens; grammar
        matchers already stand at the committed state (drafts were always rolled back)."""
        for req in reversed(self.running):
            _requeue(req)
            self.waiting.appendleft(req)
        self.running = []
        self.to_free, self.to_abort = [], []
        self.steps = {}
        self.proposal_caps = {}
        self.choices = {}
        self.predicted = {}
        self.last_done_step = self.step_id - 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_free or self.to_abort or self.steps)

    def fail(self, req_id: str, message: str) -> None:
        """The worker refused this request; it ends with ``message``, the others go on."""
        req = self.requests.get(req_id)
        if req is not None and not req.finished:
            self._finish(req, "error", message)

    def _finish(self, req: Request, reason: str, error: str | None) -> None:
        req.finish(reason, error)
        req.metrics.end_s = req.metrics.end_s or time.monotonic()
        if req in self.running:
            self.running.remove(req)
            if req.sent_to_worker:
                (self.to_abort if reason in ("abort", "error") else self.to_free).append(req.req_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.metrics.merge(req.metrics)
        if self.on_finish is not None:
            self.on_finish(req)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to send."""
        budget = self.max_num_batched_tokens
        new: list[NewRequest] = []
        ids: list[str] = []
        counts: list[int] = []
        widths: list[int] = []
        drafts: list[np.ndarray] = []
        rows: list[tuple[Request, int]] = []  # structured requests that sample, with their width
        deferred: list[str] = []
        scheduled: dict[str, tuple[int, int]] = {}  # req_id -> (tokens, drafts) this step
        sampling: set[str] = set()
        width_cap, choice, expect = self._batch_width()
        limit = self.limits.max_model_len
        kv = self.kv_blocks
        free = kv.num_free(self.running) if kv is not None else 0
        short = False  # the last place() failed for want of KV blocks

        def place(req: Request) -> bool:
            nonlocal budget, short
            short = False
            if req.pending_samples:
                return place_pending(req)
            uncomputed = req.num_tokens - req.num_computed - req.num_inflight
            m = min(uncomputed, budget, self.config.max_prefill_chunk)
            if kv is not None:
                m = min(m, kv.room(req, free))  # a shorter chunk where blocks run short
                short = m <= 0 < min(uncomputed, budget)
            if m <= 0:
                return False
            samples = m == uncomputed
            w = min(len(req.draft_ids), budget - m, width_cap) if samples else 0
            if kv is not None:
                w = max(min(w, kv.room(req, free) - m), 0)  # drafts only where blocks allow
            req.draft_ids = req.draft_ids[:w]
            put(req, m, w, req.draft_ids, samples)
            if samples and req.matcher is not None:
                rows.append((req, w))
            return True

        def place_pending(req: Request) -> bool:
            """Overlap: its last token is still being sampled; run it with the worker's own
            drafts, the width a cap (the worker uses as many as it proposed)."""
            nonlocal budget, short
            done = len(req.output_ids) + req.pending_samples >= req.sampling.max_tokens
            if done or budget < 1:
                return False  # surely finished by the steps in flight, or no room
            if req.matcher is not None and req.sampling.temperature > 0:
                return False  # a sampled structured request waits for its rows (no cap there)
            room = limit - (req.num_tokens + req.inflight_max_new) - 1
            if room < 0:
                return False
            # its drafts are validated only after this step is sent: a structured request runs
            # at most as many as its grammar kept of the last ones (a grammar-blind draft
            # model's drafts that the grammar then cut were verified for nothing: 912 draft
            # tokens verified for 160 accepted in overlap, 148 for 148 in sync, CPU)
            w = min(req.num_speculative_tokens, budget - 1, width_cap, room, _kept(req))
            if kv is not None:
                blocks_room = kv.room(req, free)
                if blocks_room < 1:
                    short = True
                    return False
                w = min(w, blocks_room - 1)
            put(req, 1, w, placeholders(w), True)
            if defers_rows(req):  # (a sampled structured one was not placed)
                deferred.append(req.req_id)
            return True

        def put(req: Request, m: int, w: int, ids_: np.ndarray, samples: bool) -> None:
            nonlocal budget, free
            budget -= m + w
            if kv is not None:
                free -= kv.take(req, m + w)  # before the in-flight counts below move
            ids.append(req.req_id)
            counts.append(m + w)
            widths.append(w)
            drafts.append(ids_)
            scheduled[req.req_id] = (m + w, w)
            if samples:
                sampling.add(req.req_id)
            if self.async_scheduling:
                req.num_inflight += m
                req.pending_samples += int(samples)
                req.inflight_max_new += (1 + w) if samples else 0

        preempted = False
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted for an older request of this step
            while not place(req) and short:
                victim = self._victim(req, scheduled)
                if victim is None:
                    break  # it waits: the blocks it needs are held by requests already placed
                free += kv.held(victim) if kv is not None else 0
                self._preempt(victim)
                preempted = True
        # No admission in a step that preempted: the freed blocks went to older requests.
        reserve = int(kv.num_blocks * self.config.kv_watermark) if kv is not None else 0
        while (
            self.waiting and not preempted and len(self.running) < self.max_num_seqs and budget > 0
        ):
            req = self.waiting[0]
            free -= reserve  # what a new request may not take
            admitted = place(req)
            free += reserve
            if not admitted:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.sent_to_worker = True
            req.metrics.scheduled_s = req.metrics.scheduled_s or time.monotonic()
            self.running.append(req)
            new.append(
                NewRequest(
                    req_id=req.req_id,
                    prompt_token_ids=np.asarray(req.prompt_ids + req.output_ids, np.int32),
                    sampling=req.sampling,
                    num_speculative_tokens=req.num_speculative_tokens,
                    structured=req.matcher is not None,
                )
            )
        if not ids and not self.to_free and not self.to_abort:
            return None
        structured_ids, cu, bitmask = step_rows(rows, self.words)
        out = SchedulerOutput(
            step_id=self.step_id,
            new_requests=new,
            req_ids=ids,
            num_scheduled_tokens=np.asarray(counts, np.int32),
            num_draft_tokens=np.asarray(widths, np.int32),
            draft_token_ids=np.concatenate(drafts).astype(np.int32)
            if drafts
            else np.zeros(0, np.int32),
            finished_req_ids=self.to_free,
            aborted_req_ids=self.to_abort,
            structured_req_ids=structured_ids,
            cu_bitmask_rows=cu,
            grammar_bitmask=bitmask,
            draft_widths_are_caps=self.async_scheduling,
            deferred_req_ids=deferred,
            max_draft_proposals=self._proposals(sampling, bool(deferred)),
        )
        self.to_free, self.to_abort = [], []
        self.steps[self.step_id] = (scheduled, sampling)
        self.proposal_caps[self.step_id] = out.max_draft_proposals
        if self.tuner is not None:
            self.choices[self.step_id] = (*choice, self.tuner.reason)
            placed = {r: e for r, e in expect.items() if r in scheduled}
            if placed:
                self.predicted[self.step_id] = placed
        self.step_id += 1
        return out

    def _victim(self, req: Request, placed: dict[str, tuple[int, int]]) -> Request | None:
        """The newest running request other than ``req`` that is neither placed in the step
        being built nor in a step in flight (overlap): preempting it frees its blocks now."""
        busy = {r for step, _ in self.steps.values() for r in step}
        for other in reversed(self.running):
            if other is req:
                return None  # only older requests are left: none is preempted for a newer one
            if other.req_id not in placed and other.req_id not in busy:
                return other
        return None

    def _preempt(self, req: Request) -> None:
        """Give ``req``'s KV blocks back: the worker drops it (an abort in the step being built)
        and it waits at the front of the queue, to be recomputed from its prompt and committed
        tokens (as after a worker's death); its grammar matcher already stands there."""
        self.running.remove(req)
        _requeue(req)
        self.to_abort.append(req.req_id)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def step_refused(self, sched: SchedulerOutput) -> None:
        """The worker applied nothing of ``sched``: its in-flight accounting goes."""
        self._settle(sched.step_id)

    def _settle(self, step_id: int) -> dict[str, tuple[int, int]]:
        """Remove a step from the in-flight books; returns its (scheduled, drafts) per request."""
        step, sampling = self.steps.pop(step_id, ({}, set()))
        self.last_settled_asked = self.proposal_caps.pop(step_id, 0)
        self.choices.pop(step_id, None)
        self.predicted.pop(step_id, None)
        if self.async_scheduling:
            for req_id, (n, w) in step.items():
                req = self.requests.get(req_id)
                if req is None:
                    continue
                req.num_inflight = max(req.num_inflight - (n - w), 0)
                if req_id in sampling and req.pending_samples:
                    req.pending_samples -= 1
                    req.inflight_max_new = max(req.inflight_max_new - (1 + w), 0)
        return step

    def deferred_bitmask(self, sched: SchedulerOutput) -> StepBitmask:
        """The rows ``sched`` deferred (see ``bitmask_rows.deferred_rows``)."""
        step = self.steps.get(sched.step_id, ({}, set()))[0]
        widths = {req_id: w for req_id, (_, w) in step.items()}
        return deferred_rows(sched, widths, self.requests, self.words)

    def _batch_width(self) -> tuple[int, tuple[int, int, int], dict[str, float]]:
        """The most drafts any request verifies this step (the tuner's choice, or no limit); for
        ``choices``: the tuner's choice (-1: none made), the decoding requests with drafts to
        verify, and all decoding requests; and, for ``predicted``, the tokens each request's
        drafts are expected to add at that choice (none without one)."""
        if self.tuner is None:
            return 1 << 30, (-1, 0, 0), {}
        # every running request that samples this step counts (one token each, drafts or not)
        decoding = [
            r
            for r in self.running
            if r.pending_samples or r.num_tokens - r.num_computed - r.num_inflight == 1
        ]
        # a request whose drafts are not back yet (overlap) gets at most what the last step sent
        # asked the worker to propose: 0 while the tuner keeps drafting off, and then the step
        # needs no choice (at c=64 the choice's per-request lists and rates cost every step)
        asked = self.proposal_caps.get(self.step_id - 1, -1)
        cap = asked if asked >= 0 else 1 << 30
        avail = [
            min(r.num_speculative_tokens, cap, _kept(r)) if r.pending_samples else len(r.draft_ids)
            for r in decoding
        ]
        if not any(avail):
            self.tuner.skip_choice()
            return 0, (-1, 0, len(decoding)), {}
        alphas = [self.tuner.alpha(r.num_judged, r.metrics.num_accepted) for r in decoding]
        # a request whose drafts are not back yet (overlap) verifies what the drafter finds
        # for it: its hit rate; one whose drafts are here verifies them
        hits = [self._hits(r) if r.pending_samples else 1.0 for r in decoding]
        # overlap: a greedy structured request whose last token is still being sampled gets
        # its grammar rows in a later message (place_pending), and the step is timed apart
        deferred = any(r.pending_samples and defers_rows(r) for r in decoding)
        choice = self.tuner.choose(alphas, avail, hits, deferred)
        expect: dict[str, float] = {}
        if choice:
            each = self.tuner.expected_extras(alphas, avail, choice, hits)
            expect = {r.req_id: e for r, e in zip(decoding, each, strict=True) if e > 0}
        return choice, (choice, sum(1 for a in avail if a), len(decoding)), expect

    def _hits(self, req: Request) -> float:
        """The share of the drafts asked for that ``req`` can verify: its own moving average once
        asked, before that the pooled share of recent asks of requests like it, structured or
        not (1.0 before any)."""
        if req.draft_hits is not None:
            return req.draft_hits
        asked, found = self._hits_pool[req.matcher is not None]
        return found / asked if asked >= 1.0 else 1.0

    def _proposals(self, sampling: set[str], deferred: bool) -> int:
        """The most drafts the worker proposes after this step (the tuner's choice; -1: each
        request's own width); ``deferred``: the step's grammar rows for some request follow it."""
        if self.tuner is None:
            return -1
        tuner = self.tuner
        if self.guard is not None and not self.guard.drafting:
            tuner.pause()  # a window with drafting off (spec_guard.py)
            return 0
        reqs = [self.requests[r] for r in sampling]
        return tuner.propose(
            lambda: [tuner.alpha(r.num_judged, r.metrics.num_accepted) for r in reqs],
            [r.num_speculative_tokens for r in reqs],
            lambda: [self._hits(r) for r in reqs],
            deferred,
        )

    def update(
        self,
        out: ModelRunnerOutput,
        first: Collection[str] = (),
        between: Callable[[], None] | None = None,
    ) -> list[Request]:
        """Commit the step's sampled tokens; returns the requests that finished (in the output's
        order). ``first``: requests committed before the others, after which ``between`` runs
        (the engine sends the next step's deferred grammar rows there: they wait only for those
        requests' tokens, and the worker samples that step while the rest are committed)."""
        expected = min(self.steps, default=self.step_id - 1)
        if out.step_id != expected:
            raise ValueError(f"output for step {out.step_id}, expected step {expected}")
        self.last_done_step = out.step_id
        predicted = self.predicted.get(out.step_id, {})  # (``_settle`` drops it)
        inflight = self._settle(out.step_id)
        expected_gain, made, committed = 0.0, 0, 0
        done: list[tuple[int, Request]] = []
        # lists once: a numpy scalar read per request costs more than the whole conversion
        sampled = out.sampled_token_ids.tolist()
        num_sampled = out.num_sampled.tolist()
        num_accepted = out.num_accepted.tolist()
        num_drafts = out.num_draft_tokens.tolist()
        offsets = np.cumsum(out.num_sampled, dtype=np.int64).tolist()
        order: list[int] = list(range(len(out.req_ids)))
        cut = 0  # ``between`` runs before the request at this place in ``order`` (or at the end)
        if first:
            early = [i for i in order if out.req_ids[i] in first]
            cut = len(early)
            order = early + [i for i in order if out.req_ids[i] not in first]
        failed: Exception | None = None  # ``between``'s, raised once every request is committed

        def run_between() -> None:
            nonlocal failed
            if between is None:
                return
            try:
                between()
            except Exception as e:
                failed = e

        for place, i in enumerate(order):
            if place == cut:
                run_between()
            req_id = out.req_ids[i]
            n = num_sampled[i]
            tokens = sampled[offsets[i] - n : offsets[i]]
            req = self.requests.get(req_id)
            sched = inflight.get(req_id)
            if req is None or sched is None or req.finished:
                continue
            scheduled, w = sched
            accepted = num_accepted[i]
            req.num_computed += scheduled - w + (accepted if n else 0)
            req.draft_ids = NO_DRAFTS
            req.grammar_drafts = None
            req.last_drafts = None
            if not n:
                continue
            w = num_drafts[i]
            req.metrics.record_step(w, accepted, n)
            req.num_judged += min(w, accepted + 1)
            if req_id in predicted:
                expected_gain += predicted[req_id]
                made += accepted
            if self.tuner is not None:
                self.tuner.observe_judged(min(w, accepted + 1), accepted)
            before = len(req.output_ids)
            try:
                self._commit(req, tokens)
            except Exception as e:
                # a grammar or detokenizer failure on this request's tokens ends this request;
                # its neighbours in the step commit as usual
                if not req.finished:
                    self._finish(req, "error", f"committing sampled tokens failed: {e!r:.300}")
            committed += len(req.output_ids) - before
            if req.finished:
                done.append((i, req))
        if cut == len(order):
            run_between()
        if expected_gain and self.tuner is not None:
            self.tuner.observe_verified(expected_gain, made)
        self.last_committed = committed
        if failed is not None:
            raise failed
        return [req for _, req in sorted(done, key=lambda d: d[0])]

    def _commit(self, req: Request, tokens: list[int]) -> None:
        eos = self.limits.eos_token_ids
        sp = req.sampling
        stops = req.stop_strings
        new: list[int] = []
        for t in tokens:
            if req.matcher is not None and not req.matcher.accept(t):
                self._emit(req, new, final=True)
                # the engine's reason, first line only (llguidance appends its whole grammar):
                # "Parser Error: Current row has 5000 items; max is 2000; ..."
                why = req.matcher.error.split("\n", 1)[0]
                self._finish(
                    req,
                    "error",
                    f"the grammar rejected sampled token {t}"
                    f"{self._show(t)}{f' ({why})' if why else ''}; the output so far is kept",
                )
                return
            if (t in eos and not req.ignore_eos) or t in sp.stop_token_ids:
                self._emit(req, new, final=True)
                self._finish(req, "stop", None)
                return
            req.output_ids.append(t)
            new.append(t)
            if stops is not None:
                # token by token: the output (and usage) ends at the token that completes a stop
                # string; the tokens sampled after it in this step are dropped
                self._emit(req, new)
                new = []
                if stops.stopped:
                    self._finish(req, "stop", None)
                    return
            if len(req.output_ids) >= sp.max_tokens or req.num_tokens >= self.limits.max_model_len:
                self._emit(req, new, final=True)
                self._finish(req, "stop" if stops is not None and stops.stopped else "length", None)
                return
        self._emit(req, new)

    def _emit(self, req: Request, new: list[int], final: bool = False) -> None:
        """Detokenize ``new`` and send the caller what it may see: with stop strings, never the
        stop nor a text that could still become one (stop_strings.py)."""
        if req.detok is None or not (new or final):
            return
        delta = req.detok.add(new, final)
        stops = req.stop_strings
        if stops is not None:
            delta = stops.add(delta) if delta else ""
            if stops.stopped:
                req.detok.text = stops.text  # the final text ends before the stop
            elif final:
                delta += stops.flush()
        if delta and req.on_delta is not None:
            req.on_delta(req, delta)

    def _show(self, t: int) -> str:
        return f" ({self.tokenizer.decode([t])!r})" if self.tokenizer is not None else ""

    def take_drafts(self, msg: DraftTokenIds) -> None:
        """Drafts proposed after ``msg.step_id``. Anything that does not match the step and
        lengths we expect is discarded: the request simply runs without drafts (fail closed)."""
        stale_step = msg.step_id != self.last_done_step
        asked = self.last_settled_asked  # drafts of another step are stale: not counted below
        off = 0
        widths = msg.num_draft_tokens.tolist()
        committed = msg.num_committed_tokens.tolist()
        for i, req_id in enumerate(msg.req_ids):
            w = widths[i]
            ids = msg.draft_token_ids[off : off + w] if w else NO_DRAFTS
            off += w
            req = self.requests.get(req_id)
            if req is None or req.finished:
                continue
            # a waiting request (requeued or preempted) has nothing on the worker: its drafts
            # are stale too, and it starts again without any
            waiting = req.status is not Status.RUNNING
            if waiting or stale_step or committed[i] != req.num_tokens:
                _stale(req)
                continue
            self._take_fresh(req, ids, asked)

    def no_drafts(self, out: ModelRunnerOutput) -> None:
        """After ``update(out)`` of an output the worker sent no ``DraftTokenIds`` for
        (``drafts_follow`` False): every request that sampled was proposed nothing, as a message
        of zero widths and current lengths would have said."""
        asked = self.last_settled_asked
        for req_id, n in zip(out.req_ids, out.num_sampled.tolist(), strict=True):
            req = self.requests.get(req_id)
            if not n or req is None or req.finished:
                continue
            if req.status is not Status.RUNNING:
                _stale(req)  # requeued or preempted: nothing on the worker, as take_drafts says
            else:
                self._take_fresh(req, NO_DRAFTS, asked)

    def _take_fresh(self, req: Request, ids: np.ndarray, asked: int) -> None:
        """A running request's drafts that match its length: kept after its grammar, and its hit
        rate moved by what it found of the ``asked`` (the proposal cap; -1: its own width).
        Nothing was asked (the tuner keeps drafting off) or the request has no width: no drafts,
        and no grammar-forced ones either, so a drafter held at zero costs what no drafter costs
        (served SmolLM2 on an H200, sync, c=64: an EAGLE step without drafts cost 0.7 ms more
        than no drafter's, part of it the forced tokens of every structured request, h200-s25)."""
        if not len(ids) and (asked == 0 or not req.num_speculative_tokens):
            req.draft_ids = req.last_drafts = NO_DRAFTS
            return
        room = self._draft_room(req)
        try:
            kept = self._take_request_drafts(req, ids, room)
        except Exception as e:
            # the grammar failed on this request's drafts: it ends, the others take theirs
            self._finish(req, "error", f"validating drafts failed: {e!r:.300}")
            return
        want = room if asked < 0 else min(asked, room)
        if want > 0:
            # how much of what was asked this request can verify: what the drafter found,
            # after its grammar (a drafter that ignores the grammar, as a draft model's argmax
            # does, finds drafts a structured request rejects: asked for on every step, the
            # next step verified none, 45% of the time of a served c=1 row)
            found = min(kept / want, 1.0)
            h = self._hits(req)
            req.draft_hits = h + DRAFT_HITS_EMA * (found - h)
            pool = self._hits_pool[req.matcher is not None]
            pool[0] = HITS_POOL_KEEP * pool[0] + 1.0
            pool[1] = HITS_POOL_KEEP * pool[1] + found

    def _draft_room(self, req: Request) -> int:
        """The most drafts ``req`` can verify next step: its own width, and the room left in its
        output and its context."""
        return max(
            min(
                req.num_speculative_tokens,
                req.sampling.max_tokens - len(req.output_ids) - 1,
                self.limits.max_model_len - req.num_tokens,
            ),
            0,
        )

    def _take_request_drafts(self, req: Request, ids: np.ndarray, cap: int) -> int:
        """Grammar-validate one request's fresh drafts (``ids`` int32 [width]), at most ``cap``
        of them (``_draft_room``); returns how many it keeps (the grammar's forced tokens aside:
        they come whatever was asked, unless nothing was, ``_take_fresh``). A few ids a request
        a step: plain lists, and no array built where nothing was forced."""
        req.last_drafts = ids
        if req.matcher is None and not len(ids):
            req.draft_ids = NO_DRAFTS  # nothing proposed, nothing to cap
            return 0
        ids = ids[:cap]
        if req.matcher is None:
            req.draft_ids = placeholders(len(ids))
            return len(ids)
        proposed = ids.tolist()
        if proposed and min(proposed) < 0:
            req.metrics.num_stale += 1  # a structured request must get real ids: fail closed
            req.draft_ids = NO_DRAFTS
            return 0
        valid = req.matcher.validate(proposed)
        req.metrics.num_grammar_invalid += len(proposed) - valid
        if proposed:
            # where the grammar cut the last drafts (None: it cut none, so no limit; the drafts
            # were as few as the drafter found or the tuner asked, not as the grammar allows)
            req.grammar_kept = valid if valid < len(proposed) else None
        real = ids[:valid].astype(np.int32)
        forced: list[int] = []
        if self.config.forced_drafts and valid < cap:
            forced = req.matcher.forced_tokens(proposed[:valid], cap - valid)
            req.metrics.num_forced += len(forced)
        # The worker keeps its own drafts (placeholders); forced ids travel as real ids.
        if forced:
            extra = np.asarray(forced, np.int32)
            req.grammar_drafts = np.concatenate([real, extra])
            req.draft_ids = np.concatenate([placeholders(valid), extra])
        else:
            req.grammar_drafts = real
            req.draft_ids = placeholders(valid)
        return valid


def _stale(req: Request) -> None:
    """Drafts that do not fit ``req`` (another step, another length, or a request not running)
    are counted and dropped: it runs its next step without drafts (fail closed)."""
    req.metrics.num_stale += 1
    req.draft_ids = NO_DRAFTS
    req.last_drafts = None


def _kept(req: Request) -> int:
    """The most drafts ``req`` verifies before they are validated (overlap): where its grammar
    cut the last drafts validated; no limit for a plain request, before any cut, or after drafts
    the grammar kept whole."""
    return 1 << 30 if req.grammar_kept is None else req.grammar_kept


def _requeue(req: Request) -> None:
    """``req`` waits again with nothing on the worker: recomputed from its prompt and committed
    tokens, without drafts."""
    req.status = Status.WAITING
    req.num_computed = 0
    req.sent_to_worker = False
    req.draft_ids = NO_DRAFTS
    req.grammar_drafts = None
    req.grammar_kept = None
    _clear_inflight(req)


def _clear_inflight(req: Request) -> None:
    req.num_inflight = req.pending_samples = req.inflight_max_new = 0
    req.last_drafts = None
