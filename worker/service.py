"""The worker's service, once ``worker.daemon`` has checked its flags and bound its socket: load,
handshake, then execute steps until told to stop.

One loop, one error boundary: a message that does not decode, or a step the worker cannot apply,
is answered with ``WorkerError`` and the loop goes on; only an unexpected exception is fatal (it is
logged, reported to the scheduler with ``fatal=True``, and the process exits 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque

import msgspec
import torch
import torch.distributed as dist
import zmq

from protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Ping,
    Pong,
    ProtocolError,
    SchedulerHello,
    SchedulerOutput,
    Shutdown,
    StepBitmask,
    WorkerError,
    WorkerReady,
)
from protocol.gc_heap import freeze_heap
from protocol.transport import Channel
from worker.config import WorkerConfig
from worker.daemon import EXIT_FATAL, EXIT_LOAD, EXIT_OK, GOODBYE_LINGER_MS
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.draft_model import DraftModelDrafter
from worker.drafters.eagle import EagleDrafter
from worker.drafters.ngram import NgramDrafter
from worker.drafters.parallel import ParallelDrafter
from worker.env import profile_dir
from worker.kv_cache import default_num_blocks, draft_num_blocks
from worker.metrics import WorkerMetrics
from worker.model_executor import ModelExecutor, kv_blocks_for_memory
from worker.model_loader import eos_token_ids, load_model
from worker.runner import LaunchedStep, ModelRunner, StepError
from worker.step_profiler import StepProfiler
from worker.tensor_parallel import shard_model
from worker.tp_group import BroadcastRunner, follow
from worker.warm_up import warm_up

log = logging.getLogger("specd.worker")

MAX_BACKLOG = 16  # steps that may queue behind one waiting for its deferred rows
OPEN_POLL_S = 20e-6  # with a step open: how often the socket and the step's kernels are checked


def build_runner(cfg: WorkerConfig) -> tuple[ModelRunner, WorkerReady]:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.tensor_parallel_size > 1 and device.type == "cuda":
        device = torch.device("cuda", cfg.tp_rank)  # one GPU per rank
    if device.type == "cuda" and device.index is not None:
        # events and streams made without a device (the graphs' copies, an open step's tokens)
        # belong to the current one: on --device cuda:N it must be N
        torch.cuda.set_device(device)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    invariant = cfg.batch_invariant or ("pad" if device.type == "cuda" else "off")
    t0 = time.monotonic()
    log.info("loading target %s on %s", cfg.model, device)
    target = load_model(cfg.model, device=device, dtype=dtype, load_format=cfg.load_format)
    if cfg.tensor_parallel_size > 1:
        shard_model(target.model, cfg.tp_rank, cfg.tensor_parallel_size)
    k = cfg.num_speculative_tokens
    bs = cfg.kv_block_size
    full = default_num_blocks(cfg.max_num_seqs, cfg.max_model_len, bs)
    target_blocks = cfg.num_kv_blocks or (
        kv_blocks_for_memory(target.model, cfg.kv_cache_memory_gib, bs)
        if cfg.kv_cache_memory_gib
        else full
    )
    if target_blocks < -(-cfg.max_model_len // bs):
        raise ValueError(
            f"--kv-cache-memory {cfg.kv_cache_memory_gib} GiB holds {target_blocks} blocks, "
            f"fewer than one --max-model-len {cfg.max_model_len} sequence needs"
        )
    draft_blocks = draft_num_blocks(target_blocks, cfg.max_num_seqs, cfg.max_model_len, bs, k)

    def executor_for(model: torch.nn.Module, num_kv_blocks: int) -> ModelExecutor:
        return ModelExecutor(
            model,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            batch_invariant=invariant,
            decode_width=1 + k,
            cuda_graphs=not cfg.enforce_eager and cfg.tensor_parallel_size == 1,
            compile_layers=cfg.enable_torch_compile,
            num_kv_blocks=num_kv_blocks,
            kv_block_size=bs,
            max_num_tokens=cfg.max_num_batched_tokens,
        )

    drafter: Drafter = NoDrafter()
    if cfg.drafter == "ngram" and k:
        drafter = NgramDrafter(min_n=cfg.ngram_min, max_n=cfg.ngram_max, max_num_tokens=k)
    elif cfg.drafter in ("draft_model", "parallel") and k:
        assert cfg.draft_model is not None
        log.info("loading draft %s", cfg.draft_model)
        # --load-format covers the draft too: dummy target, dummy draft (their random heads share
        # one permutation, dummy_weights.stable_greedy, so the pair agrees as a real one does)
        draft = load_model(cfg.draft_model, device=device, dtype=dtype, load_format=cfg.load_format)
        if (
            draft.model.config.get_text_config().vocab_size
            > target.model.config.get_text_config().vocab_size
        ):
            raise ValueError("the draft model's vocabulary is larger than the target's")
        draft_executor = executor_for(draft.model, draft_blocks)
        # a smaller draft vocabulary is padded: its distributions are over the target's ids
        target_vocab = int(target.model.config.get_text_config().vocab_size)
        drafter = (
            DraftModelDrafter(draft_executor, max_num_tokens=k, target_vocab_size=target_vocab)
            if cfg.drafter == "draft_model"
            else ParallelDrafter(draft_executor, max_num_tokens=k, target_vocab_size=target_vocab)
        )
    if cfg.drafter == "eagle" and k:
        assert cfg.eagle_head is not None
        log.info("loading EAGLE head %s", cfg.eagle_head)
        drafter = EagleDrafter.from_files(
            cfg.eagle_head,
            target.model,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_tokens=k,
            cuda_graphs=not cfg.enforce_eager and cfg.tensor_parallel_size == 1,
        )
    executor = executor_for(target.model, target_blocks)
    if executor.decode.use_graphs:
        t1 = time.monotonic()
        executors = [executor]
        if isinstance(drafter, DraftModelDrafter | ParallelDrafter):
            executors.append(drafter.executor)
        n = sum(e.decode.capture_all() for e in executors)
        r = sum(e.ragged.capture_all() for e in executors if e.ragged is not None)
        log.info("captured %d decode and %d ragged graphs in %.1f s", n, r, time.monotonic() - t1)
    runner = ModelRunner(
        executor,
        drafter,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        max_num_draft_tokens=k,
        chain_drafts=cfg.chain_drafts and cfg.tensor_parallel_size == 1,
    )
    if isinstance(drafter, EagleDrafter) and executor.decode.use_graphs:
        t1 = time.monotonic()  # (the head's graphs need its cache, made when the runner binds it)
        n = drafter.capture_all()
        log.info("captured %d EAGLE drafting graphs in %.1f s", n, time.monotonic() - t1)
    if cfg.tensor_parallel_size == 1:  # (ranks would each run it: their collectives must pair)
        t1 = time.monotonic()
        n = warm_up(runner, k, executor.vocab_size)
        log.info("warm-up: %d steps in %.1f s", n, time.monotonic() - t1)
    eos_ids = eos_token_ids(target.model)
    ready = WorkerReady(
        protocol_major=PROTOCOL_MAJOR,
        protocol_minor=PROTOCOL_MINOR,
        model_name=target.name,
        vocab_size=executor.vocab_size,
        eos_token_ids=eos_ids,
        max_model_len=cfg.max_model_len,
        drafter=drafter.name,
        max_num_speculative_tokens=k,
        kv_capacity_tokens=executor.kv_cache.capacity_tokens,
        max_num_seqs=cfg.max_num_seqs,
        tokenizer_path=target.tokenizer_directory,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_kv_blocks=executor.kv_cache.num_blocks,
        kv_block_size=executor.kv_cache.block_size,
    )
    log.info(
        "models ready in %.1f s (drafter %s, k=%d, batch_invariant %s)",
        time.monotonic() - t0,
        drafter.name,
        k,
        invariant,
    )
    return runner, ready


def freeze_startup_heap() -> None:
    """What start-up made (modules, weights' wrappers, graphs) leaves the collector's reach: a
    full collection inside a step would walk it all (protocol/gc_heap.py). A daemon's process
    only, after ``build_runner``."""
    log.info("%d objects frozen", freeze_heap())


class WorkerLoop:
    """Receives, dispatches and answers. ``peer`` is the identity of the scheduler that said hello."""

    def __init__(
        self,
        chan: Channel,
        runner: ModelRunner,
        ready: WorkerReady,
        metrics: WorkerMetrics | None = None,
        peer_timeout_s: float = 60.0,
        parent_pid: int | None = None,
        pipeline_steps: bool = False,
    ) -> None:
        self.metrics = metrics or WorkerMetrics()
        # --pipeline-steps: a step that verifies and proposes no drafts is left open (its tokens
        # on the device) while the next step, when it has already arrived, is launched behind it
        # (ModelRunner.launch, may_hold)
        self.pipeline = pipeline_steps and isinstance(runner, ModelRunner)
        self.open_step: tuple[bytes, LaunchedStep, float, int, int] | None = None
        self._last_end = 0.0
        self.parent_pid = parent_pid  # stop when this process is no longer our parent
        self.peer_timeout_s = peer_timeout_s
        self.peer_seen = 0.0
        self.chan = chan
        self.runner = runner
        self.ready = ready
        self.peer: bytes | None = None
        # the peer's protocol minor: from 6 an output without drafts is sent without a
        # DraftTokenIds after it (ModelRunnerOutput.drafts_follow)
        self.peer_minor = 0
        self.stopping = False
        self.num_bad_messages = 0
        self.last_step_id: int | None = None  # the last step executed since the handshake
        # (identity, message) received during a deferred-rows wait, handled after that step
        self.backlog: deque[tuple[bytes, object]] = deque()
        out = profile_dir()
        self.profiler = StepProfiler(out, runner.device) if out is not None else None

    def serve(self) -> int:
        code = self._serve()
        self.close_open_step()  # a stop or a shutdown: the step in progress is answered
        return code

    def _serve(self) -> int:
        while not self.stopping:
            if self.profiler is not None:
                self.profiler.poll(getattr(self.runner, "num_steps", 0))
            if self.backlog:  # messages that arrived while a step waited for its deferred rows
                identity, queued = self.backlog.popleft()
                if not isinstance(queued, SchedulerOutput):
                    self.close_open_step()
                if isinstance(queued, Shutdown):
                    return EXIT_OK
                self.dispatch(identity, queued)
                continue
            frames = self.poll_open() if self.open_step else self.chan.recv_frames(timeout_ms=200)
            if frames is None:
                if self.open_step:
                    self.close_open_step()  # its kernels are done and no step is waiting
                    continue
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    log.warning("the scheduler that launched this worker is gone: stopping")
                    return EXIT_OK
                self.check_peer()
                continue
            identity = frames[0].bytes
            if identity == self.peer:
                self.peer_seen = time.monotonic()
            try:
                msg = self.chan.codec.decode([f.buffer for f in frames[1:]])
            except ProtocolError as e:
                self.close_open_step()
                self.num_bad_messages += 1
                log.warning("bad message from %r: %s", identity, e)
                self.reply(identity, WorkerError(code=e.code, message=str(e)))
                continue
            if not (isinstance(msg, SchedulerOutput) and identity == self.peer):
                self.close_open_step()  # only the peer's next step runs behind an open one
            if isinstance(msg, Shutdown):
                log.info("shutdown requested: %s", msg.reason or "(no reason)")
                return EXIT_OK
            self.dispatch(identity, msg)
        return EXIT_OK

    def poll_open(self) -> list[zmq.Frame] | None:
        """With a step open: the next message if one arrives before the step's kernels are done
        (it is launched behind them), else None (the step is finished without waiting)."""
        assert self.open_step is not None
        launched = self.open_step[1]
        while True:
            frames = self.chan.recv_frames(timeout_ms=0)
            if frames is not None or launched.ready():
                return frames
            time.sleep(OPEN_POLL_S)

    def close_open_step(self) -> None:
        if self.open_step is not None:
            running, self.open_step = self.open_step, None
            self.answer(*running)

    def check_peer(self) -> None:
        """A scheduler that holds requests keeps sending steps. Silence past the timeout means it
        died: free every request so the slots and KV serve the next scheduler."""
        if self.peer is None or not self.runner.states.slot_of:
            return
        if time.monotonic() - self.peer_seen > self.peer_timeout_s:
            log.warning(
                "scheduler silent for %.0f s with %d requests: freeing them",
                self.peer_timeout_s,
                len(self.runner.states.slot_of),
            )
            self.runner.reset()
            self.metrics.running.set(0)
            self.peer = None
            self.last_step_id = None

    def dispatch(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, SchedulerHello):
            if msg.protocol_major != PROTOCOL_MAJOR:
                self.reply(
                    identity,
                    WorkerError(
                        code="version",
                        message=f"scheduler speaks protocol {msg.protocol_major}."
                        f"{msg.protocol_minor}, worker speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}",
                    ),
                )
                return
            if self.peer is not None and identity != self.peer:
                log.info(
                    "new scheduler %s: dropping the previous scheduler's requests", msg.scheduler_id
                )
                self.runner.reset()
            self.peer = identity
            self.peer_minor = msg.protocol_minor
            self.peer_seen = time.monotonic()
            self.last_step_id = None  # a new session numbers its steps afresh
            self.reply(identity, self.ready)
        elif isinstance(msg, Ping):
            # Answered from the step loop itself, between steps: a pong proves the loop is alive.
            self.reply(identity, Pong(seq=msg.seq, num_steps=self.runner.num_steps))
        elif isinstance(msg, SchedulerOutput):
            if identity != self.peer:
                self.reply(
                    identity,
                    WorkerError(
                        code="no_handshake",
                        step_id=msg.step_id,
                        message="send SchedulerHello before steps",
                    ),
                )
                return
            self.step(identity, msg)
        elif isinstance(msg, StepBitmask):
            # rows for a step that was refused before it waited for them, or for no step at all
            log.debug("bitmask for step %d with no step waiting: dropped", msg.step_id)
            self.reply(
                identity,
                WorkerError(
                    code="late_bitmask",
                    message=f"no step waits for the deferred rows of step {msg.step_id}: dropped",
                    step_id=msg.step_id,
                    field="StepBitmask.step_id",
                ),
            )
        else:
            self.reply(
                identity,
                WorkerError(
                    code="unexpected_message",
                    message=f"the worker does not take {type(msg).__name__}",
                ),
            )

    def step(self, identity: bytes, sched: SchedulerOutput) -> None:
        """Launch the step; answer it at once, or (``--pipeline-steps``, a step with no drafts)
        leave it open until the next message or the end of its kernels. A step launched while
        the one before is open is launched first: that one is answered right after, or, where
        the step waits for deferred grammar rows, before it waits (the scheduler builds them
        from the open step's tokens), with this step's forward already queued behind it."""
        before, self.open_step = self.open_step, None
        t0 = time.perf_counter()

        def answer_before_rows(step_id: int) -> StepBitmask:
            nonlocal before
            if before is not None:
                opened, before = before, None
                self.metrics.pipelined.inc()
                self.answer(*opened, held=True)
            return self.wait_bitmask(step_id)

        try:
            if self.last_step_id is not None and sched.step_id <= self.last_step_id:
                raise StepError(
                    "bad_step",
                    f"step {sched.step_id}: step_id: not after the last step executed, "
                    f"{self.last_step_id}",
                    field="step_id",
                )
            counts = sched.num_scheduled_tokens
            # a count out of range is the runner's check_step to name (with its index)
            in_range = counts.ndim == 1 and bool(
                ((counts >= 0) & (counts <= self.ready.max_model_len)).all()
            )
            num_tokens = int(counts.sum()) if in_range else 0
            if num_tokens > self.ready.max_num_batched_tokens > 0:
                raise StepError(
                    "bad_step",
                    f"step {sched.step_id} runs {num_tokens} tokens, above this worker's "
                    f"--max-num-batched-tokens {self.ready.max_num_batched_tokens}",
                    field="num_scheduled_tokens",
                )
            if before is not None and before[1].bounds and not self.runner.may_chain(sched):
                # a chained step's host lengths are upper bounds: only a chained step is laid
                # out behind it, any other after it is answered
                opened, before = before, None
                self.answer(*opened)
            launched = self.runner.launch(sched, answer_before_rows, hold=self.pipeline)
        except StepError as e:
            if before is not None:
                self.answer(*before)
            log.warning("step %d refused: %s", sched.step_id, e)
            self.reply(identity, refusal(e, sched.step_id))
            return
        except Exception:
            if before is not None:  # the open step's tokens still reach the scheduler first
                with contextlib.suppress(Exception):
                    self.answer(*before)
            raise
        # what the step leaves behind, for its metrics (a later step may run before it is read)
        running = (
            identity,
            launched,
            t0,
            len(self.runner.states.slot_of),
            self.runner.target.kv_cache.blocks.num_free,
        )
        if before is not None:
            self.metrics.pipelined.inc()
            self.answer(*before, held=True)
        self.last_step_id = sched.step_id
        if launched.chained:
            self.metrics.chained.inc()
        if launched.open:
            self.open_step = running
        else:
            self.answer(*running)

    def answer(
        self,
        identity: bytes,
        launched: LaunchedStep,
        t0: float,
        num_running: int,
        kv_free: int,
        held: bool = False,
    ) -> None:
        """A launched step finished: its refusals, its output, then its drafts. The output goes
        before the drafter runs, so the scheduler commits the step's tokens (detokenizes,
        streams, advances grammars) while the drafts are made; ``drafts_follow`` says whether a
        ``DraftTokenIds`` comes after it; ``held``: it was answered after the next step was
        launched behind it (an older scheduler skips the field). Its time counts from its launch or
        from the end of the step before, whichever is later (steps overlap), to its drafts."""
        out, rejected = self.runner.read_output(launched)
        if held:
            out = msgspec.structs.replace(out, held=True)
        # a step that proposes nothing sends no DraftTokenIds to a scheduler of protocol minor 6
        # or later: the scheduler clears its requests' drafts itself (at batch 64 the message
        # was an encode, a send, a decode and a loop a step)
        quiet = self.peer_minor >= 6 and not self.runner.will_propose(launched)
        if quiet:
            out = msgspec.structs.replace(out, drafts_follow=False)
        for err in rejected:
            self.reply(identity, refusal(err, launched.sched.step_id))
        self.reply(identity, out)
        self.runner.propose_after(launched)
        drafts = None if quiet else self.runner.take_draft_tokens()
        if drafts is not None:
            self.reply(identity, drafts)
        now = time.perf_counter()
        self.metrics.record_step(out, now - max(t0, self._last_end), num_running, kv_free)
        self._last_end = now

    def wait_bitmask(self, step_id: int) -> StepBitmask:
        """Overlap scheduling: the step's deferred grammar rows, read while the GPU computes.
        Meanwhile every kind of message is handled: pings are answered, rows of an earlier step
        are answered as late, bad frames and other messages are answered with an error; the next
        ``SchedulerOutput`` waits in the backlog for this step to finish. A handshake or a
        ``Shutdown`` (queued, then handled), or silence past the peer timeout, refuses the step
        (nothing of it is applied)."""
        deadline = time.monotonic() + self.peer_timeout_s
        while time.monotonic() < deadline:
            frames = self.chan.recv_frames(timeout_ms=200)
            if frames is None:
                continue
            identity = frames[0].bytes
            try:
                msg = self.chan.codec.decode([f.buffer for f in frames[1:]])
            except ProtocolError as e:
                self.num_bad_messages += 1
                self.reply(identity, WorkerError(code=e.code, message=str(e)))
                continue
            if isinstance(msg, SchedulerHello | Shutdown):
                # a new session (or the end): this step is moot; the message is handled after it
                self.backlog.append((identity, msg))
                what = "a new handshake" if isinstance(msg, SchedulerHello) else "a shutdown"
                raise StepError(
                    "bad_step",
                    f"step {step_id}: deferred_req_ids: {what} arrived while the step waited for "
                    "its deferred rows",
                    field="deferred_req_ids",
                )
            if identity != self.peer:
                self.dispatch(identity, msg)  # a health check or a stranger: not our step
                continue
            self.peer_seen = time.monotonic()
            if isinstance(msg, StepBitmask) and msg.step_id == step_id:
                return msg
            if isinstance(msg, SchedulerOutput) and len(self.backlog) < MAX_BACKLOG:
                self.backlog.append((identity, msg))  # the next step: after this one
            elif isinstance(msg, SchedulerOutput):
                self.reply(
                    identity,
                    WorkerError(
                        code="busy",
                        message=f"{MAX_BACKLOG} steps already wait behind step {step_id}",
                        step_id=msg.step_id,
                    ),
                )
            else:
                self.dispatch(identity, msg)  # a ping, rows of another step, a stray message
        raise StepError(
            "bad_step",
            f"step {step_id}: deferred_req_ids: no deferred bitmask within "
            f"{self.peer_timeout_s:.0f} s",
            field="deferred_req_ids",
        )

    def reply(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, WorkerError):
            self.metrics.errors.labels(code=msg.code).inc()
        try:
            self.chan.send(msg, identity)  # type: ignore[arg-type]
        except ProtocolError as e:
            # A health check that gave up, or a scheduler that went away: nothing to repair here.
            level = logging.INFO if e.code == "closed" else logging.WARNING
            log.log(level, "could not answer %r: %s", identity, e)


def refusal(err: StepError, step_id: int) -> WorkerError:
    """The answer to a refused step, or to one request refused within a step: step, request and
    field named."""
    return WorkerError(
        code=err.code, message=str(err), step_id=step_id, req_id=err.req_id, field=err.field
    )


def start_tp_group(
    cfg: WorkerConfig, argv: list[str], store_dir: str
) -> list[subprocess.Popen[bytes]]:
    """Rank 0: launch ranks 1..N-1 (this process's flags plus their rank) and join the group.

    The ranks meet through a file store in ``store_dir`` (rank 0 removes it when it stops): no TCP
    port is picked and released for another process to take in between."""
    init = f"file://{os.path.join(store_dir, 'tp-store')}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.daemon",
                *argv,
                "--tp-rank",
                str(r),
                "--tp-init",
                init,
                "--parent-pid",
                str(os.getpid()),
            ]
        )
        for r in range(1, cfg.tensor_parallel_size)
    ]
    join_tp_group(cfg, init)
    return procs


def join_tp_group(cfg: WorkerConfig, init: str) -> None:
    cuda = (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init,
        rank=cfg.tp_rank,
        world_size=cfg.tensor_parallel_size,
    )


def follower_main(cfg: WorkerConfig) -> int:
    """Ranks 1..N-1: no socket; load, shard, and run what rank 0 broadcasts."""
    assert cfg.tp_init is not None
    join_tp_group(cfg, cfg.tp_init)
    try:
        runner, _ready = build_runner(cfg)
        freeze_startup_heap()
        return follow(runner, runner.device)
    except Exception:
        log.exception("tensor-parallel rank %d failed", cfg.tp_rank)
        return EXIT_FATAL
    finally:
        dist.destroy_process_group()


def serve(
    cfg: WorkerConfig,
    argv: list[str],
    ctx: zmq.Context[zmq.Socket[bytes]],
    chan: Channel,
) -> int:
    """Rank 0, on the channel ``worker.daemon`` bound: load, serve, and close it at the end."""
    ranks: list[subprocess.Popen[bytes]] = []
    runner: ModelRunner | BroadcastRunner | None = None
    store_dir = None  # the rank group's file store (tensor parallelism only)
    try:
        if cfg.tensor_parallel_size > 1:
            store_dir = tempfile.TemporaryDirectory(prefix="specd-tp-")
            ranks = start_tp_group(cfg, argv, store_dir.name)
        try:
            runner, ready = build_runner(cfg)
        except (OSError, ValueError) as e:
            log.error("model load failed: %s", e)
            return EXIT_LOAD
        # --pipeline-steps: by default where the GPU runs the kernels (on the CPU the host runs
        # them, so an open step only answers later) and one rank serves; told in the handshake
        pipeline = cfg.pipeline_steps
        if pipeline is None:
            pipeline = runner.device.type == "cuda"
        ready = msgspec.structs.replace(ready, pipeline_steps=bool(pipeline) and not ranks)
        if ranks:
            runner = BroadcastRunner(runner, runner.device)  # type: ignore[assignment]
        freeze_startup_heap()
        metrics = WorkerMetrics()
        if cfg.metrics_port:
            metrics_port = metrics.serve(cfg.metrics_port)
            log.info("Prometheus metrics on :%d/metrics", metrics_port)
        loop = WorkerLoop(
            chan,
            runner,
            ready,
            metrics,
            peer_timeout_s=cfg.peer_timeout_s,
            parent_pid=cfg.parent_pid,
            pipeline_steps=ready.pipeline_steps,
        )

        def stop(signum: int, _frame: object) -> None:
            log.info("signal %d: stopping", signum)
            loop.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        # the bound endpoint: for tcp://HOST:0 the port the system picked
        log.info("serving on %s", chan.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            code = loop.serve()
            if loop.stopping and loop.peer is not None:
                # Drained: the step in progress finished. In-flight requests are the scheduler's
                # to replay; it hears so before the socket closes.
                loop.reply(
                    loop.peer,
                    WorkerError(
                        code="shutting_down",
                        message="the worker was told to stop (signal)",
                        fatal=True,
                    ),
                )
            return code
        except Exception as e:
            log.exception("fatal error in the step loop")
            if loop.peer is not None:
                loop.reply(loop.peer, WorkerError(code="fatal", message=repr(e), fatal=True))
            return EXIT_FATAL
    finally:
        # NOTE: the goodbye (shutting_down or fatal) was only queued; with the configured LINGER 0
        # the close could drop it, and the scheduler would see a bare exit instead of the reason.
        chan.close(linger_ms=GOODBYE_LINGER_MS)
        ctx.term()
        if ranks:
            stop_tp_group(runner, ranks)
        if store_dir is not None:
            store_dir.cleanup()


def stop_tp_group(
    runner: ModelRunner | BroadcastRunner | None, ranks: list[subprocess.Popen[bytes]]
) -> None:
    if isinstance(runner, BroadcastRunner):
        try:
            runner.stop()
        except RuntimeError as e:  # a rank already gone
            log.warning("could not stop the tensor-parallel ranks cleanly: %s", e)
    for proc in ranks:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    if dist.is_initialized():
        dist.destroy_process_group()
