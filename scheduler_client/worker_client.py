"""The scheduler's end of the ZeroMQ connection to one worker."""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    DraftTokenIds,
    Message,
    ModelRunnerOutput,
    Ping,
    Pong,
    ProtocolError,
    SchedulerHello,
    SchedulerOutput,
    Shutdown,
    StepBitmask,
    TransportConfig,
    WorkerError,
    WorkerReady,
    connect_dealer,
)

log = logging.getLogger("specd.scheduler")


class WorkerDied(RuntimeError):
    """The worker process exited or stopped answering; every in-flight request is affected."""


class HandshakeError(RuntimeError):
    """The worker refused us (protocol version) or answered something else."""


@dataclass
class StepResult:
    output: ModelRunnerOutput
    drafts: DraftTokenIds | None
    request_errors: list[WorkerError] = field(default_factory=list)


class StepRefused(RuntimeError):
    """The worker applied nothing of a step. ``err.step_id`` None: the worker could not tell which
    (a message it could not decode); the caller works out the culprits (``step_blame``)."""

    def __init__(self, err: WorkerError) -> None:
        super().__init__(f"worker refused step {err.step_id}: {err.code}: {err.message}")
        self.err = err


class Unsendable(ValueError):
    """A message could not be encoded (a value the wire cannot carry): nothing was sent, the
    worker is fine, and the fault is in what the message carries."""


# ProtocolError codes of a message that could not be encoded (the rest: the peer is gone or slow)
ENCODE_FAULTS = ("bad_field", "bad_array", "oversize")


