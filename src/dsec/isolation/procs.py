"""Facts about host processes that the backends keep to find their own processes again."""

from __future__ import annotations

import os

__all__ = ["start_time"]


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a live process from a recycled pid.

    None when the process is gone.
    """
    # A bare open/read/close: every container exec checks its sandbox's init this way.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return data.rsplit(b")", 1)[1].split()[19].decode()
    except IndexError:
        return None
