"""Every fault path of docs/operations.md that had no test, driven for real: a worker killed under a
running ``specd-scheduler`` (replayed; then restarts spent: 500s and exit 1), a second scheduler
taking a worker over, a handshake across major versions, the exit codes of both daemons, and a
sampled token the grammar rejects at commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerHello,
    TransportConfig,
    WorkerError,
    WorkerReady,
    bind_router,
    connect_dealer,
)
from scheduler_client import Engine, EngineConfig, WorkerDied
from scheduler_client.grammar import StructuredSpec, make_backend
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.tokenizer import TokenizerInfo
from tests.daemons import log_messages, wait_until
from tests.models import (
    BYTE_MODEL_SEED,
    BYTE_VOCAB,
    EOS_ID,
    greedy_reference,
    reference_copy,
    tiny_model,
)
from tests.procs import start_worker
from tests.test_scheduler_daemon import KEY, Daemon, start_daemon

PROMPTS = ["the cat sat on the mat. the cat", "abcabcabc", "x y z"]


@pytest.fixture(scope="module")
def model(target_dir: Path) -> Path:
    return target_dir


class StreamReader(threading.Thread):
    """Reads one streamed completion line by line; ``first`` is set at its first event."""

    def __init__(self, d: Daemon, body: dict[str, Any]) -> None:
        super().__init__()
        self.d, self.body = d, body
        self.first = threading.Event()
        self.events: list[Any] = []

    def run(self) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.d.port}/v1/completions",
            data=json.dumps({**self.body, "stream": True}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                if line.startswith(b"data: "):
                    data = line[len(b"data: ") :].strip().decode()
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.first.set()

    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict))


def call_all(d: Daemon, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any] | None] = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = d.call("/v1/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(o is not None for o in out), "a request never answered"
    return [o for o in out if o is not None]


def kill_worker(d: Daemon, old: str | None = None) -> str:
    """SIGKILL the daemon's worker (waiting for one other than ``old`` to exist first)."""
    wait_until(lambda: any(k != old for k in d.children()), 60, "a new worker")
    (pid,) = [k for k in d.children() if k != old]
    os.kill(int(pid), signal.SIGKILL)
    return pid


# make test keeps test_request_faults.py::test_64_streams_survive_a_kill_9_of_their_worker (a
# kill -9 under the daemon, 64 streamed requests replayed to their undisturbed outputs); this one
# (non-streamed requests, then SIGTERM and exit 0 after the replay) runs in make test-long.
@pytest.mark.long
def test_daemon_replays_a_killed_worker_s_requests_identically(tmp_path: Path, model: Path) -> None:
    d = start_daemon(tmp_path, model)
    try:
        bodies = [
            {"prompt": p, "max_tokens": 80, "ignore_eos": True, "temperature": 0} for p in PROMPTS
        ]
        want = [body["choices"][0]["text"] for _, body in call_all(d, bodies)]
        stream = StreamReader(d, bodies[0])
        stream.start()
        others: list[list[tuple[int, Any]]] = []
        rest = threading.Thread(target=lambda: others.append(call_all(d, bodies[1:])))
        rest.start()
        assert stream.first.wait(timeout=120), "the stream never started"
        kill_worker(d)
        assert "[DONE]" not in stream.events  # killed mid-stream: the rest is replayed
        stream.join(timeout=300)
        rest.join(timeout=300)
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        assert stream.events[-2]["choices"][0]["finish_reason"] == "length"
        ((s1, b1), (s2, b2)) = others[0]
        assert (s1, s2) == (200, 200), (b1, b2)
        assert [stream.text(), b1["choices"][0]["text"], b2["choices"][0]["text"]] == want
        status, metrics = d.call("/metrics", key=None)
        assert status == 200
        assert "specd_scheduler_worker_restarts_total 1.0" in metrics
        assert any(m.startswith("worker lost (") for m in log_messages(d.log))
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 0
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)


