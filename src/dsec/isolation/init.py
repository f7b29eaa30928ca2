"""Builds DSec's static helper binaries from their C sources on first use.

- ``dsec-init`` (``init.c``): pid 1 of a container sandbox; reaps orphans, nothing else.
- ``dsec-nsenter`` (``nsenter.c``): the last step of an exec into a running sandbox.
- ``dsec-rtshim`` (``rtshim.c``): starts the OCI runtime inside a new sandbox's cgroups.
- ``dsec-zygote`` (``zygote.c``): the pre-warmed parent of a function sandbox's calls.

Binaries are cached in the node's state directory, keyed by the source's digest, so an
upgrade rebuilds them. They need gcc and a static libc (Debian: ``gcc libc6-dev``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dsec.errors import BackendUnavailable

__all__ = ["INIT_SOURCE", "NSENTER_SOURCE", "RTSHIM_SOURCE", "ZYGOTE_SOURCE", "ensure_binary", "ensure_init",
           "ensure_nsenter", "ensure_rtshim", "ensure_zygote"]

INIT_SOURCE = Path(__file__).with_name("init.c")
NSENTER_SOURCE = Path(__file__).with_name("nsenter.c")
RTSHIM_SOURCE = Path(__file__).with_name("rtshim.c")
ZYGOTE_SOURCE = Path(__file__).with_name("zygote.c")


def ensure_binary(source: Path, name: str, directory: Path) -> Path:
    """Path of ``name`` built statically from the current ``source``; builds it if needed."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = directory / f"{name}-{digest}"
    if target.exists():
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendUnavailable(f"building {name} needs a C compiler: apt-get install gcc libc6-dev")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}-{digest}.{os.getpid()}"
    proc = subprocess.run([cc, "-static", "-O2", "-s", "-Wall", "-Werror", "-o", str(tmp), str(source)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendUnavailable(f"building {name} failed (apt-get install gcc libc6-dev): "
                                 f"{proc.stderr.strip()[-500:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def ensure_init(directory: Path) -> Path:
    """The container init, built if needed."""
    return ensure_binary(INIT_SOURCE, "dsec-init", directory)


def ensure_nsenter(directory: Path) -> Path:
    """The exec entry binary, built if needed."""
    return ensure_binary(NSENTER_SOURCE, "dsec-nsenter", directory)


def ensure_rtshim(directory: Path) -> Path:
    """The OCI runtime launcher, built if needed."""
    return ensure_binary(RTSHIM_SOURCE, "dsec-rtshim", directory)


def ensure_zygote(directory: Path) -> Path:
    """The function backend's zygote, built if needed."""
    return ensure_binary(ZYGOTE_SOURCE, "dsec-zygote", directory)
