"""The HTTP door's fault answers, each driven for real against a running ``specd-scheduler``:
411 (no Content-Length), 413 (body over --max-request-bytes), 503 (over --max-active-requests),
and a streaming client that leaves mid-stream (its request is aborted in the engine)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.daemons import log_messages, raw_http, wait_until
from tests.models import save_byte_model
from tests.test_scheduler_daemon import KEY, Daemon, start_daemon

LONG = {"prompt": "go", "max_tokens": 350, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    model = save_byte_model("llama", 31, tmp_path_factory.mktemp("target"))
    d = start_daemon(
        tmp_path_factory.mktemp("sched"),
        model,
        "--max-active-requests",
        "1",
        "--max-request-bytes",
        "1024",
    )
    try:
        yield d
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)


def metric(d: Daemon, name: str) -> float:
    status, text = d.call("/metrics", key=None)
    assert status == 200
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def active(d: Daemon) -> int:
    n = d.call("/health", key=None)[1]["active_requests"]
    assert isinstance(n, int)
    return n


def test_no_content_length_is_411_and_a_large_body_is_413(daemon: Daemon) -> None:
    head = f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY}\n"
    status, body = raw_http(daemon.port, head)
    assert status == 411, body
    assert "Content-Length" in body["error"]["message"]  # type: ignore[index]
    # Only the header is sent: the door must refuse from the length alone, before reading.
    status, body = raw_http(daemon.port, head + "Content-Length: 5000\n")
    assert status == 413, body
    message = body["error"]["message"]  # type: ignore[index]
    assert "5000 bytes" in message and "(1024)" in message
    # a body at the limit is read and answered
    prompt = "ab" * 100
    ok = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "pad": "x" * 700}
    assert len(json.dumps(ok)) <= 1024
    status, done = daemon.call("/v1/completions", ok)
    assert status == 200 and done["usage"]["prompt_tokens"] == len(prompt), done


def test_over_max_active_requests_is_503_and_the_limit_frees(daemon: Daemon) -> None:
    results: list[tuple[int, Any]] = []
    t = threading.Thread(target=lambda: results.append(daemon.call("/v1/completions", LONG)))
    t.start()
    try:
        wait_until(lambda: active(daemon) == 1, 60, "the long request to start")
        status, err = daemon.call("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and "too many requests" in err["error"]["message"], err
        assert err["error"]["type"] == "server_error"
    finally:
        t.join(timeout=300)
    ((status, done),) = results
    assert status == 200 and done["usage"]["completion_tokens"] == 350  # untouched by the 503
    status, done = daemon.call("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, done


def test_a_client_leaving_a_stream_aborts_its_request(daemon: Daemon) -> None:
    before = metric(daemon, 'specd_scheduler_requests_finished_total{reason="abort"}')
    lengths = metric(daemon, 'specd_scheduler_requests_finished_total{reason="length"}')
    body = json.dumps({**LONG, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as s:
        s.sendall(head.encode() + body.encode())
        got = b""
        while b"data: " not in got:  # the first streamed event: the request is running
            chunk = s.recv(4096)
            assert chunk, "the stream closed before its first event"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
    # The socket is closed: the door's next write fails and the engine aborts the request
    # long before its 350 tokens are done.
    wait_until(lambda: active(daemon) == 0, 60, "the request to be aborted")
    after = metric(daemon, 'specd_scheduler_requests_finished_total{reason="abort"}')
    assert after == before + 1
    assert metric(daemon, 'specd_scheduler_requests_finished_total{reason="length"}') == lengths
    assert any(m.startswith("client left; aborted cmpl-") for m in log_messages(daemon.log))
    # its worker slot is free again: the one allowed request runs
    status, done = daemon.call("/v1/completions", {"prompt": "y", "max_tokens": 3})
    assert status == 200, done
    print(f"aborted after {time.monotonic() - t0:.2f} s")
