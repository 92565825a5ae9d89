"""tcp:// needs CURVE; a peer without an authorized key is refused and logged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protocol import TransportConfig
from protocol.transport import check_security, keygen
from scheduler_client.worker_client import WorkerClient, WorkerDied
from tests.models import save_tiny
from tests.procs import logged, reap, start_worker
from worker.config import WorkerConfig, parse_args


def test_tcp_without_curve_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="specd keygen"):
        WorkerConfig(listen="tcp://127.0.0.1:5555")
    with pytest.raises(ValueError, match="specd keygen"):
        check_security("tcp://127.0.0.1:5555", TransportConfig(), server=False)
    with pytest.raises(ValueError, match="both --curve-secret"):
        check_security("ipc:///tmp/x", TransportConfig(curve_secret_file="k"), server=True)


def test_worker_flags_all_reach_the_config(tmp_path: Path) -> None:
    cfg = parse_args(
        [
            "--model",
            "m",
            "--drafter",
            "draft_model",
            "--draft-model",
            "d",
            "--num-speculative-tokens",
            "3",
            "--ngram-min",
            "2",
            "--ngram-max",
            "5",
            "--listen",
            "ipc:///tmp/w",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "3",
            "--max-model-len",
            "99",
            "--batch-invariant",
            "pad",
            "--log-level",
            "DEBUG",
            "--curve-secret",
            "s",
            "--curve-authorized",
            "a",
        ]
    )
    assert (cfg.model, cfg.drafter, cfg.draft_model, cfg.num_speculative_tokens) == (
        "m",
        "draft_model",
        "d",
        3,
    )
    assert (cfg.ngram_min, cfg.ngram_max, cfg.listen, cfg.device, cfg.dtype) == (
        2,
        5,
        "ipc:///tmp/w",
        "cpu",
        "float32",
    )
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.batch_invariant, cfg.log_level) == (
        3,
        99,
        "pad",
        "DEBUG",
    )
    assert (cfg.curve_secret, cfg.curve_authorized) == ("s", "a")


def test_curve_lets_the_right_key_in_and_refuses_others(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, worker_secret = keygen(str(keys), "worker")
    sched_public, sched_secret = keygen(str(keys), "scheduler")
    _, intruder_secret = keygen(str(keys), "intruder")
    (authorized / "scheduler.key").write_bytes(Path(sched_public).read_bytes())
    assert (Path(sched_secret).stat().st_mode & 0o777) == 0o600
    model = save_tiny("llama", 2, tmp_path / "model")
    log = tmp_path / "worker.log"
    with open(log, "wb") as err:
        proc = start_worker(
            str(model),
            "tcp://127.0.0.1:0",  # the worker binds a free port and logs it
            "--max-model-len",
            "64",
            "--curve-secret",
            worker_secret,
            "--curve-authorized",
            str(authorized),
            stderr=err,
        )
    try:
        addr = logged(log, r"serving on (tcp://127\.0\.0\.1:\d+)", proc).group(1)
        good = WorkerClient(
            addr,
            transport=TransportConfig(
                curve_secret_file=sched_secret, curve_server_public_file=str(keys / "worker.key")
            ),
        )
        assert good.handshake(timeout_s=120).vocab_size == 128
        good.close()
        bad = WorkerClient(
            addr,
            transport=TransportConfig(
                curve_secret_file=intruder_secret, curve_server_public_file=str(keys / "worker.key")
            ),
        )
        # refused silently by CURVE: the 3 s are the wait for an answer that never comes
        with pytest.raises(
            WorkerDied, match=f"no handshake from the worker at {re.escape(addr)} within"
        ):
            bad.handshake(timeout_s=3)
        bad.close()
        logged(log, "refused a peer: DENIED", proc)
        assert proc.poll() is None
    finally:
        reap(proc)
