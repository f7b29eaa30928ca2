"""Cgroup v1 (per-controller hierarchies, as on hybrid hosts) and v2 (unified) behind one class.

DSec owns its sandboxes' cgroups: this module creates them with their limits (the OCI
runtime runs with its cgroup manager disabled), finds them again, reads usage (memory,
peak, OOM kills, CPU, pids), freezes and thaws them, and removes them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.isolation.procs import read_small

__all__ = ["CPU_SHARES_BUSY", "CPU_SHARES_IDLE", "CPU_WEIGHT_BUSY", "CPU_WEIGHT_IDLE", "TEARDOWN_BOUND", "CgroupSet",
           "LimitCounters", "Limits", "background_group", "cgroup_mode", "v2_controllers_in_hybrid", "v2_make"]

_ROOT = Path("/sys/fs/cgroup")
_log = logging.getLogger(__name__)


CPU_SHARES_IDLE, CPU_SHARES_BUSY = 2, 1024
"""v1 ``cpu.shares`` of an idle sandbox and of one running a command (:meth:`CgroupSet.set_cpu_class`)."""
CPU_WEIGHT_IDLE, CPU_WEIGHT_BUSY = 1, 100
"""The same on v2 (``cpu.weight``)."""
TEARDOWN_BOUND = 30.0
"""Seconds a destroyed sandbox's killed tasks get to leave its cgroups: microseconds on an idle host, seconds on
one whose CPUs are oversubscribed (each exit waits its turn; a count of quick retries ran out there)."""
V1_JOINED = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer", "devices"})
"""v1 controllers a command joins: its limits (memory, pids, cpu), CPU accounting, pause, device rules."""


@functools.lru_cache(maxsize=8)
def cgroup_mode(root: Path = _ROOT) -> str:
    """``"v2"`` on a unified host, ``"v1"`` on a legacy or hybrid one (controllers on v1).

    Remembered per root: a host does not switch cgroup versions under a running daemon, and backends ask
    on every exec."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    return "v1"


def v2_controllers_in_hybrid(root: Path = _ROOT) -> bool:
    """True on a hybrid host whose v2 hierarchy holds a controller (crun refuses to start there)."""
    try:
        return cgroup_mode(root) == "v1" and bool((root / "unified" / "cgroup.controllers").read_text().split())
    except OSError:
        return False


@dataclass(frozen=True)
class Limits:
    """What a sandbox's cgroups allow."""

    memory: int
    """Bytes of memory (page cache included); swap is never allowed on top."""
    cpu: float
    """CPUs (a CFS quota of ``cpu`` periods per period)."""
    pids: int
    """Live processes and threads."""
    cpu_period_us: int = 100_000

    @property
    def cpu_quota_us(self) -> int:
        return max(1000, int(self.cpu * self.cpu_period_us))


# v1 device rules: deny everything, then allow what an OCI runtime puts in /dev (null, zero, full,
# random, urandom, tty, ptmx and the pts ptys). In a user namespace mknod is impossible anyway.
_V1_DEVICES_ALLOW = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm",
                     "c 5:2 rwm", "c 136:* rwm")


_KERNEL_CFS_PERIOD_US = 100_000
"""``cpu.cfs_period_us`` of a new v1 cgroup."""


def _write(path: Path | str, value: str) -> None:
    # A bare open/write/close, with open(path, "w")'s flags: ~15 of these per create (limits, device rules),
    # and a text file object costs three syscalls more each (fstat, ioctl, lseek) and its Python layers.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


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


def _read_kv(path: Path | str) -> dict[str, int]:
    out: dict[str, int] = {}
    data = read_small(str(path), 65536)  # read around every exec: a bare open/read/close
    if data is None:
        return out
    for line in data.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class LimitCounters:
    """Where a set counts its OOM kills and pids-limit hits: what :meth:`CgroupSet.oom_kills` and
    :meth:`CgroupSet.pids_limit_hits` read, without building the paths again at each read."""

    oom_file: str | None
    pids_file: str | None

    def oom_kills(self) -> int:
        return _read_kv(self.oom_file).get("oom_kill", 0) if self.oom_file else 0

    def pids_limit_hits(self) -> int:
        return _read_kv(self.pids_file).get("max", 0) if self.pids_file else 0


