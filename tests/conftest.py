"""Shared fixtures. Every socket a test opens closes with LINGER 0; every receive has a timeout."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def ipc_addr() -> Iterator[str]:
    """A fresh ipc:// address in a private temporary folder."""
    with tempfile.TemporaryDirectory(prefix="specd-test-") as d:
        yield f"ipc://{os.path.join(d, 'sock')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skipif(True, reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
