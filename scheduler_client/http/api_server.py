"""The HTTP door in a process of its own (``--api-server-count 1``), as vLLM's API server and
SGLang's tokenizer manager run beside their engine: the engine's thread then has this process's
GIL to itself, where in one process it shared it with the thread writing every stream's events.

Two halves, one per process, joined by two ZeroMQ PUSH/PULL pipes over ``ipc://`` in a private
directory (mode 0700: only this user can connect):

- ``ApiServerProcess`` (the scheduler's process): launches the HTTP process, puts the requests it
  forwards into the ``EngineLoop``s, and sends each loop's events back as **one message a step**
  (the loop's ``after_step``), the loops' health and drain state when they change, and the
  Prometheus text when asked. When the HTTP process dies, the loops drain at once and the daemon
  exits 1.
- ``main`` (the HTTP process): uvicorn and the ``Door`` as in one process, with a ``RemoteLoop``
  standing in for each engine loop. It ignores SIGINT and SIGTERM (the scheduler drains, then
  tells it to stop, after each loop's last events) and leaves when the scheduler is gone.

Messages are msgpack arrays. Up (HTTP -> scheduler): ``["add", loop, request]``, ``["abort",
loop, req_id]``, ``["metrics", ask]``, ``["listening", host, port]``, ``["unusable", why]``.
Down: ``["events", loop, [[req_id, code, payload], ...]]`` (code 0 text, 1 refused, 2 finished),
``["state", [[health, draining, failed], ...]]``, ``["metrics", ask, text]``, ``["stop", loop]``.
Each loop's events and its stop share one socket, so a stop never overtakes the last events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from scheduler_client.engine_loop import (
    Delta,
    Done,
    EngineLoop,
    Event,
    Finished,
    Refused,
    Stream,
    with_req_id,
)
from scheduler_client.http.door import Door
from scheduler_client.http.server import SHUTDOWN_S, DoorLimits, DoorServer

log = logging.getLogger("specd.http")

START_S = 60.0  # the longest the scheduler waits for the HTTP process to listen
POLL_MS = 200  # how often each side checks the other is alive and the loops' state
METRICS_S = 10.0  # the longest /metrics waits for the scheduler's answer
SEND_HWM = 100_000  # messages queued for a peer that stopped reading, then dropped (logged)
TEXT, REFUSED, FINISHED = 0, 1, 2

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _push(ctx: zmq.Context[zmq.Socket[bytes]], addr: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.LINGER, 2000)  # the last events and the stop still go out at close
    sock.connect(addr)
    return sock


def _send(sock: zmq.Socket[bytes], msg: list[Any] | bytes) -> bool:
    """``msg`` (or its encoding, already made); False when the peer has stopped reading (its
    queue is full): the message is dropped."""
    try:
        sock.send(msg if isinstance(msg, bytes) else _encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


# -- the scheduler's process -------------------------------------------------------------------
class _Outbox:
    """One loop's events of the current step, sent as one message by the loop's thread."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str, index: int) -> None:
        self.index = index
        self.sock = _push(ctx, addr)
        self._lock = threading.Lock()
        self._items: list[list[Any]] = []
        self._dropped = 0

    def put(self, req_id: str, code: int, payload: Any) -> None:
        with self._lock:
            self._items.append([req_id, code, payload])

    def flush(self) -> None:
        """The loop's thread (its after_step); once the loop has ended, the relay's too: the
        lock keeps the socket to one thread at a time."""
        if not self._items:
            return
        with self._lock:
            items, self._items = self._items, []
            try:
                msg = _encode(["events", self.index, items])
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
                msg = _encode(["events", self.index, [_sendable(item) for item in items]])
            if not _send(self.sock, msg):
                self._dropped += len(items)
                log.error("the HTTP process is not reading: %d events dropped", self._dropped)


def _sendable(item: list[Any]) -> list[Any]:
    """``item`` if msgpack takes it, else its request's end as a failure that says why."""
    try:
        _encode(item)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
        log.error("an event of %s could not be sent to the HTTP process: %s", item[0], e)
        return [item[0], REFUSED, [f"the scheduler could not send this result: {e}", 500]]
    return item


class _Forward(Stream):
    """A request's reader in the HTTP process: its events go to the loop's outbox."""

    def __init__(self, loop: EngineLoop, box: _Outbox) -> None:
        super().__init__(loop)
        self.box = box

    def put(self, event: Event) -> None:
        assert self.req_id is not None
        if isinstance(event, Delta):
            self.box.put(self.req_id, TEXT, event.text)
        elif isinstance(event, Refused):
            self.box.put(self.req_id, REFUSED, [event.message, event.status])
        else:
            self.box.put(self.req_id, FINISHED, list(vars(event.result).values()))


