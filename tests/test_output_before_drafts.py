"""The worker sends a step's output before its drafter runs: the scheduler commits the step's
tokens (detokenizes, streams, advances grammars) while the drafts are made, and in sync mode that
turnaround no longer adds to a drafting step. Its ``DraftTokenIds`` follows; ``drafts_follow`` is
known before the drafter runs (a request with a width, and a drafter), so a width whose lookup
finds nothing still sends one, with zero drafts for it, and a worker without a drafter sends
none."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq

from protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    DraftTokenIds,
    ModelRunnerOutput,
    NewRequest,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    Shutdown,
    TransportConfig,
    WorkerError,
    WorkerReady,
    connect_dealer,
)
from protocol.transport import Channel, bind_router
from scheduler_client.engine import Engine, EngineConfig
from scheduler_client.engine_loop import Done, EngineLoop, Event, Stream
from scheduler_client.scheduler import SchedulerConfig
from scheduler_client.worker_client import WorkerClient, WorkerDied
from tests.models import BYTE_MODEL_SEED, save_byte_model, save_tiny
from tests.test_worker_daemon import step
from worker.config import parse_args
from worker.runner import LaunchedStep, ModelRunner
from worker.service import WorkerLoop, build_runner

WAIT_S = 20.0
REPEATS = [5, 6, 7, 5, 6, 7, 5, 6]
UNIQUE = [9, 14, 21, 30, 41, 8, 3]


STEPS = [
    step(
        0,
        [
            NewRequest("r", np.array(REPEATS, np.int32), SamplingParams(), 3),
            NewRequest("u", np.array(UNIQUE, np.int32), SamplingParams(), 3),
        ],
        ["r", "u"],
        [len(REPEATS), len(UNIQUE)],
    ),
    step(1, [], ["u"], [1]),
]


@contextmanager
def worker_loop(
    model: Path, ipc_addr: str, *args: str, fail_to_peer: bool = False
) -> Iterator[ModelRunner]:
    """A ``WorkerLoop`` on a thread of this process, bound on ``ipc_addr``; yields its runner.
    ``fail_to_peer``: an exception in the loop goes to the peer as a fatal ``WorkerError``, as
    ``worker.service.serve`` sends it."""
    cfg = parse_args(
        [
            *("--model", str(model), "--device", "cpu", *args),
            *("--max-num-seqs", "2", "--max-model-len", "64"),
        ]
    )
    runner, ready = build_runner(cfg)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = bind_router(ctx, ipc_addr, TransportConfig())
    loop = WorkerLoop(router, runner, ready)

    def serve() -> None:
        try:
            loop.serve()
        except Exception as e:
            if not fail_to_peer or loop.peer is None:
                raise
            loop.reply(loop.peer, WorkerError(code="fatal", message=repr(e), fatal=True))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        loop.stopping = True
        thread.join(timeout=30)
        router.close()
        ctx.term()


@contextmanager
def serving(model: Path, ipc_addr: str, *args: str) -> Iterator[tuple[ModelRunner, Channel]]:
    """``worker_loop``, and a scheduler's channel that said hello."""
    with worker_loop(model, ipc_addr, *args) as runner:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = connect_dealer(ctx, ipc_addr, TransportConfig(send_timeout_ms=30_000))
        try:
            dealer.send(SchedulerHello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "order"))
            hello = dealer.recv(30_000)
            assert hello is not None and isinstance(hello[1], WorkerReady)
            yield runner, dealer
        finally:
            dealer.send(Shutdown(reason="test over"))
            dealer.close()
            ctx.term()


def _output(dealer: Channel, sched: SchedulerOutput) -> ModelRunnerOutput:
    dealer.send(sched)
    out = dealer.recv(30_000)
    assert out is not None and isinstance(out[1], ModelRunnerOutput), out
    assert out[1].step_id == sched.step_id
    return out[1]


def test_the_output_reaches_the_scheduler_before_the_drafter_runs(
    tmp_path: Path, ipc_addr: str
) -> None:
    model = save_tiny("llama", 11, tmp_path / "tiny")
    got_output = threading.Event()
    seen: list[bool] = []  # per proposal: had the scheduler read the step's output by then?
    with serving(model, ipc_addr, "--drafter", "ngram", "--num-speculative-tokens", "3") as (
        runner,
        dealer,
    ):
        propose_after = runner.propose_after

        def watched(step: LaunchedStep) -> None:
            seen.append(got_output.wait(WAIT_S))
            propose_after(step)

        runner.propose_after = watched  # type: ignore[method-assign]
        try:
            for sched in STEPS:
                got_output.clear()
                out = _output(dealer, sched)
                got_output.set()
                assert out.drafts_follow
                drafts = dealer.recv(30_000)
                assert drafts is not None and isinstance(drafts[1], DraftTokenIds), drafts
                assert drafts[1].step_id == sched.step_id
                assert drafts[1].req_ids == (["r", "u"] if sched.step_id == 0 else ["u"])
        finally:
            got_output.set()
    assert seen == [True, True], "the drafter ran before the step's output was sent"


def test_a_worker_without_a_drafter_sends_no_drafts(tmp_path: Path, ipc_addr: str) -> None:
    """Requests keep their widths without a drafter (the scheduler's grammar-forced drafts), and
    nothing is proposed for them: no ``DraftTokenIds`` after any output."""
    model = save_tiny("llama", 11, tmp_path / "tiny")
    with serving(model, ipc_addr, "--drafter", "none", "--num-speculative-tokens", "3") as (
        _,
        dealer,
    ):
        for sched in STEPS:
            assert not _output(dealer, sched).drafts_follow
        assert dealer.recv(500) is None, "a message followed the last output"


