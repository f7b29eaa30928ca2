"""Per-call cgroups of a function sandbox: each running call in a cgroup of its own, with its own limits.

Layout under the sandbox's cgroup (v1: in the memory and pids hierarchies; v2: one unified directory)::

    <sandbox>/zygote   the zygotes and the calls they cloned ahead (infrastructure: memory and pids of its own)
    <sandbox>/c<N>     one running call each, with that call's memory and pids limits (``r<R>c<N>`` once the
                       sandbox's zygote was replaced R times: the old zygote's slots may still be draining)

The sandbox's own cgroup keeps its CPU quota (on v1 the zygotes stay there in the cpu, cpuacct, freezer and
devices hierarchies) and bounds the sum: at most :data:`MAX_CALLS` calls run at once, so one call's fork bomb
or memory hog can never take what another call's verdict depends on. A call's cgroup is a *slot*, made on
first use and reused: a memory cgroup costs ~0.4 ms to make and remove, and a removed one lingers while pages
it was charged for (files a call wrote in the workspace) live on. Those pages stay charged to the slot, so
each call's limit is the slot's charge when it was taken back plus the call's own memory; a slot whose
leftover charge grows past :data:`_RECYCLE_BYTES` is replaced.

This module owns these directories, the ``cgroup.procs`` files the zygotes write a call's pid into (opened
here, as host root: the zygotes, inside the sandbox's user namespace, could not open them) and the reading
of their OOM-kill and pids-limit counters. It must never kill anything but the processes left in a slot it
takes back, and never touch the sandbox's own cgroup but to lay it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from dsec.isolation.cgroups import V1_JOINED, CgroupSet
from dsec.isolation.procs import read_small

__all__ = ["MAX_CALLS", "ZYGOTE_PIDS", "CallLimits", "CallSlots", "Slot", "lay_out", "zygote_procs"]

MAX_CALLS = 32
"""Calls of one sandbox running at once; more wait for a slot (the sandbox's cgroup bounds their sum)."""
ZYGOTE_PIDS = 64
"""Processes of the zygote group: the zygote, its launcher, Python zygotes and the calls cloned ahead."""
_ZYGOTE_MIN_MEMORY = 256 * 1024 * 1024
_RECYCLE_BYTES = 64 * 1024 * 1024
_SLOT_CONTROLLERS = ("memory", "pids")
_LIMIT_GRANULE = 1024 * 1024


@dataclass(frozen=True)
class CallLimits:
    """One call's own limits."""

    memory: int
    """Bytes of memory: its processes, and files it writes in its /tmp or the workspace."""
    pids: int
    """Processes and threads of the call (its pid 1 in the sandbox is not counted)."""


def _slot_dirs(sandbox: CgroupSet, name: str) -> dict[str, Path]:
    """The directories of child ``name`` of the sandbox's cgroup where calls are limited."""
    if sandbox.mode == "v2":
        return {"unified": Path(sandbox.dirs["unified"]) / name}
    return {c: Path(d) / name for c, d in sandbox.dirs.items() if c in _SLOT_CONTROLLERS}


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _int_of(data: bytes | None) -> int:
    try:
        return int((data or b"0").split()[0])
    except (ValueError, IndexError):
        return 0


def _key_of(data: bytes | None, key: bytes) -> int:
    for line in (data or b"").splitlines():
        name, _, value = line.partition(b" ")
        if name == key:
            return int(value)
    return 0


def lay_out(sandbox: CgroupSet, memory: int, pids: int) -> None:
    """Make the zygote group and bound the sandbox's cgroup by the sum of its calls' limits (idempotent: a sandbox
    recovered from an older daemon gets its layout here)."""
    total_memory, total_pids = memory * (MAX_CALLS + 1), pids * MAX_CALLS + ZYGOTE_PIDS
    if sandbox.mode == "v2":
        top = Path(sandbox.dirs["unified"])
        control = top / "cgroup.subtree_control"
        missing = {"memory", "pids"} - set(control.read_text().split())
        if missing:
            _write(control, " ".join(f"+{c}" for c in sorted(missing)))
        _write(top / "memory.max", str(total_memory))
        _write(top / "pids.max", str(total_pids))
    else:
        memory_dir, pids_dir = Path(sandbox.dirs["memory"]), Path(sandbox.dirs["pids"])
        memsw = memory_dir / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # raised before the limit it must stay at or above
            _write(memsw, str(total_memory))
        _write(memory_dir / "memory.limit_in_bytes", str(total_memory))
        _write(pids_dir / "pids.max", str(total_pids))
    for controller, d in _slot_dirs(sandbox, "zygote").items():
        d.mkdir(exist_ok=True)
        _set_limits(sandbox.mode, d, controller, max(memory, _ZYGOTE_MIN_MEMORY), ZYGOTE_PIDS,
                    memsw=(d / "memory.memsw.limit_in_bytes").exists())


def zygote_procs(sandbox: CgroupSet) -> list[str]:
    """The ``cgroup.procs`` files the zygote joins: the zygote group where calls are limited, the sandbox's own
    cgroup in every other hierarchy a command joins (its CPU quota, accounting, freezer, device rules)."""
    group = _slot_dirs(sandbox, "zygote")
    if sandbox.mode == "v2":
        return [str(group["unified"] / "cgroup.procs")]
    return [str(group.get(name, Path(d)) / "cgroup.procs") for name, d in sandbox.dirs.items()
            if V1_JOINED.intersection(name.split(","))]


def _set_limits(mode: str, d: Path, controller: str, memory: int | None, pids: int | None,
                previous: int | None = None, memsw: bool = False) -> None:
    """Write what is not None; ``previous``: the memory limit there now (None: a new group, unlimited)."""
    if mode == "v2":
        if memory is not None:
            _write(d / "memory.max", str(memory))
            if previous is None and (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
        if pids is not None:
            _write(d / "pids.max", str(pids))
        return
    if controller == "memory" and memory is not None:
        # memsw (memory + swap: no swap on top) must stay at or above the limit: raised first, lowered last
        raising = previous is not None and memory > previous
        if memsw and raising:
            _write(d / "memory.memsw.limit_in_bytes", str(memory))
        _write(d / "memory.limit_in_bytes", str(memory))
        if memsw and not raising:
            _write(d / "memory.memsw.limit_in_bytes", str(memory))
    if controller == "pids" and pids is not None:
        _write(d / "pids.max", str(pids))


class Slot:
    """One call's cgroup: its directories, the open ``cgroup.procs`` files and its counters."""

    def __init__(self, mode: str, name: str, dirs: dict[str, Path]) -> None:
        self.mode, self.name, self.dirs = mode, name, dirs
        self.memory_dir = dirs["unified" if mode == "v2" else "memory"]
        self.pids_dir = dirs["unified" if mode == "v2" else "pids"]
        self.procs_fds: list[int] = []
        self.memsw = mode == "v1" and (self.memory_dir.parent / "memory.memsw.limit_in_bytes").exists()
        self.memory_limit: int | None = None
        self.pids_limit: int | None = None
        self.base = 0
        """Memory still charged to the slot when it was taken back (pages of files earlier calls wrote)."""
        self.oom_before = 0
        self.pids_before = 0
        self._counters: dict[str, int] = {}
        """The counter files read after every call, kept open: a read at offset 0 of a cgroup file makes it
        anew, so each read is one ``pread`` instead of an open, a read and a close."""

    @classmethod
    def make(cls, sandbox: CgroupSet, name: str) -> Slot:
        slot = cls(sandbox.mode, name, _slot_dirs(sandbox, name))
        try:
            for d in slot.dirs.values():
                d.mkdir(exist_ok=True)  # a slot of the sandbox before its zygote was restarted: empty, reused
                slot.procs_fds.append(os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            slot.remove()
            raise
        slot.read_counters()
        return slot

    def limit(self, limits: CallLimits) -> None:
        """Give the next call ``limits``: its memory on top of what the slot still holds, its processes plus its
        pid 1. Written only when they differ from the slot's (a write is cheap, a memsw reorder less so)."""
        memory = -(-(self.base + limits.memory) // _LIMIT_GRANULE) * _LIMIT_GRANULE
        pids = limits.pids + 1
        for controller, d in self.dirs.items():
            self._apply(controller, d, memory if memory != self.memory_limit else None,
                        pids if pids != self.pids_limit else None)
        self.memory_limit, self.pids_limit = memory, pids

    def _apply(self, controller: str, d: Path, memory: int | None, pids: int | None) -> None:
        _set_limits(self.mode, d, controller, memory, pids, previous=self.memory_limit, memsw=self.memsw)

    def _read(self, path: Path, limit: int) -> bytes | None:
        key = str(path)
        fd = self._counters.get(key)
        if fd is None:
            try:
                fd = self._counters[key] = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            return os.pread(fd, limit, 0)
        except OSError:
            return None

    def oom_kills(self) -> int:
        name = "memory.events" if self.mode == "v2" else "memory.oom_control"
        return _key_of(self._read(self.memory_dir / name, 4096), b"oom_kill")

    def pids_hits(self) -> int:
        return _key_of(self._read(self.pids_dir / "pids.events", 4096), b"max")

    def charged(self) -> int:
        """Bytes of memory charged to the slot now."""
        name = "memory.current" if self.mode == "v2" else "memory.usage_in_bytes"
        return _int_of(self._read(self.memory_dir / name, 64))

    def read_counters(self) -> None:
        self.oom_before, self.pids_before = self.oom_kills(), self.pids_hits()

    def memory_hit(self) -> bool:
        """The call was OOM-killed at its limit (the slot's count rose while it ran)."""
        return self.oom_kills() > self.oom_before

    def pids_hit(self) -> bool:
        """A fork of the call failed at its pids limit."""
        return self.pids_hits() > self.pids_before

    def busy(self) -> bool:
        """Processes of the call are still alive (its pid namespace is ending)."""
        return _int_of(self._read(self.pids_dir / "pids.current", 64)) > 0

    def run_delay(self) -> float:
        """Seconds the call's processes have waited for a CPU (the longest of them; ``/proc/PID/schedstat``):
        what a node overloaded by others took from the call's timeout."""
        longest = 0
        for pid in (read_small(str(self.pids_dir / "cgroup.procs"), 1 << 16) or b"").split():
            stat = read_small(f"/proc/{int(pid)}/schedstat", 128)
            with contextlib.suppress(ValueError, IndexError):
                longest = max(longest, int((stat or b"").split()[1]))
        return longest / 1e9

    def at_memory_limit(self) -> bool:
        """The call's memory is within 1% of its limit: it is pressing on it (reclaim, or an OOM kill coming)."""
        usage = self.charged()
        return self.memory_limit is not None and usage >= self.memory_limit - max(self.memory_limit // 100, 1 << 20)

    def kill(self) -> None:
        """SIGKILL whatever of the last call is left (its pid 1 first, which ends its pid namespace)."""
        data = read_small(str(self.pids_dir / "cgroup.procs"), 1 << 20) or b""
        for pid in data.split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def taken_back(self) -> None:
        """The call is over and its processes gone: what it left charged, and the counters for the next."""
        self.base = self.charged()
        self.read_counters()

    def close_files(self) -> None:
        for fd in (*self.procs_fds, *self._counters.values()):
            os.close(fd)
        self.procs_fds = []
        self._counters = {}

    def remove(self) -> None:
        self.close_files()
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.rmdir(d)
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise


class CallSlots:
    """The slots of one sandbox: :meth:`acquire` waits for one when :data:`MAX_CALLS` calls run."""

    def __init__(self, sandbox: CgroupSet, prefix: str = "c") -> None:
        self.sandbox = sandbox
        self.prefix = prefix
        """Of the slots' names (``<prefix><N>``): the slots of a zygote started anew over the same cgroup (a revive)
        must not share names with the old zygote's, which may still be draining (killing what is in them, then
        removing them)."""
        self._free: list[Slot] = []
        self._made = 0
        self._gate = asyncio.Semaphore(MAX_CALLS)
        self._draining: set[asyncio.Task[None]] = set()
        self._closed = False

    async def acquire(self, limits: CallLimits) -> Slot:
        await self._gate.acquire()
        try:
            if self._free:
                slot = self._free.pop()
            else:
                self._made += 1
                slot = await asyncio.to_thread(Slot.make, self.sandbox, f"{self.prefix}{self._made}")
            slot.limit(limits)
        except BaseException:
            self._gate.release()
            raise
        return slot

    def release(self, slot: Slot, settled: bool = True) -> None:
        """The call is over and its zygote reaped it (``settled``): the slot is free again, once anything left in
        it is gone. Not ``settled`` (its zygote never let go of it): it may still hold or receive the call's
        processes, so it is killed, removed when empty and never reused."""
        if settled and not self._closed and not slot.busy():
            self._take_back(slot)
            return
        task = asyncio.get_running_loop().create_task(self._drain(slot, retire=not settled or self._closed))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, slot: Slot, retire: bool) -> None:
        # Rare: the call's zygote died (its calls die by PDEATHSIG, a moment later) or never let go of the call.
        try:
            pause = 0.005
            for _ in range(40):
                slot.kill()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                if not slot.busy():
                    break
        finally:
            if not retire and not self._closed and not slot.busy():
                self._take_back(slot)
            else:  # retired, given up on (a process that would not die) or the sandbox is going away
                with contextlib.suppress(OSError):
                    slot.remove()
                self._gate.release()

    def _take_back(self, slot: Slot) -> None:
        slot.taken_back()
        if slot.base > _RECYCLE_BYTES:  # replaced: the next call gets a fresh one
            with contextlib.suppress(OSError):
                slot.remove()
        else:
            self._free.append(slot)
        self._gate.release()

    def close(self, remove: bool = False) -> None:
        """Forget every slot: the sandbox is going away (its cgroups are removed with it), or with ``remove`` its
        zygote is replaced (the free slots' cgroups are removed now; those in use go when their call ends)."""
        self._closed = True
        for task in self._draining:
            task.cancel()
        for slot in self._free:
            if remove:
                with contextlib.suppress(OSError):
                    slot.remove()
            else:
                slot.close_files()
        self._free = []

