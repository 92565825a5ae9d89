"""The door's routes: OpenAI completions and chat completions (JSON or server-sent events),
``/v1/models``, ``/health`` and ``/metrics``, as one Starlette app.

Everything here runs on the door's event loop; it only talks to the ``EngineLoop``s (submit,
abort, read a ``Stream``), never to an engine. The engine's thread wakes waiting handlers
through ``Stream.waker`` and the door's ``Wakeups`` (one ``call_soon_threadsafe`` a step for
all streams), so a waiting request costs no thread. A stream that fell behind sends the
tokens queued for it as one chunk; the middle chunks come from one stream's byte template.

Admission and the engine loops' state live in ``door``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from scheduler_client import openai_api as api
from scheduler_client.engine_loop import Delta, Done, Event, Refused
from scheduler_client.http.door import Door, Events, Gone
from scheduler_client.http.errors import ApiError

STOPPED = ApiError(503, "the scheduler stopped before the request finished", "server_error")


def json_response(status: int, obj: dict[str, Any], close: bool = False) -> Response:
    headers = {"Connection": "close"} if close else None
    body = json.dumps(obj, ensure_ascii=False).encode()
    return Response(body, status, headers=headers, media_type="application/json")


def refused(event: Refused) -> ApiError:
    """A request the engine never ran: 400 for its own fault, 5xx when the scheduler is going
    away or failed (retry elsewhere)."""
    kind = "server_error" if event.status >= 500 else "invalid_request_error"
    return ApiError(event.status, event.message, kind)


def error_response(e: ApiError, close: bool = False) -> Response:
    """``close``: the request's body was not read, so its connection cannot carry another."""
    return json_response(e.status, e.body(), close=close)


