"""``SPECD_PROFILE_DIR``: SIGUSR1 starts a profile of the worker's steps, the next one writes it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from worker.step_profiler import StepProfiler


def test_two_sigusr1_bracket_a_profile_of_the_steps_between(tmp_path: Path) -> None:
    old = signal.getsignal(signal.SIGUSR1)
    try:
        prof = StepProfiler(tmp_path, torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        prof.poll(10)
        for _ in range(3):
            torch.ones(64, 64) @ torch.ones(64, 64)
        os.kill(os.getpid(), signal.SIGUSR1)
        prof.poll(13)
        (out,) = tmp_path.glob("worker-profile-*.txt")
        text = out.read_text()
        assert text.startswith("3 steps in ") and "aten::mm" in text, text[:500]
    finally:
        signal.signal(signal.SIGUSR1, old)
