"""The ASGI door of ``specd-scheduler`` against real daemons over loopback: typed request
validation (hypothesis, then generated hostile requests), the official ``openai`` client end to
end, slow and half-open clients, a non-streaming client that leaves, admission under a burst,
and a bounded SIGTERM with idle keep-alive clients."""

from __future__ import annotations

import contextlib
import json
import random
import select
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import hostile
from tests.daemons import log_messages, wait_until
from tests.models import save_byte_model
from tests.procs import reap
from tests.test_scheduler_daemon import HTTP_MODES, KEY, Daemon, start_daemon

VOCAB = 256 + 3  # the byte model's vocabulary (worker.byte_tokenizer)
LONG = {"prompt": "go", "max_tokens": 350, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model("llama", 31, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module", params=list(HTTP_MODES))
def door(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path
) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("door"), model, *HTTP_MODES[request.param])
    try:
        yield d
    finally:
        reap(d.proc)


def metric(d: Daemon, name: str) -> float:
    status, text = d.call("/metrics", key=None)
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def active(d: Daemon) -> int:
    n = d.call("/health", key=None)[1]["active_requests"]
    assert isinstance(n, int)
    return n


def post(port: int, path: str, body: bytes, timeout_s: float = 60) -> tuple[int, Any, float]:
    """One request on its own connection: (status, JSON answer, seconds)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    seconds = time.monotonic() - t0
    status = int(data.split(b" ", 2)[1])
    payload = data.partition(b"\r\n\r\n")[2]
    return status, json.loads(payload) if payload.startswith(b"{") else payload, seconds


# -- a) typed validation ----------------------------------------------------------------------
INT64 = 2**63


def floats(**kw: Any) -> st.SearchStrategy[float]:
    """Finite floats: JSON has no NaN or infinity (Python's ``json.dumps`` writes them, and the
    door answers such a body 400 as invalid JSON, with no field to name)."""
    return st.floats(**{"allow_nan": False, "allow_infinity": False, **kw})


BAD: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(
        st.integers(max_value=0), st.integers(min_value=2**31), floats(), st.text(max_size=3)
    ),
    "temperature": st.one_of(
        floats(max_value=-1e-9), floats(min_value=100.001),
        st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=2),
    ),
    "top_p": st.one_of(floats(max_value=0), floats(min_value=1.0001)),
    "top_k": st.one_of(st.integers(max_value=-2), st.integers(min_value=2**31), floats()),
    "min_p": st.one_of(floats(max_value=-1e-9), floats(min_value=1.0001, max_value=1e300)),
    "seed": st.one_of(st.integers(min_value=INT64), st.integers(max_value=-INT64 - 1)),
    "n": st.integers(max_value=0) | st.integers(min_value=2, max_value=2**70),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(min_value=VOCAB, max_value=2**40), min_size=1, max_size=3),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.just(7), st.lists(st.text(max_size=2), min_size=1, max_size=2),
    ),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=2)),
    "ignore_eos": st.one_of(st.integers(), st.text(max_size=2)),
    "logit_bias": st.dictionaries(st.text(max_size=4), floats(min_value=101, max_value=1e9), min_size=1),
    "num_speculative_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31)),
    "stream_options": st.one_of(st.integers(), st.text(max_size=2)),
}  # fmt: skip
GOOD: dict[str, st.SearchStrategy[Any]] = {
    "temperature": floats(min_value=0, max_value=2),
    "top_p": floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=300),
    "seed": st.integers(min_value=-INT64, max_value=INT64 - 1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "max_tokens": st.integers(min_value=1, max_value=3),
    "unknown_field": st.one_of(st.none(), st.integers(), st.text(max_size=3)),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any], str | None]:
    """(path, body, the field made invalid or None)."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"max_tokens": 2, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=8))}]
    else:
        body["prompt"] = draw(
            st.text(min_size=1, max_size=8)
            | st.lists(st.integers(min_value=3, max_value=VOCAB - 1), min_size=1, max_size=8)
        )
    for name in draw(st.lists(st.sampled_from(sorted(GOOD)), max_size=4, unique=True)):
        body[name] = draw(GOOD[name])
    bad = draw(st.none() | st.sampled_from(sorted(BAD)))
    if bad is not None:
        body[bad] = draw(BAD[bad])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, bad


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=requests())
def test_typed_requests_answer_200_or_400_naming_the_field(
    door: Daemon, case: tuple[str, dict[str, Any], str | None]
) -> None:
    path, body, bad = case
    status, answer, seconds = post(door.port, path, json.dumps(body).encode())
    assert seconds < 5, (seconds, body)
    if bad is None:
        assert status == 200, (body, answer)
        return
    assert status == 400, (body, answer)
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    param = err["param"]
    assert param == bad or param.startswith((bad + "[", bad + ".")), (bad, err)


