"""uvicorn serving the door's app on its own thread and event loop.

Limits a slow or hostile client meets: its request line and headers must arrive within
``header_timeout_s`` (else the connection is closed), its body within ``body_timeout_s`` (408,
``app``); an idle keep-alive connection is closed after ``keep_alive_timeout_s``; more than
``max_connections`` open connections get 503 from uvicorn. Connections cost no thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler_client.http.app import build_app
from scheduler_client.http.door import Door

log = logging.getLogger("specd.http")

BACKLOG = 1024  # 64 clients connecting at once were reset with socketserver's 5 (H200 bench)
SHUTDOWN_S = 3.0  # after the drain: the longest uvicorn waits for answers still being written
START_S = 30.0  # the longest ``start`` waits for uvicorn's loop to accept


@dataclass(frozen=True, kw_only=True)
class DoorLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 8192


class _TimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus a deadline on each request's head: from the connection
    (or the previous answer) to the end of the headers. uvicorn's own keep-alive timer is
    cancelled by the first byte, so without this a client sending a byte a minute holds its
    connection forever."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug(
                "closing %s: no complete request head in %.0f s", self.client, self.header_timeout_s
            )
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's head (a pipelined one disarms it at once)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class DoorServer:
    """Binds at construction (an ``OSError`` means the address is unusable), serves after
    ``start``, and stops in ``stop`` (bounded: ``SHUTDOWN_S``)."""

    def __init__(self, door: Door, host: str, port: int, limits: DoorLimits) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            # listening from here on: a client that connects before uvicorn's loop runs waits in
            # the backlog instead of being refused (the daemon says "ready" right after start)
            self.sock.listen(BACKLOG)
        except OSError:
            self.sock.close()
            raise
        protocol = type("TimedH11", (_TimedH11,), {"header_timeout_s": limits.header_timeout_s})
        config = uvicorn.Config(
            build_app(door),
            http=protocol,
            loop="asyncio",
            lifespan="off",
            log_config=None,
            access_log=False,
            backlog=BACKLOG,
            timeout_keep_alive=int(max(1, limits.keep_alive_timeout_s)),
            limit_concurrency=limits.max_connections,
            timeout_graceful_shutdown=int(SHUTDOWN_S),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Serve from a thread; returns once uvicorn accepts (or after ``START_S``)."""
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=SHUTDOWN_S + 2)
        if self.thread.is_alive():
            log.warning("the HTTP server did not stop in time; exiting anyway")
        self.sock.close()
