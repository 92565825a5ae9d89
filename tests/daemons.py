"""``specd-scheduler`` on ``--port 0``: the port is read from its "ready: http://HOST:PORT" log line,
so no port is guessed in advance. Raw HTTP for what ``urllib`` will not send (no Content-Length,
a client that leaves mid-stream)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

READY = re.compile(r"ready: http://[^:\s]+:(\d+)")


def wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> int:
    """The port from the daemon's "ready" line (it listens before it logs it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            return int(m.group(1))
        assert proc.poll() is None, f"the scheduler exited {proc.returncode}:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError("the scheduler never became ready:\n" + log.read_text())


def log_messages(log: Path) -> list[str]:
    return [json.loads(x)["msg"] for x in log.read_text().splitlines() if x.startswith("{")]


def raw_http(port: int, head: str, timeout_s: float = 60) -> tuple[int, dict[str, object]]:
    """Send ``head`` (request line and headers, no body) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body)


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