class ApiServerProcess:
    """Launches the HTTP process for ``loops`` and relays between them (``start``, ``stop``).
    ``failed`` says why it ended early (the HTTP process died): the daemon then exits 1."""

    def __init__(
        self, loops: Sequence[EngineLoop], registry: CollectorRegistry, settings: dict[str, Any]
    ) -> None:
        self.loops = list(loops)
        self.settings = settings  # the HTTP process's: main() reads them from its stdin
        self.failed: str | None = None
        self.registry = registry  # every loop's engine metrics, for /metrics
        self._dir = tempfile.mkdtemp(prefix="specd-http-")  # 0700
        self._up_addr = f"ipc://{self._dir}/up"
        self._down_addr = f"ipc://{self._dir}/down"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._up = self._ctx.socket(zmq.PULL)
            self._up.setsockopt(zmq.LINGER, 0)
            self._up.bind(self._up_addr)
            self._ctl = _push(self._ctx, self._down_addr)  # the relay thread's
            self._boxes = [_Outbox(self._ctx, self._down_addr, i) for i in range(len(self.loops))]
        except zmq.ZMQError as e:  # an ipc path too long for the system (a long TMPDIR), ...
            self.close()
            raise OSError(f"cannot open the HTTP process's pipes in {self._dir}: {e}") from None
        for lp, box in zip(self.loops, self._boxes, strict=True):
            lp.after_step = box.flush
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="http-relay", daemon=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> tuple[str, int]:
        """Launch the HTTP process; its address once it listens. ``OSError`` if it cannot."""
        settings = {
            **self.settings,
            "up": self._up_addr,
            "down": self._down_addr,
            "num_loops": len(self.loops),
            "parent_pid": os.getpid(),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_client.http.api_server"], stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(settings).encode())  # the API key: never on argv
        self.proc.stdin.close()
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self._up.poll(POLL_MS):
                msg = _decode(self._up.recv())
                if msg[0] == "listening":
                    self._thread.start()
                    return str(msg[1]), int(msg[2])
                if msg[0] == "unusable":
                    self._reap(5.0)
                    self.close()
                    raise OSError(msg[1])
            elif self.proc.poll() is not None:
                self.close()
                raise OSError(f"the HTTP process exited with {self.proc.returncode} at start")
        self._reap()
        self.close()
        raise OSError(f"the HTTP process did not listen within {START_S:.0f} s")

    def _relay(self) -> None:
        """Requests from the HTTP process into the loops; their state and metrics back. A
        failure here is the HTTP process's loss: the loops drain at once."""
        try:
            self._relay_until_stopped()
        except Exception as e:
            log.exception("the relay to the HTTP process failed")
            self._lost(f"the relay to the HTTP process failed: {e!r}")

    def _lost(self, why: str) -> None:
        self.failed = why
        log.error("%s: draining at once", why)
        for lp in self.loops:
            lp.drain(0.0)

    def _relay_until_stopped(self) -> None:
        state: list[Any] | None = None
        while not self._stopping.is_set():
            if self._up.poll(POLL_MS):
                while True:
                    try:
                        raw = self._up.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(raw)
            now = [[lp.health(), lp.draining, lp.failed] for lp in self.loops]
            if now != state and _send(self._ctl, ["state", now]):
                state = now  # else sent again at the next poll
            assert self.proc is not None
            if self.proc.poll() is not None and not self._stopping.is_set():
                self._lost(f"the HTTP process exited with {self.proc.returncode}")
                return

    def _take(self, raw: bytes) -> None:
        try:
            kind, *args = _decode(raw)
            if kind == "add":
                index, request = args
                loop = self.loops[index]
                loop.submit_stream(request, _Forward(loop, self._boxes[index]))
            elif kind == "abort":
                index, req_id = args
                self.loops[index].abort(req_id)
            elif kind == "metrics":
                _send(self._ctl, ["metrics", args[0], generate_latest(self.registry)])
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except (ValueError, TypeError, IndexError, KeyError, msgspec.DecodeError) as e:
            log.error("a malformed message from the HTTP process was dropped: %s", e)

    def stop(self) -> None:
        """After every loop has ended: tell the HTTP process (behind each loop's last events)
        and wait for it to finish writing its answers."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for box in self._boxes:
            box.flush()
            _send(box.sock, ["stop", box.index])
        self._reap(SHUTDOWN_S + 5)
        self.close()

    def close(self) -> None:
        """The pipes and their directory."""
        self._ctx.destroy(linger=2000)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _reap(self, timeout_s: float = 0.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        if self.proc.poll() is None:
            log.warning("the HTTP process did not stop in time; killing it")
            self.proc.kill()
            self.proc.wait()


# -- the HTTP process --------------------------------------------------------------------------
class RemoteLoop:
    """An engine loop of the scheduler's process as the door sees it."""

    def __init__(self, link: _Link, index: int) -> None:
        self.link = link
        self.index = index
        self.draining = False
        self.failed: str | None = None
        self._health = "ok"

    def submit(self, request: dict[str, Any], waker: Callable[[], None] | None = None) -> Stream:
        stream = Stream(self, waker)
        request = with_req_id(request)
        stream.req_id = request["req_id"]
        try:
            msg = _encode(["add", self.index, request])
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            # (an integer past 64 bits in a JSON schema): refused here, its slot given back
            stream.put(Refused(f"the request cannot be passed to the engine: {e}"))
            return stream
        self.link.streams[stream.req_id] = stream  # before the add: no event finds it missing
        self.link.send_raw(msg, "add")
        return stream

    def abort(self, req_id: str) -> None:
        self.link.send(["abort", self.index, req_id])

    def health(self) -> str:
        return self._health


class _Link:
    """The HTTP process's end: sends on the event loop's (and main) thread, under a lock;
    receives on the main thread (``run``)."""

    def __init__(self, up: str, down: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.down = self.ctx.socket(zmq.PULL)
        self.down.setsockopt(zmq.LINGER, 0)
        self.down.bind(down)
        self.down_path = down.removeprefix("ipc://")
        self.up = _push(self.ctx, up)
        self._lock = threading.Lock()
        self.streams: dict[str, Stream] = {}  # req_id -> its reader, until its end
        self._asks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[bytes]]] = {}
        self._ask_ids = itertools.count()

    def send(self, msg: list[Any]) -> None:
        self.send_raw(_encode(msg), msg[0])

    def send_raw(self, raw: bytes, kind: str) -> None:
        with self._lock:
            if not _send(self.up, raw):
                log.error("the scheduler is not reading: %s dropped", kind)

    async def metrics(self) -> bytes:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        ask = next(self._ask_ids)
        self._asks[ask] = (loop, future)
        self.send(["metrics", ask])
        try:
            return await asyncio.wait_for(future, METRICS_S)
        finally:
            self._asks.pop(ask, None)

    def run(self, loops: list[RemoteLoop], parent_pid: int) -> bool:
        """Until every loop has stopped (True) or the scheduler is gone (False)."""
        stopped: set[int] = set()
        while True:
            if self.down.poll(POLL_MS):
                kind, *args = _decode(self.down.recv())
                if kind == "events":
                    self._deliver(args[1])
                elif kind == "state":
                    for lp, (health, draining, failed) in zip(loops, args[0], strict=True):
                        lp._health, lp.draining, lp.failed = health, draining, failed
                elif kind == "metrics":
                    asked = self._asks.get(args[0])
                    if asked is not None:
                        asked[0].call_soon_threadsafe(_answer, asked[1], args[1])
                elif kind == "stop":
                    stopped.add(args[0])
                    if len(stopped) == len(loops):
                        return True
            if os.getppid() != parent_pid:
                log.error("the scheduler (pid %d) is gone: stopping", parent_pid)
                # nobody else removes the pipes' directory of a killed scheduler
                shutil.rmtree(os.path.dirname(self.down_path), ignore_errors=True)
                return False

    def _deliver(self, items: list[list[Any]]) -> None:
        streams = self.streams
        for req_id, code, payload in items:
            stream = streams.get(req_id)
            if stream is None:
                continue
            event: Event
            if code == TEXT:
                event = Delta(payload)
            elif code == REFUSED:
                event = Refused(*payload)
                del streams[req_id]
            else:
                event = Done(Finished(*payload))
                del streams[req_id]
            stream.put(event)


