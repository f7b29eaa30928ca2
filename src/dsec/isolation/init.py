"""Builds ``dsec-init``, the static pid 1 of container sandboxes, from ``init.c`` on first use.

The binary is cached in the node's state directory, keyed by the source's digest, so an
upgrade rebuilds it. It needs gcc and a static libc (Debian: ``gcc libc6-dev``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dsec.errors import BackendUnavailable

__all__ = ["INIT_SOURCE", "ensure_init"]

INIT_SOURCE = Path(__file__).with_name("init.c")


def ensure_init(directory: Path) -> Path:
    """Path of a built ``dsec-init`` for the current ``init.c``; builds it if needed."""
    digest = hashlib.sha256(INIT_SOURCE.read_bytes()).hexdigest()[:16]
    target = directory / f"dsec-init-{digest}"
    if target.exists():
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendUnavailable("building the container init needs a C compiler: apt-get install gcc libc6-dev")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".dsec-init-{digest}.{os.getpid()}"
    proc = subprocess.run([cc, "-static", "-Os", "-s", "-o", str(tmp), str(INIT_SOURCE)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendUnavailable(f"building the container init failed (apt-get install gcc libc6-dev): "
                                 f"{proc.stderr.strip()[-500:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target
