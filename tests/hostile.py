"""Hostile HTTP requests against a running ``specd-scheduler``: wrong types, out-of-range values,
deep nesting, large sizes, broken encodings and broken HTTP framing, generated from a seed.

``run`` sends them from a few threads (a fresh connection each, with a 5 s answer deadline) while
one good greedy request repeats alongside; it reports how many answers were 5xx, how many got no
answer, the slowest answer, and whether the good request's text ever changed. Used by
``tests/test_http_door.py`` (a sample) and ``tools/hostile.py`` (``make hostile``: 10,000).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEADLINE_S = 5.0
FIELDS = (
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
    "stop_token_ids", "ignore_eos", "stream", "stream_options", "logit_bias", "presence_penalty",
    "num_speculative_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "messages", "model", "logprobs", "max_completion_tokens",
)  # fmt: skip


def nested(depth: int, leaf: Any = 1) -> Any:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"a": out}
    return out


def values(rng: random.Random) -> Any:
    """One hostile JSON value."""
    pool: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([-1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]),
        lambda: rng.choice([10**100, -(10**100), 10**400]),
        lambda: rng.choice([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 1.0000001, 100.5, 1e9]),
        lambda: rng.choice(["", "x", "\u0000", "\ud7ff", "é" * 50, "🙂" * 20, "a" * 100_000]),
        lambda: [],
        lambda: {},
        lambda: [rng.randint(-5, 300) for _ in range(rng.randint(1, 50))],
        lambda: ["s"] * rng.choice([1, 5, 5000]),
        lambda: nested(rng.choice([10, 70, 500])),  # deeper: the raw mangles below
        lambda: {str(i): i for i in range(rng.choice([1, 100, 5000]))},
        lambda: [{"role": "user", "content": rng.choice(["hi", 5, None, [], [{"type": "x"}]])}],
        lambda: {"type": rng.choice(["json_schema", "json_object", "text", "bogus", 7])},
    ]
    return rng.choice(pool)()


def body(rng: random.Random) -> tuple[str, bytes]:
    """(path, body bytes): a small valid request with a few fields made hostile, sometimes
    re-encoded badly."""
    chat = rng.random() < 0.5
    req: dict[str, Any] = {"max_tokens": 2, "temperature": 0}
    if chat:
        req["messages"] = [{"role": "user", "content": "hi"}]
    else:
        req["prompt"] = "ab"
    for name in rng.sample(FIELDS, rng.randint(1, 3)):
        req[name] = values(rng)
    if isinstance(req.get("max_tokens"), int) and req["max_tokens"] > 8:
        req["max_tokens"] = -req["max_tokens"]  # keep valid requests short; large ones invalid
    if chat and req.get("max_tokens") is None:
        req["max_tokens"] = 2  # a chat without one runs to max_model_len: slow, not hostile
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(req, ensure_ascii=rng.random() < 0.5).encode()
    mangle = rng.random()
    if mangle < 0.05:
        raw = raw.decode().encode("utf-16")
    elif mangle < 0.10:
        raw = raw[: rng.randint(0, len(raw))]  # truncated JSON
    elif mangle < 0.15:
        raw = raw.replace(b'"', b"\xff", 1)  # invalid UTF-8
    elif mangle < 0.20:
        raw = raw.replace(b'"ab"', b'"\\ud800"').replace(b'"hi"', b'"\\udfff x"')
    elif mangle < 0.22:
        raw = b"[" * 100_000 + b"]" * 100_000
    elif mangle < 0.24:
        raw = b"NaN"
    return path, raw


def message(rng: random.Random, key: str | None) -> bytes:
    """One whole hostile HTTP request (bytes on the wire)."""
    path, raw = body(rng)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    length = str(len(raw))
    framing = rng.random()
    extra = ""
    if framing < 0.03:
        length = rng.choice(["-1", "abc", "1e3", "99999999999999999999", "+5", "0x10", "5 5"])
    elif framing < 0.05:
        return f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode() + raw  # no length
    elif framing < 0.07:
        extra = "Transfer-Encoding: chunked\r\n"
    elif framing < 0.09:
        extra = "X-Big: " + "a" * 100_000 + "\r\n"
    elif framing < 0.10:
        return rng.choice([b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x00\xff\r\n\r\n"])
    elif framing < 0.12:
        path = rng.choice(["/v1/completions/../x", "/%00", "/v1/models?x=" + "y" * 5000])
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + raw


def exchange(port: int, data: bytes, deadline_s: float = DEADLINE_S) -> tuple[int | None, float]:
    """Send ``data`` and read the answer's status; (None, seconds) when no answer came in time."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        # the server may close before reading a body it refused: read its answer all the same
        with contextlib.suppress(OSError):
            s.sendall(data)
        got = b""
        try:
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
                if time.monotonic() - t0 > deadline_s:
                    break
        except OSError:
            pass
    seconds = time.monotonic() - t0
    parts = got.split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1]), seconds
    return None, seconds


@dataclass
class Report:
    num_sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    num_unanswered: int = 0  # closed or timed out without a status line
    num_5xx: int = 0
    max_latency_s: float = 0.0
    slowest: dict[int, float] = field(default_factory=dict)  # status -> its slowest answer
    num_good: int = 0
    good_mismatches: list[str] = field(default_factory=list)
    seed: int = 0
    suspects: list[int] = field(default_factory=list)  # indexes: 5xx, unanswered or late

    def line(self) -> str:
        return (
            f"hostile seed={self.seed}: {self.num_sent} sent, 5xx={self.num_5xx}, unanswered="
            f"{self.num_unanswered}, max latency {self.max_latency_s:.2f} s, statuses "
            f"{dict(sorted(self.statuses.items()))}, slowest by status "
            f"{ {k: round(v, 2) for k, v in sorted(self.slowest.items())} }; good request ran {self.num_good} times, "
            f"{len(self.good_mismatches)} mismatches; suspects (message(Random(seed * 1000003 + "
            f"i))) {self.suspects[:20]}"
        )


def good_text(port: int, key: str | None, body: dict[str, Any]) -> str:
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head.encode() + raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = data.split(b" ", 2)[1]
    _, _, payload = data.partition(b"\r\n\r\n")
    assert status == b"200", data[:500]
    return str(json.loads(payload)["choices"][0]["text"])


GOOD = {"prompt": "the cat sat", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def run(port: int, key: str | None, count: int, seed: int, threads: int = 8) -> Report:
    """``count`` hostile requests from ``threads`` threads, with the good request alongside."""
    report = Report(seed=seed)
    want = good_text(port, key, GOOD)  # undisturbed
    lock = threading.Lock()
    done = threading.Event()
    next_index = iter(range(count))

    def hostile() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            data = message(random.Random(seed * 1_000_003 + i), key)
            status, seconds = exchange(port, data)
            with lock:
                report.num_sent += 1
                report.max_latency_s = max(report.max_latency_s, seconds)
                if status is None or status >= 500 or seconds > DEADLINE_S:
                    report.suspects.append(i)
                if status is None:
                    report.num_unanswered += 1
                else:
                    report.statuses[status] = report.statuses.get(status, 0) + 1
                    report.slowest[status] = max(report.slowest.get(status, 0.0), seconds)
                    report.num_5xx += status >= 500

    def good() -> None:
        while not done.is_set():
            got = good_text(port, key, GOOD)
            with lock:
                report.num_good += 1
                if got != want:
                    report.good_mismatches.append(got)

    workers = [threading.Thread(target=hostile) for _ in range(threads)]
    checker = threading.Thread(target=good)
    checker.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    checker.join(timeout=300)
    return report
