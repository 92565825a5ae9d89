"""Every environment variable the worker reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``SPECD_CACHE_DIR``, else ``$XDG_CACHE_HOME/specd``, else ``~/.cache/specd``."""
    explicit = os.environ.get("SPECD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "specd"


def profile_dir() -> Path | None:
    """``SPECD_PROFILE_DIR``: where SIGUSR1-bracketed step profiles go (worker.step_profiler)."""
    explicit = os.environ.get("SPECD_PROFILE_DIR")
    return Path(explicit) if explicit else None
