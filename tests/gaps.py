"""How long other streams wait while one request is prepared: a probe streams completions one
after another from a running ``specd-scheduler`` and records when each token event arrives; the
largest gap between two events of one stream, inside a time window, is the stall.

Used by tests/test_prep.py (a loose bound) and bench/prep_bench.py (the 200 ms figure).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

PROBE_BODY = {"prompt": "abc", "max_tokens": 300, "ignore_eos": True, "temperature": 0}


class GapProbe:
    """Streams ``PROBE_BODY`` in a loop on its own thread until ``stop``; ``events`` holds
    (stream number, arrival time) for every token event."""

    def __init__(self, port: int, key: str | None) -> None:
        self.port, self.key = port, key
        self.events: list[tuple[int, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gap-probe", daemon=True)

    def __enter__(self) -> GapProbe:
        self._thread.start()
        deadline = time.monotonic() + 120
        while len(self.events) < 5:  # streaming steadily before anything is measured
            assert time.monotonic() < deadline, f"the probe never streamed: {self.errors}"
            assert not self.errors, self.errors
            time.sleep(0.01)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the probe did not stop"

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                headers = {"Content-Type": "application/json"}
                if self.key:
                    headers["Authorization"] = f"Bearer {self.key}"
                body = json.dumps({**PROBE_BODY, "stream": True})
                conn.request("POST", "/v1/completions", body, headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    self.errors.append(f"probe got {resp.status}: {resp.read()[:200]!r}")
                    return
                while line := resp.readline():
                    if line.startswith(b"data: {"):
                        self.events.append((n, time.perf_counter()))
            except OSError as e:
                self.errors.append(f"probe failed: {e!r}")
                return
            finally:
                conn.close()
            n += 1

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait between consecutive events of one stream that overlaps
        [start, end] (seconds)."""
        worst = 0.0
        for (n0, t0), (n1, t1) in zip(self.events, self.events[1:], strict=False):
            if n0 == n1 and t1 >= start and t0 <= end:
                worst = max(worst, t1 - t0)
        return worst

    def num_events(self, start: float, end: float) -> int:
        return sum(1 for _, t in self.events if start <= t <= end)


def timed_call(port: int, key: str | None, path: str, data: bytes) -> tuple[int, Any, float, float]:
    """POST ``data`` (a JSON body, encoded beforehand: encoding 10 MB holds this process's GIL,
    which would stall the probe's own reads); (status, decoded answer, sent at, answered at) in
    perf_counter seconds."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw), t0, time.perf_counter()