def test_prompt_ids_outside_the_vocabulary_are_400(door: Daemon) -> None:
    for prompt, want in [([5, VOCAB], "prompt"), ([5, -1], "prompt"), ([[1, True]], "prompt")]:
        status, answer, _ = post(
            door.port, "/v1/completions", json.dumps({"prompt": prompt}).encode()
        )
        assert status == 400 and answer["error"]["param"] == want, answer
    body = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    status, answer, _ = post(door.port, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == "messages[0].content[0].type", answer
    body = {"messages": [{"content": "no role"}]}
    status, answer, _ = post(door.port, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == "messages[0]", answer
    deep = {"prompt": "x", "guided_json": json.loads('{"a":' * 80 + "1" + "}" * 80)}
    status, answer, _ = post(door.port, "/v1/completions", json.dumps(deep).encode())
    assert status == 400 and "deeper than 64" in answer["error"]["message"], answer
    for raw in [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "\\ud800"}', b"\xff\xfe{}", b"NaN"]:
        status, answer, _ = post(door.port, "/v1/completions", raw)
        assert status == 400 and "not valid JSON" in answer["error"]["message"], answer


def test_bad_content_lengths_are_400_and_chunked_bodies_are_refused(door: Daemon) -> None:
    for length in ["-1", "abc", "1e3"]:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
        status, _ = hostile.exchange(door.port, head.encode())
        assert status == 400, length
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    assert hostile.exchange(door.port, head.encode())[0] == 400


def test_hostile_sample_gets_no_5xx_and_leaves_the_good_request_intact(door: Daemon) -> None:
    seed = random.randrange(2**32)
    print(f"hostile seed {seed}")
    report = hostile.run(door.port, KEY, 200, seed, threads=4)
    print(report.line())
    assert report.num_sent == 200
    assert report.num_5xx == 0 and report.num_unanswered == 0, report.line()
    assert report.max_latency_s < hostile.DEADLINE_S, report.line()
    assert report.num_good >= 1 and not report.good_mismatches, report.line()
    assert door.proc.poll() is None and door.call("/health", key=None)[0] == 200


# -- b) the official OpenAI client ------------------------------------------------------------
def test_the_openai_client_completes_chats_streams_and_reads_a_400(door: Daemon) -> None:
    # imported here: the GPU machine collects this module (its gpu stage) without the SDK
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEY, max_retries=0, timeout=120
    )
    try:
        c = client.completions.create(
            model="tiny",
            prompt="the cat",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert c.choices[0].finish_reason == "length" and c.usage is not None
        assert c.usage.completion_tokens == 12
        _, raw, _ = post(
            door.port,
            "/v1/completions",
            json.dumps(
                {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            ).encode(),
        )
        assert c.choices[0].text == raw["choices"][0]["text"]  # the SDK reads what we send
        parts = client.completions.create(
            model="tiny",
            prompt="the cat",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(p.choices[0].text for p in parts) == c.choices[0].text
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage is not None
        streamed = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(streamed)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == chat.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["tiny"]
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=1.5)
        assert bad.value.param == "top_p" and bad.value.status_code == 400
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{door.port}/v1", api_key="wrong", max_retries=0
            ).models.list()
    finally:
        client.close()


# -- c) slow clients, d) a client that leaves ---------------------------------------------------
def test_a_non_streaming_client_that_leaves_aborts_its_request(door: Daemon) -> None:
    aborts = metric(door, 'specd_scheduler_requests_finished_total{reason="abort"}')
    lengths = metric(door, 'specd_scheduler_requests_finished_total{reason="length"}')
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    s = socket.create_connection(("127.0.0.1", door.port), timeout=60)
    try:
        s.sendall(head.encode() + body)
        wait_until(lambda: metric(door, "specd_scheduler_running_requests") == 1, 60, "it to run")
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    # the engine sees the abort long before its 350 tokens would be done
    wait_until(lambda: active(door) == 0, 60, "the request to be aborted")
    assert metric(door, 'specd_scheduler_requests_finished_total{reason="abort"}') == aborts + 1
    assert metric(door, 'specd_scheduler_requests_finished_total{reason="length"}') == lengths
    assert any(m.startswith("client left; aborted cmpl-") for m in log_messages(door.log))


@pytest.fixture(scope="module", params=list(HTTP_MODES))
def strict(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path
) -> Iterator[Daemon]:
    """5 s client timeouts, 4 requests at a time, long keep-alive, a 3 s drain."""
    d = start_daemon(
        tmp_path_factory.mktemp("strict"), model,
        "--max-active-requests", "4", "--header-timeout", "5", "--body-timeout", "5",
        "--keep-alive-timeout", "60", "--drain-timeout", "3", *HTTP_MODES[request.param],
    )  # fmt: skip
    try:
        yield d
    finally:
        reap(d.proc)


def test_a_burst_never_runs_more_than_max_active_requests(strict: Daemon) -> None:
    body = json.dumps({"prompt": "go", "max_tokens": 40, "ignore_eos": True, "temperature": 0})
    results: list[int] = []
    peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            n = metric(strict, "specd_scheduler_running_requests") + metric(
                strict, "specd_scheduler_queue_depth"
            )
            peak[0] = max(peak[0], n)

    def one() -> None:
        results.append(post(strict.port, "/v1/completions", body.encode(), 120)[0])

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=one) for _ in range(48)]
    try:
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=300)
    finally:
        stop.set()
        watcher.join(timeout=60)
    assert len(results) == 48 and set(results) <= {200, 503}, results
    assert results.count(200) >= 4 and results.count(503) >= 1, results
    assert peak[0] <= 4, peak
    wait_until(lambda: active(strict) == 0, 60, "the burst to end")


