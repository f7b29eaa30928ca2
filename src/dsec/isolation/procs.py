"""Facts about host processes that the backends keep to find their own processes again."""

from __future__ import annotations

import os
import time

__all__ = ["meminfo", "read_small", "reap", "start_time"]


def meminfo(*keys: str, path: str = "/proc/meminfo") -> dict[str, int]:
    """Fields of the host's ``/proc/meminfo``, in bytes; RuntimeError naming any that is missing."""
    found = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0]) * 1024
    if missing := set(keys) - set(found):
        raise RuntimeError(f"no {', '.join(sorted(missing))} in {path}")
    return found


def read_small(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of a small kernel file with a bare open/read/close, or None if it cannot be read.

    Hot-path reads (every exec checks its sandbox's init and limit counters) skip a text file object's
    four more syscalls (fstat, ioctl, lseek, a second read) per read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a live process from a recycled pid.

    None when the process is gone.
    """
    data = read_small(f"/proc/{pid}/stat", 4096)  # every container exec checks its sandbox's init this way
    if data is None:
        return None
    try:
        return data.rsplit(b")", 1)[1].split()[19].decode()
    except IndexError:
        return None


def reap(pid: int, within: float, pending: bool = False) -> bool:
    """Reap child ``pid`` once it exits, waiting up to ``within`` seconds; True when it is gone (reaped, or not
    our child). ``pending``: it may not be our child yet (the kernel hands a dead helper's or zygote's children
    to the daemon, a child subreaper, a moment after it died), so a pid that is not ours is waited for too."""
    deadline = time.monotonic() + within
    pause = 0.001
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            if not pending:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
