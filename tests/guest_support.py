"""Shared pieces of the probes that microvm and vm tests run inside a guest."""

from __future__ import annotations

__all__ = ["CONFINED_VIEW"]

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