def test_daemon_exits_1_once_worker_restarts_are_spent(tmp_path: Path, model: Path) -> None:
    """Killed twice with --max-worker-restarts 1: every request fails with "worker died" (a plain
    request gets 500, a stream the error event then [DONE]) and the daemon exits 1."""
    d = start_daemon(tmp_path, model, "--max-worker-restarts", "1")
    try:
        body = {"prompt": "go", "max_tokens": 350, "ignore_eos": True, "temperature": 0}
        stream = StreamReader(d, body)
        stream.start()
        plain: list[tuple[int, Any]] = []
        t = threading.Thread(target=lambda: plain.append(d.call("/v1/completions", body)))
        t.start()
        assert stream.first.wait(timeout=120), "the stream never started"
        first = kill_worker(d)
        kill_worker(d, old=first)  # the relaunched one
        stream.join(timeout=300)
        t.join(timeout=300)
        assert d.proc.wait(timeout=60) == 1
        ((status, err),) = plain
        assert status == 500 and err["error"]["type"] == "server_error", err
        assert "worker died" in err["error"]["message"]
        assert stream.events[-1] == "[DONE]"
        last = stream.events[-2]["error"]
        assert last["code"] == 500 and "worker died" in last["message"], last
        assert any(m.startswith("worker lost for good: ") for m in log_messages(d.log))
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)


def test_a_second_scheduler_takes_the_worker_over(tmp_path: Path, model: Path) -> None:
    """Scheduler A holds both slots; B says hello: the worker drops A's requests (B gets both
    slots, greedy outputs right) and A's next step is refused, ending A's requests."""
    addr = f"ipc://{tmp_path}/w.sock"
    log = tmp_path / "w.log"
    with open(log, "wb") as err:
        worker = start_worker(
            model, addr, "--max-num-seqs", "2", "--max-model-len", "128", stderr=err
        )
    cfg = EngineConfig(worker_addr=addr, handshake_timeout_s=120, step_timeout_s=60)
    a = b = None
    try:
        a = Engine(cfg)
        held = [a.add_request("hold", max_tokens=100, ignore_eos=True) for _ in range(2)]
        for _ in range(3):
            a.step()
        assert all(r.output_ids and not r.finished for r in held)
        b = Engine(cfg)
        prompts = [list(b"abcabc"), list(b"hello")]
        got = b.generate([{"prompt": p, "max_tokens": 10, "ignore_eos": True} for p in prompts])
        assert all(r.error is None for r in got), [r.error for r in got]
        ref = reference_copy(tiny_model("llama", BYTE_MODEL_SEED, vocab=BYTE_VOCAB))
        assert [r.output_ids for r in got] == [greedy_reference(ref, p, 10) for p in prompts]
        a.step()
        assert all(r.finish_reason == "error" for r in held)
        assert all("no_handshake" in (r.error or "") for r in held), held[0].error
        assert "dropping the previous scheduler's requests" in log.read_text()
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        worker.kill()
        worker.wait(timeout=30)


def test_a_worker_restarted_at_its_address_takes_the_replay(tmp_path: Path, model: Path) -> None:
    """A worker we did not launch is killed mid-run and a supervisor restarts it at once at the
    same address: the engine notices the dropped connection (not only after ten missed pings, by
    which time the new worker would answer them), shakes hands with the new one and replays;
    outputs equal an undisturbed run, long before the step timeout."""
    addr = f"ipc://{tmp_path}/w.sock"
    flags = ("--max-model-len", "256")
    workers = [start_worker(model, addr, *flags)]
    e = None
    try:
        e = Engine(
            EngineConfig(
                worker_addr=addr, handshake_timeout_s=180, step_timeout_s=600, max_worker_restarts=1
            )
        )
        batch = [{"prompt": p, "max_tokens": 60, "ignore_eos": True} for p in PROMPTS[:2]]
        want = [r.output_ids for r in e.generate(batch)]
        reqs = [e.add_request(**r) for r in batch]
        errors: list[BaseException] = []

        def run() -> None:
            try:
                e.run_until_done()
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: len(reqs[0].output_ids) >= 5, 60, "the requests to run")
        t0 = time.monotonic()
        workers[0].kill()
        workers[0].wait(timeout=30)
        workers.append(start_worker(model, addr, *flags))
        t.join(timeout=300)
        assert not t.is_alive() and not errors, errors
        assert time.monotonic() - t0 < 120  # not the 600 s step timeout
        assert e.num_worker_restarts == 1
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
    finally:
        if e is not None:
            e.close()
        for w in workers:
            w.kill()
            w.wait(timeout=30)


