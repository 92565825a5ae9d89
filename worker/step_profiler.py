"""``SPECD_PROFILE_DIR``: SIGUSR1 starts torch's profiler over the worker's steps, the next
SIGUSR1 stops it and writes a summary there (as vLLM's ``/start_profile`` and ``/stop_profile``).

On CUDA only the device's kernels are recorded (CUPTI; the host's ops are not traced, so the
host path runs at its own speed): the summary says how much of the window's wall time the GPU
spent in kernels, per step and in all, then the kernels that took most of it. A busy share well
below 1 is host time the device waits through; near 1, the step is the kernels' time.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("specd.worker")


class StepProfiler:
    def __init__(self, out_dir: Path, device: torch.device) -> None:
        self.out_dir = out_dir
        self.device = device
        self.wanted = False
        self._prof: Any = None
        self._t0 = 0.0
        self._steps0 = 0
        self._count = 0
        signal.signal(signal.SIGUSR1, self._toggle)

    def _toggle(self, _signum: int, _frame: object) -> None:
        self.wanted = not self.wanted

    def poll(self, num_steps: int) -> None:
        """Between steps: start or stop as the last signal asked."""
        if self.wanted and self._prof is None:
            gpu = self.device.type == "cuda"
            self._prof = profile(
                activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]
            )
            self._prof.__enter__()
            self._t0, self._steps0 = time.perf_counter(), num_steps
        elif not self.wanted and self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self._write(self._prof, wall, num_steps - self._steps0)
            self._prof = None

    def _write(self, prof: Any, wall_s: float, steps: int) -> None:
        events = prof.key_averages()
        gpu = self.device.type == "cuda"
        busy_us = sum(e.self_device_time_total if gpu else e.self_cpu_time_total for e in events)
        self._count += 1
        path = self.out_dir / f"worker-profile-{self._count}.txt"
        per = f"{1000 * wall_s / steps:.3f} ms a step, " if steps else ""
        head = (
            f"{steps} steps in {wall_s:.3f} s ({per}{'kernels' if gpu else 'ops'} "
            f"{busy_us / 1000 / max(steps, 1):.3f} ms a step, busy {busy_us / 1e6 / wall_s:.3f})"
        )
        sort = "self_device_time_total" if gpu else "self_cpu_time_total"
        path.write_text(head + "\n\n" + events.table(sort_by=sort, row_limit=30) + "\n")
        log.warning("profile: %s -> %s", head, path)
