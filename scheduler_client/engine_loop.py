"""One thread owns the ``Engine``; any other thread submits, aborts and reads results through it.

The engine (scheduler, grammar matchers, worker socket) is single-threaded by design. Front doors
(the HTTP server) hand requests over through a queue and receive each request's text deltas and
its end through that request's own ``Stream``; nothing else touches the engine.

With a ``Preparer`` (the daemon always has one), a request is first prepared off this thread
(limits, chat template, tokenizing, grammar: prep.py) and joins the scheduler when that is done;
an abort while it is being prepared ends it there, and a preparation error refuses it alone. Its
preparation starts as it is submitted, on the submitting thread, while a step may be under way:
this thread takes its inbox only between steps, and a request that waited there for the step to
end before its preparation began, then for the next step to end before it joined, reached the
scheduler two steps after it came.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler_client.engine import Engine
from scheduler_client.prep import Preparer
from scheduler_client.request import Request
from scheduler_client.worker_client import WorkerDied

log = logging.getLogger("specd.scheduler")

IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    """What a reader needs of a finished request: plain values, so it can cross to the HTTP
    process (``--api-server-count 1``) as they are."""

    req_id: str
    finish_reason: str | None
    error: str | None
    text: str
    num_prompt_tokens: int
    output_ids: list[int]
    spec_decode: dict[str, Any]

    @classmethod
    def of(cls, req: Request) -> Finished:
        return cls(
            req.req_id,
            req.finish_reason,
            req.error,
            req.text,
            len(req.prompt_ids),
            list(req.output_ids),
            req.metrics.summary(),
        )


@dataclass(frozen=True)
class Done:
    result: Finished


@dataclass(frozen=True)
class Refused:
    """The request never ran: ``message`` says why (a bad schema, a prompt too long, ...);
    ``status`` is the HTTP status it earns (503: the scheduler is going away, retry later)."""

    message: str
    status: int = 400


SHUTTING_DOWN = "the scheduler is shutting down"

Event = Delta | Done | Refused


def with_req_id(request: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``request`` with its id, a new one where the caller gave none."""
    return {"req_id": f"req-{uuid.uuid4().hex}", **request}


class LoopHandle(Protocol):
    """What readers and the HTTP door use of an engine loop: an ``EngineLoop`` in this process,
    or its stand-in in the HTTP process (``http/api_server.py``)."""

    @property
    def draining(self) -> bool: ...

    @property
    def failed(self) -> str | None: ...

    def submit(
        self, request: dict[str, Any], waker: Callable[[], None] | None = None
    ) -> Stream: ...

    def abort(self, req_id: str) -> None: ...

    def health(self) -> str: ...


class Stream:
    """What one request's reader sees: ``Delta`` events, then exactly one ``Done`` or ``Refused``."""

    def __init__(self, loop: LoopHandle, waker: Callable[[], None] | None = None) -> None:
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.req_id: str | None = None
        self.loop = loop  # the engine that runs it
        # called (on the engine's thread) after each event is queued: an asyncio reader's wake-up
        self.waker = waker

    def put(self, event: Event) -> None:
        self.events.put(event)
        if self.waker is not None:
            self.waker()

    def abort(self) -> None:
        if self.req_id is not None:
            self.loop.abort(self.req_id)

    def get(self, timeout_s: float | None = None) -> Event:
        return self.events.get(timeout=timeout_s)