class WorkerClient:
    """Connects, shakes hands, runs steps. ``proc`` (when we launched the worker) lets us notice
    its death from the process itself, within one poll interval, not from a timeout alone."""

    POLL_MS = 50

    def __init__(
        self,
        addr: str,
        *,
        proc: subprocess.Popen[bytes] | None = None,
        step_timeout_s: float = 120.0,
        transport: TransportConfig | None = None,
        ping_interval_s: float = 1.0,
        max_missed_pings: int = 10,
    ) -> None:
        self.addr = addr
        self.proc = proc
        self.step_timeout_s = step_timeout_s
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.chan = connect_dealer(self.ctx, addr, transport or TransportConfig())
        self.ready: WorkerReady | None = None
        self.scheduler_id = uuid.uuid4().hex[:8]
        self._ping_seq = 0
        # A worker we did not launch is watched with pings: after ping_interval_s of silence we
        # ping; max_missed_pings unanswered in a row means it is gone. The worker answers pings
        # between steps, so a step longer than interval * max_missed is taken for a death.
        self.ping_interval_s = ping_interval_s
        self.max_missed_pings = max_missed_pings
        self._missed = 0
        # A worker we did not launch that exits drops its connection: that is noticed at once,
        # before another worker can bind the same address and answer our pings (its pongs would
        # hide the loss of the step in flight) or our next step (refused: "no_handshake").
        self._monitor = self.chan.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def close(self) -> None:
        self.chan.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.chan.close()
        self.ctx.term()

    def _check_connected(self) -> None:
        """After the handshake, a dropped connection to a worker we did not launch is its end."""
        if self.proc is not None or self.ready is None or not self._monitor.poll(0):
            return
        event = recv_monitor_message(self._monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            raise WorkerDied(f"the connection to the worker at {self.addr} dropped")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            # NOTE: a worker that stops says why (a fatal WorkerError) just before it exits; read
            # what it sent before the exit so the reason is not lost to the race with poll().
            while True:
                try:
                    got = self.chan.recv(timeout_ms=0)
                except ProtocolError:
                    continue  # consumed; what follows may still be the reason
                if got is None:
                    break
                if isinstance(got[1], WorkerError) and got[1].fatal:
                    raise WorkerDied(f"worker failed: {got[1].code}: {got[1].message}")
            raise WorkerDied(
                f"worker process {self.proc.pid} exited with code {self.proc.returncode}"
            )

    def _recv(self, deadline: float, what: str) -> Message:
        silent_since = time.monotonic()
        while True:
            self._check_alive()
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise WorkerDied(f"no {what} from the worker at {self.addr} within the timeout")
            if (
                self.proc is None
                and self.ready is not None
                and now - silent_since >= self.ping_interval_s
            ):
                if self._missed >= self.max_missed_pings:
                    raise WorkerDied(f"the worker at {self.addr} missed {self._missed} pings")
                self._ping_seq += 1
                self._send(Ping(seq=self._ping_seq))
                self._missed += 1
                silent_since = now
            try:
                got = self.chan.recv(timeout_ms=min(self.POLL_MS, max(1, int(left * 1000))))
            except ProtocolError as e:
                raise WorkerDied(f"the worker sent a message that does not decode: {e}") from None
            if got is not None:
                self._missed = 0
                return got[1]
            self._check_connected()

    def _send(self, msg: Message) -> None:
        self._check_alive()
        self._check_connected()
        try:
            self.chan.send(msg)
        except ProtocolError as e:
            if e.code in ENCODE_FAULTS:
                raise Unsendable(f"{type(msg).__name__} cannot be sent: {e}") from None
            raise WorkerDied(f"cannot send to the worker at {self.addr}: {e}") from None

    def handshake(self, timeout_s: float = 600.0) -> WorkerReady:
        self._send(
            SchedulerHello(
                protocol_major=PROTOCOL_MAJOR,
                protocol_minor=PROTOCOL_MINOR,
                scheduler_id=self.scheduler_id,
            )
        )
        msg = self._recv(time.monotonic() + timeout_s, "handshake")
        if isinstance(msg, WorkerError):
            raise HandshakeError(f"the worker refused the handshake: {msg.code}: {msg.message}")
        if not isinstance(msg, WorkerReady):
            raise HandshakeError(f"expected WorkerReady, got {type(msg).__name__}")
        if msg.protocol_major != PROTOCOL_MAJOR:
            raise HandshakeError(
                f"worker speaks protocol {msg.protocol_major}.{msg.protocol_minor}, "
                f"this scheduler {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
            )
        self.ready = msg
        return msg

    def step(self, sched: SchedulerOutput) -> StepResult:
        """Send one step; return its output and the drafts proposed after it."""
        self._send(sched)
        return self.receive(sched)

    def send_step(self, msg: SchedulerOutput | StepBitmask) -> None:
        """Overlap scheduling: send a step (or a step's deferred rows) without waiting."""
        self._send(msg)

    def receive(self, sched: SchedulerOutput, with_drafts: bool = True) -> StepResult:
        """The output of a step already sent, and (``with_drafts``) the drafts proposed after
        it; else those are ``receive_drafts``' to read, once the output is committed."""
        deadline = time.monotonic() + self.step_timeout_s
        errors: list[WorkerError] = []
        while True:
            msg = self._recv(deadline, f"output for step {sched.step_id}")
            if isinstance(msg, ModelRunnerOutput) and msg.step_id == sched.step_id:
                break
            if isinstance(msg, WorkerError):
                if msg.fatal:
                    raise WorkerDied(f"worker failed: {msg.code}: {msg.message}")
                if (
                    msg.req_id is not None
                    and msg.step_id == sched.step_id
                    and msg.code
                    not in (
                        "bad_step",
                        "width_mismatch",
                        "unknown_request",
                        "too_long",
                        "no_kv_blocks",
                    )
                ):
                    errors.append(msg)
                    continue
                # NOTE: an error naming no step answers a message the worker could not decode;
                # the worker runs steps in order and drops what it cannot read, so the step we
                # wait for is lost: refuse it now rather than wait out the step timeout
                if msg.step_id == sched.step_id or msg.step_id is None:
                    raise StepRefused(msg)
            elif _unexpected(msg, sched.step_id):
                raise StepRefused(
                    WorkerError(
                        code="unexpected",
                        message=f"the worker answered step {sched.step_id} with {_describe(msg)}",
                        step_id=sched.step_id,
                    )
                )
            # anything else (a late pong, an old step's output or drafts) is stale: drop it
        drafts = self.receive_drafts(sched, msg, deadline) if with_drafts else None
        return StepResult(msg, drafts, errors)

    def receive_drafts(
        self, sched: SchedulerOutput, out: ModelRunnerOutput, deadline: float | None = None
    ) -> DraftTokenIds | None:
        """The drafts proposed after ``sched``, whose output ``out`` was received: None when no
        ``DraftTokenIds`` follows it (``drafts_follow``, or nothing sampled)."""
        if not (out.drafts_follow and int(out.num_sampled.sum()) > 0):
            return None
        if deadline is None:
            deadline = time.monotonic() + self.step_timeout_s
        while True:
            d = self._recv(deadline, f"drafts for step {sched.step_id}")
            if isinstance(d, DraftTokenIds) and d.step_id == sched.step_id:
                return d
            # the drafter runs after the output went: a worker that fails there says so now
            if isinstance(d, WorkerError) and d.fatal:
                raise WorkerDied(f"worker failed: {d.code}: {d.message}")
            if _unexpected(d, sched.step_id):
                raise WorkerDied(
                    f"the worker sent {_describe(d)} where the drafts of step {sched.step_id} "
                    "were due"
                )
            # anything else (a late pong, an earlier step's message, an error) is stale: dropped

    def ping(self, timeout_s: float = 5.0) -> Pong:
        """A pong proves the worker's step loop is alive (it answers between steps)."""
        self._ping_seq += 1
        seq = self._ping_seq
        self._send(Ping(seq=seq))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._recv(deadline, "pong")
            if isinstance(msg, Pong) and msg.seq >= seq:
                return msg

    def shutdown(self) -> None:
        try:
            self.chan.send(Shutdown(reason="scheduler done"))
        except ProtocolError as e:
            log.warning("could not tell the worker to shut down: %s", e)


def _unexpected(msg: Message, step_id: int) -> bool:
    """A message no worker sends while a step runs, or the output of a step after ours (ours
    was skipped): waiting longer cannot bring our output."""
    if isinstance(msg, ModelRunnerOutput | DraftTokenIds):
        return msg.step_id > step_id
    return not isinstance(msg, Pong | WorkerError)


def _describe(msg: Message) -> str:
    step = getattr(msg, "step_id", None)
    return type(msg).__name__ + ("" if step is None else f" of step {step}")
