"""What every owner of CUDA graphs shares (``decode_graphs.py``, ``ragged_graphs.py``, the EAGLE
head's ``drafters/eagle_graphs.py``): a graph's host inputs staged in one buffer and sent in one
copy, and the capture itself.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

Out = TypeVar("Out")


class StagedInputs:
    """A graph's int64 inputs on the device (``inputs``, static: the graph reads them in place)
    and their host twin (``staging``, pinned on CUDA). ``host`` hands the twin out for writing
    once the last copy out of it has run; ``send`` queues one non-blocking copy of all of it."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        self.staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None

    def host(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the staging buffer has finished
        return self.staging

    def send(self) -> None:
        self.inputs.copy_(self.staging, non_blocking=True)
        if self.inputs.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class GraphCapture:
    """One owner's graphs: their memory pool, and one side stream for every capture's warm-up
    (the caching allocator keeps freed blocks per stream, so a new stream per capture stranded
    each warm-up's memory: an 8B target at batch 64 ran out of the H200's 140 GB)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)

    def capture(
        self, staged: StagedInputs, run: Callable[[], Out]
    ) -> tuple[torch.cuda.CUDAGraph, Out]:
        """Send ``staged`` (dummy inputs that touch only scratch rows), run ``run`` twice on the
        side stream, then capture it; returns the graph and the captured run's output."""
        staged.inputs.copy_(staged.staging)
        torch.cuda.synchronize(self.device)
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            for _ in range(2):
                run()
        main.wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        # A garbage collection inside the capture can free another runner's graphs, and
        # destroying a graph while a stream captures invalidates the capture (seen on the H200
        # when a benchmark built its second runner): collect first, then hold the collector off.
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = run()
        finally:
            gc.enable()
        return graph, out
