"""``specd-scheduler`` as a real process (it launches a real worker): the OpenAI-compatible HTTP
API, TOML config, JSON logs, API keys and the SIGTERM drain."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from scheduler_client import Engine, EngineConfig
from scheduler_client.daemon import parse_args
from scheduler_client.openai_api import ApiError, engine_request
from tests.models import save_byte_model
from tests.procs import logged, reap
from tests.test_scheduler_e2e import SCHEMAS

KEY = "sk-test-0123"
# the HTTP door on a thread of the scheduler, or in a process of its own: the same answers
HTTP_MODES = {"thread": (), "process": ("--api-server-count", "1")}


class Daemon:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.mode = "thread"  # the HTTP door's (HTTP_MODES)

    def request(
        self, path: str, body: dict[str, Any] | None = None, key: str | None = KEY
    ) -> urllib.request.Request:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if body is not None:
            req.data = json.dumps(body).encode()
            req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        return req

    def call(
        self, path: str, body: dict[str, Any] | None = None, key: str | None = KEY
    ) -> tuple[int, Any]:
        req = self.request(path, body, key)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()

    def all_children(self) -> list[str]:
        """Pids of every process the daemon launched: workers and tokenizer processes."""
        return subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, timeout=10
        ).stdout.split()

    def children(self) -> list[str]:
        """Pids of the workers the daemon launched (not its tokenizer processes, prep.py)."""
        return [pid for pid in self.all_children() if b"worker.daemon" in _cmdline(pid)]

    def stream_in_flight(
        self, path: str, body: dict[str, Any]
    ) -> tuple[http.client.HTTPResponse, bytes]:
        """Start a streamed request and read up to its first SSE event: once this returns, the
        request is observably running (it has produced a token) and has not finished."""
        resp = urllib.request.urlopen(self.request(path, {**body, "stream": True}), timeout=120)
        first = b""
        while not first.endswith(b"\n\n"):
            line = resp.readline()
            assert line, "the stream ended before its first event"
            first += line
        return resp, first

    def events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """A streamed answer as its list of SSE payloads (``[DONE]`` kept as a string)."""
        _, raw = self.call(path, {**body, "stream": True})
        assert isinstance(raw, str)
        return sse(raw)


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # it ended since pgrep saw it
        return b""


def sse(raw: str) -> list[Any]:
    """SSE text as its list of payloads (``[DONE]`` kept as a string)."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def start_daemon(tmp: Path, model: Path, *flags: str) -> Daemon:
    """The daemon on a port it picks (--port 0), read back from its "ready: http://..." line."""
    (tmp / "key").write_text(KEY + "\n")
    (tmp / "sched.toml").write_text(
        f'model = "{model}"\ndevice = "cpu"\nmax-model-len = 384\nlog_format = "json"\n'
        f'port = 1\nserved_model_name = "tiny"\napi_key_file = "{tmp / "key"}"\n'
    )
    log = tmp / "sched.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler_client.daemon",
                "--config",
                str(tmp / "sched.toml"),
                "--port",  # the flag wins over the file's port = 1
                "0",
                "--worker-log",
                str(tmp / "worker.log"),
                *flags,
            ],
            stderr=err,
        )
    try:
        port = int(logged(log, r'"ready: http://127\.0\.0\.1:(\d+) ', proc, 180).group(1))
        d = Daemon(proc, port, log)
        assert d.call("/health", key=None)[0] == 200
    except BaseException:
        reap(proc)
        raise
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model("llama", 31, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module", params=list(HTTP_MODES))
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path
) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("sched"), model, *HTTP_MODES[request.param])
    d.mode = request.param
    try:
        yield d
    finally:
        reap(d.proc)


