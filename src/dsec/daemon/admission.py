"""Create admission: creates queue instead of failing when the node is short of slots, memory or pids.

Owns the create slots, the host-resource checks done before a create starts and the queue-time
accounting. A burst of creates (``create_many(1000)``) waits here, in arrival order, until a slot is
free and the host has headroom, and each create learns how long it waited. It never creates or
destroys anything itself and never fails a create for being queued, except past ``timeout``, with an
error naming what was short, or when the daemon stops (:meth:`Admission.close`): the queue is then failed at
once instead of making the shutdown wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from dsec.errors import DaemonStopping, QuotaExceeded
from dsec.isolation.procs import mem_available
from dsec.models import AdmissionStatistics

__all__ = ["Admission", "Deferred", "host_shortage"]


class Deferred(Exception):
    """A background create (a warm-pool refill) found the node busy and was not queued: creates of users
    come first. Not an error of the create: the pool tries again shortly."""

_MIB = 1024**2


_LIMIT_TTL = 5.0
_limit_cache: tuple[float, Path, int] | None = None


def _tasks_and_limit(proc: Path = Path("/proc")) -> tuple[int, int]:
    """(threads alive on the host, the lower of pid_max and threads-max): cheap, no /proc walk. The two limits
    are sysctls an operator changes rarely: read again every ``_LIMIT_TTL`` seconds, not at every create."""
    global _limit_cache
    entities = (proc / "loadavg").read_text().split()[3]  # "running/total" scheduling entities
    total = int(entities.split("/")[1])
    now = time.monotonic()
    if _limit_cache is None or now - _limit_cache[0] > _LIMIT_TTL or _limit_cache[1] != proc:
        limit = min(int((proc / "sys/kernel/pid_max").read_text()),
                    int((proc / "sys/kernel/threads-max").read_text()))
        _limit_cache = (now, proc, limit)
    return total, _limit_cache[2]


def host_shortage(min_free_memory: int, min_free_pids: int) -> str | None:
    """What the host is short of for one more sandbox (``None`` when it has headroom)."""
    available = mem_available()
    if available < min_free_memory:
        return (f"memory: {available // _MIB} MiB available, the node keeps {min_free_memory // _MIB} MiB free "
                "before starting another sandbox")
    tasks, limit = _tasks_and_limit()
    if limit - tasks < min_free_pids:
        return (f"pids: {tasks} of {limit} in use, the node keeps {min_free_pids} free before starting another "
                "sandbox (raise kernel.pid_max)")
    return None


class Admission:
    """At most ``slots`` creates at once, each started only while ``shortage()`` says the host has room.

    ``shortage`` is injectable so that tests can make the host look full; the default reads
    ``/proc/meminfo`` and ``/proc/loadavg``.
    """

    def __init__(
        self,
        slots: int = 32,
        *,
        min_free_memory: int = 512 * _MIB,
        min_free_pids: int = 1024,
        timeout: float = 600.0,
        poll: float = 0.05,
        shortage: Callable[[], str | None] | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"admission needs at least one create slot, got {slots}")
        self.slots = slots
        self.timeout = timeout
        self.poll = poll
        self._shortage = shortage or (lambda: host_shortage(min_free_memory, min_free_pids))
        self._sem = asyncio.Semaphore(slots)
        self._running = 0
        self._waiting = 0
        self._admitted = 0
        self._queued = 0
        self._queue_seconds = 0.0
        self._last_shortage: str | None = None
        self._closed: str | None = None
        self._closing = asyncio.Event()

    def close(self, reason: str) -> None:
        """Admit nothing more: every queued create and every later one raises :class:`DaemonStopping` with
        ``reason``. Creates already admitted run to their end."""
        if self._closed is None:
            self._closed = reason
            self._closing.set()

    def _refuse_if_closed(self) -> None:
        if self._closed is not None:
            raise DaemonStopping(f"create refused: {self._closed}", kept=0)

    async def _acquire(self, deadline: float) -> None:
        """Take a slot: at once when one is free, else wait until one is, ``deadline`` passes (QuotaExceeded)
        or the admission is closed (DaemonStopping)."""
        if not self._sem.locked():
            await self._sem.acquire()  # a free slot: returns without waiting
            return
        slot = asyncio.ensure_future(self._sem.acquire())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((slot, closing), timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            closing.cancel()
            self._give_back(slot)
            raise
        closing.cancel()
        if slot.done() and not slot.cancelled() and self._closed is None:
            return
        self._give_back(slot)  # the daemon began stopping, or the deadline passed, maybe just as a slot came
        self._refuse_if_closed()
        raise QuotaExceeded(f"create not admitted within {self.timeout:g} s: all {self.slots} create slots "
                            "stayed busy")

    def _give_back(self, slot: asyncio.Future[Any]) -> None:
        """Undo a slot wait: a slot granted is released; a wait still pending is cancelled (the semaphore
        passes a slot it grants at that moment on to the next waiter)."""
        if not slot.done():
            slot.cancel()
        elif not slot.cancelled() and slot.exception() is None:
            self._sem.release()

    def statistics(self) -> AdmissionStatistics:
        """Slots, running and waiting creates, totals and the current shortage."""
        return AdmissionStatistics(slots=self.slots, running=self._running, waiting=self._waiting,
                                   admitted=self._admitted, queued=self._queued,
                                   queue_seconds=self._queue_seconds,
                                   # Seen by a create still waiting: once none waits, it may be long over.
                                   shortage=self._last_shortage if self._waiting else None)

    def busy(self) -> str | None:
        """Why a background create would be deferred now (a create queued, no slot free, the host short), or
        None. Cheap (two small /proc reads at most): checked before a refill does any of its set-up."""
        if self._waiting or self._sem.locked():
            return "every create slot is taken or creates are queued"
        if (short := self._shortage()) is not None:
            return f"the node is short of {short}"
        return None

    @contextlib.asynccontextmanager
    async def admit(self, background: bool = False) -> AsyncIterator[float]:
        """Wait for a slot and host headroom; yields the seconds waited. Raises :class:`QuotaExceeded`
        after ``timeout`` seconds, naming what was short, and :class:`DaemonStopping` once :meth:`close` was
        called (at once, also for a create already queued). A ``background`` create never waits: with a
        create queued, no slot free or the host short now, it raises :class:`Deferred` (holding a slot while
        it polled for headroom, a refill would be admitted before the users' creates queued behind it)."""
        started = time.monotonic()
        deadline = started + self.timeout
        self._refuse_if_closed()
        if background and (busy := self.busy()) is not None:
            raise Deferred(busy)
        self._waiting += 1
        try:
            await self._acquire(deadline)
            try:
                while (short := self._shortage()) is not None:  # two small /proc reads: no thread hop
                    if background:  # short since the check above: no slot held while polling
                        raise Deferred(f"the node is short of {short}")
                    self._last_shortage = short
                    self._refuse_if_closed()
                    if time.monotonic() >= deadline:
                        raise QuotaExceeded(f"create not admitted within {self.timeout:g} s: the node is short "
                                            f"of {short}")
                    await asyncio.sleep(self.poll)
            except BaseException:
                self._sem.release()
                self._last_shortage = None  # gone with this create (a later one waiting for a slot is not short)
                raise
            self._last_shortage = None
        finally:
            self._waiting -= 1
        waited = time.monotonic() - started
        self._admitted += 1
        # A free slot and headroom found at once is not "queued": the checks take some microseconds.
        if waited > 0.001:
            self._queued += 1
            self._queue_seconds += waited
        self._running += 1
        try:
            yield waited
        finally:
            self._running -= 1
            self._sem.release()
