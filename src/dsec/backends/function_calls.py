"""How a function sandbox runs its calls: each in a cgroup of its own, with its own limits and a verdict
that names the limit it hit; ``exec`` through the sandbox's zygote, ``sb.call`` through its Python zygote.

:class:`Calls` is composed into :class:`~dsec.backends.function.FunctionBackend`. Per sandbox it owns the
call slots (:mod:`dsec.isolation.callslots`) and the Python zygotes (one per interpreter name, started at the
first ``sb.call``, drained after a mount change). It must never create or remove a sandbox's other resources
(directories, the zygote, the sandbox's cgroup): the backend does.

A call's limits default to the sandbox's and may only be lowered per call: ``memory`` (its processes and the
files it writes, which live in memory), ``pids`` (its processes) and ``disk`` (its ``/tmp``, by default half
of its memory at most, so that a file outgrowing ``/tmp`` ends in ENOSPC and the ``disk`` verdict rather than
an OOM kill). Verdicts of a failed call, from its own cgroup's counters: ``memory`` (OOM kills rose),
``time`` (SIGXCPU, or the CPU-time backstop), ``pids`` (a fork failed at the limit), ``disk`` (its ``/tmp``
full, or the workspace filled while it ran); ``time`` and ``output`` from the stream itself. A call's timeout
does not count the time it waited for a CPU (a node overloaded by others: ``/proc/PID/schedstat``) nor its
set-up before its own code ran (its zygote waiting for a CPU, its move into its cgroup, which blocks for
seconds on a busy node), nor the time it spent at its memory limit while the kernel had still to OOM-kill it,
up to ten times the timeout and 300 s in all. Failures of the sandbox (a zygote gone, a call
that could not start) raise errors and are never a verdict.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from dsec.backends.base import signal_of
from dsec.errors import InvalidRequest, SandboxError
from dsec.isolation.callslots import CallLimits, CallSlots, Slot
from dsec.isolation.cgroups import CgroupSet
from dsec.isolation.disk import disk_full
from dsec.isolation.exec_client import Spawned, stream_exec
from dsec.isolation.pipewatch import pipe_watch
from dsec.isolation.zygote import PyZygote, Zygote
from dsec.models import ExecEvent, ExecRequest, LimitHit, SandboxRecord

__all__ = ["Calls", "cpu_rlimit", "default_tmp", "release_when_exited", "release_when_reaped", "warm_program"]

_MIN_TMP = 1024 * 1024
# A call's pid namespace normally ends within milliseconds of its report; a sandbox starved of CPU (its class
# yields to the node's processes) can take seconds.
_REAPED_WITHIN_S = 120.0

Spawn = Callable[[list[str], Sequence[int]], Awaitable[Spawned]]


def default_tmp(memory: int, disk: int) -> int:
    """The size of a call's ``/tmp`` unless it asks for another: its disk, at most half of its memory."""
    return max(_MIN_TMP, min(disk, memory // 2))


def warm_program(request: ExecRequest, env: Mapping[str, str]) -> bool:
    """Whether ``request`` may run forked from the sandbox's Python zygote (``warm_python``) and behave as a fresh
    ``python script arg...``: an argv of an interpreter name and a script (no interpreter option, no program on
    stdin), no ``PYTHON*`` variable (the zygote's interpreter has read its environment) and a locale the zygote
    reproduces (C, POSIX or UTF-8). Anything else runs as a fresh process."""
    argv = request.command
    if not request.warm_python or isinstance(argv, str) or len(argv) < 2:
        return False
    if argv[0].startswith("-") or "/" in argv[0] or argv[1].startswith("-"):
        return False
    if any(key.startswith("PYTHON") for key in env):
        return False
    locale = env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "C"
    return locale in ("C", "POSIX") or locale.lower().replace("-", "").endswith(".utf8")


def cpu_rlimit(timeout: float | None, cpus: float) -> int:
    """RLIMIT_CPU backing a call's wall-clock timeout (0: none). It counts every thread of a process, so it
    allows the CPU time the sandbox's quota gives in that time (a 4-thread call on cpu=4 got SIGXCPU after a
    quarter of its timeout)."""
    return math.ceil(timeout * math.ceil(cpus)) + 1 if timeout else 0


class Calls:
    """The calls of every function sandbox of one backend: slots, Python zygotes, verdicts."""

    def __init__(self) -> None:
        self._slots: dict[str, CallSlots] = {}
        self._pythons: dict[str, dict[str, PyZygote]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refused: dict[tuple[str, str], InvalidRequest] = {}
        self._revivals: dict[str, int] = {}
        """Sandbox id -> how many times its zygote was replaced (:meth:`forget` with ``again``): its slots' names."""

    # -- limits ---------------------------------------------------------------------------

    @staticmethod
    def limits(record: SandboxRecord, memory: int | None = None, pids: int | None = None,
               disk: int | None = None) -> tuple[CallLimits, int]:
        """A call's limits and the size of its ``/tmp``: the sandbox's, or lower ones it asked for."""
        spec = record.spec
        for name, value, cap in (("memory", memory, spec.memory), ("pids", pids, spec.pids),
                                 ("disk", disk, spec.disk)):
            if value is not None and value > cap:
                raise InvalidRequest(f"a call's {name} ({value}) cannot exceed its sandbox's ({cap}): create the "
                                     f"sandbox with {name}={value} or more", field=name)
        limits = CallLimits(memory=memory or spec.memory, pids=pids or spec.pids)
        return limits, disk if disk is not None else default_tmp(limits.memory, spec.disk)

    def slots(self, record: SandboxRecord, cgroups: CgroupSet) -> CallSlots:
        found = self._slots.get(record.id)
        if found is None:
            again = self._revivals.get(record.id, 0)
            found = self._slots[record.id] = CallSlots(cgroups, prefix=f"r{again}c" if again else "c")
        return found

    # -- running one call -----------------------------------------------------------------

    async def run(self, record: SandboxRecord, cgroups: CgroupSet, request: ExecRequest, fields: list[str],
                  spawn: Spawn, limits: CallLimits, peer: str, caps: Mapping[str, int] | None = None,
                  cpu: int = 0) -> AsyncGenerator[ExecEvent, None]:
        """Run one call in a slot of its own and stream it, with its verdict."""
        slots = self.slots(record, cgroups)
        slot = await slots.acquire(limits)
        spawned: Spawned | None = None

        def status_to(status: int, at_eof: bool) -> None:
            # The status pipe reaches end of file once the zygote has reaped the call's pid 1, which is when the
            # last process of its pid namespace is gone: the moment its slot can take the next call.
            release_when_reaped(slots, slot, status, at_eof)

        try:
            disk: str | None = record.backend_state.get("disk")
            workspace_was_full = disk is not None and disk_full(disk)
            spawned = await spawn(fields, slot.procs_fds)

            def verdict(exit_code: int, sig: int | None) -> LimitHit | None:
                if exit_code == 0:
                    return None
                if slot.memory_hit():
                    return "memory"
                if sig == signal.SIGXCPU:
                    return "time"
                if slot.pids_hit():
                    return "pids"
                if spawned.reports.get("tmpfull") == "1" or (disk and not workspace_was_full and disk_full(disk)):
                    return "disk"
                return None

            events = stream_exec(spawned, request, verdict, peer=peer, caps=caps, starved=slot.run_delay,
                                 pressing=slot.at_memory_limit, status_to=status_to)
            try:
                async for event in events:
                    if event.type == "exit" and event.result is not None:
                        event = _cpu_backstop(event, cpu)
                    yield event
            finally:
                await events.aclose()
        finally:
            if spawned is None:
                slots.release(slot)
            elif spawned.status >= 0:
                # The stream never ran (one that did took the pipe, and hands it over at once or once it killed the
                # call): the call is killed, its slot freed once it is reaped.
                spawned.kill()
                status, spawned.status = spawned.status, -1
                spawned.close()
                release_when_reaped(slots, slot, status, False)

    # -- Python zygotes -------------------------------------------------------------------

    async def python(self, record: SandboxRecord, zygote: Zygote, python: str, argv: list[str]) -> PyZygote:
        """The sandbox's Python zygote for interpreter ``python``, started with ``argv`` on first use (and again
        after it went away or was drained); :class:`InvalidRequest` when the image has no such interpreter."""
        pythons = self._pythons.setdefault(record.id, {})
        found = pythons.get(python)
        if found is not None and found.alive():
            return found
        refused = self._refused.get((record.id, python))
        if refused is not None:
            raise refused
        lock = self._locks.setdefault(record.id, asyncio.Lock())
        async with lock:
            found = pythons.get(python)
            if found is not None and found.alive():
                return found
            if found is not None:
                found.close()
            try:
                started = await asyncio.to_thread(zygote.start_python, argv)
            except InvalidRequest as e:
                refused = InvalidRequest(f"sb.call needs Python in the sandbox's image: {e.message}; exec() works "
                                         f"without it. Use an image with Python, or name its interpreter with "
                                         f"python='/path/to/python3'", python=python)
                self._refused[(record.id, python)] = refused
                raise refused from None
            if self._locks.get(record.id) is not lock:
                # Forgotten meanwhile (destroyed, or its zygote replaced): nothing would ever close this one, and
                # the call must not make slots again for a sandbox that is gone.
                started.close()
                raise SandboxError(f"sandbox {record.id} is not running (it was destroyed, or its zygote replaced, "
                                   f"while its Python zygote started)")
            pythons[python] = started
            return started

    def drain_pythons(self, sandbox_id: str) -> None:
        """The sandbox's mounts changed: its Python zygotes finish their calls and go; the next call starts a
        new one, which sees the mounts as they are now."""
        for found in self._pythons.pop(sandbox_id, {}).values():
            found.drain()

    def forget(self, sandbox_id: str, again: bool = False) -> None:
        """The sandbox is going away, or with ``again`` its zygote is replaced (a revive): stop its Python zygotes
        and drop its slots (the next ones are named apart from these, which may still be draining)."""
        for found in self._pythons.pop(sandbox_id, {}).values():
            found.close()
        slots = self._slots.pop(sandbox_id, None)
        if slots is not None:
            slots.close(remove=again)
        revivals = self._revivals.pop(sandbox_id, 0)
        if again:
            self._revivals[sandbox_id] = revivals + 1
        self._locks.pop(sandbox_id, None)
        for key in [k for k in self._refused if k[0] == sandbox_id]:
            del self._refused[key]

    def close(self) -> None:
        for sandbox_id in list({*self._pythons, *self._slots}):
            self.forget(sandbox_id)


def release_when_reaped(slots: CallSlots, slot: Slot, status: int, at_eof: bool = False) -> None:
    """Give ``slot`` back when ``status`` (the call's status pipe, non-blocking, which this now owns) reaches end
    of file (``at_eof``: it has); a call whose zygote never lets go of it within :data:`_REAPED_WITHIN_S` has its
    slot retired instead."""
    if at_eof:  # (the stream has already stopped reading it)
        os.close(status)
        slots.release(slot)
        return
    loop = asyncio.get_running_loop()
    pipes = pipe_watch(loop)
    timer: asyncio.TimerHandle | None = None

    def finish(reaped: bool) -> None:
        pipes.remove(status)
        os.close(status)
        if timer is not None:
            timer.cancel()
        slots.release(slot, settled=reaped)

    def readable() -> None:
        try:
            if os.read(status, 4096):
                return  # a report the stream did not wait for (the zygote's "exit" of a killed call)
        except BlockingIOError:
            return
        except OSError:
            pass
        finish(True)

    pipes.replace(status, readable)  # the stream's watch of it changes hands, or a watch of our own
    timer = loop.call_later(_REAPED_WITHIN_S, finish, False)


def release_when_exited(slots: CallSlots, slot: Slot, host_pid: int | None) -> None:
    """Give ``slot`` back once the process ``host_pid`` (a call's pid 1, which ends its pid namespace) exits: for a
    process of the surface API, whose status pipe its own reader consumes."""
    try:
        pidfd = os.pidfd_open(host_pid) if host_pid else -1
    except ProcessLookupError:
        pidfd = -1
    if pidfd < 0:
        slots.release(slot)
        return
    loop = asyncio.get_running_loop()

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        slots.release(slot)

    loop.add_reader(pidfd, exited)


def _cpu_backstop(event: ExecEvent, cpu: int) -> ExecEvent:
    """A call killed (SIGKILL) by its CPU rlimit's hard limit after SIGXCPU was ignored: the time verdict."""
    r: Any = event.result
    if r is None or r.limit is not None:
        return event
    killed = signal_of(r.exit_code, r.signal) in (signal.SIGKILL, signal.SIGXCPU)
    if killed and cpu and r.cpu_s is not None and r.cpu_s >= cpu - 1:
        return ExecEvent(type="exit", result=r.model_copy(update={"limit": "time"}))
    return event