def test_completions_equal_the_engine_greedy_output(daemon: Daemon, model: Path) -> None:
    prompts = ["the cat sat on the mat. the cat", "abcabcabc", "x"]
    got = []
    for p in prompts:
        status, body = daemon.call(
            "/v1/completions",
            {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["finish_reason"] == "length"
        got.append(body["choices"][0]["text"])
    with Engine(EngineConfig(model=str(model), device="cpu", max_model_len=384)) as e:
        want = e.generate([{"prompt": p, "max_tokens": 24, "ignore_eos": True} for p in prompts])
    assert got == [r.text for r in want]


def test_streamed_chat_with_a_json_schema(daemon: Daemon) -> None:
    schema = SCHEMAS[0]
    events = daemon.events(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a user as JSON"}],
            "max_tokens": 200,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] >= len(chunks) - 2


def test_bad_requests_get_clear_errors_and_others_keep_running(daemon: Daemon) -> None:
    long_result: list[tuple[int, Any]] = []
    body = {"prompt": "long", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    t = threading.Thread(target=lambda: long_result.append(daemon.call("/v1/completions", body)))
    t.start()
    bad_schema = {
        "prompt": "x",
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
    }
    status, err = daemon.call("/v1/completions", bad_schema)
    assert status == 400 and "bogus" in err["error"]["message"]
    status, err = daemon.call("/v1/completions", {"prompt": "x" * 500})
    assert status == 400 and "too long" in err["error"]["message"]
    status, err = daemon.call("/v1/completions", {"prompt": "x", "n": 3})
    assert status == 400 and "n must be 1" in err["error"]["message"]
    status, err = daemon.call("/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert status == 404 and "gpt-9" in err["error"]["message"]
    status, err = daemon.call("/v1/completions", {"prompt": "x"}, key="wrong")
    assert status == 401
    status, err = daemon.call("/v1/nothing", {"prompt": "x"})
    assert status == 404
    t.join(timeout=120)
    ((status, done),) = long_result
    assert status == 200 and done["usage"]["completion_tokens"] == 120
    assert daemon.call("/health", key=None) == (200, {"status": "ok", "active_requests": 0})
    status, metrics = daemon.call("/metrics", key=None)
    assert status == 200 and "specd_scheduler_requests_finished_total" in metrics
    # each request that ran has its time in every phase, its preparation included
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    counts = {
        name: float(values[f"specd_scheduler_request_{name}_seconds_count"])
        for name in ("prep", "queue", "prefill", "decode")
    }
    assert counts["prep"] >= 1 and len(set(counts.values())) == 1, counts
    assert float(values["specd_scheduler_request_decode_seconds_sum"]) > 0
    status, models = daemon.call("/v1/models")
    assert models["data"][0]["id"] == "tiny"


def test_a_schema_msgpack_cannot_carry_leaves_no_slot_behind(daemon: Daemon) -> None:
    """An integer past 64 bits is valid JSON; the HTTP process cannot forward it to the engine
    (400, naming why), and in either mode the request's admission slot is given back."""
    body = {
        "prompt": "x",
        "max_tokens": 4,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "integer", "maximum": 10**30}},
        },
    }
    for _ in range(3):
        status, answer = daemon.call("/v1/completions", body)
        assert status in (200, 400), answer
        if daemon.mode == "process":
            assert status == 400 and "cannot be passed to the engine" in str(answer), answer
    assert daemon.call("/health", key=None) == (200, {"status": "ok", "active_requests": 0})


@pytest.mark.parametrize("mode", list(HTTP_MODES))
def test_sigterm_drains_running_requests_then_exits_0(
    tmp_path: Path, model: Path, mode: str
) -> None:
    """SIGTERM once the request has streamed its first token: it runs on (300 tokens, seconds
    of work against the microseconds between that token and the signal) and ends whole."""
    d = start_daemon(tmp_path, model, "--drain-timeout", "60", *HTTP_MODES[mode])
    try:
        body = {
            "prompt": "go",
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        resp, first = d.stream_in_flight("/v1/completions", body)
        with resp:
            d.proc.send_signal(signal.SIGTERM)
            events = sse((first + resp.read()).decode())
        assert d.proc.wait(timeout=60) == 0
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # finished, not cut
        assert events[-2]["usage"]["completion_tokens"] == 300
        lines = [json.loads(x) for x in d.log.read_text().splitlines() if x.startswith("{")]
        msgs = [x["msg"] for x in lines]
        assert any(m.startswith("ready: http://") for m in msgs)
        assert any(m.startswith("draining 1 requests") for m in msgs), msgs
    finally:
        reap(d.proc)


@pytest.mark.parametrize("mode", list(HTTP_MODES))
def test_sigterm_aborts_what_outlives_the_drain_deadline(
    tmp_path: Path, model: Path, mode: str
) -> None:
    d = start_daemon(tmp_path, model, "--drain-timeout", "0", *HTTP_MODES[mode])
    try:
        body = {
            "prompt": "go",
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        resp, first = d.stream_in_flight("/v1/completions", body)
        with resp:
            d.proc.send_signal(signal.SIGTERM)
            events = sse((first + resp.read()).decode())
        assert d.proc.wait(timeout=60) == 0
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        assert 0 < events[-2]["usage"]["completion_tokens"] < 300  # cut: some tokens, not all
    finally:
        reap(d.proc)


def test_config_errors_name_what_to_fix(tmp_path: Path) -> None:
    bad = tmp_path / "s.toml"
    bad.write_text("prot = 8000\n")
    with pytest.raises(ValueError, match="unknown option 'prot'"):
        parse_args(["--config", str(bad)])
    with pytest.raises(ValueError, match="--port must be"):
        parse_args(["--port", "70000"])
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_client.daemon", "--api-key-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "/nonexistent: no such file" in out.stderr


def test_openai_bodies_become_engine_requests() -> None:
    chat = engine_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7,
            "top_k": -1,
            "stop": "END",
            "guided_choice": ["a", "b"],
        },
        chat=True,
        max_model_len=100,
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["top_k"], chat["stop"]) == (7, 0, ["END"])
    assert chat["structured"] == {"choice": ["a", "b"]} and chat["temperature"] == 1.0
    plain = engine_request({"prompt": [[1, 2, 3]]}, chat=False, max_model_len=100)
    assert plain["prompt"] == [1, 2, 3] and plain["max_tokens"] == 16
    obj = engine_request(
        {"prompt": "p", "response_format": {"type": "json_object"}}, chat=False, max_model_len=9
    )
    assert obj["structured"] == {"json": {"type": "object"}}
    for body, message in [
        ({"prompt": "p", "logprobs": 2}, "logprobs is not supported"),
        ({"prompt": "p", "temperature": "hot"}, "temperature has the wrong type"),
        ({"prompt": ["a", "b"]}, "one prompt"),
        ({"prompt": "p", "guided_regex": "a", "guided_choice": ["a"]}, "not several"),
        ({"messages": []}, "messages must be a non-empty list"),
        ([], "must be a JSON object"),
    ]:
        with pytest.raises(ApiError, match=message):
            engine_request(body, chat="messages" in body, max_model_len=9)


@pytest.mark.parametrize("mode", list(HTTP_MODES))
def test_a_killed_scheduler_leaves_no_worker_behind(tmp_path: Path, model: Path, mode: str) -> None:
    """The worker notices within a poll or two (0.2 s each); the limit is 10 s. So do the
    tokenizer processes and the HTTP process."""
    before = set(Path(tempfile.gettempdir()).glob("specd-http-*"))
    d = start_daemon(tmp_path, model, *HTTP_MODES[mode])
    worker = 0
    try:
        children = d.children()
        assert len(children) == 1, children
        worker = int(children[0])
        others = [int(p) for p in d.all_children() if int(p) != worker]
        assert others, "no tokenizer processes"  # prep.py's, which must not outlive it either
        http = [p for p in others if b"http.api_server" in _cmdline(str(p))]
        assert len(http) == (mode == "process"), others
        pipes = set(Path(tempfile.gettempdir()).glob("specd-http-*")) - before
        assert len(pipes) == (mode == "process"), pipes
        d.proc.kill()  # no drain, no Shutdown message: the worker must notice on its own
        d.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        for pid in (worker, *others):
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            status = Path(f"/proc/{pid}/status")
            gone = not status.exists() or "zombie" in status.read_text()
            assert gone, f"launched process {pid} outlived its scheduler"
        assert "is gone: stopping" in (tmp_path / "worker.log").read_text()
        # the HTTP process removes the pipes' directory its killed scheduler could not
        deadline = time.monotonic() + 10
        while [p for p in pipes if p.exists()] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pipes if p.exists()], pipes
    finally:
        reap(d.proc)
        if worker and Path(f"/proc/{worker}").exists():
            # orphaned (not our child, so not ours to wait for): its new parent reaps it
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("draining", [False, True])
def test_a_killed_http_process_stops_the_scheduler_with_exit_1(
    tmp_path: Path, model: Path, draining: bool
) -> None:
    """A running request is cut (its client's connection is gone with the HTTP process); the
    scheduler drains at once, stops its worker and exits 1 for its supervisor to restart it. So
    it does in the middle of a long SIGTERM drain: the drain is cut short, not sat out."""
    d = start_daemon(tmp_path, model, "--drain-timeout", "120", *HTTP_MODES["process"])
    try:
        (http,) = [p for p in d.all_children() if b"http.api_server" in _cmdline(p)]
        worker = d.children()
        body = {"prompt": "go", "max_tokens": 300, "ignore_eos": True}
        resp, _first = d.stream_in_flight("/v1/completions", body)
        with resp:
            if draining:
                d.proc.send_signal(signal.SIGTERM)
                logged(d.log, "draining 1 requests", d.proc, 30)
            os.kill(int(http), signal.SIGKILL)
            assert d.proc.wait(timeout=30) == 1
        assert "the HTTP process exited with -9" in d.log.read_text()
        for pid in worker:
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not Path(f"/proc/{pid}").exists(), "the worker outlived its scheduler"
    finally:
        reap(d.proc)


