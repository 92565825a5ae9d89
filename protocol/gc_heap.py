"""Python's cyclic garbage collector in a serving process: the start-up heap frozen, and its pauses
counted.

A loaded worker tracks some 380,000 objects (torch, transformers, the model's modules, the graphs'
buffers), a scheduler its tokenizer and grammar engine. A full collection walks all of them (170 ms
on the 2-core CPU machine) and runs whenever enough survivors pile up, inside a step. Like vLLM and
SGLang, each daemon collects once and freezes what start-up made (``gc.freeze``: later collections
skip it) before it reports ready, and counts the pauses left (``GcCollector``, on /metrics).

It lives beside the wire code because both daemons import this package; it needs the standard
library only (``prometheus_client`` when a registry asks for the counters).
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from collections.abc import Iterator
from typing import Any


def freeze_heap() -> int:
    """Collect, then move every object alive now out of the collector's reach; returns how many.
    A daemon's own process only (a frozen object is never freed: in a process that builds and
    drops runners, their memory would stay). The pause counts start over here, so the freeze's
    own collection is not among them. At exit the heap is unfrozen, so that extension modules
    that check for leaks at shutdown (nanobind's) do not report the frozen objects.
    ``SPECD_GC_FREEZE=0`` leaves the heap as it is (for measuring what the freeze saves)."""
    if os.environ.get("SPECD_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    if _pauses is not None:
        _pauses.reset()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


class _Pauses:
    """The process's collections and their seconds, through ``gc.callbacks`` (installed once)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self.reset()

    def reset(self) -> None:
        self.collections = 0
        self.full = 0  # the oldest generation's: they walk the whole heap not frozen
        self.seconds = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t0
        self.collections += 1
        self.full += info["generation"] == 2


_pauses: _Pauses | None = None


def pauses() -> _Pauses:
    """The process's counts, from the first call on."""
    global _pauses
    if _pauses is None:
        _pauses = _Pauses()
        gc.callbacks.append(_pauses)
    return _pauses


class GcCollector:
    """The process's collections on a Prometheus registry (``registry.register(GcCollector(
    "specd_worker_"))``), counted from the first collector made."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.pauses = pauses()

    def collect(self) -> Iterator[Any]:
        """The counters, as ``prometheus_client`` reads a custom collector."""
        from prometheus_client.core import CounterMetricFamily

        p, c = self.prefix, self.pauses
        yield CounterMetricFamily(
            f"{p}gc_pause_seconds", "Seconds in Python's garbage collector", value=c.seconds
        )
        yield CounterMetricFamily(
            f"{p}gc_collections", "Garbage collections, every generation", value=c.collections
        )
        yield CounterMetricFamily(
            f"{p}gc_full_collections",
            "Garbage collections of the oldest generation (the heap not frozen at start-up)",
            value=c.full,
        )