class _Held:
    """``--stream-interval``: one stream's text since its last chunk. The first token is put at
    once, then a chunk once ``interval`` more tokens have come; the rest before ``Done``."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.texts: list[str] = []
        self.sent_at: int | None = None  # output tokens when the last chunk was put

    def add(self, text: str, num_output: int) -> str | None:
        """The chunk to put now, if any."""
        self.texts.append(text)
        if self.sent_at is not None and num_output - self.sent_at < self.interval:
            return None
        self.sent_at = num_output
        return self.take()

    def take(self) -> str:
        chunk = "".join(self.texts)
        self.texts.clear()
        return chunk


class EngineLoop:
    """Runs ``engine`` on the thread that calls ``run``; ``submit``/``abort``/``drain`` are safe
    from any thread."""

    def __init__(
        self,
        engine: Engine,
        prep: Preparer | None = None,
        stream_interval: int = 1,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        if stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        self.engine = engine
        self.prep = prep  # None: requests are prepared on the engine's thread (trusted callers)
        # a stream's text is put every this many output tokens (the first token at once, what
        # is held at the end before Done): SGLang's and vLLM's --stream-interval
        self.stream_interval = stream_interval
        self._held: dict[str, _Held] = {}  # req_id -> its text not yet put
        self._inbox: queue.SimpleQueue[tuple[str, Any, Stream | None]] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        # req_id -> its reader, its preparation and when it came in (monotonic), while it is
        # prepared off this thread
        self._preparing: dict[str, tuple[Stream, Future[dict[str, Any]], float | None]] = {}
        self._drain_deadline: float | None = None
        self.draining = False
        self.failed: str | None = None  # set when the worker is gone for good
        # set (under _ended_lock) when run has returned: a request submitted later, or left in
        # the inbox then, is refused at once instead of waiting in an inbox nobody reads
        self.ended = False
        self._ended_lock = threading.Lock()
        # called on the engine's thread after each pass of ``run`` (and as it ends), and after a
        # step's commit when its drafts follow (``_committed``), once the events are put: the
        # HTTP process's link sends them there as one message
        self.after_step = after_step
        engine.on_commit = self._committed

    # -- any thread -----------------------------------------------------------------------------
    def submit(self, request: dict[str, Any], waker: Callable[[], None] | None = None) -> Stream:
        """Queue ``request`` (keyword arguments of ``Engine.add_request``); ``waker`` is called
        after each event of its stream is queued (an asyncio reader's wake-up)."""
        return self.submit_stream(request, Stream(self, waker))

    def submit_stream(self, request: dict[str, Any], stream: Stream) -> Stream:
        """``submit`` with the reader's ``stream`` made by the caller."""
        request = with_req_id(request)
        req_id = stream.req_id = request["req_id"]  # known at once, so an abort can name it
        with self._ended_lock:
            if not self.ended:
                if self.prep is None or self.draining:
                    self._inbox.put(("add", (request, None, None), stream))
                    return stream
                # prepared from now on, meanwhile the engine's thread runs its step; its
                # "prepared" event comes after its "add" (the callback is added after the put)
                arrived = time.monotonic()
                try:
                    future = self.prep.submit(request)
                except RuntimeError as e:  # its pools shut down (the daemon is stopping)
                    stream.put(Refused(f"the request could not be prepared: {e}", 503))
                    return stream
                self._inbox.put(("add", (request, future, arrived), stream))
                future.add_done_callback(lambda f: self._inbox.put(("prepared", (req_id, f), None)))
                return stream
        stream.put(Refused(self._gone_reason(), 503))
        if self.after_step is not None:
            self.after_step()  # this loop's thread has ended: nobody else sends its events
        return stream

    def abort(self, req_id: str) -> None:
        self._inbox.put(("abort", req_id, None))

    def drain(self, timeout_s: float) -> None:
        """Take no new requests; let the running ones finish for ``timeout_s``, then abort them."""
        self._inbox.put(("drain", timeout_s, None))

    @property
    def num_active(self) -> int:
        return len(self._streams) + len(self._preparing)

    def health(self) -> str:
        """ "ok"; "recovering" while a lost worker is relaunched and its requests replayed;
        "stalled" while a step has been outstanding longer than the engine's
        ``stall_threshold_s`` (the worker is alive but not answering in time)."""
        engine = self.engine
        if engine.recovering:
            return "recovering"
        since = engine.outstanding_since
        if since is not None and time.monotonic() - since > engine.config.stall_threshold_s:
            return "stalled"
        return "ok"

    # -- the engine's thread --------------------------------------------------------------------
    def run(self) -> None:
        """Step until drained (or the worker is lost for good)."""
        try:
            self._run()
        finally:
            with self._ended_lock:
                self.ended = True
            self._refuse_inbox()
            if self.after_step is not None:
                self.after_step()

    def _gone_reason(self) -> str:
        return f"worker lost: {self.failed}" if self.failed else SHUTTING_DOWN

    def _refuse_inbox(self) -> None:
        """The requests still in the inbox once ``run`` has ended: each one refused (503)."""
        while True:
            try:
                kind, arg, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and stream is not None:
                if arg[1] is not None:
                    arg[1].cancel()  # its preparation, if it has not begun
                stream.put(Refused(self._gone_reason(), 503))

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        while True:
            if self.after_step is not None:
                self.after_step()
            busy = scheduler.has_work()
            self._take_inbox(block=not busy)
            if self.draining:
                if not self._streams and not self._preparing and not scheduler.has_work():
                    return
                assert self._drain_deadline is not None
                if time.monotonic() > self._drain_deadline:
                    for req_id in list(self._streams):
                        scheduler.abort(req_id)
                    self._refuse_preparing(
                        "the scheduler shut down before the request started", 503
                    )
            if scheduler.has_work():
                try:
                    self.engine.step()
                except WorkerDied as e:
                    self.failed = str(e)
                    log.error("worker lost for good: %s", e)
                    self._finish_streams()
                    self._refuse_preparing(f"worker lost: {e}", 503)
                    return
                except Exception as e:
                    # Our bug or the worker's: every reader hears it before the process ends.
                    self.failed = repr(e)
                    for req_id in list(self._streams):
                        scheduler.fail(req_id, f"the scheduler failed: {e!r}")
                    self._finish_streams()
                    self._refuse_preparing(f"the scheduler failed: {e!r}", 500)
                    raise
            self._finish_streams()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg: Any, stream: Stream | None) -> None:
        if kind == "drain":
            deadline = time.monotonic() + float(arg)
            if not self.draining:
                log.info("draining %d requests (deadline %.1f s)", len(self._streams), arg)
                self.draining = True
                self._drain_deadline = deadline
            elif self._drain_deadline is not None and deadline < self._drain_deadline:
                log.info("draining: the deadline is now %.1f s away", arg)
                self._drain_deadline = deadline  # a second, shorter drain cuts the first short
        elif kind == "abort":
            preparing = self._preparing.pop(arg, None)
            if preparing is None:
                self.engine.abort(arg)
            else:  # its preparation goes on (it cannot be interrupted); its result is dropped
                preparing[1].cancel()
                preparing[0].put(Refused("the request was aborted before it started"))
        elif kind == "prepared":
            self._join(*arg)
        else:
            assert stream is not None
            request, future, arrived = arg
            self._add(request, future, arrived, stream)

    def _add(
        self,
        request: dict[str, Any],
        future: Future[dict[str, Any]] | None,
        arrived: float | None,
        stream: Stream,
    ) -> None:
        """A submitted request: its arguments and, with a ``Preparer``, their preparation (under
        way since it was submitted) and when it came in."""
        if self.draining:
            if future is not None:
                future.cancel()  # (a preparation under way runs on; its result is dropped)
            stream.put(Refused(SHUTTING_DOWN, 503))
            return
        if future is None:
            self._start(request, stream)
            return
        req_id = request["req_id"]
        if req_id in self._preparing or req_id in self.engine.scheduler.requests:
            future.cancel()
            stream.put(Refused(f"request id {req_id!r} is already in use"))
            return
        # NOTE: the future's callback runs on a preparation thread (or on the submitting one):
        # it only posts to the inbox; this thread takes the result in _join
        self._preparing[req_id] = (stream, future, arrived)

    def _join(self, req_id: str, future: Future[dict[str, Any]]) -> None:
        """A preparation ended: its request joins the scheduler, or is refused."""
        preparing = self._preparing.get(req_id)
        if preparing is None or preparing[1] is not future:
            return  # aborted or refused (the drain, an id in use) while it was prepared
        del self._preparing[req_id]
        stream, _, arrived = preparing
        try:
            request = future.result()
        except (ValueError, TypeError) as e:
            stream.put(Refused(str(e)))
            return
        except Exception as e:
            log.exception("preparing %s failed", req_id)
            stream.put(Refused(f"the request could not be prepared: {e!r}"))
            return
        self._start(request, stream, arrived)

    def _refuse_preparing(self, message: str, status: int = 400) -> None:
        for stream, future, _ in self._preparing.values():
            future.cancel()
            stream.put(Refused(message, status))
        self._preparing.clear()

    def _start(self, request: dict[str, Any], stream: Stream, arrived: float | None = None) -> None:
        """``arrived``: when the request came in, before its preparation (its ``prep`` phase)."""
        try:
            req = self.engine.add_request(**request)
        except (ValueError, TypeError) as e:
            stream.put(Refused(str(e)))
            return
        except Exception as e:
            # Untrusted input (a chat template, a schema) may fail in ways no check foresaw:
            # that is this request's fault, never the engine thread's.
            log.warning("request refused: %r", e)
            stream.put(Refused(f"the request could not be added: {e!r:.300}"))
            return
        if req.finished:  # refused at once: a bad schema, a prompt too long, ...
            self.engine.scheduler.release(req.req_id)
            stream.put(Refused(req.error or "the request was refused"))
            return
        req.metrics.arrival_s = arrived
        stream.req_id = req.req_id
        self._streams[req.req_id] = stream
        if self.stream_interval == 1:
            req.on_delta = lambda _r, text: stream.put(Delta(text))
            return
        held = self._held[req.req_id] = _Held(self.stream_interval)

        def on_delta(r: Request, text: str) -> None:
            if (chunk := held.add(text, len(r.output_ids))) is not None:
                stream.put(Delta(chunk))

        req.on_delta = on_delta

    def _committed(self, finished: list[Request]) -> None:
        """A step's output is committed and its drafts are not in yet (the worker drafts): the
        requests it ``finished`` are answered and its text sent now. Answered after the step, a
        finished request's reader waited out the drafting of the others (a draft model's, most
        of a step), and so did every token sent through the HTTP process."""
        for req in finished:
            self._answer(req)
        if self.after_step is not None:
            self.after_step()

    def _finish_streams(self) -> None:
        requests = self.engine.scheduler.requests
        for req_id in list(self._streams):
            req = requests.get(req_id)
            if req is not None and req.finished:
                self._answer(req)

    def _answer(self, req: Request) -> None:
        """A finished request's reader gets the text held back for it, then its end; the
        scheduler forgets it."""
        stream = self._streams.pop(req.req_id, None)
        if stream is None:
            return
        held = self._held.pop(req.req_id, None)
        if held is not None and held.texts:
            stream.put(Delta(held.take()))
        stream.put(Done(Finished.of(req)))
        self.engine.scheduler.release(req.req_id)