def test_a_major_version_mismatch_is_refused_naming_both_versions(
    tmp_path: Path, model: Path
) -> None:
    addr = f"ipc://{tmp_path}/w.sock"
    worker = start_worker(model, addr, "--max-model-len", "64")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = connect_dealer(ctx, addr, TransportConfig())
    ours = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
    newer = PROTOCOL_MAJOR + 1
    try:
        # a scheduler of the next major version: its frames carry that version
        hello = SchedulerHello(protocol_major=newer, protocol_minor=0, scheduler_id="new")
        chan.sock.send_multipart(chan.codec.encode_versioned(hello, newer, 0))
        got = chan.recv(timeout_ms=120_000)
        assert got is not None, "the worker did not answer"
        err = got[1]
        assert isinstance(err, WorkerError) and err.code == "version", err
        assert f"{newer}.0" in err.message and ours in err.message, err.message
        # a hello whose envelope matches but that declares another major
        chan.send(hello)
        got = chan.recv(timeout_ms=60_000)
        assert got is not None
        err = got[1]
        assert isinstance(err, WorkerError) and err.code == "version"
        assert f"scheduler speaks protocol {newer}.0" in err.message and ours in err.message
        # refused, not fatal: a matching hello is served
        chan.send(
            SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=0, scheduler_id="ok")
        )
        got = chan.recv(timeout_ms=60_000)
        assert got is not None and isinstance(got[1], WorkerReady)
        assert worker.poll() is None
    finally:
        chan.close()
        ctx.term()
        worker.kill()
        worker.wait(timeout=30)


def test_specd_scheduler_refuses_a_worker_of_another_major_and_exits_3(tmp_path: Path) -> None:
    """A worker of the next major version (played by a socket in this test) answers the hello:
    the daemon names both versions and exits 3 (no worker)."""
    addr = f"ipc://{tmp_path}/w.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = bind_router(ctx, addr, TransportConfig())
    newer = PROTOCOL_MAJOR + 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler_client.daemon", "--worker", addr, "--port", "0"],
        stderr=subprocess.PIPE,
    )
    try:
        frames = chan.recv_frames(timeout_ms=120_000)
        assert frames is not None, "the scheduler never said hello"
        ready = WorkerReady(
            protocol_major=newer,
            protocol_minor=0,
            model_name="m",
            vocab_size=BYTE_VOCAB,
            eos_token_ids=(EOS_ID,),
            max_model_len=64,
            drafter="none",
            max_num_speculative_tokens=0,
            kv_capacity_tokens=64,
            max_num_seqs=1,
            tokenizer_path=None,
        )
        chan.sock.send_multipart([frames[0].bytes, *chan.codec.encode_versioned(ready, newer, 0)])
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 3, stderr.decode()
        text = stderr.decode()
        assert "no worker" in text and f"{newer}.0" in text, text
        assert f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}" in text, text
    finally:
        proc.kill()
        proc.wait(timeout=30)
        chan.close()
        ctx.term()


def run_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=180
    )


def test_worker_exit_codes_config_and_load(tmp_path: Path) -> None:
    """2: an address it cannot bind (the message names it; a bad flag is
    test_worker_daemon.py::test_bad_flags_exit_2); 3: the model does not load. (0 is
    test_operations.py's SIGTERM and test_worker_daemon.py's Shutdown; 1 is
    test_worker_exits_1_on_a_fatal_error.)"""
    bad_dir = f"ipc://{tmp_path}/no/such/dir/w.sock"
    out = run_cmd("worker.daemon", "--model", "x", "--device", "cpu", "--listen", bad_dir)
    assert out.returncode == 2 and "cannot bind" in out.stderr and bad_dir in out.stderr
    missing = tmp_path / "no-model"
    out = run_cmd(
        "worker.daemon",
        "--model",
        str(missing),
        "--device",
        "cpu",
        "--listen",
        f"ipc://{tmp_path}/w.sock",
    )
    assert out.returncode == 3 and "model load failed" in out.stderr, out.stderr[-2000:]


def test_scheduler_exit_codes_config_and_no_worker(tmp_path: Path) -> None:
    """2: a bad option (TOML or flag); 3: the launched worker cannot load its model. (0 and 1
    are the drain tests and test_daemon_exits_1_once_worker_restarts_are_spent.)"""
    toml = tmp_path / "s.toml"
    toml.write_text("max_active_request = 5\n")
    out = run_cmd("scheduler_client.daemon", "--config", str(toml))
    assert out.returncode == 2 and "unknown option 'max_active_request'" in out.stderr
    out = run_cmd("scheduler_client.daemon", "--max-active-requests", "0")
    assert out.returncode == 2 and "--max-active-requests must be >= 1" in out.stderr
    out = run_cmd(
        "scheduler_client.daemon",
        "--model",
        str(tmp_path / "no-model"),
        "--device",
        "cpu",
        "--port",
        "0",
    )
    assert out.returncode == 3, out.stderr[-2000:]
    assert "no worker: worker process" in out.stderr and "exited with code 3" in out.stderr


