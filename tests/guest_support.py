"""Shared pieces of the probes that microvm and vm tests run inside a guest, and of finding a guest's QEMU."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from dsec.backends.base import ImageRef
from dsec.backends.qemu.backend import QemuBackend
from dsec.testing.conformance import Check, SharedSandbox

__all__ = ["CONFINED_VIEW", "conforms", "lending", "qemu_of"]


@contextlib.asynccontextmanager
async def lending(backend: QemuBackend, image: ImageRef, reset: str) -> AsyncIterator[SharedSandbox]:
    """A :class:`SharedSandbox` of ``backend``'s guests, its sandbox destroyed on exit."""
    lender = SharedSandbox(backend, image, reset=reset)
    try:
        yield lender
    finally:
        await lender.aclose()


async def conforms(shared: SharedSandbox, check: Check, timeout: float) -> None:
    """Run a conformance check, lent ``shared``'s guest where it only needs a running sandbox: no guest but that
    one may be left after it."""
    backend = shared.backend
    assert isinstance(backend, QemuBackend)
    with shared.serving(check):
        await asyncio.wait_for(check(backend, shared.image), timeout)
    kept = {shared.record.id} if shared.record else set()
    assert set(backend.machines.machines) == kept, "a check left a guest behind"


def qemu_of(sandbox_id: str) -> list[int]:
    """Pids of QEMU processes whose command line names the sandbox (what an operator would look for)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu" in argv and sandbox_id.encode() in argv:
            found.append(int(proc.name))
    return found

CONFINED_VIEW = r'''
def _comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""
out["comms"] = sorted({_comm(pid) for pid in os.listdir("/proc") if pid.isdigit()} - {""})
_mounts = [line.split() for line in open("/proc/self/mountinfo")]
out["submounts"] = {m[4]: m[5] for m in _mounts if m[4].startswith(("/sys/", "/proc/sys/"))}
'''
"""What a command sees of the guest (appended to a probe that has ``os`` and a dict ``out``): ``comms``, the
names of every process it can see, and ``submounts``, each mount below ``/sys`` and ``/proc/sys`` with its
per-mount options (``ro``/``rw`` first)."""
