"""Operating the worker: TOML config, JSON logs, health checks, SIGTERM drain."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler_client import Engine, EngineConfig, WorkerDied
from scheduler_client.scheduler import SchedulerConfig
from tests.models import save_byte_model, save_tiny
from tests.procs import logged, reap, start_worker
from worker.config import parse_args


def test_toml_config_with_flags_winning(tmp_path: Path) -> None:
    cfg_file = tmp_path / "worker.toml"
    cfg_file.write_text('model = "m"\nmax-num-seqs = 7\nngram_max = 3\nlog_format = "json"\n')
    cfg = parse_args(["--config", str(cfg_file), "--max-num-seqs", "2"])
    assert (cfg.model, cfg.max_num_seqs, cfg.ngram_max, cfg.log_format) == ("m", 2, 3, "json")
    cfg_file.write_text("max_num_sequences = 7\n")
    with pytest.raises(ValueError, match="unknown option 'max_num_sequences'"):
        parse_args(["--config", str(cfg_file)])


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_health_json_logs_and_sigterm(tmp_path: Path, ipc_addr: str) -> None:
    model = save_tiny("llama", 4, tmp_path / "m")
    log = tmp_path / "w.log"
    with open(log, "wb") as err:
        proc = start_worker(
            str(model), ipc_addr, "--max-model-len", "64", "--log-format", "json", stderr=err
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            out = specd("health", ipc_addr, "--timeout", "2")
            if out.returncode == 0 or time.monotonic() > deadline:
                break
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert report["ok"] is True and report["num_steps"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any("serving on" in entry["msg"] for entry in lines)
        assert any("stopping" in entry["msg"] for entry in lines)
        down = specd("health", ipc_addr, "--timeout", "1")
        assert down.returncode == 1 and json.loads(down.stdout)["ok"] is False
    finally:
        reap(proc)


def test_sigterm_mid_run_is_reported_to_the_scheduler(tmp_path: Path) -> None:
    model = save_byte_model("llama", 5, tmp_path / "m")
    e = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            max_model_len=128,
            max_worker_restarts=0,
            step_timeout_s=60,
        )
    )
    try:
        reqs = [e.add_request("go", max_tokens=100, ignore_eos=True) for _ in range(2)]
        e.step()
        assert e.proc is not None
        e.proc.send_signal(signal.SIGTERM)
        with pytest.raises(WorkerDied) as info:
            while True:
                e.step()
        # the worker says why before it exits, and the reason is read even when its exit is
        # noticed first
        assert (
            str(info.value) == "worker failed: shutting_down: the worker was told to stop (signal)"
        )
        assert e.proc.wait(timeout=30) == 0
        assert all(r.finish_reason == "error" for r in reqs)
    finally:
        e.close()


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def assert_cycles_add_up(trace: list[dict[str, Any]]) -> None:
    """A step's time in a ``--step-trace`` is the cycle from the output before it (the
    scheduler's turnaround included), so consecutive steps' times add up to the wall time
    between their outputs."""
    pairs = [(a, b) for a, b in itertools.pairwise(trace) if b["step"] == a["step"] + 1]
    assert len(pairs) >= 5
    cycle_ms = sum(1000 * (b["t"] - a["t"]) for a, b in pairs)
    assert sum(b["ms"] for _, b in pairs) == pytest.approx(cycle_ms, rel=0.03)


def test_prometheus_endpoints_on_both_sides(tmp_path: Path) -> None:
    model = save_byte_model("llama", 6, tmp_path / "m")
    log = tmp_path / "worker.log"
    cfg = EngineConfig(
        model=str(model),
        device="cpu",
        max_model_len=128,
        step_timeout_s=60,
        worker_args=("--metrics-port", "-1"),  # -1: any free port, logged
        worker_log=str(log),
        metrics_port=-1,
        step_trace=str(tmp_path / "steps.jsonl"),
        # no tuner: every step asks for drafts, so the grammar's forced tokens come on every
        # step (a tuner measuring its no-drafts end, or keeping drafting off, asks for none,
        # and then none are forced either)
        scheduler=SchedulerConfig(adaptive_speculation=False),
    )
    with Engine(cfg) as e:
        reqs = e.generate(
            [{"prompt": "abababababab", "max_tokens": 12, "ignore_eos": True}] * 3
            + [{"prompt": "x", "max_tokens": 40, "structured": {"choice": ["yes"]}}]
        )
        assert all(r.error is None for r in reqs)
        assert e.metrics_port > 0
        worker_port = int(logged(log, r"Prometheus metrics on :(\d+)/metrics").group(1))
        w = scrape(worker_port)
        s = scrape(e.metrics_port)
    with pytest.raises(OSError, match="Connection refused"):  # closed with the engine
        scrape(e.metrics_port)
    assert w["specd_worker_steps_total"] > 0
    assert w["specd_worker_sampled_tokens_total"] >= 36
    assert w["specd_worker_draft_tokens_total"] > 0
    assert w["specd_worker_step_seconds_count"] == w["specd_worker_steps_total"]
    assert 'specd_worker_accepted_per_position_total{position="0"}' in w
    # 16 slots of 128 tokens in blocks of 16: some taken by the last requests, most free
    assert 0 < w["specd_worker_kv_blocks_free"] <= 16 * 8
    assert s["specd_scheduler_preemptions"] == 0  # the default cache fits every request
    assert s['specd_scheduler_requests_finished_total{reason="length"}'] == 3
    assert s["specd_scheduler_output_tokens_total"] >= 36
    assert s["specd_scheduler_draft_tokens_total"] == w["specd_worker_draft_tokens_total"]
    assert s["specd_scheduler_queue_depth"] == 0
    # "yes" is the only choice: its tokens are forced, and offered as drafts
    forced = sum(r.metrics.num_forced for r in reqs)
    assert forced > 0 and s["specd_scheduler_grammar_forced_drafts_total"] == forced
    # --step-trace: a line per step output that ran requests (not one that only frees them),
    # whose drafts add up to the worker's count
    trace = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert 0 < len(trace) <= w["specd_worker_steps_total"]
    assert [x["step"] for x in trace] == sorted({x["step"] for x in trace})
    assert sum(x["drafts"] for x in trace) == w["specd_worker_draft_tokens_total"]
    assert all(x["ms"] > 0 and 1 <= x["width"] <= 5 and x["reqs"] >= 1 for x in trace)
    assert any(x["prefill"] > 0 for x in trace)
    assert_cycles_add_up(trace)
    assert not any(x["queued"] for x in trace)  # sync: each step sent after the output before
    # the garbage collector: the start-up heap frozen (logged), the pauses counted both sides
    assert int(logged(log, r"(\d+) objects frozen").group(1)) > 10_000
    assert w["specd_worker_gc_collections_total"] >= w["specd_worker_gc_full_collections_total"]
    assert s["specd_scheduler_gc_pause_seconds_total"] >= 0
    # request phases (the engine prepares nothing itself: no prep phase); every request ran
    assert "specd_scheduler_request_prep_seconds_count" in s
    assert s["specd_scheduler_request_prep_seconds_count"] == 0
    for phase in ("queue", "prefill", "decode"):
        assert s[f"specd_scheduler_request_{phase}_seconds_count"] == 4, phase


def test_worker_frees_requests_of_a_dead_scheduler(tmp_path: Path) -> None:
    """The scheduler is killed (its requests stay on the worker); after --peer-timeout of silence
    the worker frees them, and a new scheduler gets every slot. The timeout (10 s) leaves the
    scrape that sees the dead scheduler's requests ample time (it takes well under a second)."""
    model = save_byte_model("llama", 7, tmp_path / "m")
    addr = f"ipc://{tmp_path}/w.sock"
    log = tmp_path / "worker.log"
    with open(log, "wb") as err:
        proc = start_worker(
            str(model),
            addr,
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "2",
            "--peer-timeout",
            "10",
            "--metrics-port",
            "-1",
            stderr=err,
        )
    try:
        port = int(logged(log, r"Prometheus metrics on :(\d+)/metrics", proc).group(1))
        script = (
            "from scheduler_client import Engine, EngineConfig\n"
            f"e = Engine(EngineConfig(worker_addr={addr!r}, handshake_timeout_s=120))\n"
            "[e.add_request('x', max_tokens=100, ignore_eos=True) for _ in range(2)]\n"
            "e.step(); e.step(); print('stepped', flush=True)\n"
            "import os; os._exit(9)\n"  # dies without a word to the worker
        )
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
        )
        assert "stepped" in out.stdout, out.stderr
        assert scrape(port)["specd_worker_running_requests"] == 2
        logged(log, "scheduler silent for 10 s with 2 requests: freeing them", proc)
        deadline = time.monotonic() + 30  # the gauge is set just after that line is logged
        while scrape(port)["specd_worker_running_requests"] != 0:
            assert time.monotonic() < deadline, "requests of the dead scheduler were never freed"
            time.sleep(0.1)
        with Engine(EngineConfig(worker_addr=addr, handshake_timeout_s=60)) as e:
            reqs = e.generate([{"prompt": "y", "max_tokens": 3, "ignore_eos": True}] * 2)
            assert all(r.error is None for r in reqs)
    finally:
        reap(proc)


def test_bench_serve_reports_latency_and_throughput(tmp_path: Path) -> None:
    model = save_byte_model("llama", 8, tmp_path / "m")
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "abcabcabc", "max_tokens": 6, "ignore_eos": True},
                {"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                {"prompt": "q", "max_tokens": 30, "structured": {"choice": ["yes", "no"]}},
            ]
        )
        + "\n"
    )
    out = specd(
        "bench-serve",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--max-model-len",
        "128",
        "--file",
        str(workload),
        "--num-requests",
        "12",
        "--rate",
        "40",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["requests"] == 12 and report["errors"] == 0
    assert report["ttft"]["p50_ms"] > 0 and report["e2e"]["p99_ms"] >= report["e2e"]["p50_ms"]
    assert report["throughput_rps"] > 0 and report["spec"]["output_tokens"] > 0
    assert "12/12 finished" in out.stderr


def test_compile_refuses_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        parse_args(["--enable-torch-compile", "--tensor-parallel-size", "2"])
    assert parse_args(["--enable-torch-compile"]).enable_torch_compile
