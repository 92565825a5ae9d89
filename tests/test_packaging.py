"""The distribution ships every module of the three packages (a container once lacked one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    # setuptools writes build/ and *.egg-info next to the sources: build a copy, under tmp
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("protocol", "worker", "scheduler_client"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("specd-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    source = {
        str(p.relative_to(ROOT))
        for pkg in ("protocol", "worker", "scheduler_client")
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert source <= shipped, sorted(source - shipped)
    assert not any(n.startswith("tests/") for n in shipped)