def build_app(door: Door) -> Starlette:
    async def health(_request: Request) -> Response:
        state = door.state()
        body = {"status": state, "active_requests": door.num_admitted}
        return json_response(200 if state == "ok" else 503, body)

    async def metrics(_request: Request) -> Response:
        try:
            text = await door.metrics()
        except TimeoutError:
            return error_response(
                ApiError(503, "the engine did not answer in time", "server_error")
            )
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        if (denied := _unauthorized(door, request)) is not None:
            return error_response(denied)
        model = {
            "id": door.model,
            "object": "model",
            "owned_by": "specd",
            "max_model_len": door.max_model_len,
        }
        return json_response(200, {"object": "list", "data": [model]})

    async def completions(request: Request) -> Response:
        return await _generate(door, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(door, request, chat=True)

    async def no_route(request: Request, _exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", "not_found_error"))

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        exception_handlers={HTTPException: no_route},
    )


def _unauthorized(door: Door, request: Request) -> ApiError | None:
    if door.api_key is None:
        return None
    given = request.headers.get("authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {door.api_key}".encode()):
        return None
    return ApiError(401, "a valid API key is required", "authentication_error")


async def _body(door: Door, request: Request) -> bytes:
    """The body: 411 without a Content-Length, 413 over the limit (both judged from the
    header alone), 408 when it does not arrive within the body timeout."""
    length = request.headers.get("content-length")
    if length is None:
        raise ApiError(411, "a Content-Length header is required")
    if "transfer-encoding" in request.headers:
        # with both headers the framing is ambiguous (request smuggling): refuse, unread
        raise ApiError(400, "send the body with Content-Length alone, not Transfer-Encoding")
    if int(length) > door.max_request_bytes:  # the HTTP parser has checked it is digits
        raise ApiError(
            413, f"request body of {length} bytes is over the limit ({door.max_request_bytes})"
        )
    chunks = []
    try:
        async with asyncio.timeout(door.body_timeout_s):
            async for chunk in request.stream():
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {door.body_timeout_s} s") from None
    except ClientDisconnect:
        raise ApiError(400, "the client left before sending its body") from None  # unread
    return b"".join(chunks)


async def _generate(door: Door, request: Request, *, chat: bool) -> Response:
    if (denied := _unauthorized(door, request)) is not None:
        return error_response(denied)
    try:
        raw = await _body(door, request)
    except ApiError as e:
        return error_response(e, close=True)
    try:
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        engine_request = api.engine_request(
            body, chat=chat, max_model_len=door.max_model_len, vocab_size=door.vocab_size
        )
        model = body.get("model")
        if model is not None and model != door.model:
            raise ApiError(
                404,
                f"model {model!r} is not served here (this is {door.model!r})",
                "not_found_error",
                param="model",
            )
        loop = door.admit()
    except ApiError as e:
        return error_response(e)
    req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    engine_request["req_id"] = req_id
    events = Events(door)
    events.stream = loop.submit(engine_request, events.wake)
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await _stream(door, events, req_id, chat=chat, include_usage=include_usage)
    return await _complete(door, request, events, req_id, chat=chat)


async def _watch(receive: Receive, events: Events) -> None:
    """Wait for the client to leave (the body has been read: only a disconnect can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    events.gone = True
    events.ready.set()


async def _complete(
    door: Door, request: Request, events: Events, req_id: str, *, chat: bool
) -> Response:
    created = api.now()
    watcher = asyncio.get_running_loop().create_task(_watch(request.receive, events))
    try:
        while True:
            event = await events.next()
            if isinstance(event, Gone):
                door.abandon(req_id, events.stream, events)
                return Response(status_code=499)  # nobody reads it
            if event is None:
                door.release(events.stream)
                return error_response(STOPPED)
            if isinstance(event, Refused):
                door.release(events.stream)
                return error_response(refused(event))
            if isinstance(event, Done):
                door.release(events.stream)
                req = event.result
                if req.finish_reason == "error":
                    return error_response(ApiError(500, req.error or "failed", "server_error"))
                return json_response(
                    200, api.response(req, chat=chat, model=door.model, created=created)
                )
    finally:
        watcher.cancel()


class _EventStream(StreamingResponse):
    """Server-sent events; when the client leaves before the end (Starlette cancels the
    iterator), the request is aborted."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _stream(
    door: Door, events: Events, req_id: str, *, chat: bool, include_usage: bool
) -> Response:
    created = api.now()
    first = await events.next()
    assert not isinstance(first, Gone)  # nothing watches a streamed request's disconnect
    if first is None or isinstance(first, Refused):  # nothing sent yet: a plain error answer
        door.release(events.stream)
        return error_response(STOPPED if first is None else refused(first))
    ended = False

    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    text_sse = api.text_chunks(req_id, chat=chat, model=door.model, created=created)

    async def body() -> AsyncIterator[bytes]:
        nonlocal ended
        event: Event | Gone | None = first
        opened = False
        while event is not None and not isinstance(event, Gone):
            if isinstance(event, Delta):
                text = event.text + events.more_text()  # fallen behind: one chunk for all
                if opened:
                    yield text_sse(text)
                else:
                    yield sse(
                        api.chunk(
                            req_id,
                            chat=chat,
                            model=door.model,
                            created=created,
                            text=text,
                            first=True,
                        )
                    )
                opened = True
            elif isinstance(event, Done):
                ended = True
                door.release(events.stream)
                req = event.result
                if req.finish_reason == "error":
                    yield sse(ApiError(500, req.error or "failed", "server_error").body())
                else:
                    last = api.chunk(
                        req.req_id,
                        chat=chat,
                        model=door.model,
                        created=created,
                        text=None,
                        finish_reason=req.finish_reason,
                        first=not opened,
                    )
                    if include_usage:
                        last["usage"] = api.usage(req)
                    yield sse(last)
                yield b"data: [DONE]\n\n"
                return
            event = await events.next()
        ended = True
        door.release(events.stream)
        yield sse(STOPPED.body())

    def on_close() -> None:
        if not ended:
            door.abandon(req_id, events.stream, events)

    return _EventStream(body(), on_close)
