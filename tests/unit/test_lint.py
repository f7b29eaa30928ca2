"""The code stays ruff- and mypy-clean (CONVENTIONS: "ruff and mypy clean")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_clean() -> None:
    proc = _run("ruff", "check", "--output-format", "concise", "src", "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict_clean() -> None:
    proc = _run("mypy", "src")
    assert proc.returncode == 0, proc.stdout + proc.stderr
