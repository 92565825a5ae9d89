"""The harness API: one scheduler driving one worker.

    from scheduler_client import Engine, EngineConfig
    with Engine(EngineConfig(model="embedded:smollm2", drafter="ngram")) as engine:
        done = engine.generate([{"prompt": "Hello", "max_tokens": 16}])
        for delta in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta, end="")

The engine starts ``specd-worker`` as a separate process (or connects to ``worker_addr``), shakes
hands, and runs the step loop in the calling thread.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from protocol.transport import TransportConfig
from scheduler_client.grammar import Matcher, StructuredSpec, make_backend, parse_spec
from scheduler_client.metrics import RequestMetrics
from scheduler_client.prom import SchedulerMetrics
from scheduler_client.request import Request
from scheduler_client.restart_budget import RestartBudget
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.spec_tuner import StepShape
from scheduler_client.step_blame import blame
from scheduler_client.step_faults import refuse_step
from scheduler_client.tokenizer import TokenizerInfo
from scheduler_client.worker_client import StepRefused, Unsendable, WorkerClient, WorkerDied

log = logging.getLogger("specd.scheduler")
SHALLOW = 0.5  # --max-steps-in-flight auto: two steps in flight while the worker drafts and the
# scheduler's turnaround takes under this share of the time between outputs (else the most)
DEPTH_EMA = 0.1  # the weight of a new step in those moving averages


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else old + DEPTH_EMA * (new - old)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """``worker_addr`` set: connect to a running worker; otherwise launch one with the worker_*
    fields. ``tokenizer`` overrides the tokenizer directory the worker reports."""

    worker_addr: str | None = None
    model: str = "embedded:smollm2"
    drafter: str = "ngram"
    draft_model: str | None = None
    eagle_head: str | None = None  # with drafter="eagle": the head's folder
    num_speculative_tokens: int = 4
    device: str | None = None
    max_model_len: int = 2048
    # a launched worker's KV slots and tokens per step; None: the worker's defaults
    worker_max_num_seqs: int | None = None
    worker_max_num_batched_tokens: int | None = None
    worker_args: tuple[str, ...] = ()
    worker_env: tuple[tuple[str, str], ...] = ()  # extra environment for a launched worker
    tokenizer: str | None = None
    grammar_backend: str = "llguidance"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    step_timeout_s: float = 300.0
    handshake_timeout_s: float = 600.0
    worker_log: str | None = None  # file for the launched worker's stderr; None: inherit
    # After a worker death: relaunch it (when we launched it) or wait for a new one at worker_addr,
    # then replay every in-flight request from prompt + committed tokens, at most
    # max_worker_restarts times within any restart_window_s seconds (0 disables). A request that
    # was running at two deaths is failed, not replayed again.
    max_worker_restarts: int = 3
    restart_window_s: float = 600.0
    # health() says "stalled" while a step has been outstanding longer than this
    stall_threshold_s: float = 60.0
    metrics_port: int = 0  # Prometheus endpoint of the scheduler (0: off; -1: any free port)
    metrics_host: str = "127.0.0.1"  # the address it binds (the daemon passes its --host)
    # a JSON line per step output: its size, widths, prefill, time and the drafts it judged
    step_trace: str | None = None
    # CURVE keys for a tcp:// worker_addr (launched workers use ipc:// and need none)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if self.max_worker_restarts < 0:
            raise ValueError("--max-worker-restarts must be >= 0 (0: never restart)")
        if self.restart_window_s <= 0:
            raise ValueError("--restart-window-s must be > 0 seconds")
        if self.stall_threshold_s <= 0:
            raise ValueError("--stall-threshold-s must be > 0 seconds")
        if self.worker_addr and self.worker_args:
            raise ValueError(
                "--worker-args applies to a launched worker: with --worker, start that worker "
                "with those flags"
            )


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.restarts = RestartBudget(config.max_worker_restarts, config.restart_window_s)
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.addr = config.worker_addr or self._launch()
        self.client = self._client()
        self.num_worker_restarts = 0
        try:
            ready = self.client.handshake(timeout_s=config.handshake_timeout_s)
            tok_dir = config.tokenizer or ready.tokenizer_path
            self.tokenizer = TokenizerInfo(tok_dir) if tok_dir else None
            grammar = None
            if self.tokenizer is not None:
                self.tokenizer.token_bytes()  # built now (0.2 s for 49k ids), not in a step
                grammar = make_backend(
                    config.grammar_backend,
                    self.tokenizer.json_text,
                    ready.vocab_size,
                    ready.eos_token_ids,
                )
            limits = WorkerLimits(
                vocab_size=ready.vocab_size,
                eos_token_ids=ready.eos_token_ids,
                max_model_len=ready.max_model_len,
                max_num_speculative_tokens=ready.max_num_speculative_tokens,
                max_num_seqs=ready.max_num_seqs,
                max_num_batched_tokens=ready.max_num_batched_tokens,
                num_kv_blocks=ready.num_kv_blocks,
                kv_block_size=ready.kv_block_size,
                pipeline_steps=ready.pipeline_steps,
            )
            self.scheduler = Scheduler(config.scheduler, limits, self.tokenizer, grammar)
            self.prom = SchedulerMetrics()
            self.scheduler.on_finish = self.prom.record_finished
            if self.scheduler.tuner is not None:
                self.prom.watch_tuner(self.scheduler.tuner, self.scheduler.guard)
            # the port bound (the one asked for, or a free one for -1); 0: not serving
            self.metrics_port = (
                self.prom.serve(config.metrics_port, config.metrics_host)
                if config.metrics_port
                else 0
            )
        except BaseException:
            self.close()
            raise
        self.ready = ready
        # overlap scheduling needs a worker that knows capped widths and deferred rows (minor 1)
        # (the mode the user left to the worker is chosen by now: ``resolve_mode``)
        wanted = self.scheduler.async_scheduling
        self.overlap = wanted and ready.protocol_minor >= 1
        if wanted and not self.overlap:
            log.warning(
                "the worker speaks protocol minor %d: overlap scheduling is off",
                ready.protocol_minor,
            )
        self.in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self._last_output_s = time.perf_counter()
        # requests were left unfinished at the last output: the loop went straight on, so the
        # next step's time counts from that output (the cycle), not from its own send
        self._went_on = False
        # a step whose output the worker held until it had launched the next one
        # (``ModelRunnerOutput.held``): the tuner's observation of it, waiting for the next
        # cycle, and its own cycle
        self._held: tuple[StepShape, float] | None = None
        # --max-steps-in-flight auto: moving averages of the time between outputs and of the
        # scheduler's turnaround (from a step's output and drafts in to the next step's send),
        # and when the last step's output and drafts were in (None: the turnaround is measured)
        self._cycle_s = 0.0
        self._turnaround_s = 0.0
        self._ready_s: float | None = None
        self._drafting = False  # the last output said drafts follow it (the worker drafted)
        self._sent_s: dict[int, float] = {}
        self._sent_mono: dict[int, float] = {}  # step_id -> monotonic send time (health)
        self.num_deferred_bitmasks = 0
        self.num_early_bitmasks = 0  # ... of them sent before the rest of the output committed
        self._ids = itertools.count()
        self.started_s = time.monotonic()
        # Read by other threads (health): plain attributes, each set in one assignment.
        self.recovering = False  # a worker relaunch, handshake and replay is under way
        self.outstanding_since: float | None = None  # monotonic send time of the oldest step
        # overlap: steps after the current one that the worker could not read, with their culprits
        self._lost: dict[int, tuple[list[str], str]] = {}
        self._ended: list[Request] = []  # requests a step fault ended, returned by step()
        # called on the engine's thread once the output of a step whose drafts follow is
        # committed, before they are read (the worker drafts meanwhile), with the requests that
        # output finished: an ``EngineLoop`` answers them and sends the text streamed then, not
        # a drafting later
        self.on_commit: Callable[[list[Request]], None] | None = None
        # closed in close(); line-buffered, so a killed scheduler leaves whole lines
        self._trace = (
            open(config.step_trace, "a", buffering=1)  # noqa: SIM115
            if config.step_trace
            else None
        )

    def _client(self) -> WorkerClient:
        return WorkerClient(
            self.addr,
            proc=self.proc,
            step_timeout_s=self.config.step_timeout_s,
            transport=self.config.transport,
        )

    def _launch(self) -> str:
        c = self.config
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="specd-")
        addr = f"ipc://{os.path.join(self._tmp.name, 'worker.sock')}"
        cmd = [
            sys.executable,
            "-m",
            "worker.daemon",
            "--model",
            c.model,
            "--drafter",
            c.drafter,
            "--num-speculative-tokens",
            str(c.num_speculative_tokens),
            "--listen",
            addr,
            "--max-model-len",
            str(c.max_model_len),
            "--parent-pid",
            str(os.getpid()),
        ]
        if c.worker_max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(c.worker_max_num_seqs)]
        if c.worker_max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(c.worker_max_num_batched_tokens)]
        if c.draft_model:
            cmd += ["--draft-model", c.draft_model]
        if c.eagle_head:
            cmd += ["--eagle-head", c.eagle_head]
        if c.device:
            cmd += ["--device", c.device]
        cmd += c.worker_args  # last: where they name a flag set above, they win
        stderr = open(c.worker_log, "ab") if c.worker_log else None  # noqa: SIM115
        env = {**os.environ, **dict(c.worker_env)} if c.worker_env else None
        self.proc = subprocess.Popen(cmd, stderr=stderr, env=env)
        return addr

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        structured: StructuredSpec | dict[str, Any] | None = None,
        num_speculative_tokens: int | None = None,
        req_id: str | None = None,
        matcher: Matcher | None = None,
    ) -> Request:
        """Queue one request. ``structured``: a ``StructuredSpec`` or ``{"json": schema}``,
        ``{"regex": ...}``, ``{"grammar": lark}``, ``{"choice": [...]}``; ``matcher``: its
        grammar, already compiled (``prep.Preparer``), else the scheduler compiles it here."""
        ids = self._prompt_ids(prompt, messages)
        spec = parse_spec(structured)
        k = (
            self.ready.max_num_speculative_tokens
            if num_speculative_tokens is None
            else num_speculative_tokens
        )
        req = Request(
            req_id=req_id or f"req-{next(self._ids)}",
            prompt_ids=ids,
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                max_tokens=max_tokens,
                stop_token_ids=tuple(_plain_ints(list(stop_token_ids or ()))),
            ),
            num_speculative_tokens=k,
            stop=tuple(stop or ()),
            ignore_eos=ignore_eos,
            structured=spec,
            matcher=matcher,
        )
        return self.scheduler.add(req)

    def _prompt_ids(
        self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None
    ) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if isinstance(prompt, list):
            return _plain_ints(prompt)  # checked by the scheduler (request_checks.py)
        if self.tokenizer is None:
            raise ValueError("this worker reported no tokenizer: send token ids")
        text = prompt if prompt is not None else self.tokenizer.apply_chat_template(messages or [])
        return self.tokenizer.encode(text)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.prom.step_seconds.observe(time.perf_counter() - t0)
            self.prom.queue_depth.set(len(self.scheduler.waiting))
            self.prom.running.set(len(self.scheduler.running))
            self.prom.preemptions.set(self.scheduler.num_preemptions)

    def _step(self) -> list[Request]:
        """Receive one step's output. In sync mode the step is scheduled and sent first; with
        overlap (``async_scheduling``) the next steps (up to ``max_steps_in_flight`` in all) are
        sent before this one's output is read, and the deferred grammar rows of the next follow
        once this one's tokens are committed."""
        sch = self.scheduler
        ended, self._ended = self._ended, []
        try:
            if not self.in_flight:
                sched = sch.schedule()
                if sched is None:
                    return ended
                self._send(sched)
                if not self.in_flight:  # it could not be sent: its culprits are ended
                    return ended + self._take_ended()
            depth = self._depth()
            while self.overlap and 0 < len(self.in_flight) < depth:
                nxt = sch.schedule()
                if nxt is None:
                    break
                sent = len(self.in_flight)
                self._send(nxt)
                if len(self.in_flight) == sent:  # it could not be sent (its culprits ended)
                    break
            cur = self.in_flight.popleft()
            if cur.step_id in self._lost:
                names, message = self._lost.pop(cur.step_id)
                return ended + self._refuse(cur, names, message)
            self.outstanding_since = self._sent_mono.get(cur.step_id)
            result = self.client.receive(cur, with_drafts=False)
        except WorkerDied as e:
            return ended + self._worker_died(e)
        except StepRefused as e:
            return ended + self._refused(cur, e)
        self._sent_mono.pop(cur.step_id, None)
        now = time.perf_counter()
        # A step's time is the cycle from the last output to its own: the scheduler's turnaround
        # (committing the output, checking drafts against grammars, the next step's layout) is
        # part of what a step costs, and drafting adds to it. In overlap a step that waited for
        # drafts was sent only after that turnaround, during which the worker had nothing to
        # run: timed from its send, drafting looked cheaper than it was by the whole bubble.
        # After an idle spell (no unfinished requests at the last output) the time counts from
        # the step's send.
        sent_s = self._sent_s.pop(cur.step_id, now)
        cycle_s = now - self._last_output_s if self._went_on else 0.0  # (0: after an idle spell)
        if self._went_on:
            self._cycle_s = _ema(self._cycle_s, cycle_s)
        self._observe(
            cur,
            result.output,
            cycle_s if self._went_on else now - max(self._last_output_s, sent_s),
            queued=sent_s < self._last_output_s,
            cycle=self._went_on,
        )
        self._last_output_s = now
        failed = []
        for err in result.request_errors:
            if err.req_id is not None:
                sch.fail(err.req_id, f"worker refused the request: {err.message}")
                failed.append(sch.requests[err.req_id])
        # the next step's deferred grammar rows wait only for its structured requests' tokens:
        # sent once those are committed, before the rest (detokenizing and streaming 64
        # requests), where no drafts follow (the rows validate drafts that come after)
        nxt = self.in_flight[0] if self.in_flight and not result.output.drafts_follow else None
        first = set(nxt.deferred_req_ids) if nxt is not None else set()
        done = sch.update(result.output, first, self._send_early if first else None)
        if sch.guard is not None:  # the output tokens it committed a second, against no drafts'
            sch.guard.observe(cycle_s, sch.last_committed, len(sch.running))
        if self.on_commit is not None and result.output.drafts_follow:
            self.on_commit(failed + done)  # (without drafts to wait for, the step ends now)
        # the drafts come after the output: the worker drafts while the tokens are committed
        # (and may stall there: the step stays outstanding until they are in, for ``health``)
        try:
            drafts = self.client.receive_drafts(cur, result.output)
        except WorkerDied as e:
            return ended + failed + done + self._worker_died(e)
        # the turnaround counts from the output, or from its drafts' arrival (the worker drafts
        # while the step is committed, so the commit is hidden up to then)
        ready = time.perf_counter() if result.output.drafts_follow else now
        self._drafting = result.output.drafts_follow
        self._mark_outstanding()
        if drafts is not None:
            sch.take_drafts(drafts)
        elif not result.output.drafts_follow:
            sch.no_drafts(result.output)
        self._went_on = bool(sch.running or sch.waiting)
        self._ready_s = ready if self._went_on else None
        if not first:  # (else ``update`` sent them)
            self._send_deferred()
        return ended + self._take_ended() + failed + done

    def _depth(self) -> int:
        """The most steps in flight: ``max_steps_in_flight``, or with ``steps_in_flight_auto``
        two while the worker drafts (the last output said drafts follow) and the scheduler's
        turnaround takes under SHALLOW of the time between outputs. The step sent after an
        output runs after the steps already queued: a third step in flight hides a turnaround as
        long as a step (no drafts at c=64, 2-3 ms a step) and gives a worker with
        --pipeline-steps its next step (it holds only steps without drafts), and makes a new
        request wait one step more for its first token; with a draft model's 7-ms steps the
        turnaround (1-1.5 ms, counted from the drafts' arrival: the worker drafts meanwhile) is
        hidden at two, and three added a step to every first token (TTFT p50 31 ms in overlap
        against 19 in sync at c=8, h100-s24)."""
        cfg = self.scheduler.config
        if (
            cfg.steps_in_flight_auto
            and self._drafting
            and self._cycle_s
            and self._turnaround_s < SHALLOW * self._cycle_s
        ):
            return 2
        return self.scheduler.max_steps_in_flight

    def _worker_died(self, e: WorkerDied) -> list[Request]:
        """The worker is gone: a new one takes the requests over (``_recover``) while restarts
        remain; else every request fails and ``e`` is raised."""
        self._went_on = False  # the next step's time counts from its send
        self._held = None
        self._ready_s = None  # a relaunch is no turnaround
        self.in_flight.clear()
        self._sent_s.clear()
        self._sent_mono.clear()
        self._lost.clear()
        self.outstanding_since = None
        if self.scheduler.guard is not None:
            self.scheduler.guard.restart()  # the replayed prompts would count in its window
        if self.restarts.take():
            self._recover(e)
            return self._take_ended()
        self._fail_all(f"worker died: {e}")
        raise e

    def _send(self, sched: SchedulerOutput) -> None:
        """Send ``sched``; one that cannot be encoded fails the requests that carry the fault
        (``step_blame``), and the worker, which never saw it, is left alone."""
        try:
            self.client.send_step(sched)
        except Unsendable as e:
            names = blame(sched) or list(sched.req_ids)
            log.warning("step %d cannot be sent (%s): failing %s", sched.step_id, e, names)
            message = f"this request cannot be sent to the worker: {e}"
            self._ended += refuse_step(
                self.scheduler, sched, names, message, last=not self.in_flight
            )
            return
        self.in_flight.append(sched)
        self._sent_s[sched.step_id] = now = time.perf_counter()
        if self._ready_s is not None:
            self._turnaround_s = _ema(self._turnaround_s, now - self._ready_s)
            self._ready_s = None
        self._sent_mono[sched.step_id] = time.monotonic()

    def _refused(self, cur: SchedulerOutput, e: StepRefused) -> list[Request]:
        """The worker applied nothing of ``cur``. A refusal is a disagreement between us and the
        worker, our bug or theirs: the safe answer is to end the requests it names, else the
        ones that fail the wire round trip, else all of the step's."""
        if e.err.req_id is not None:
            return self._refuse(cur, [e.err.req_id], str(e))
        if e.err.step_id is not None:
            return self._refuse(cur, list(cur.req_ids), str(e))
        # an error naming no step: the worker could not decode a message of ours
        message = f"the worker could not read this request: {e.err.code}: {e.err.message}"
        culprits = blame(cur)
        if not culprits:
            # overlap: the unreadable one may be the step sent after this one, whose output
            # will never come; this one's output still does
            for later in self.in_flight:
                found = blame(later)
                if found:
                    self._lost[later.step_id] = (found, message)
                    self.in_flight.appendleft(cur)
                    return []
            culprits = list(cur.req_ids)
        return self._refuse(cur, culprits, message)

    def _refuse(self, cur: SchedulerOutput, names: list[str], message: str) -> list[Request]:
        self._went_on = False  # no output: the next step's time counts from its send
        self._ready_s = None  # ... and no turnaround is timed from it
        self._sent_s.pop(cur.step_id, None)
        self._sent_mono.pop(cur.step_id, None)
        self._mark_outstanding()
        ended = refuse_step(self.scheduler, cur, names, message, last=True)
        self._send_deferred()
        return ended

    def _mark_outstanding(self) -> None:
        """The oldest step still in flight is now the one that may stall."""
        first = self.in_flight[0].step_id if self.in_flight else None
        self.outstanding_since = None if first is None else self._sent_mono.get(first)

    def _take_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    def _send_early(self) -> None:
        """``_send_deferred`` before the rest of an output is committed (``num_early_bitmasks``)."""
        self.num_early_bitmasks += self._send_deferred()

    def _send_deferred(self) -> bool:
        """The next step in flight waits for its deferred rows: send them now. Returns whether
        they went."""
        if self.in_flight and self.in_flight[0].deferred_req_ids:
            # a death here is reported (and recovered from) by the next receive
            with contextlib.suppress(WorkerDied):
                self.client.send_step(self.scheduler.deferred_bitmask(self.in_flight[0]))
                self.num_deferred_bitmasks += 1
                return True
        return False

    def _observe(
        self,
        sched: SchedulerOutput,
        out: ModelRunnerOutput,
        seconds: float,
        queued: bool = False,
        cycle: bool = True,
    ) -> None:
        """Feed the speculation tuner the cost of a step (``seconds``: the cycle from the output
        before, see ``_step``), at the width the worker ran: with overlap the step's widths are
        caps, and a request runs only the drafts the worker proposed (none after a proposal of
        zero). Counting the caps filed every overlap step under the widest width, so the
        no-draft end was never measured and the tuner kept proposing zero drafts to measure it:
        overlap never speculated. A step that carries prompt chunks counts with its prefill
        tokens: with arrivals at c=64 nearly every step does, and counting decode-only steps
        alone left the tuner unmeasured there, drafting at full width whatever it cost (the
        draft model served at 0.38x no drafts). With ``--step-trace`` the same figures, and the
        tuner's choice for the step, go to the trace as one JSON line (with or without a
        tuner); ``queued``: the step was sent before the output ahead of it came (overlap: it
        waited behind that step in the worker; False after a drain, as after a drafting step).
        A step whose output the worker held until it had launched the next one (``out.held``,
        ``--pipeline-steps``) has a cycle that holds part of the next step's, whose own comes
        short by as much (2.3 then 0.5 ms, h100-s26): it is timed by the mean of the two
        (``cycle``: ``seconds`` is a cycle; False, counted from the step's send after an idle
        spell, and a held step before it keeps its own). Timed by its own, a no-drafts
        re-measurement among drafting steps read up to twice its cost."""
        tuner = self.scheduler.tuner
        counts = sched.num_scheduled_tokens
        if (tuner is None and self._trace is None) or not len(counts):
            return
        # (a step with deferred grammar rows waited for the scheduler's round trip: timed apart)
        shape = StepShape.of(sched, out)
        if tuner is not None:
            held, self._held = self._held, None
            if held is not None:
                held_shape, before = held
                tuner.observe_shape(held_shape, (before + seconds) / 2 if cycle else before)
            if out.held:
                self._held = (shape, seconds)
            else:
                tuner.observe_shape(shape, seconds)
        if self._trace is not None:
            self._trace.write(
                json.dumps(
                    {
                        "t": round(time.time(), 5),
                        "step": sched.step_id,
                        "reqs": len(counts),
                        "cap": int(sched.num_draft_tokens.max()),
                        "width": shape.width,
                        "proposals": sched.max_draft_proposals,
                        "prefill": shape.prefill_tokens,
                        "ms": round(seconds * 1e3, 3),
                        "drafts": int(out.num_draft_tokens.sum()),
                        "accepted": int(out.num_accepted.sum()),
                        # the tuner's verify width for it (-1: none made), the decoding
                        # requests with drafts to verify, all decoding requests, and why it
                        # proposed what it did after it (spec_tuner.py: hold, ends, explore, best)
                        "choice": self.scheduler.choices.get(sched.step_id, (-1, 0, 0, "")),
                        "queued": queued,
                        "deferred": shape.deferred,
                        # its output went out after the next step was launched (see above)
                        "held": out.held,
                        # the tokens its verified drafts were expected to add (the tuner's
                        # model, before calibration; 0: none verified)
                        "predicted": round(
                            sum(self.scheduler.predicted.get(sched.step_id, {}).values()), 3
                        ),
                    }
                )
                + "\n"
            )

    def _recover(self, cause: WorkerDied) -> None:
        """A new worker (relaunched, or the next one to appear at worker_addr), a new handshake,
        and every in-flight request queued again from its prompt plus committed tokens, except
        those that were on the worker at an earlier death too: they may be what kills it."""
        log.warning("worker lost (%s): restarting and replaying in-flight requests", cause)
        self.recovering = True
        try:
            self._fail_repeat_losses()
            self._relaunch()
        finally:
            self.recovering = False

    def _fail_repeat_losses(self) -> None:
        for req in list(self.scheduler.running):
            if not req.sent_to_worker:
                continue
            req.num_worker_losses += 1
            if req.num_worker_losses >= 2:
                self.scheduler.fail(
                    req.req_id,
                    f"the worker died {req.num_worker_losses} times while running this request: "
                    "it is not replayed again",
                )
                self._ended.append(req)

    def _relaunch(self) -> None:
        self.num_worker_restarts += 1
        self.prom.worker_restarts.inc()
        self.client.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
            self._launch()
        self.client = self._client()
        try:
            ready = self.client.handshake(timeout_s=self.config.handshake_timeout_s)
        except WorkerDied as e:
            self._fail_all(f"worker died and could not be replaced: {e}")
            raise
        if (ready.vocab_size, ready.eos_token_ids) != (
            self.ready.vocab_size,
            self.ready.eos_token_ids,
        ):
            self._fail_all("the replacement worker serves a different model")
            raise WorkerDied("the replacement worker serves a different model")
        sch = self.scheduler
        kv = sch.kv_blocks
        if (
            ready.max_num_seqs < sch.max_num_seqs
            or 0 < ready.max_num_batched_tokens < sch.max_num_batched_tokens
            or (
                kv is not None
                and (ready.num_kv_blocks < kv.num_blocks or ready.kv_block_size != kv.block_size)
            )
        ):
            self._fail_all("the replacement worker has less capacity than the scheduler runs")
            raise WorkerDied("the replacement worker has less capacity than the scheduler runs")
        self.scheduler.requeue_all()

    def _fail_all(self, message: str) -> None:
        for req in list(self.scheduler.requests.values()):
            if not req.finished:
                self.scheduler.fail(req.req_id, message)

    def run_until_done(self) -> None:
        while self.scheduler.has_work():
            self.step()

    def generate(self, requests: list[dict[str, Any]]) -> list[Request]:
        """Run ``requests`` (keyword arguments of ``add_request``) to completion, batched."""
        reqs = [self.add_request(**r) for r in requests]
        self.run_until_done()
        return reqs

    def stream(self, prompt: str | list[int] | None = None, **kwargs: Any) -> Iterator[str]:
        """Text deltas of one request as they are committed (other queued requests run too)."""
        deltas: list[str] = []
        req = self.add_request(prompt, **kwargs)
        req.on_delta = lambda _r, d: deltas.append(d)
        while not req.finished:
            self.step()
            yield from deltas
            deltas.clear()
        if req.error:
            raise RuntimeError(req.error)

    def metrics(self) -> dict[str, object]:
        total = RequestMetrics()
        total.merge(self.scheduler.metrics)
        return total.summary(time.monotonic() - self.started_s)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        trace = getattr(self, "_trace", None)
        if trace is not None:
            trace.close()
            self._trace = None
        client = getattr(self, "client", None)
        if client is not None:
            if self.proc is not None and self.proc.poll() is None:
                client.shutdown()
            client.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        prom = getattr(self, "prom", None)
        if prom is not None:
            prom.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _plain_ints(ids: list[Any]) -> list[Any]:
    """numpy integers as Python ints (the wire encodes only these); anything else is kept for the
    scheduler's checks to name."""
    return [int(t) if isinstance(t, np.integer) else t for t in ids]