def _answer(future: asyncio.Future[bytes], text: bytes) -> None:
    if not future.done():
        future.set_result(text)


def main() -> int:
    """The HTTP process: settings (JSON) on stdin, from ``ApiServerProcess.start``."""
    from protocol.gc_heap import freeze_heap
    from protocol.options import setup_logging

    for sig in (signal.SIGINT, signal.SIGTERM):  # the scheduler drains, then says stop
        signal.signal(sig, signal.SIG_IGN)
    s = json.loads(sys.stdin.read())
    setup_logging(s["log_level"], s["log_format"])
    link = _Link(s["up"], s["down"])
    loops = [RemoteLoop(link, i) for i in range(s["num_loops"])]
    door = Door(loops, metrics=link.metrics, **s["door"])
    try:
        server = DoorServer(door, s["host"], s["port"], DoorLimits(**s["limits"]))
    except OSError as e:
        link.send(["unusable", f"cannot listen on {s['host']}:{s['port']}: {e}"])
        link.ctx.destroy(linger=2000)
        return 1
    freeze_heap()  # (protocol/gc_heap.py)
    server.start()
    link.send(["listening", *server.address])
    clean = link.run(loops, s["parent_pid"])
    door.alive = False
    for stream in list(link.streams.values()):
        if stream.waker is not None:
            stream.waker()  # a waiting reader sees the door closed at once
    server.stop()
    link.ctx.destroy(linger=0)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
