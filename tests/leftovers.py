"""What a test session leaves behind: processes, listening ports, files in the repository.

``Snapshot.take()`` at the start of the session and ``Snapshot.leftovers()`` at its end (the
session fixture in conftest.py) name what the session added and did not remove:

- processes: the session marks its environment with ``SPECD_TEST_SESSION=<token>``; every process
  it starts inherits the mark, grandchildren and orphans included (an orphan is re-parented away
  from pytest, so parent links alone would miss it). At the end none may still run, and no child of
  pytest may be a zombie (killed but never waited). Allowed: the helpers that multiprocessing and
  torch keep for the interpreter's lifetime (resource tracker, forkserver, inductor compile
  workers). Processes get ``GRACE_S`` to go: a worker whose scheduler was killed notices within a
  poll or two.
- ports: TCP sockets in LISTEN state held by pytest itself or by a marked process, compared with
  the start (an HTTP or metrics server a test opened in-process and never closed).
- files: ``git status --porcelain --ignored`` of the repository, compared with the start, minus
  caches that tools write on purpose (``__pycache__``, ``.pytest_cache``, ``.mypy_cache``,
  ``.ruff_cache``, ``.hypothesis``). Tests write under tmp only; a new or changed path here is a
  test (or a build step) writing into the working tree. Skipped when git or the work tree is absent
  (an installed copy of the tests). Edits made to the tree by hand during the run show up too.

Linux only (``/proc``); psutil is not needed.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MARK = "SPECD_TEST_SESSION"
GRACE_S = 30.0
CACHES = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
# cmdline fragments of interpreter-lifetime helpers (multiprocessing, torch.compile)
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch/_inductor")
LISTEN = "0A"  # the TCP state code in /proc/net/tcp


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process is gone, or not ours to read
        return b""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def marked(token: str) -> dict[int, str]:
    """pid -> cmdline of every live process carrying ``token`` (this one excluded)."""
    needle = f"{MARK}={token}".encode()
    out = {}
    for pid in _pids():
        if pid != os.getpid() and needle in _read(f"/proc/{pid}/environ").split(b"\0"):
            cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
            if not any(h in cmd for h in HELPERS):
                out[pid] = cmd.strip()
    return out


def zombie_children() -> list[int]:
    """Children of this process that exited and were never waited for."""
    me = os.getpid()
    out = []
    for pid in _pids():
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2 and fields[0] == "Z" and int(fields[1]) == me:
            out.append(pid)
    return out


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN state on sockets that ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).decode().splitlines()[1:]:
            cols = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(cols) > 9 and cols[3] == LISTEN and cols[9] in inodes:
                ports.add(int(cols[1].rpartition(":")[2], 16))
    return ports


def repo_status(root: Path) -> set[str] | None:
    """``git status --porcelain --ignored`` lines, caches left out; None without git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--ignored"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {
        line
        for line in out.stdout.splitlines()
        if not CACHES.intersection(Path(line[3:].rstrip("/")).parts)
    }


@dataclass
class Snapshot:
    token: str
    root: Path
    ports: set[int]
    status: set[str] | None

    @classmethod
    def take(cls, root: Path) -> Snapshot:
        """Mark this process's environment (children inherit it) and record the start."""
        token = os.environ.setdefault(MARK, uuid.uuid4().hex)
        ports = listening_ports([os.getpid(), *marked(token)])
        return cls(token, root, ports, repo_status(root))

    def leftovers(self) -> list[str]:
        """What the session added and left, one line each; empty when it left nothing."""
        deadline = time.monotonic() + GRACE_S
        while (marked(self.token) or zombie_children()) and time.monotonic() < deadline:
            time.sleep(0.2)
        procs = marked(self.token)
        out = [f"process {pid} still runs: {cmd}" for pid, cmd in sorted(procs.items())]
        out += [f"process {pid} was never waited for (zombie)" for pid in zombie_children()]
        ports = listening_ports([os.getpid(), *procs]) - self.ports
        out += [f"TCP port {port} still listening" for port in sorted(ports)]
        status = repo_status(self.root)
        if self.status is not None and status is not None:
            out += [f"repository: {line}" for line in sorted(status - self.status)]
        return out
