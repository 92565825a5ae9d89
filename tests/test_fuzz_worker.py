"""Fuzzing the worker's socket: malformed and random frames never crash it, memory stays bounded,
and a good step works afterwards. ``SPECD_FUZZ_EXAMPLES`` sets the count (10,000 in the
benchmark run, fewer in `make test`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    PROTOCOL_MAJOR,
    ModelRunnerOutput,
    NewRequest,
    Ping,
    Pong,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    Shutdown,
    TransportConfig,
    WorkerError,
    WorkerReady,
    connect_dealer,
)
from protocol.codec import Codec
from protocol.transport import Channel
from tests.models import save_tiny
from tests.procs import start_worker
from tests.wire_samples import all_messages

EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "2000"))
SAMPLES = [m for m in all_messages() if not isinstance(m, Shutdown)]
TAGS = ["hello", "ready", "sched", "out", "drafts", "ping", "pong", "error", "bogus", ""]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=20,
)


@st.composite
def steps(draw: st.DrawFn) -> list[bytes]:
    """Well-formed SchedulerOutputs with hostile contents: ids outside the vocabulary, NaN and
    negative sampling values, huge seeds, widths and counts that disagree."""
    n_new = draw(st.integers(0, 3))
    ints = st.integers(-(2**40), 2**40)
    new = [
        NewRequest(
            req_id=draw(st.sampled_from(["a", "b", "c", ""])),
            prompt_token_ids=np.array(draw(st.lists(st.integers(-5, 300), max_size=70)), np.int32),
            sampling=SamplingParams(
                temperature=draw(st.floats()),
                top_p=draw(st.floats()),
                top_k=draw(ints),
                seed=draw(st.none() | st.integers(-(2**63), 2**64 - 1)),
                max_tokens=draw(ints),
            ),
            num_speculative_tokens=draw(st.integers(-3, 40)),
            structured=draw(st.booleans()),
        )
        for _ in range(n_new)
    ]
    coherent = draw(st.booleans())
    if coherent:  # schedule exactly the new prompts, so the step runs
        ids = [r.req_id for r in new]
        counts = [len(r.prompt_token_ids) for r in new]
        widths = [0] * len(new)
    else:
        ids = draw(st.lists(st.sampled_from(["a", "b", "c", "zz"]), max_size=4))
        counts = draw(st.lists(st.integers(-3, 80), min_size=len(ids), max_size=len(ids)))
        widths = draw(st.lists(st.integers(-2, 6), min_size=len(ids), max_size=len(ids)))
    drafts = [] if coherent else draw(st.lists(st.integers(-3, 300), max_size=12))
    rows = 0 if coherent else draw(st.integers(0, 4))
    msg = SchedulerOutput(
        step_id=draw(ints),
        new_requests=new,
        req_ids=ids,
        num_scheduled_tokens=np.array(counts, np.int32),
        num_draft_tokens=np.array(widths, np.int32),
        draft_token_ids=np.array(drafts, np.int32),
        finished_req_ids=draw(st.lists(st.sampled_from(["a", "b", "q"]), max_size=2)),
        aborted_req_ids=[],
        structured_req_ids=[]
        if coherent
        else draw(st.lists(st.sampled_from(["a", "b"]), max_size=2)),
        cu_bitmask_rows=None
        if coherent
        else np.array(draw(st.lists(st.integers(-1, 6), max_size=3)), np.int32),
        grammar_bitmask=np.full((rows, 4), -1, np.int32) if rows else None,
    )
    return [bytes(f) for f in Codec().encode(msg)]


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.integers(0, 4))
    if kind == 4:
        return draw(steps())
    if kind == 0:  # raw garbage
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
    if kind == 1:  # a valid header, a random body under a (mostly) real tag
        body = [draw(st.sampled_from(TAGS)), *draw(st.lists(values, max_size=12))]
        major = draw(st.sampled_from([PROTOCOL_MAJOR, PROTOCOL_MAJOR, 0, PROTOCOL_MAJOR + 1]))
        extra = draw(st.lists(st.binary(max_size=64), max_size=3))
        return [msgspec.msgpack.encode([major, 0, body]), *extra]
    # a real message, then mutated: bit flips, truncation, frames dropped, duplicated or swapped
    msg = draw(st.sampled_from(SAMPLES))
    out = [bytes(f) for f in Codec().encode(msg)]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 3))
        i = draw(st.integers(0, len(out) - 1))
        if op == 0 and out[i]:
            pos = draw(st.integers(0, len(out[i]) - 1))
            b = bytearray(out[i])
            b[pos] ^= 1 << draw(st.integers(0, 7))
            out[i] = bytes(b)
        elif op == 1:
            out[i] = out[i][: draw(st.integers(0, len(out[i])))]
        elif op == 2 and len(out) > 1:
            out.pop(i)
        else:
            out.insert(i, out[draw(st.integers(0, len(out) - 1))])
    return out or [b""]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], Channel]]:
    model = save_tiny("llama", 3, tmp_path_factory.mktemp("fuzz-model"))
    addr = f"ipc://{tmp_path_factory.mktemp('fuzz-sock')}/w.sock"
    proc = start_worker(
        str(model), addr, "--max-num-seqs", "4", "--max-model-len", "64", "--log-level", "ERROR"
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = connect_dealer(ctx, addr, TransportConfig(send_timeout_ms=10_000))
    chan.send(SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=0, scheduler_id="fuzz"))
    got = chan.recv(timeout_ms=120_000)
    assert got is not None and isinstance(got[1], WorkerReady)
    try:
        yield proc, chan
    finally:
        chan.close()
        ctx.term()
        proc.kill()
        proc.wait(timeout=30)


def drain(chan: Channel) -> int:
    n = 0
    while chan.poll(0):
        chan.recv_frames(0)
        n += 1
    return n


def test_fuzzed_frames_never_crash_the_worker(
    worker: tuple[subprocess.Popen[bytes], Channel],
) -> None:
    proc, chan = worker
    rss_before = rss_kib(proc.pid)
    sent = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frames())
    def send_one(fs: list[bytes]) -> None:
        nonlocal sent
        chan.sock.send_multipart(fs)
        sent += 1
        if sent % 64 == 0:
            drain(chan)
            assert proc.poll() is None, f"worker died after {sent} fuzzed messages"

    send_one()
    # everything sent was handled: a ping queued behind it comes back
    chan.send(Ping(seq=77))
    while True:
        got = chan.recv(timeout_ms=120_000)
        assert got is not None, "worker stopped answering"
        if isinstance(got[1], Pong) and got[1].seq == 77:
            break
    assert proc.poll() is None
    assert sent >= EXAMPLES
    growth_mib = (rss_kib(proc.pid) - rss_before) / 1024
    assert growth_mib < 256, f"RSS grew {growth_mib:.0f} MiB over {sent} messages"

    # and it still serves a good step (after re-claiming the session with a hello)
    chan.send(SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=0, scheduler_id="fuzz"))
    drain_until = chan.recv(timeout_ms=30_000)
    while drain_until is not None and not isinstance(drain_until[1], WorkerReady):
        drain_until = chan.recv(timeout_ms=30_000)
    req = NewRequest("after-fuzz", np.array([5, 6, 7], np.int32), SamplingParams(), 0)
    chan.send(
        SchedulerOutput(
            step_id=10**9,
            new_requests=[req],
            req_ids=["after-fuzz"],
            num_scheduled_tokens=np.array([3], np.int32),
            num_draft_tokens=np.array([0], np.int32),
            draft_token_ids=np.zeros(0, np.int32),
            finished_req_ids=[],
            aborted_req_ids=[],
            structured_req_ids=[],
        )
    )
    while True:
        got = chan.recv(timeout_ms=30_000)
        assert got is not None
        msg = got[1]
        if isinstance(msg, ModelRunnerOutput) and msg.step_id == 10**9:
            assert msg.num_sampled.tolist() == [1]
            break
        assert not (isinstance(msg, WorkerError) and msg.step_id == 10**9), msg