@pytest.mark.long
@pytest.mark.parametrize("mode", list(HTTP_MODES))
def test_data_parallel_spreads_requests_over_two_workers(
    tmp_path: Path, model: Path, mode: str
) -> None:
    d = start_daemon(tmp_path, model, "--data-parallel-size", "2", *HTTP_MODES[mode])
    try:
        children = d.children()
        assert len(children) == 2, children
        prompts = ["abcabc", "the cat", "xyz", "hello hello"]
        results: dict[str, Any] = {}

        def call(p: str) -> None:
            body = {"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            results[p] = d.call("/v1/completions", body)

        threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all(results[p][0] == 200 for p in prompts), results
        with Engine(EngineConfig(model=str(model), device="cpu", max_model_len=384)) as e:
            want = e.generate(
                [{"prompt": p, "max_tokens": 20, "ignore_eos": True} for p in prompts]
            )
        assert [results[p][1]["choices"][0]["text"] for p in prompts] == [r.text for r in want]
        status, metrics = d.call("/metrics", key=None)
        assert status == 200
        assert 'worker="1"' in metrics and 'worker="0"' in metrics
        # both workers served: each one's finished-request counter moved
        served = [
            line
            for line in metrics.splitlines()
            if line.startswith("specd_scheduler_requests_finished_total")
            and 'reason="length"' in line
        ]
        assert len(served) == 2, served
        # the process's garbage collector is one process's: given once, without a worker label
        gc_lines = [x for x in metrics.splitlines() if x.startswith("specd_scheduler_gc_")]
        assert [x.split(" ")[0] for x in gc_lines] == [
            "specd_scheduler_gc_pause_seconds_total",
            "specd_scheduler_gc_collections_total",
            "specd_scheduler_gc_full_collections_total",
        ], gc_lines
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 0
    finally:
        reap(d.proc)
