"""A tensor-parallel worker: rank 0 talks to the scheduler and broadcasts each step to the others.

``BroadcastRunner`` wraps rank 0's ``ModelRunner``: before it executes a step (or drops every
request) it sends the operation to all ranks, so every rank runs the same step on the same state and
the sharded layers' collectives meet. Steps travel as the wire codec's frames (msgspec, no pickle),
length-prefixed in one uint8 tensor. ``follow`` is the other ranks' whole life: receive, execute,
until rank 0 says stop (or disappears, which ends the collective with an error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from protocol.codec import Codec
from protocol.messages import SchedulerOutput, StepBitmask
from worker.runner import ModelRunner, StepError

log = logging.getLogger("specd.worker")

OP_STEP, OP_RESET, OP_STOP, OP_BITMASK = 1, 2, 3, 4


def _send(op: int, payload: bytes, device: torch.device) -> None:
    head = torch.tensor([op, len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    if payload:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        dist.broadcast(buf, src=0)


def _recv(device: torch.device) -> tuple[int, bytes]:
    head = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    op, n = int(head[0]), int(head[1])
    if not n:
        return op, b""
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return op, bytes(buf.cpu().numpy())


def _pack(frames: list[Any]) -> bytes:
    """Frames as one byte string: count, lengths (uint64), then the frames."""
    parts = [bytes(memoryview(f)) for f in frames]
    lengths = np.asarray([len(p) for p in parts], np.uint64)
    return np.uint64(len(parts)).tobytes() + lengths.tobytes() + b"".join(parts)


def _unpack(data: bytes) -> list[bytes]:
    n = int(np.frombuffer(data[:8], np.uint64)[0])
    lengths = np.frombuffer(data[8 : 8 + 8 * n], np.uint64)
    out, off = [], 8 + 8 * n
    for length in lengths.tolist():
        out.append(data[off : off + length])
        off += length
    return out


class BroadcastRunner:
    """Rank 0's runner: the same interface as ``ModelRunner`` (whatever it does not override is
    the inner runner's), with every state change sent to the other ranks first."""

    def __init__(self, runner: ModelRunner, device: torch.device) -> None:
        self._runner = runner
        self._device = device
        self._codec = Codec()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(
        self,
        sched: SchedulerOutput,
        wait_bitmask: Callable[[int], StepBitmask] | None = None,
    ) -> Any:
        return self._runner.finish(self.launch(sched, wait_bitmask))

    def launch(
        self,
        sched: SchedulerOutput,
        wait_bitmask: Callable[[int], StepBitmask] | None = None,
        *,
        hold: bool = False,
    ) -> Any:
        """The step goes to every rank first. ``hold`` is not taken: every rank runs each step
        to its end, as the followers do."""
        _send(OP_STEP, _pack(self._codec.encode(sched)), self._device)
        relay = None
        if wait_bitmask is not None:
            receive = wait_bitmask

            def relay(step_id: int) -> StepBitmask:
                """Overlap: the deferred rows reach every rank (each verifies and commits)."""
                try:
                    msg = receive(step_id)
                except StepError:
                    _send(OP_BITMASK, b"", self._device)  # the others refuse the step too
                    raise
                _send(OP_BITMASK, _pack(self._codec.encode(msg)), self._device)
                return msg

        return self._runner.launch(sched, relay)

    def reset(self) -> None:
        _send(OP_RESET, b"", self._device)
        self._runner.reset()

    def stop(self) -> None:
        _send(OP_STOP, b"", self._device)


def follow(runner: ModelRunner, device: torch.device) -> int:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
    codec = Codec()
    while True:
        op, payload = _recv(device)
        if op == OP_STOP:
            return 0
        if op == OP_RESET:
            runner.reset()
            continue
        sched = codec.decode(_unpack(payload))
        assert isinstance(sched, SchedulerOutput)

        def rows_from_rank0(step_id: int) -> StepBitmask:
            op, payload = _recv(device)
            if op != OP_BITMASK or not payload:
                raise StepError("bad_step", f"step {step_id}: rank 0 refused it")
            msg = codec.decode(_unpack(payload))
            assert isinstance(msg, StepBitmask)
            return msg

        try:
            runner.execute(sched, rows_from_rank0)
            runner.take_draft_tokens()
        except StepError:
            pass  # rank 0 refuses the same step with the same error and tells the scheduler
