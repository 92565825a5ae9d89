"""The HTTP front door of ``specd-scheduler``: OpenAI-compatible completions and chat completions
(JSON or server-sent events), ``/v1/models``, ``/health`` and ``/metrics``.

Each connection has its own thread (``ThreadingHTTPServer``); it only talks to the ``EngineLoop``
(submit, abort, read its ``Stream``), never to the engine itself.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from scheduler_client import openai_api as api
from scheduler_client.engine_loop import Delta, Done, EngineLoop, Refused, Stream

log = logging.getLogger("specd.http")

POLL_S = 1.0  # how often a waiting handler checks that the engine is still alive
STOPPED = api.ApiError(503, "the scheduler stopped before the request finished", "server_error")


def merged_registry(registries: list[CollectorRegistry]) -> CollectorRegistry:
    """One registry for /metrics: with one worker its own; with several, every sample labelled
    ``worker="i"`` under one family per metric (duplicate families would be invalid)."""
    if len(registries) == 1:
        return registries[0]

    class Merged:
        def collect(self) -> Iterator[Metric]:
            families: dict[str, Metric] = {}
            for i, reg in enumerate(registries):
                for fam in reg.collect():
                    out = families.setdefault(
                        fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    )
                    for smp in fam.samples:
                        labels = {**smp.labels, "worker": str(i)}
                        out.add_sample(smp.name, labels, smp.value, smp.timestamp, smp.exemplar)
            yield from families.values()

    merged = CollectorRegistry()
    merged.register(Merged())
    return merged


class _Server(ThreadingHTTPServer):
    # The listen backlog. socketserver's default of 5 reset connections when 64 clients
    # connected at once (the served benchmark at concurrency 64, H200, 2026-12-03).
    request_queue_size = 1024


class Frontend:
    """What the handlers need: the loop, the model name, limits and the optional API key."""

    def __init__(
        self,
        loops: list[EngineLoop],
        *,
        model: str,
        max_model_len: int,
        api_key: str | None = None,
        max_request_bytes: int = 16 << 20,
        max_active_requests: int = 4096,
    ) -> None:
        self.loops = loops  # one per worker (data parallel); requests go to the least busy
        self.registry = merged_registry([lp.engine.prom.registry for lp in loops])
        self.model = model
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_active_requests = max_active_requests
        self.alive = True  # False once the engine loop has ended

    @property
    def draining(self) -> bool:
        return any(lp.draining for lp in self.loops)

    @property
    def num_active(self) -> int:
        return sum(lp.num_active for lp in self.loops)

    def health(self) -> str:
        """ "ok", "draining", "stopped", or the first engine's state that is not "ok"
        ("recovering", "stalled"; see ``EngineLoop.health``)."""
        if not self.alive:
            return "stopped"
        if self.draining:
            return "draining"
        return next((h for h in (lp.health() for lp in self.loops) if h != "ok"), "ok")

    def pick(self) -> EngineLoop:
        """The least busy engine whose worker is still there."""
        alive = [lp for lp in self.loops if lp.failed is None] or self.loops
        return min(alive, key=lambda lp: lp.num_active)

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        front = self

        class Handler(_Handler):
            frontend = front

        server = _Server((host, port), Handler)
        # Not daemon threads: on shutdown, server_close waits for every answer to be written.
        server.daemon_threads = False
        return server


class _Handler(BaseHTTPRequestHandler):
    frontend: Frontend
    server_version = "specd"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # -- routes ---------------------------------------------------------------------------------
    def do_GET(self) -> None:
        f = self.frontend
        if self.path == "/health":
            state = f.health()
            status = HTTPStatus.OK if state == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
            self._json(status, {"status": state, "active_requests": f.num_active})
        elif self.path == "/metrics":
            data = generate_latest(f.registry)
            self._send(HTTPStatus.OK, data, CONTENT_TYPE_LATEST)
        elif self.path == "/v1/models":
            if self._authorized():
                model: dict[str, Any] = {"id": f.model, "object": "model", "owned_by": "specd"}
                model["max_model_len"] = f.max_model_len
                self._json(HTTPStatus.OK, {"object": "list", "data": [model]})
        else:
            self._error(api.ApiError(404, f"no route {self.path}", "not_found_error"))

    def do_POST(self) -> None:
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(api.ApiError(404, f"no route {self.path}", "not_found_error"))
            return
        if not self._authorized():
            return
        chat = self.path == "/v1/chat/completions"
        try:
            body = self._body()
            request = api.engine_request(body, chat=chat, max_model_len=self.frontend.max_model_len)
            self._check_model(body)
            self._check_capacity()
        except api.ApiError as e:
            self._error(e)
            return
        request["req_id"] = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = self.frontend.pick().submit(request)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(stream, chat=chat, include_usage=include_usage)
        else:
            self._complete(stream, chat=chat)

    # -- answers --------------------------------------------------------------------------------
    def _complete(self, stream: Stream, *, chat: bool) -> None:
        created = api.now()
        while True:
            event = self._next(stream)
            if event is None:
                self._error(STOPPED)
                return
            if isinstance(event, Refused):
                self._error(api.ApiError(400, event.message))
                return
            if isinstance(event, Done):
                req = event.req
                if req.finish_reason == "error":
                    self._error(api.ApiError(500, req.error or "failed", "server_error"))
                    return
                f = self.frontend
                body = api.response(req, chat=chat, model=f.model, created=created)
                self._json(HTTPStatus.OK, body)
                return

    def _stream(self, stream: Stream, *, chat: bool, include_usage: bool) -> None:
        created = api.now()
        model = self.frontend.model
        first = self._next(stream)
        if first is None:
            self._error(STOPPED)
            return
        if isinstance(first, Refused):  # nothing sent yet: a plain error answer
            self._error(api.ApiError(400, first.message))
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        event: Delta | Done | Refused | None = first
        opened = False
        try:
            while event is not None:
                if isinstance(event, Delta):
                    self._sse(
                        api.chunk(
                            stream.req_id or "",
                            chat=chat,
                            model=model,
                            created=created,
                            text=event.text,
                            first=not opened,
                        )
                    )
                    opened = True
                elif isinstance(event, Done):
                    req = event.req
                    if req.finish_reason == "error":
                        self._sse(api.ApiError(500, req.error or "failed", "server_error").body())
                    else:
                        last = api.chunk(
                            req.req_id,
                            chat=chat,
                            model=model,
                            created=created,
                            text=None,
                            finish_reason=req.finish_reason,
                            first=not opened,
                        )
                        if include_usage:
                            last["usage"] = api.usage(req)
                        self._sse(last)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    return
                event = self._next(stream)
            self._sse(STOPPED.body())
        except (BrokenPipeError, ConnectionResetError):
            # The client went away: its request stops using the GPU.
            if stream.req_id is not None:
                stream.abort()
            log.info("client left; aborted %s", stream.req_id)

    def _next(self, stream: Stream) -> Delta | Done | Refused | None:
        """The stream's next event; None when the engine has stopped (the caller answers)."""
        while True:
            try:
                return stream.get(timeout_s=POLL_S)
            except queue.Empty:
                if not self.frontend.alive:
                    return None

    # -- plumbing -------------------------------------------------------------------------------
    def _authorized(self) -> bool:
        key = self.frontend.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        self._error(api.ApiError(401, "a valid API key is required", "authentication_error"))
        return False

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.frontend.model:
            raise api.ApiError(
                404,
                f"model {model!r} is not served here (this is {self.frontend.model!r})",
                "not_found_error",
            )

    def _check_capacity(self) -> None:
        f = self.frontend
        if not f.alive or f.draining:
            raise api.ApiError(503, "the scheduler is shutting down", "server_error")
        if f.num_active >= f.max_active_requests:
            raise api.ApiError(503, "too many requests in flight; retry later", "server_error")

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise api.ApiError(411, "a Content-Length header is required") from None
        if length > self.frontend.max_request_bytes:
            raise api.ApiError(
                413,
                f"request body of {length} bytes is over the limit "
                f"({self.frontend.max_request_bytes})",
            )
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise api.ApiError(400, "the body is nested too deeply to parse") from None

    def _sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, obj: dict[str, Any]) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json")

    def _error(self, e: api.ApiError) -> None:
        self._json(e.status, e.body())

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client left before its answer")
