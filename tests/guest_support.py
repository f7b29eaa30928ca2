"""Shared pieces of the probes that microvm and vm tests run inside a guest, and of finding a guest's QEMU."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFINED_VIEW", "qemu_of"]


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
