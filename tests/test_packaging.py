"""The distribution ships every module of the three packages (a container once lacked one)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT),
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