def test_a_drafter_that_fails_after_the_output_is_heard_at_once(
    tmp_path: Path, ipc_addr: str
) -> None:
    """The drafter runs after the output went: a worker that fails there sends its fatal error
    while the scheduler waits for the drafts, which raises it at once, naming it (a wait that
    dropped every other message heard of it only at the step timeout, without the reason)."""
    model = save_tiny("llama", 11, tmp_path / "tiny")
    with worker_loop(
        model, ipc_addr, "--drafter", "ngram", "--num-speculative-tokens", "3", fail_to_peer=True
    ) as runner:

        def fail(_step: LaunchedStep) -> None:
            raise RuntimeError("the drafter ran out of memory")

        runner.propose_after = fail  # type: ignore[method-assign]
        client = WorkerClient(ipc_addr, step_timeout_s=60.0)
        try:
            client.handshake(30)
            client.send_step(STEPS[0])
            out = client.receive(STEPS[0], with_drafts=False).output
            assert out.drafts_follow
            t0 = time.monotonic()
            with pytest.raises(WorkerDied, match="the drafter ran out of memory"):
                client.receive_drafts(STEPS[0], out)
            assert time.monotonic() - t0 < 10
        finally:
            client.close()


def test_a_step_stays_outstanding_until_its_drafts_are_in(tmp_path: Path, ipc_addr: str) -> None:
    """In sync mode nothing else is in flight while the worker drafts: ``health`` reports a
    drafter that hangs as a stall (past ``stall_threshold_s``), as it did when the drafts came
    before the output."""
    model = save_byte_model("llama", BYTE_MODEL_SEED, tmp_path / "tiny")  # a tokenizer
    with worker_loop(
        model, ipc_addr, "--drafter", "ngram", "--num-speculative-tokens", "3"
    ) as runner:
        hang = threading.Event()
        propose_after = runner.propose_after

        def slow(step: LaunchedStep) -> None:
            if hang.is_set() and runner.will_propose(step):
                time.sleep(3.0)
            propose_after(step)

        runner.propose_after = slow  # type: ignore[method-assign]
        engine = Engine(
            EngineConfig(
                worker_addr=ipc_addr,
                stall_threshold_s=0.5,
                step_timeout_s=60.0,
                scheduler=SchedulerConfig(adaptive_speculation=False),
            )
        )
        try:
            loop = EngineLoop(engine)
            engine.add_request(REPEATS, max_tokens=6, ignore_eos=True)
            engine.step()
            hang.set()
            stepping = threading.Thread(target=engine.step)
            stepping.start()
            seen = set()
            while stepping.is_alive():
                seen.add(loop.health())
                time.sleep(0.1)
            assert "stalled" in seen, seen
            hang.clear()
            engine.run_until_done()
        finally:
            engine.close()


class _Answered(Stream):
    """A reader that notes when its request's ``Done`` is put."""

    def __init__(self, loop: EngineLoop) -> None:
        super().__init__(loop)
        self.done = threading.Event()

    def put(self, event: Event) -> None:
        super().put(event)
        if isinstance(event, Done):
            self.done.set()


def test_a_finished_request_is_answered_while_the_worker_drafts(
    tmp_path: Path, ipc_addr: str
) -> None:
    """A request that ends in a step is answered once the step's output is committed, while the
    worker still drafts for the others: its reader (a closed-loop client about to send its next
    request) does not wait out a drafting it has no part in. The drafting after each step that
    ran the short request waits up to 2 s for its answer; before, the answer came only after the
    drafts were read, so the drafting after its last step never saw it come."""
    model = save_byte_model("llama", BYTE_MODEL_SEED, tmp_path / "tiny")
    with worker_loop(
        model, ipc_addr, "--drafter", "ngram", "--num-speculative-tokens", "3"
    ) as runner:
        engine = Engine(
            EngineConfig(
                worker_addr=ipc_addr,
                step_timeout_s=60.0,
                scheduler=SchedulerConfig(adaptive_speculation=False),
            )
        )
        loop = EngineLoop(engine)
        short = _Answered(loop)
        # per drafting: whether its step ran the short request, and whether that request was
        # answered by the drafting's end
        seen: list[tuple[bool, bool]] = []
        propose_after = runner.propose_after

        def watched(step: LaunchedStep) -> None:
            if runner.will_propose(step):
                ran = short.req_id in step.batch.req_ids
                seen.append((ran, short.done.is_set() or (ran and short.done.wait(2.0))))
            propose_after(step)

        runner.propose_after = watched  # type: ignore[method-assign]
        thread = threading.Thread(target=loop.run, name="engine")
        thread.start()
        try:
            long = loop.submit({"prompt": REPEATS, "max_tokens": 12, "ignore_eos": True})
            loop.submit_stream({"prompt": UNIQUE, "max_tokens": 3, "ignore_eos": True}, short)
            for stream in (short, long):
                while not isinstance(stream.get(timeout_s=60), Done):
                    pass
        finally:
            loop.drain(0)
            thread.join(timeout=60)
            engine.close()
    last = max(i for i, (ran, _) in enumerate(seen) if ran)  # the step it ended in
    assert seen[last][1], seen
