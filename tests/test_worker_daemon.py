"""specd-worker as a real process, driven over ipc:// by a small client."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from protocol import (
    PROTOCOL_MAJOR,
    DraftTokenIds,
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
from protocol.transport import Channel
from tests.models import greedy_reference, reference_copy, save_tiny, tiny_model
from tests.procs import reap, start_worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", 11, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def worker(model_dir: Path, ipc_addr: str) -> Iterator[tuple[subprocess.Popen[bytes], Channel]]:
    proc = start_worker(
        str(model_dir),
        ipc_addr,
        "--drafter",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "64",
    )
    try:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        chan = connect_dealer(ctx, ipc_addr, TransportConfig(send_timeout_ms=60_000))
        try:
            yield proc, chan
        finally:
            chan.close()
            ctx.term()
    finally:
        reap(proc)


def recv(chan: Channel, timeout_ms: int = 60_000) -> object:
    got = chan.recv(timeout_ms)
    assert got is not None, "worker did not answer in time"
    return got[1]


def step(
    step_id: int,
    new: list[NewRequest],
    ids: list[str],
    counts: list[int],
    widths: list[int] | None = None,
) -> SchedulerOutput:
    widths = widths or [0] * len(ids)
    return SchedulerOutput(
        step_id=step_id,
        new_requests=new,
        req_ids=ids,
        num_scheduled_tokens=np.array(counts, np.int32),
        num_draft_tokens=np.array(widths, np.int32),
        draft_token_ids=np.full(sum(widths), -1, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )


def test_handshake_bad_message_then_good_steps(
    worker: tuple[subprocess.Popen[bytes], Channel], model_dir: Path
) -> None:
    proc, chan = worker
    chan.send(SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=0, scheduler_id="t"))
    ready = recv(chan, timeout_ms=120_000)
    assert isinstance(ready, WorkerReady)
    assert ready.vocab_size == 128 and ready.max_num_seqs == 4 and ready.drafter == "ngram"
    assert ready.kv_capacity_tokens == 4 * 64

    # garbage: answered with a typed error, the worker keeps serving
    chan.sock.send_multipart([b"\x93\x01\x00\xa5bogus"])
    err = recv(chan)
    assert isinstance(err, WorkerError) and not err.fatal
    assert (err.code, err.message) == ("bad_field", "bad_field: Expected `array`, got `str`")

    # a step for a request the worker never saw: refused, named
    chan.send(step(0, [], ["ghost"], [1]))
    err = recv(chan)
    assert isinstance(err, WorkerError) and err.code == "unknown_request" and err.req_id == "ghost"

    # a prompt longer than the model: refused for that request only
    too_long = NewRequest("big", np.arange(100, dtype=np.int32) % 100, SamplingParams(), 0)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ok = NewRequest("a", np.array(prompt, np.int32), SamplingParams(), 3)
    chan.send(step(1, [too_long, ok], ["big", "a"], [100, len(prompt)]))
    err = recv(chan)
    assert isinstance(err, WorkerError) and err.code == "prompt_too_long" and err.req_id == "big"
    out = recv(chan)
    assert isinstance(out, ModelRunnerOutput) and out.req_ids == ["a"]
    drafts = recv(chan)
    assert isinstance(drafts, DraftTokenIds) and drafts.step_id == 1
    assert drafts.num_committed_tokens.tolist() == [len(prompt) + 1]

    # decode until 10 tokens, verifying whatever the worker drafted
    tokens = out.sampled_token_ids.tolist()
    width = int(drafts.num_draft_tokens[0])
    sid = 2
    while len(tokens) < 10:
        chan.send(step(sid, [], ["a"], [1 + width], [width]))
        out = recv(chan)
        assert isinstance(out, ModelRunnerOutput), out
        tokens += out.sampled_token_ids.tolist()
        drafts = recv(chan)
        assert isinstance(drafts, DraftTokenIds) and drafts.step_id == sid
        width = int(drafts.num_draft_tokens[0])
        sid += 1
    ref = reference_copy(tiny_model("llama", 11))
    assert tokens[:10] == greedy_reference(ref, prompt, 10)

    # a width the worker never proposed is an error naming both numbers
    chan.send(step(sid, [], ["a"], [1 + width + 1], [width + 1]))
    err = recv(chan)
    assert isinstance(err, WorkerError) and err.code == "width_mismatch"
    assert f"scheduled {width + 1} drafts" in err.message and f"proposed {width}" in err.message

    chan.send(Ping(seq=42))
    pong = recv(chan)
    assert isinstance(pong, Pong) and pong.seq == 42 and pong.num_steps >= sid - 1

    chan.send(Shutdown(reason="test over"))
    assert proc.wait(timeout=30) == 0


def test_a_step_without_drafts_sends_no_draft_message_to_a_minor_6_scheduler(
    worker: tuple[subprocess.Popen[bytes], Channel],
) -> None:
    """Protocol minor 6: after an output whose requests are proposed no draft (a width of zero,
    or the proposals capped at zero) the worker sends no DraftTokenIds and says so
    (``drafts_follow``); one with drafts is followed by its message (and so is one whose lookup
    found nothing: the output goes before the drafter runs, tests/test_output_before_drafts.py). A scheduler of minor 5
    still gets a message after every output that samples (the handshake test above, minor 0)."""
    proc, chan = worker
    chan.send(SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=6, scheduler_id="m6"))
    assert isinstance(recv(chan, timeout_ms=120_000), WorkerReady)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # repeats: prompt lookup finds drafts
    plain = NewRequest("k0", np.array(prompt, np.int32), SamplingParams(), 0)
    spec = NewRequest("k3", np.array(prompt, np.int32), SamplingParams(), 3)

    def answer(msg: SchedulerOutput) -> tuple[ModelRunnerOutput, DraftTokenIds | None]:
        chan.send(msg)
        out = recv(chan)
        assert isinstance(out, ModelRunnerOutput) and out.step_id == msg.step_id, out
        if not out.drafts_follow:
            return out, None
        drafts = recv(chan)
        assert isinstance(drafts, DraftTokenIds) and drafts.step_id == msg.step_id, drafts
        return out, drafts

    # a request without a width: no message
    out, drafts = answer(step(0, [plain], ["k0"], [len(prompt)]))
    assert drafts is None and out.num_sampled.tolist() == [1]
    # one with a width whose proposals the scheduler caps at zero: no message
    capped = msgspec.structs.replace(
        step(1, [spec], ["k0", "k3"], [1, len(prompt)]), max_draft_proposals=0
    )
    out, drafts = answer(capped)
    assert drafts is None and out.num_sampled.tolist() == [1, 1]
    # the same request proposing: its drafts follow, every sampler listed
    out, drafts = answer(step(2, [], ["k0", "k3"], [1, 1]))
    assert drafts is not None and drafts.req_ids == ["k0", "k3"]
    assert drafts.num_draft_tokens[0] == 0 and drafts.num_draft_tokens[1] > 0
    # the next message the worker sends answers the next step: nothing was left queued
    chan.send(Ping(seq=7))
    pong = recv(chan)
    assert isinstance(pong, Pong) and pong.seq == 7
    chan.send(Shutdown(reason="test over"))
    assert proc.wait(timeout=30) == 0


def test_bad_flags_exit_2(model_dir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.daemon",
            "--model",
            str(model_dir),
            "--drafter",
            "draft_model",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--draft-model" in out.stderr