def test_worker_exits_1_on_a_fatal_error(tmp_path: Path, model: Path) -> None:
    """A real fatal error in the step loop: rank 1 of a tensor-parallel worker is killed, rank 0's
    next broadcast fails. The scheduler hears it first (fatal=True), then rank 0 exits 1."""
    addr = f"ipc://{tmp_path}/tp.sock"
    log = tmp_path / "w.log"
    with open(log, "wb") as err:
        worker = start_worker(
            model, addr, "--tensor-parallel-size", "2", "--max-model-len", "128", stderr=err
        )
    e = None
    try:
        e = Engine(
            EngineConfig(
                worker_addr=addr, handshake_timeout_s=180, step_timeout_s=60, max_worker_restarts=0
            )
        )
        req = e.add_request("go", max_tokens=100, ignore_eos=True)
        e.step()
        ranks = subprocess.run(
            ["pgrep", "-P", str(worker.pid)], capture_output=True, text=True, timeout=10
        ).stdout.split()
        assert len(ranks) == 1, ranks
        os.kill(int(ranks[0]), signal.SIGKILL)
        with pytest.raises(WorkerDied, match="worker failed: fatal: "):
            for _ in range(1000):
                e.step()
        assert worker.wait(timeout=60) == 1
        assert req.finish_reason == "error" and "worker died" in (req.error or "")
        assert "fatal error in the step loop" in log.read_text()
    finally:
        if e is not None:
            e.close()
        worker.kill()
        worker.wait(timeout=30)


# -- a token the grammar rejects at commit (the scheduler on its own, real llguidance) -----------


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> TokenizerInfo:
    return TokenizerInfo(str(model))


def sampled(step_id: int, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """What a worker would return: ``tokens`` sampled per request, no drafts."""
    return ModelRunnerOutput(
        step_id=step_id,
        req_ids=list(tokens),
        num_sampled=np.array([len(t) for t in tokens.values()], np.int32),
        sampled_token_ids=np.array([t for ts in tokens.values() for t in ts], np.int32),
        num_draft_tokens=np.zeros(len(tokens), np.int32),
        num_accepted=np.zeros(len(tokens), np.int32),
    )


def test_a_token_the_grammar_rejects_ends_that_request_alone(tokenizer: TokenizerInfo) -> None:
    """The worker samples a token the request's grammar forbids (it could only do so by ignoring
    the bitmask): that request ends with an error naming the token, its output so far is kept,
    the worker is told to drop it, and the other request in the batch runs on."""
    limits = WorkerLimits(
        vocab_size=BYTE_VOCAB,
        eos_token_ids=(EOS_ID,),
        max_model_len=64,
        max_num_speculative_tokens=0,
        max_num_seqs=4,
    )
    grammar = make_backend("llguidance", tokenizer.json_text, BYTE_VOCAB, (EOS_ID,))
    s = Scheduler(SchedulerConfig(), limits, tokenizer, grammar)
    (a, b, c, n, q, y) = (tokenizer.encode(ch)[0] for ch in "abcnqy")
    choice = Request(
        "choice",
        tokenizer.encode("pick"),
        SamplingParams(max_tokens=10),
        0,
        structured=StructuredSpec("choice", ["yes", "no"]),
    )
    free = Request("free", tokenizer.encode("go"), SamplingParams(max_tokens=3), 0)
    s.add(choice)
    s.add(free)
    step = s.schedule()
    assert step is not None and step.structured_req_ids == ["choice"]
    # the bitmask the worker was sent allows only the first letters of "yes" and "no"
    row = step.grammar_bitmask[0]
    allowed = [t for t in range(BYTE_VOCAB) if (row[t // 32] >> (t % 32)) & 1]
    assert allowed == sorted([n, y])
    assert s.update(sampled(0, {"choice": [y], "free": [a]})) == []
    step = s.schedule()
    assert step is not None
    done = s.update(sampled(1, {"choice": [q], "free": [b]}))  # "yq": not yes/no
    assert done == [choice]
    assert choice.finish_reason == "error" and choice.output_ids == [y]
    assert choice.text == "y"
    assert (
        choice.error == f"the grammar rejected sampled token {q} ('q'); the output so far is kept"
    )
    assert not free.finished and free.output_ids == [a, b]
    step = s.schedule()
    assert step is not None
    assert step.req_ids == ["free"] and step.aborted_req_ids == ["choice"]
    assert s.update(sampled(2, {"free": [c]})) == [free]
    assert free.finish_reason == "length" and free.error is None and free.text == "abc"
