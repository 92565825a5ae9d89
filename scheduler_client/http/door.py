"""The door's state: the engine loops, the admission counts, and a request's events read on the
event loop.

Admission is counted here, at submit: the check and the increment run with no ``await`` between
them on the one event loop, so ``max_active_requests`` holds under any number of clients. A slot
is released when the engine has finished the request (after an abort too), not when its client
leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence

from scheduler_client.engine_loop import Delta, Done, Event, LoopHandle, Refused, Stream
from scheduler_client.http.errors import ApiError

log = logging.getLogger("specd.http")

POLL_S = 1.0  # how often a waiting handler checks that the engine is still alive


class Gone:
    """The client disconnected while its answer was being made."""


GONE = Gone()


class Door:
    """What the routes need: the engine loops, the model's name and limits, the API key, and the
    admission count (touched only on the event loop)."""

    def __init__(
        self,
        loops: Sequence[LoopHandle],
        *,
        metrics: Callable[[], Awaitable[bytes]],
        model: str,
        max_model_len: int,
        vocab_size: int,
        api_key: str | None = None,
        max_request_bytes: int = 16 << 20,
        max_active_requests: int = 4096,
        body_timeout_s: float = 30.0,
    ) -> None:
        self.loops = list(loops)  # one per worker (data parallel); requests go to the least busy
        self.metrics = metrics  # the Prometheus text of every engine
        self.model = model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_active_requests = max_active_requests
        self.body_timeout_s = body_timeout_s
        self.alive = True  # False once the engine loops have ended
        self.wakeups: Wakeups | None = None  # set by the first Events, on the event loop
        # loop index -> requests submitted to it and not yet finished by it
        self.admitted = [0] * len(loops)
        self._settling: set[asyncio.Task[None]] = set()

    @property
    def draining(self) -> bool:
        return any(lp.draining for lp in self.loops)

    def state(self) -> str:
        if not self.alive:
            return "stopped"
        if self.draining:
            return "draining"
        for lp in self.loops:
            if (health := lp.health()) != "ok":
                return health
        return "ok"

    @property
    def num_admitted(self) -> int:
        return sum(self.admitted)

    def admit(self) -> LoopHandle:
        """Count one request in and choose its engine (the one with the fewest admitted requests
        whose worker is still there), or refuse it (503). No ``await`` may come between the
        check and the increment: the counts are exact, where the loops' own lag behind."""
        if not self.alive or self.draining:
            raise ApiError(503, "the scheduler is shutting down", "server_error")
        if self.num_admitted >= self.max_active_requests:
            raise ApiError(503, "too many requests in flight; retry later", "server_error")
        live = [i for i, lp in enumerate(self.loops) if lp.failed is None] or list(
            range(len(self.loops))
        )
        i = min(live, key=lambda i: self.admitted[i])
        self.admitted[i] += 1
        return self.loops[i]

    def release(self, stream: Stream) -> None:
        """The engine has finished ``stream``'s request (or the engines have stopped)."""
        self.admitted[self.loops.index(stream.loop)] -= 1

    def abandon(self, req_id: str, stream: Stream, events: Events) -> None:
        """The client left: abort its request and release its slot once the engine has ended it."""
        stream.loop.abort(req_id)  # after its submit in the loop's inbox: never lost
        log.info("client left; aborted %s", req_id)
        events.gone = False  # from here on, read to the end

        async def settle() -> None:
            try:
                while (event := await events.next()) is not None:
                    if isinstance(event, (Done, Refused, Gone)):
                        return
            finally:
                self.release(stream)

        task = asyncio.get_running_loop().create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)


class Wakeups:
    """Wakes readers on one event loop from the engine's thread, one loop wake-up for all the
    readers woken meanwhile. A step streams a token to each of its requests: one
    ``call_soon_threadsafe`` each (a write to the loop's self-pipe, a callback) was 64 of them a
    step at batch 64, on the engine's thread and under the GIL; now the first reader woken in a
    step schedules one flush and the others join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []

    def wake(self, ready: asyncio.Event) -> None:  # any thread
        with self._lock:
            self._pending.append(ready)
            if len(self._pending) > 1:
                return  # a flush is already scheduled and has not run yet
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is reading
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the event loop
        with self._lock:
            pending, self._pending = self._pending, []
        for ready in pending:
            ready.set()


class Events:
    """A request's stream read on the event loop: the engine's thread queues an event, then
    wakes ``ready`` through the loop (``Wakeups``)."""

    def __init__(self, door: Door) -> None:
        self.door = door
        loop = asyncio.get_running_loop()
        if door.wakeups is None or door.wakeups.loop is not loop:
            door.wakeups = Wakeups(loop)
        self.wakeups = door.wakeups
        self.ready = asyncio.Event()
        self.gone = False  # set by the disconnect watcher
        self.stream: Stream  # set right after submit, which needs ``wake`` first
        self._held: Event | None = None  # read past by ``more_text``, returned by ``next``

    def wake(self) -> None:  # the engine's thread
        self.wakeups.wake(self.ready)

    async def next(self) -> Event | Gone | None:
        """The next event; ``GONE`` once the client has left (non-streaming requests watch
        for it), None once the engines have stopped."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        while not self.gone:
            self.ready.clear()
            with contextlib.suppress(queue.Empty):
                return self.stream.events.get_nowait()
            if not self.door.alive:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), POLL_S)
        return GONE

    def more_text(self) -> str:
        """The text of the ``Delta``s already queued behind the one just read, without waiting:
        a reader that fell behind the engine sends them as one chunk (one write, not one a
        token; vLLM's output collector merges the same way). The first other event read is
        kept for ``next``."""
        texts = []
        while self._held is None:
            try:
                event = self.stream.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Delta):
                texts.append(event.text)
            else:
                self._held = event
        return "".join(texts)