@dataclass(frozen=True)
class CgroupSet:
    """The cgroup directories of one sandbox: one per v1 controller, or one unified v2 directory."""

    mode: str
    dirs: dict[str, str]
    """Controller name (``"unified"`` on v2) -> absolute directory."""

    @classmethod
    def at(cls, relpath: str, root: Path = _ROOT) -> CgroupSet:
        """The cgroups at ``relpath`` (as in runc's ``cgroupsPath``), whether they exist or not."""
        mode = cgroup_mode(root)
        rel = relpath.lstrip("/")
        if mode == "v2":
            return cls(mode=mode, dirs={"unified": str(root / rel)})
        return cls(mode=mode, dirs={name: str(root / name / rel) for name in _v1_hierarchies(root)})

    @classmethod
    def create(cls, relpath: str, limits: Limits, root: Path = _ROOT, *, background: bool | None = None
               ) -> CgroupSet:
        """Make the cgroups at ``relpath`` with ``limits``; on v1 only in the :data:`V1_JOINED` hierarchies.

        The parent directory is created when missing and kept (other sandboxes share it); when this call
        makes it and ``background`` is not None, the top-level group gets that CPU class
        (:func:`background_group`). On failure whatever was made for ``relpath`` is removed again.
        """
        mode = cgroup_mode(root)
        rel = relpath.strip("/")
        if mode == "v2":
            made = cls(mode=mode, dirs={"unified": str(root / rel)})
        else:
            made = cls(mode=mode, dirs={name: str(root / name / rel) for name in _v1_hierarchies(root)
                                        if V1_JOINED.intersection(name.split(","))})
        try:
            made_parent = False
            for name, d in made.dirs.items():
                path = Path(d)
                for attempt in range(3):
                    if mode == "v2":
                        made_parent |= _v2_enable_parents(root, path.parent)
                    else:
                        try:
                            path.parent.mkdir(parents=True)
                            made_parent = True
                        except FileExistsError:
                            pass
                    try:
                        path.mkdir()
                        break
                    except FileNotFoundError:
                        # The last sibling's destroy removed the shared parent between the two mkdirs: again.
                        if attempt == 2:
                            raise
                made._limit(name, path, limits)
            if made_parent and background is not None and "/" in rel:  # before anything runs in the new group
                background_group(rel.split("/", 1)[0], background, root, make=False)
        except BaseException:
            made.remove()
            raise
        return made

    def _limit(self, name: str, d: Path, limits: Limits) -> None:
        if self.mode == "v2":
            _write(d / "memory.max", str(limits.memory))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "cpu.max", f"{limits.cpu_quota_us} {limits.cpu_period_us}")
            _write(d / "pids.max", str(limits.pids))
            return
        controllers = set(name.split(","))  # a hierarchy may carry several ("cpu,cpuacct")
        if "memory" in controllers:
            _write(d / "memory.limit_in_bytes", str(limits.memory))
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", str(limits.memory))
        if "cpu" in controllers:
            # Each write of either file walks the node's whole CFS bandwidth tree (__cfs_schedulable: every
            # cpu cgroup, so O(live sandboxes); 3% of all CPU samples at 6,000 sandboxes): the period of a new
            # cgroup already is the kernel's default, so only a different one is written.
            if limits.cpu_period_us != _KERNEL_CFS_PERIOD_US:
                _write(d / "cpu.cfs_period_us", str(limits.cpu_period_us))
            _write(d / "cpu.cfs_quota_us", str(limits.cpu_quota_us))
        if "pids" in controllers:
            _write(d / "pids.max", str(limits.pids))
        if "devices" in controllers:
            _write(d / "devices.deny", "a")
            for rule in _V1_DEVICES_ALLOW:
                _write(d / "devices.allow", rule)

    def set_cpu_class(self, busy: bool) -> None:
        """Best-effort CPU for an idle sandbox, normal weight while it runs a command.

        v1: ``cpu.shares`` 2 (the kernel's minimum) vs 1024; v2: ``cpu.weight`` 1 vs 100. The CFS quota
        (the ``cpu`` limit) is untouched: the class only decides who yields when the node's CPUs are
        contended, so the background processes of sandboxes nobody is talking to yield to the commands
        of the others. It ranks a sandbox against its siblings only; against the node's own processes the
        sandboxes' top-level group decides (:func:`background_group`).
        """
        d = self._dir("cpu")
        if d is None:
            return
        if self.mode == "v2":
            _write(d / "cpu.weight", str(CPU_WEIGHT_BUSY if busy else CPU_WEIGHT_IDLE))
        else:
            _write(d / "cpu.shares", str(CPU_SHARES_BUSY if busy else CPU_SHARES_IDLE))

    def kill_all(self, recursive: bool = False) -> None:
        """SIGKILL every process in the set (the function backend's calls after their zygote died); ``recursive``:
        in its child cgroups too."""
        for pid in self.pids(recursive):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)

    def _dir(self, controller: str) -> Path | None:
        d = self.dirs.get("unified" if self.mode == "v2" else controller)
        if d is None and self.mode != "v2":  # co-mounted v1 hierarchies are keyed "cpu,cpuacct"
            d = next((p for name, p in self.dirs.items() if controller in name.split(",")), None)
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

    def limit_counters(self) -> LimitCounters:
        """The OOM-kill and pids-limit counters of this set, paths resolved once (read around every exec)."""
        memory, pids = self._dir("memory"), self._dir("pids")
        oom = None if memory is None else str(memory / ("memory.events" if self.mode == "v2" else "memory.oom_control"))
        return LimitCounters(oom_file=oom, pids_file=None if pids is None else str(pids / "pids.events"))

    def pids(self, recursive: bool = False) -> list[int]:
        """Every process in the set (``recursive``: and in its child cgroups, e.g. a function sandbox's calls)."""
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                found.update(int(x) for x in Path(procs).read_text().split())
            if recursive:
                with contextlib.suppress(OSError):
                    for child in Path(procs).parent.iterdir():
                        if child.is_dir():
                            with contextlib.suppress(OSError):
                                found.update(int(x) for x in (child / "cgroup.procs").read_text().split())
        return sorted(found)

    def freeze(self, timeout: float = 5.0) -> None:
        """Freeze every process of the set and wait until the kernel reports it frozen."""
        d = self._dir("freezer")
        if d is None:
            raise OSError(f"no freezer cgroup in {sorted(self.dirs)}")
        _write(d / ("cgroup.freeze" if self.mode == "v2" else "freezer.state"), "1" if self.mode == "v2" else "FROZEN")
        deadline = time.monotonic() + timeout
        while not self.frozen():
            if time.monotonic() > deadline:
                self.thaw()
                raise TimeoutError(f"cgroup {d} did not freeze within {timeout:g}s")
            time.sleep(0.001)

    def frozen(self) -> bool:
        """True when every process of the set is frozen."""
        d = self._dir("freezer")
        if d is None:
            return False
        if self.mode == "v2":
            return _read_kv(d / "cgroup.events").get("frozen", 0) == 1
        with contextlib.suppress(OSError):
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        return False

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

    A cgroup with no child cgroup (the usual case) goes in one rmdir. Only when that fails (EBUSY) are its
    children listed, with scandir's d_type (no stat per control file: a v1 memory cgroup alone holds ~30
    files, and this runs for every hierarchy of every destroyed sandbox); a cgroup that still holds tasks
    then fails the last rmdir with EBUSY.
    """
    try:
        os.rmdir(path)
        return
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as err:
        if err.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            raise
    try:
        with os.scandir(path) as entries:
            children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for child in children:
        _rmdir_tree(child)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def background_group(relpath: str, background: bool, root: Path = _ROOT, *, make: bool = True) -> None:
    """Make the top-level cgroup ``relpath`` that holds a backend's sandboxes (in every hierarchy they join)
    and set its CPU class; with ``make`` False only set the class of a group that is already there (a daemon
    restarted with another setting over live sandboxes).

    ``background``: a SCHED_IDLE group (``cpu.idle`` 1, kernel 5.15+). Against the node's own processes
    (the daemon, the exec helper) the whole group then counts as one idle task: they preempt it at once
    when they wake. A sandbox's share of CPU weight (``cpu.shares``, :meth:`CgroupSet.set_cpu_class`) only
    ranks it against its siblings inside the group, so without this a CPU hog in an idle sandbox still
    took the daemon's CPU at equal weight and delayed every other sandbox's exec by a few ms. Otherwise
    (``cpu.idle`` 0) the sandboxes compete with the node's processes at normal weight.
    """
    rel = relpath.strip("/")
    if not rel or "/" in rel:
        raise ValueError(f"background_group: {relpath!r} is not a top-level cgroup")
    mode = cgroup_mode(root)
    if mode == "v2":
        if make:
            _v2_enable_parents(root, root / rel)
        _set_cpu_idle(root / rel, background)
        return
    for name in _v1_hierarchies(root):
        if V1_JOINED.intersection(name.split(",")):
            if make:
                (root / name / rel).mkdir(exist_ok=True)
            if "cpu" in name.split(","):
                _set_cpu_idle(root / name / rel, background)


def v2_make(path: Path, root: Path = _ROOT) -> None:
    """Make the v2 cgroup ``path`` (below ``root``) with memory, cpu and pids enabled for it: each directory
    above it lists them in ``cgroup.subtree_control``, or the limit files would not exist and a limit written
    there would never apply (for a caller that writes its own limits, such as the microvm backend's QEMU)."""
    _v2_enable_parents(root, path.parent)
    path.mkdir(exist_ok=True)


def _set_cpu_idle(group: Path, idle: bool) -> None:
    """Write ``cpu.idle`` of ``group`` when it differs. Best effort, since sandboxes run without the class:
    nothing is done where there is no such file (a kernel older than 5.15, a v2 group without the cpu
    controller), and a failed write (the group removed meanwhile: ENODEV; the create that makes it again
    sets the class) is logged, not raised."""
    value = "1" if idle else "0"
    try:
        if read_small(str(group / "cpu.idle"), 16) not in (value.encode() + b"\n", None):
            _write(group / "cpu.idle", value)
    except OSError as exc:
        _log.warning("could not set cpu.idle of %s to %s: %s", group, value, exc)


def _v2_enable_parents(root: Path, parent: Path) -> bool:
    """Make ``parent`` (below ``root``) and enable memory, cpu and pids for the children of every
    directory from ``root`` down to it, so that a sandbox directory below ``parent`` gets them; True when
    this call made any of those directories."""
    rel = parent.relative_to(root).parts
    chain = [root] + [root.joinpath(*rel[:n]) for n in range(1, len(rel) + 1)]
    made = False
    for d in chain:
        try:
            d.mkdir()
            made = True
        except FileExistsError:
            pass
        control = d / "cgroup.subtree_control"
        missing = {"memory", "cpu", "pids"} - set(control.read_text().split())
        if missing:
            _write(control, " ".join(f"+{c}" for c in sorted(missing)))
    return made
