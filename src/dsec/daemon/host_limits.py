"""Host limits a node needs for thousands of sandboxes: raised at daemon start, restored at shutdown.

Owns the list of kernel settings (``kernel.pid_max``, ``kernel.threads-max``, inotify instances and
watches, ``fs.file-max``) with the floor each needs for ~10,000 idle sandboxes, and the values found
before raising them. Only raises (a host set higher is left alone) and only restores a value that is
still the one it wrote (someone who changed it since wins). Opt-in (``DSEC_HOST_LIMITS=1``): a host
sysctl is shared by every daemon and tool on the machine, and on production hosts they belong to the
host's own configuration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FLOORS", "HostLimits"]

log = logging.getLogger(__name__)

FLOORS: dict[str, int] = {
    "kernel/pid_max": 4_194_304,  # the kernel's maximum on 64-bit; each idle sandbox holds >= 1 pid
    "kernel/threads-max": 1_000_000,
    "fs/inotify/max_user_instances": 65_536,  # sandboxes' inotify instances count against host root
    "fs/inotify/max_user_watches": 1_048_576,
    "fs/file-max": 4_194_304,
}
"""``/proc/sys`` path -> the lowest value a node with 10,000 sandboxes wants."""


@dataclass
class HostLimits:
    """Raise :data:`FLOORS` under ``root`` (``/proc/sys``); :meth:`restore` puts back what was there."""

    root: Path = Path("/proc/sys")
    floors: dict[str, int] = field(default_factory=lambda: dict(FLOORS))
    changed: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Path -> (value found, value written)."""

    def raise_all(self) -> dict[str, tuple[int, int]]:
        """Raise every setting below its floor; returns what changed. A setting that cannot be read or
        written (no such file, not root) is logged and skipped: the node still works, with fewer sandboxes."""
        for rel, floor in self.floors.items():
            path = self.root / rel
            try:
                found = int(path.read_text().split()[0])
                if found >= floor:
                    continue
                path.write_text(f"{floor}\n")
            except (OSError, ValueError) as exc:
                log.warning("cannot raise %s to %d: %s", rel, floor, exc)
                continue
            self.changed[rel] = (found, floor)
            log.info("raised %s from %d to %d (restored at shutdown)", rel.replace("/", "."), found, floor)
        return dict(self.changed)

    def restore(self) -> list[str]:
        """Put back each value this object raised, unless someone changed it since; returns the paths restored."""
        restored = []
        for rel, (found, wrote) in list(self.changed.items()):
            path = self.root / rel
            try:
                now = int(path.read_text().split()[0])
                if now != wrote:
                    log.info("%s was changed to %d since DSec raised it; left alone", rel, now)
                else:
                    path.write_text(f"{found}\n")
                    restored.append(rel)
            except (OSError, ValueError) as exc:
                log.warning("cannot restore %s to %d: %s", rel, found, exc)
            del self.changed[rel]
        return restored
