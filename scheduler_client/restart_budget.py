"""How many worker restarts the engine may still spend: at most ``max_restarts`` within any
``window_s`` seconds. A rate, not a lifetime count: a daemon that lost a worker a week ago may
lose one today and recover; one that loses its worker in a crash loop stops."""

from __future__ import annotations

import collections
import time


class RestartBudget:
    """Owned by the engine's thread: ``take`` before each restart."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        if max_restarts < 0:
            raise ValueError("max_worker_restarts must be >= 0 (0: never restart)")
        if window_s <= 0:
            raise ValueError("restart_window_s must be > 0 seconds")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float | None = None) -> bool:
        """Spend one restart if the window has one left."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
