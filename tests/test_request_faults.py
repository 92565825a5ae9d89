"""Faults stay with their request (issue #15, item 3): hostile input against a running
``specd-scheduler`` fails that request alone (400 at add time), the engine thread and the worker
live on, and a concurrent greedy request's output equals an undisturbed run. Values that slip past
the checks (the Python API's back door) are caught where the step is encoded or where the worker
cannot read it, and blamed on their request. A request running at two worker deaths is failed;
the restart budget is a rate; /health says "recovering" while a killed worker is relaunched; and
64 streams survive a kill -9 of their worker with identical outputs."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import SamplingParams
from scheduler_client import Engine, EngineConfig
from scheduler_client.engine_loop import EngineLoop, Refused
from scheduler_client.request import Request
from scheduler_client.restart_budget import RestartBudget
from tests.daemons import log_messages, wait_until
from tests.test_faults import StreamReader, kill_worker
from tests.test_scheduler_daemon import Daemon, start_daemon

GOOD = {"prompt": "the cat sat on the mat. the cat", "max_tokens": 200, "ignore_eos": True}
GREEDY = {**GOOD, "temperature": 0}


def nested_schema(depth: int) -> dict[str, Any]:
    """An array of arrays ... ``depth`` deep: past Python's recursion limit in the grammar's
    cache key (depth 500), not in the HTTP server's JSON parser (about 1000)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "nested schema": (
        {
            "prompt": "go",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": nested_schema(500)},
            },
        },
        "invalid json spec",
    ),
    "prompt id past int32": (
        {"prompt": [1, 2, 2**31 + 5]},
        "prompt token ids[2] = 2147483653 is outside the vocabulary",
    ),
    "seed past 64 bits": ({"prompt": "go", "seed": 2**70}, "seed must be an integer in"),
    "max_tokens past 64 bits": ({"prompt": "go", "max_tokens": 2**70}, "max_tokens must be"),
    "top_k past 64 bits": ({"prompt": "go", "top_k": 2**70}, "top_k must be an integer in"),
    "stop_token_ids strings": (
        {"prompt": "go", "stop_token_ids": ["a", "b"]},
        "stop_token_ids[0] must be an integer token id, got str",
    ),
}


@pytest.fixture(scope="module")
def model(target_dir: Path) -> Path:
    return target_dir


def post_raw(d: Daemon, data: bytes) -> tuple[int, Any]:
    req = d.request("/v1/completions")
    req.data = data
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def restarts(d: Daemon) -> float:
    status, text = d.call("/metrics", key=None)
    assert status == 200
    (line,) = [x for x in text.splitlines() if x.startswith("specd_scheduler_worker_restarts_total")]
    return float(line.split()[1])


def test_hostile_requests_fail_alone_while_a_greedy_stream_runs(
    tmp_path: Path, model: Path
) -> None:
    d = start_daemon(tmp_path, model)
    try:
        status, body = d.call("/v1/completions", GREEDY)
        assert status == 200, body
        want = body["choices"][0]["text"]
        (worker,) = d.children()
        stream = StreamReader(d, GREEDY)
        stream.start()
        assert stream.first.wait(timeout=120), "the stream never started"
        for name, (bad, message) in HOSTILE.items():
            status, err = d.call("/v1/completions", {"temperature": 0, **bad})
            assert status == 400, (name, status, err)
            assert message in err["error"]["message"], (name, err)
        assert "[DONE]" not in stream.events, "the hostile requests must overlap the stream"
        stream.join(timeout=300)
        assert stream.events[-1] == "[DONE]" and stream.text() == want
        assert d.proc.poll() is None and d.children() == [worker]  # no relaunch
        assert restarts(d) == 0
        assert d.call("/health", key=None) == (200, {"status": "ok", "active_requests": 0})
        # a body nested past the JSON parser's own limit: 400, not a dropped connection
        deep = '{"prompt": "go", "x": ' + "[" * 5000 + "]" * 5000 + "}"
        status, err = post_raw(d, deep.encode())
        assert status == 400 and "nested too deeply" in err["error"]["message"], err
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)
