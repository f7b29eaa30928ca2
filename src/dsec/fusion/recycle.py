"""The function sandboxes ``/run_code`` requests run in: claimed from the daemon's warm pool, and, once a
request is done and the sandbox's working directory is wiped, kept for the next request of the same shape
(which waits for a wipe under way rather than take a new sandbox).

Owns which sandbox a request gets and whether a used one may serve again. A function sandbox keeps nothing of
a call but the files of its working directory (each call has its own pid, mount, IPC and UTS namespaces, its
own ``/tmp`` and cgroup, and every process of a call dies with it), so a sandbox whose working directory was
emptied (through the files API, or a shell for what that cannot remove) is as fresh as a new one; one whose
wipe failed, or that served ``MAX_USES`` requests, or comes near its expiry, is destroyed instead. Sandboxes
of different memory or of different jobs are never mixed. It must never run a request's code
(:mod:`dsec.fusion.runner`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from dsec.api.protocol import NodeAPI
from dsec.daemon.auth import JOB_LABEL
from dsec.errors import DSecError
from dsec.models import ExecRequest, SandboxSpec

__all__ = ["Lease", "Recycler"]

log = logging.getLogger("dsec.fusion")

LIFETIME = 3600.0
"""Seconds a sandbox lives (its timeout); it stops serving ``RETIRE_MARGIN`` before."""
RETIRE_MARGIN = 600.0
MAX_USES = 500
"""Requests one sandbox serves before it is replaced."""


@dataclass
class Lease:
    """One sandbox lent to a request."""

    sandbox_id: str
    key: tuple[int, str | None]
    """(memory, job): the shape it may serve again."""
    born: float
    uses: int = 0


class Recycler:
    """Hands out sandboxes of ``image`` and takes them back."""

    def __init__(self, api: NodeAPI, image: str, workdir: str, keep: int) -> None:
        self.api = api
        self.image = image
        self.workdir = workdir
        self.keep = keep
        """Idle sandboxes kept per shape at most."""
        self._idle: dict[tuple[int, str | None], list[Lease]] = {}
        self._wiping: dict[tuple[int, str | None], int] = {}
        self._waiters: dict[tuple[int, str | None], list[asyncio.Future[None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def claim(self, memory: int, job: str | None) -> Lease:
        """An idle sandbox of that shape; else one of that shape being wiped, once it is; else a new one (from
        the daemon's pool when it has that shape). A wipe takes a few ms; a new sandbox costs its creation and
        its first Python program the start of the sandbox's warm interpreter."""
        key = (memory, job)
        while True:
            lease = self._take(key)
            if lease is not None:
                return lease
            if not self._wiping.get(key):
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(waiter)
            await waiter
        spec = SandboxSpec(image=self.image, backend="function", memory=memory, workdir=self.workdir,
                           timeout=LIFETIME, labels={JOB_LABEL: job} if job is not None else {})
        return Lease((await self.api.create(spec)).id, key, time.monotonic())

    def _take(self, key: tuple[int, str | None]) -> Lease | None:
        idle = self._idle.get(key, [])
        while idle:
            lease = idle.pop()
            if time.monotonic() - lease.born < LIFETIME - RETIRE_MARGIN:
                return lease
            self._background(self._destroy(lease.sandbox_id))
        return None

    def release(self, lease: Lease) -> None:
        """Take a sandbox back after its request (its wipe runs in the background)."""
        lease.uses += 1
        self._background(self._recycle(lease))

    async def aclose(self) -> None:
        """Destroy every idle sandbox once the pending wipes are done."""
        while self._tasks:
            await asyncio.wait(set(self._tasks), timeout=30)
        for leases in self._idle.values():
            for lease in leases:
                await self._destroy(lease.sandbox_id)
        self._idle.clear()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recycle(self, lease: Lease) -> None:
        idle = self._idle.setdefault(lease.key, [])
        if lease.uses >= MAX_USES or len(idle) >= self.keep:
            await self._destroy(lease.sandbox_id)
            return
        self._wiping[lease.key] = self._wiping.get(lease.key, 0) + 1
        try:
            wiped = await self._wipe(lease.sandbox_id)
            if wiped:
                idle.append(lease)
        finally:
            self._wiping[lease.key] -= 1
            for waiter in self._waiters.pop(lease.key, []):  # they look again: one takes it, or they create
                if not waiter.done():
                    waiter.set_result(None)
        if not wiped:
            await self._destroy(lease.sandbox_id)

    async def _wipe(self, sandbox_id: str) -> bool:
        """Empty the working directory; True when it is empty. Through the files API first (no process to
        start), then, for what that could not remove (a directory the code made unreadable), a shell."""
        try:
            entries = await self.api.list_files(sandbox_id, self.workdir)
            await asyncio.gather(*(self.api.remove_file(sandbox_id, e.path, recursive=e.type == "dir")
                                   for e in entries))
            if not await self.api.list_files(sandbox_id, self.workdir):
                return True
        except DSecError:
            pass
        script = 'chmod -R u+rwX "$0" 2>/dev/null; find "$0" -mindepth 1 -delete && [ -z "$(ls -A "$0")" ]'
        try:
            done = await self.api.exec(sandbox_id, ExecRequest(command=["/bin/sh", "-c", script, self.workdir],
                                                               timeout=60))
        except DSecError as exc:
            log.warning("run_code: wiping sandbox %s failed: %s", sandbox_id, exc)
            return False
        return done.exit_code == 0

    async def _destroy(self, sandbox_id: str) -> None:
        try:
            await self.api.destroy(sandbox_id)
        except DSecError as exc:  # it expires at its timeout anyway
            log.warning("run_code: destroying sandbox %s failed: %s", sandbox_id, exc)
