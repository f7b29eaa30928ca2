"""Facts about host processes that the backends keep to find their own processes again."""

from __future__ import annotations

from pathlib import Path

__all__ = ["start_time"]


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a live process from a recycled pid.

    None when the process is gone.
    """
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
