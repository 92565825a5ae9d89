"""Shared fixtures. Every socket a test opens closes with LINGER 0; every receive has a timeout."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.leftovers import Snapshot


def _interpret_triton_on_cpu() -> None:
    """Without CUDA, triton kernels run in triton's interpreter, which must be chosen before
    triton is first imported: the paged kernel's tests (marked triton) then run on CPU. Workers
    that tests launch inherit it and still attend with SDPA on CPU (paged_kernel.use_kernel)."""
    if find_spec("triton") is None or "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_on_cpu()

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    """The session ends as it started: no process it started still running or unwaited, no TCP
    port it opened still listening, nothing new in the repository (tests/leftovers.py says how
    each is checked). A leftover fails the session at its last teardown, naming what was left."""
    start = Snapshot.take(ROOT)
    yield
    left = start.leftovers()
    if left:
        pytest.fail("the test session left behind:\n  " + "\n  ".join(left), pytrace=False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level Llama with a tokenizer, saved for a launched worker (seed BYTE_MODEL_SEED)."""
    from tests.models import BYTE_MODEL_SEED, save_byte_model  # torch only where it is used

    return save_byte_model("llama", BYTE_MODEL_SEED, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its one-layer draft model."""
    from tests.models import BYTE_MODEL_SEED, save_byte_model

    return save_byte_model("llama", BYTE_MODEL_SEED + 1, tmp_path_factory.mktemp("draft"), layers=1)


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    """A draft derived from the target (its weights plus seeded noise): greedy acceptance is
    partial, unlike the unrelated ``draft_dir``."""
    from tests.models import BYTE_MODEL_SEED, save_near_draft

    return save_near_draft(target_dir, BYTE_MODEL_SEED + 3, tmp_path_factory.mktemp("near"))


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
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # _interpret_triton_on_cpu
    for item in items:
        if "gpu" in item.keywords and not ("triton" in item.keywords and interpreted):
            item.add_marker(skip_gpu)
