"""The scheduler's running-request cap and token budget come from the worker's handshake unless
the user sets them; a setting above the worker's capacity is refused (real worker process)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_client import Engine, EngineConfig, SchedulerConfig
from scheduler_client.daemon import parse_args as scheduler_args
from scheduler_client.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    WorkerLimits,
    resolve_limits,
)
from tests.procs import start_worker

WORKER_SEQS, WORKER_TOKENS = 24, 600


@pytest.fixture(scope="module")
def worker_addr(target_dir: Path) -> Iterator[str]:
    """One worker with 24 KV slots and a 600-token step budget, shared by the tests here (each
    new scheduler's hello drops the previous one's requests)."""
    with tempfile.TemporaryDirectory(prefix="specd-test-") as d:
        addr = f"ipc://{os.path.join(d, 'sock')}"
        proc = start_worker(
            target_dir,
            addr,
            "--max-num-seqs",
            str(WORKER_SEQS),
            "--max-num-batched-tokens",
            str(WORKER_TOKENS),
            "--log-level",
            "WARNING",
        )
        try:
            yield addr
        finally:
            proc.kill()
            proc.wait(timeout=30)


def connect(addr: str, scheduler: SchedulerConfig) -> Engine:
    return Engine(
        EngineConfig(
            worker_addr=addr, scheduler=scheduler, step_timeout_s=60, max_worker_restarts=0
        )
    )


def run_counting(engine: Engine, num: int) -> int:
    """Run ``num`` requests to the end; the most that ran at once (the scheduler's books)."""
    reqs = [
        engine.add_request(list(b"abc %d" % i), max_tokens=6, ignore_eos=True) for i in range(num)
    ]
    most = 0
    while engine.scheduler.has_work():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert [r.error for r in reqs] == [None] * num
    assert all(len(r.output_ids) == 6 for r in reqs)
    return most


def test_unset_caps_take_the_workers(worker_addr: str) -> None:
    with connect(worker_addr, SchedulerConfig()) as engine:
        assert engine.ready.max_num_seqs == WORKER_SEQS
        assert engine.ready.max_num_batched_tokens == WORKER_TOKENS
        assert engine.scheduler.max_num_seqs == WORKER_SEQS
        assert engine.scheduler.max_num_batched_tokens == WORKER_TOKENS
        # more requests than slots: exactly the worker's 24 run at once, not the old default 16
        assert run_counting(engine, 30) == WORKER_SEQS


def test_explicit_caps_win(worker_addr: str) -> None:
    with connect(worker_addr, SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64)) as e:
        assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (5, 64)
        assert run_counting(e, 12) == 5


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SchedulerConfig(max_num_seqs=WORKER_SEQS + 1), "max_num_seqs 25 is above the worker's 24"),
        (
            SchedulerConfig(max_num_batched_tokens=WORKER_TOKENS + 1),
            "max_num_batched_tokens 601 is above the worker's 600",
        ),
    ],
)
def test_caps_above_the_workers_are_refused(
    worker_addr: str, config: SchedulerConfig, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        connect(worker_addr, config)


def test_the_worker_refuses_a_step_above_its_budget(worker_addr: str) -> None:
    """A scheduler that ignores the budget (as a minor-1 scheduler with a larger one would) gets
    that step refused by the worker, with the flag to change named."""
    with connect(worker_addr, SchedulerConfig(max_prefill_chunk=1000)) as engine:
        engine.scheduler.max_num_batched_tokens = 5000  # what an old scheduler would do
        req = engine.add_request(list(b"x" * 700), max_tokens=2)
        engine.run_until_done()
        assert req.error is not None
        assert "700 tokens, above this worker's --max-num-batched-tokens 600" in req.error


def test_a_minor_1_worker_leaves_the_default_budget() -> None:
    old = WorkerLimits(
        vocab_size=100,
        eos_token_ids=(2,),
        max_model_len=64,
        max_num_speculative_tokens=4,
        max_num_seqs=8,
    )
    assert resolve_limits(SchedulerConfig(), old) == (8, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    # with no budget from the worker, the user's stands whatever its size
    assert resolve_limits(SchedulerConfig(max_num_batched_tokens=8192), old) == (8, 8192)


def test_scheduler_flags_are_unset_unless_given(tmp_path: Path) -> None:
    cfg = scheduler_args(["--model", str(tmp_path)]).engine
    assert cfg.scheduler.max_num_seqs is None and cfg.scheduler.max_num_batched_tokens is None
    assert cfg.worker_max_num_seqs is None and cfg.worker_max_num_batched_tokens is None
    cfg = scheduler_args(["--max-num-seqs", "24", "--max-num-batched-tokens", "600"]).engine
    assert (cfg.scheduler.max_num_seqs, cfg.worker_max_num_seqs) == (24, 24)
    assert (cfg.scheduler.max_num_batched_tokens, cfg.worker_max_num_batched_tokens) == (600, 600)


def test_worker_budget_below_its_slots_fails_at_start(target_dir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.daemon",
            "--model",
            str(target_dir),
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "--max-num-batched-tokens must be >= --max-num-seqs" in out.stderr
