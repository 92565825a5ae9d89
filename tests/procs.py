"""Processes the tests start: a worker daemon driven directly (not through an Engine)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import IO


def start_worker(
    model: Path | str, addr: str, *flags: str, stderr: IO[bytes] | None = None
) -> subprocess.Popen[bytes]:
    """``specd-worker`` on the CPU for ``model`` at ``addr``; the caller kills it."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.daemon",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--listen",
            addr,
            *flags,
        ],
        stderr=stderr,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
