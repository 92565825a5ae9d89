"""The worker sends a step's output before its drafter runs: the scheduler commits the step's
tokens (detokenizes, streams, advances grammars) while the drafts are made, and in sync mode that
turnaround no longer adds to a drafting step. Its ``DraftTokenIds`` follows; ``drafts_follow`` is
known before the drafter runs (a request with a width), so a width whose lookup finds nothing
still sends one, with zero drafts for it."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
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
    WorkerReady,
    connect_dealer,
)
from protocol.transport import bind_router
from tests.models import save_tiny
from worker.config import parse_args
from worker.runner import LaunchedStep
from worker.service import WorkerLoop, build_runner

WAIT_S = 20.0


def _step(
    step_id: int, new: list[NewRequest], ids: list[str], counts: list[int]
) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        new_requests=new,
        req_ids=ids,
        num_scheduled_tokens=np.array(counts, np.int32),
        num_draft_tokens=np.zeros(len(ids), np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )


def test_the_output_reaches_the_scheduler_before_the_drafter_runs(
    tmp_path: Path, ipc_addr: str
) -> None:
    model = save_tiny("llama", 11, tmp_path / "tiny")
    cfg = parse_args(
        [
            *("--model", str(model), "--drafter", "ngram", "--num-speculative-tokens", "3"),
            *("--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "64"),
        ]
    )
    runner, ready = build_runner(cfg)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = bind_router(ctx, ipc_addr, TransportConfig())
    dealer = connect_dealer(ctx, ipc_addr, TransportConfig(send_timeout_ms=30_000))
    loop = WorkerLoop(router, runner, ready)
    got_output = threading.Event()
    seen: list[bool] = []  # per proposal: had the scheduler read the step's output by then?
    propose_after = runner.propose_after

    def watched(step: LaunchedStep) -> None:
        seen.append(got_output.wait(WAIT_S))
        propose_after(step)

    runner.propose_after = watched  # type: ignore[method-assign]
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    try:
        dealer.send(SchedulerHello(PROTOCOL_MAJOR, PROTOCOL_MINOR, "order"))
        hello = dealer.recv(30_000)
        assert hello is not None and isinstance(hello[1], WorkerReady)
        repeats = [5, 6, 7, 5, 6, 7, 5, 6]
        unique = [9, 14, 21, 30, 41, 8, 3]
        for step_id, sched in enumerate(
            [
                _step(
                    0,
                    [
                        NewRequest("r", np.array(repeats, np.int32), SamplingParams(), 3),
                        NewRequest("u", np.array(unique, np.int32), SamplingParams(), 3),
                    ],
                    ["r", "u"],
                    [len(repeats), len(unique)],
                ),
                _step(1, [], ["u"], [1]),
            ]
        ):
            got_output.clear()
            dealer.send(sched)
            out = dealer.recv(30_000)
            assert out is not None and isinstance(out[1], ModelRunnerOutput), out
            assert out[1].step_id == step_id and out[1].drafts_follow
            got_output.set()
            drafts = dealer.recv(30_000)
            assert drafts is not None and isinstance(drafts[1], DraftTokenIds), drafts
            assert drafts[1].step_id == step_id
            assert drafts[1].req_ids == (["r", "u"] if step_id == 0 else ["u"])
        assert seen == [True, True], "the drafter ran before the step's output was sent"
    finally:
        got_output.set()
        dealer.send(Shutdown(reason="test over"))
        serving.join(timeout=30)
        dealer.close()
        router.close()
        ctx.term()
