"""Cgroup v1 (per-controller hierarchies, as on hybrid hosts) and v2 (unified) behind one class.

runc creates and limits a sandbox's cgroups; this module finds them again from a pid,
reads usage (memory, peak, OOM kills, CPU, pids), moves a helper process in, and
removes leftovers. It never sets limits itself: limits have one owner (runc's config).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupSet", "cgroup_mode"]

_ROOT = Path("/sys/fs/cgroup")


V1_JOINED = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer", "devices"})
"""v1 controllers a command joins: its limits (memory, pids, cpu), CPU accounting, pause, device rules."""


def cgroup_mode(root: Path = _ROOT) -> str:
    """``"v2"`` on a unified host, ``"v1"`` on a legacy or hybrid one (controllers on v1)."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    return "v1"


def _v1_hierarchies(root: Path) -> list[str]:
    """Every hierarchy mounted below ``root`` on a v1/hybrid host (controllers, ``systemd``, ``unified``):
    runc joins all of them, so cleanup must visit all of them. Symlinked aliases are skipped."""
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class CgroupSet:
    """The cgroup directories of one sandbox: one per v1 controller, or one unified v2 directory."""

    mode: str
    dirs: dict[str, str]
    """Controller name (``"unified"`` on v2) -> absolute directory."""

    @classmethod
    def of_pid(cls, pid: int, root: Path = _ROOT) -> CgroupSet:
        """The cgroups that process ``pid`` is in."""
        mode = cgroup_mode(root)
        dirs: dict[str, str] = {}
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if mode == "v2":
                if controllers == "":
                    dirs["unified"] = str(root / path.lstrip("/"))
                continue
            name = controllers.removeprefix("name=") if controllers.startswith("name=") else controllers
            if controllers == "":
                name = "unified"
            if (root / name).is_dir() and not (root / name).is_symlink():
                dirs[name] = str(root / name / path.lstrip("/"))
            else:
                for ctrl in controllers.split(","):
                    if (root / ctrl).is_dir():
                        dirs[ctrl] = str(root / ctrl / path.lstrip("/"))
        return cls(mode=mode, dirs=dirs)

    @classmethod
    def at(cls, relpath: str, root: Path = _ROOT) -> CgroupSet:
        """The cgroups at ``relpath`` (as in runc's ``cgroupsPath``), whether they exist or not."""
        mode = cgroup_mode(root)
        rel = relpath.lstrip("/")
        if mode == "v2":
            return cls(mode=mode, dirs={"unified": str(root / rel)})
        return cls(mode=mode, dirs={name: str(root / name / rel) for name in _v1_hierarchies(root)})

    def _dir(self, controller: str) -> Path | None:
        d = self.dirs.get("unified" if self.mode == "v2" else controller)
        return Path(d) if d else None

    def procs_files(self) -> list[str]:
        """Every ``cgroup.procs`` a process must be written to in order to join this set's controllers.

        On v1 each move costs ~50 us, so commands join only the hierarchies that limit, account
        for or freeze them (:data:`V1_JOINED`); ``systemd``, ``unified``, ``cpuset``, ``blkio``... hold no
        sandbox limit, and the pid namespace, not the cgroup, is what ends every process on destroy."""
        if self.mode == "v2":
            return [str(Path(d) / "cgroup.procs") for d in self.dirs.values()]
        return [str(Path(d) / "cgroup.procs") for name, d in self.dirs.items()
                if V1_JOINED.intersection(name.split(","))]

    def memory_usage(self) -> int:
        d = self._dir("memory")
        if d is None:
            return 0
        return _read_int(d / ("memory.current" if self.mode == "v2" else "memory.usage_in_bytes"))

    def memory_peak(self) -> int:
        d = self._dir("memory")
        if d is None:
            return 0
        return _read_int(d / ("memory.peak" if self.mode == "v2" else "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        """Processes the kernel killed for exceeding this set's memory limit."""
        d = self._dir("memory")
        if d is None:
            return 0
        if self.mode == "v2":
            return _read_kv(d / "memory.events").get("oom_kill", 0)
        return _read_kv(d / "memory.oom_control").get("oom_kill", 0)

    def cpu_seconds(self) -> float:
        if self.mode == "v2":
            d = self._dir("cpu")
            return _read_kv(d / "cpu.stat").get("usage_usec", 0) / 1e6 if d else 0.0
        d = self._dir("cpuacct")
        return _read_int(d / "cpuacct.usage") / 1e9 if d else 0.0

    def pids_current(self) -> int:
        d = self._dir("pids")
        return _read_int(d / "pids.current") if d else 0

    def pids_limit_hits(self) -> int:
        """How often a fork failed on the pids limit (v1 and v2 both count ``max`` events)."""
        d = self._dir("pids")
        return _read_kv(d / "pids.events").get("max", 0) if d else 0

    def pids(self) -> list[int]:
        """Every process in the set."""
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                found.update(int(x) for x in Path(procs).read_text().split())
        return sorted(found)

    def thaw(self) -> None:
        """Unfreeze the set (a no-op when it is not frozen or has no freezer)."""
        with contextlib.suppress(OSError):
            if self.mode == "v2":
                (Path(self.dirs["unified"]) / "cgroup.freeze").write_text("0")
            elif "freezer" in self.dirs:
                (Path(self.dirs["freezer"]) / "freezer.state").write_text("THAWED")

    def remove(self) -> None:
        """Remove the (empty) directories, children first. Missing ones are fine."""
        for d in self.dirs.values():
            _rmdir_tree(d)


def _rmdir_tree(path: str) -> None:
    """rmdir a cgroup directory and any child cgroups, deepest first (control files go with them).

    Walks with scandir's d_type (no stat per control file): a v1 memory cgroup alone holds ~30 files,
    and this runs for every hierarchy of every destroyed sandbox.
    """
    try:
        with os.scandir(path) as entries:
            children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for child in children:
        _rmdir_tree(child)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
