"""Operating the worker: TOML config, JSON logs, health checks, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler_client import Engine, EngineConfig, WorkerDied
from tests.models import save_byte_model, save_tiny
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
    return subprocess.run([sys.executable, "-m", "scheduler_client.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_health_json_logs_and_sigterm(tmp_path: Path, ipc_addr: str) -> None:
    model = save_tiny("llama", 4, tmp_path / "m")
    log = tmp_path / "w.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "worker.daemon", "--model", str(model),
                                 "--device", "cpu", "--listen", ipc_addr, "--max-model-len", "64",
                                 "--log-format", "json"], stderr=err)
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
        proc.kill()
        proc.wait(timeout=30)


def test_sigterm_mid_run_is_reported_to_the_scheduler(tmp_path: Path) -> None:
    model = save_byte_model("llama", 5, tmp_path / "m")
    e = Engine(EngineConfig(model=str(model), device="cpu", max_model_len=128,
                            max_worker_restarts=0, step_timeout_s=60))
    try:
        reqs = [e.add_request("go", max_tokens=100, ignore_eos=True) for _ in range(2)]
        e.step()
        assert e.proc is not None
        e.proc.send_signal(signal.SIGTERM)
        with pytest.raises(WorkerDied) as info:
            while True:
                e.step()
        assert "shutting_down" in str(info.value) or "exited with code 0" in str(info.value)
        assert e.proc.wait(timeout=30) == 0
        assert all(r.finish_reason == "error" for r in reqs)
    finally:
        e.close()
