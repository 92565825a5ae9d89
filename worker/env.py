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
