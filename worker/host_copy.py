"""Host values onto the device without a stream sync.

``torch.tensor(list, device="cuda")`` and ``.to("cuda", non_blocking=True)`` from pageable memory
both wait for every kernel already queued on the stream (CUDA stages a pageable copy only once
the stream is idle): after a step's forward has been launched, one such copy makes the host wait
for the whole forward before it can queue the grammar rows and the verification behind it. A
pinned copy does not: the copy is queued like a kernel, and torch's caching host allocator keeps
the pinned block until the copy that reads it has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: np.ndarray | Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
    device: torch.device,
    dtype: torch.dtype | None = torch.long,
) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (``dtype`` None: the array's own), queued behind the
    stream's work instead of waiting for it."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's copy into pinned host memory, queued behind the stream's work so that
    nothing waits for it now; ``read`` waits for it then (on a blocking event: the host sleeps
    rather than spins). On the CPU the tensor itself is kept."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._host = values
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event(blocking=True)
        self._event.record(torch.cuda.current_stream(values.device))

    def ready(self) -> bool:
        """True once the copy has run (``read`` won't wait)."""
        return self._event is None or self._event.query()

    def read(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()