def test_half_open_connections_neither_block_a_request_nor_stay_open(strict: Daemon) -> None:
    body = json.dumps({"prompt": "ab", "max_tokens": 8, "temperature": 0}).encode()
    usual = statistics.median(post(strict.port, "/v1/completions", body)[2] for _ in range(3))
    half: list[socket.socket] = []
    try:
        for i in range(500):
            s = socket.create_connection(("127.0.0.1", strict.port), timeout=60)
            half.append(s)
            if i % 2:  # half a head
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            else:  # a whole head and part of the promised body
                s.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                    '\r\nContent-Length: 100\r\n\r\n{"pro'.encode()
                )
        opened = time.monotonic()
        status, answer, seconds = post(strict.port, "/v1/completions", body)
        assert status == 200, answer
        print(f"usual {usual:.3f} s, beside 500 half-open connections {seconds:.3f} s")
        # it did not wait for them: every one of them is still open, short of its 5 s timeout
        assert time.monotonic() - opened < 5
        poll = select.poll()
        for s in half:
            poll.register(s, select.POLLIN)
        early = poll.poll(0)
        assert early == [], f"{len(early)} half-open connections were answered early"
        # each is answered (408, body late) or closed (head late) after its 5 s timeout
        deadline = time.monotonic() + 60
        statuses = []
        for s in half:
            s.settimeout(max(deadline - time.monotonic(), 0.1))
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            statuses.append(data.split(b" ", 2)[1] if data else b"closed")
        assert statuses.count(b"408") == 250 and statuses.count(b"closed") == 250, statuses
    finally:
        for s in half:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()


