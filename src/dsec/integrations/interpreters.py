"""Finding a Python interpreter new enough for a harness that needs a newer one than DSec's own.

Owns the search (``DSEC_HARBOR_PYTHON`` first, then ``python3.N`` names on ``PATH``, in the usual prefixes and
in pyenv's versions, newest first) and the version probe. harbor needs Python >= 3.12 and runs from its own venv
made with the interpreter found here; ``dsec doctor`` reports the search. It never installs or downloads an interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["find_python", "python_version"]

_PREFIXES = (Path("/usr/local/bin"), Path("/usr/bin"), Path("/opt/python/bin"))


def python_version(exe: str | Path) -> tuple[int, int] | None:
    """``(major, minor)`` of interpreter ``exe``, or None when it does not run."""
    try:
        proc = subprocess.run([str(exe), "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = proc.stdout.split()
    if proc.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def _pyenv_versions() -> Path:
    return Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"


def _candidates() -> list[str]:
    found: list[str] = []
    if env := os.environ.get("DSEC_HARBOR_PYTHON"):
        found.append(env)
    for minor in range(20, 11, -1):
        name = f"python3.{minor}"
        if path := shutil.which(name):
            found.append(path)
        found += [str(p / name) for p in _PREFIXES if (p / name).is_file()]
        found += [str(p) for p in sorted(_pyenv_versions().glob(f"3.{minor}.*/bin/{name}"), reverse=True)]
    if path := shutil.which("python3"):
        found.append(path)
    return list(dict.fromkeys(found))


def find_python(minimum: tuple[int, int] = (3, 12)) -> tuple[str, tuple[int, int]] | None:
    """The first interpreter at least ``minimum`` (``DSEC_HARBOR_PYTHON`` first), with its version; None if none."""
    for exe in _candidates():
        version = python_version(exe)
        if version is not None and version >= minimum:
            return exe, version
    return None
