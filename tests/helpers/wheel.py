"""The rft-hpc wheel as a user gets it: built from a copy of the checkout's sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import ROOT

SOURCES = ("pyproject.toml", "setup.py", "README.md", "rft_hpc", "slurm")
"""What a wheel is built from (copied out of the checkout: the build writes build/ and
*.egg-info next to its sources, and test sessions may build at the same time)."""


def sh(argv: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None,
       timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `argv`, print the command and its output (kept in the test's report), and
    return the finished process."""
    start = time.monotonic()
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    print(f"$ {' '.join(map(str, argv))}   (in {cwd}: exit {result.returncode}, "
          f"{time.monotonic() - start:.1f} s)")
    for stream in (result.stdout, result.stderr):
        if stream.strip():
            print(stream.rstrip()[-4000:])
    return result


def ok(argv: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    """`sh`, asserting that the command succeeded."""
    result = sh(argv, **kwargs)
    assert result.returncode == 0, f"{argv[:3]} failed:\n{result.stderr[-3000:]}"
    return result


def build_wheel(base: Path) -> Path:
    """Build the wheel from a copy of the checkout's sources under `base`; its path."""
    src = base / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (ROOT / name).is_file():
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = base / "dist"
    # no isolation: the build uses this venv's setuptools (no package index needed)
    ok([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--disable-pip-version-check", "-q", "-w", dist, src], cwd=base)
    (wheel,) = dist.glob("rft_hpc-*.whl")
    return wheel
