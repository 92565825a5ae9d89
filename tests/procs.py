"""Processes the tests start: a worker daemon driven directly (not through an Engine).

Children bind port 0 and log the port they got; ``logged`` reads it back, so no test picks a port
and releases it for another process to take before the child binds it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import IO


def start_worker(
    model: Path | str, addr: str, *flags: str, stderr: IO[bytes] | None = None
) -> subprocess.Popen[bytes]:
    """``specd-worker`` on the CPU for ``model`` at ``addr``; the caller reaps it (``reap``)."""
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


def logged(
    log: Path, pattern: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 120
) -> re.Match[str]:
    """The first match of ``pattern`` in the log file ``log``, waiting for it to be written.
    Fails at once (with the log) when ``proc`` exits first, and after ``timeout_s`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text() if log.exists() else ""
        found = re.search(pattern, text)
        if found:
            return found
        assert proc is None or proc.poll() is None, f"exited {proc.returncode}:\n{text[-3000:]}"
        assert time.monotonic() < deadline, (
            f"{pattern!r} not logged in {timeout_s} s:\n{text[-3000:]}"
        )
        time.sleep(0.1)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` if it still runs, and wait for it: no zombie, no orphan. For ``finally``."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