def test_sigterm_with_idle_keep_alive_clients_exits_within_drain_plus_5_s(strict: Daemon) -> None:
    idle: list[socket.socket] = []
    try:
        for _ in range(20):  # a request answered, then the connection kept open and idle
            s = socket.create_connection(("127.0.0.1", strict.port), timeout=60)
            idle.append(s)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        for _ in range(20):  # and some that never finish their head
            s = socket.create_connection(("127.0.0.1", strict.port), timeout=60)
            idle.append(s)
            s.sendall(b"GET /hea")
        t0 = time.monotonic()
        strict.proc.send_signal(signal.SIGTERM)
        assert strict.proc.wait(timeout=60) == 0
        took = time.monotonic() - t0
        print(f"exited {took:.2f} s after SIGTERM")
        assert took < 3 + 5
    finally:
        for s in idle:
            s.close()


# -- 6, 7) typed config, the metrics address, health -------------------------------------------
def test_toml_values_meet_the_flags_checks(tmp_path: Path) -> None:
    import subprocess
    import sys

    from scheduler_client.daemon import parse_args

    toml = tmp_path / "s.toml"
    for text, key in [
        ('port = "8000"\n', "port"),
        ("drain-timeout = true\n", "drain-timeout"),
        ("max_active_requests = 1.5\n", "max_active_requests"),
        ('async-scheduling = "yes"\n', "async-scheduling"),
        ('drafter = "bogus"\n', "drafter"),
        ("host = 5\n", "host"),
    ]:
        toml.write_text(text)
        with pytest.raises(ValueError, match=f"{key}"):
            parse_args(["--config", str(toml)])
    toml.write_text("max-active-requests = 0\n")  # the flag's range check applies too
    with pytest.raises(ValueError, match="--max-active-requests must be >= 1"):
        parse_args(["--config", str(toml)])
    toml.write_text('port = "80"\n')
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_client.daemon", "--config", str(toml)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "port must be an integer" in out.stderr, out.stderr
    toml.write_text("drain-timeout = 7\nmax-connections = 9\n")
    cfg = parse_args(["--config", str(toml), "--host", "127.0.0.2"])
    assert cfg.drain_timeout_s == 7.0 and cfg.limits.max_connections == 9
    assert cfg.engine.metrics_host == "127.0.0.2"


def test_the_metrics_port_listens_on_the_given_host_only() -> None:
    from scheduler_client.prom import SchedulerMetrics

    m = SchedulerMetrics()
    try:
        port = m.serve(-1, "127.0.0.2")
        assert m.server is not None and m.server.server_address[0] == "127.0.0.2"
        with contextlib.closing(socket.socket()) as s:
            s.settimeout(5)
            assert s.connect_ex(("127.0.0.1", port)) != 0  # not on every interface
        with socket.create_connection(("127.0.0.2", port), timeout=5):
            pass
    finally:
        m.stop()


def test_health_is_ok_with_its_active_count(door: Daemon) -> None:
    assert door.call("/health", key=None) == (200, {"status": "ok", "active_requests": 0})
    status, answer = door.call("/v1/completions", {"prompt": "x"}, key=None)
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    status, answer = door.call("/health", {"x": 1})  # POST on a GET route
    assert status == 404 and answer["error"]["type"] == "not_found_error"


def sse_texts(port: int, body: dict[str, Any]) -> list[str]:
    """The texts of a streamed completion's chunks, in order (empty ones included)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
        resp = conn.getresponse()
        assert resp.status == 200
        texts = []
        for raw in resp:
            line = raw.strip()
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or []
                texts += [c["text"] for c in choices if c.get("text") is not None]
        return texts
    finally:
        conn.close()


def test_stream_interval_sends_the_first_token_alone_then_chunks_of_n(
    tmp_path: Path, model: Path, door: Daemon
) -> None:
    body = {"prompt": "the cat", "max_tokens": 13, "temperature": 0, "ignore_eos": True}
    each = sse_texts(door.port, body)  # --stream-interval 1: a chunk a step
    d = start_daemon(tmp_path, model, "--stream-interval", "4")
    try:
        chunked = sse_texts(d.port, body)
    finally:
        reap(d.proc)
    assert "".join(chunked) == "".join(each)  # nothing lost or reordered
    # the first token at once, then 12 tokens in chunks of at least 4 but the last: at most 3
    # more (drafts and a reader that fell behind make chunks only larger; test_sse_events
    # counts them one token a step)
    assert 1 <= len([t for t in chunked if t]) <= 4, chunked
