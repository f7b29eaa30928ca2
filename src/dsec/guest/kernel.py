"""The guest kernel: Debian's ``linux-image-cloud-amd64``, downloaded and unpacked, never installed.

Layout under the guest directory (``DSEC_GUEST``, default ``/var/lib/dsec/guest``)::

    kernel/<version>/boot/vmlinuz-<version>     the kernel
    kernel/<version>/lib/modules/<version>/...  its modules (the initramfs takes a few)
    kernel/current                              symlink to the version in use

This module owns fetching and locating it; it runs ``apt-get download`` and ``dpkg-deb -x`` only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import BackendUnavailable

__all__ = ["META_PACKAGE", "GuestKernel", "default_guest_dir", "fetch_kernel", "find_kernel"]

META_PACKAGE = "linux-image-cloud-amd64"
"""Debian's meta package; it depends on the versioned kernel package we unpack."""


def default_guest_dir() -> Path:
    """``DSEC_GUEST`` or ``/var/lib/dsec/guest``: shared by every DSEC_HOME on the node, like images."""
    return Path(os.environ.get("DSEC_GUEST") or "/var/lib/dsec/guest")


@dataclass(frozen=True)
class GuestKernel:
    """An unpacked kernel package."""

    version: str
    vmlinuz: Path
    modules: Path
    """``lib/modules/<version>`` of the package."""


def find_kernel(guest_dir: Path) -> GuestKernel:
    """The kernel in use under ``guest_dir``; raises BackendUnavailable naming the fix when absent."""
    current = guest_dir / "kernel" / "current"
    if current.is_dir():
        version = current.resolve().name
        vmlinuz = current / "boot" / f"vmlinuz-{version}"
        modules = current / "lib" / "modules" / version
        if vmlinuz.is_file() and modules.is_dir():
            return GuestKernel(version, vmlinuz, modules)
    raise BackendUnavailable(f"no guest kernel in {guest_dir}/kernel: run `python -m dsec.guest.kernel` "
                             f"(or ./scripts/setup), which unpacks Debian's {META_PACKAGE}")


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BackendUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def fetch_kernel(guest_dir: Path) -> GuestKernel:
    """Download the cloud kernel's package with apt and unpack it under ``guest_dir`` (idempotent)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise BackendUnavailable("fetching the guest kernel needs apt-get and dpkg-deb (a Debian host)")
    depends = _run(["apt-cache", "depends", META_PACKAGE], Path("/"))
    versioned = [line.split(":", 1)[1].strip() for line in depends.splitlines()
                 if line.strip().startswith("Depends:") and "linux-image-" in line]
    if not versioned:
        raise BackendUnavailable(f"apt knows no {META_PACKAGE} (apt-get update?)")
    package = versioned[0]
    version = package.removeprefix("linux-image-")
    target = guest_dir / "kernel" / version
    if not (target / "boot" / f"vmlinuz-{version}").is_file():
        (guest_dir / "kernel").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=guest_dir / "kernel") as tmp:
            os.chmod(tmp, 0o755)  # apt's sandbox user must be able to write the download here
            _run(["apt-get", "download", "-q", package], Path(tmp))
            debs = list(Path(tmp).glob("*.deb"))
            if len(debs) != 1:
                raise BackendUnavailable(f"apt-get download {package} gave {len(debs)} packages")
            staging = Path(tmp) / "unpacked"
            _run(["dpkg-deb", "-x", str(debs[0]), str(staging)], Path(tmp))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    link = guest_dir / "kernel" / "current"
    tmp_link = link.with_name(f".current.{os.getpid()}")
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(version)
    tmp_link.replace(link)
    return find_kernel(guest_dir)


if __name__ == "__main__":
    print(fetch_kernel(default_guest_dir()).vmlinuz)
