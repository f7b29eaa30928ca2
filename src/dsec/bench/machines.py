"""What the microvm and vm benches do alike: sandboxes started on a restoring and a cold-booting backend, timed
from create to their first exec, left idle for their memory, and all destroyed however the run ends.

Owns :class:`Machines`; must never time anything but a create-to-first-exec, nor assert a figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from dsec.backends.base import Backend, ImageRef
from dsec.isolation.procs import mem_available
from dsec.models import ExecRequest, SandboxRecord
from dsec.testing import new_record

__all__ = ["Machines"]


class Machines:
    """The sandboxes of one bench run on ``fast`` (restores from templates) and ``cold`` (boots every time).

    Every sandbox made here is destroyed by :meth:`aclose` if the run did not, then both backends are closed."""

    def __init__(self, fast: Backend, cold: Backend, image: ImageRef) -> None:
        self.fast, self.cold, self.image = fast, cold, image
        self._live: list[tuple[Backend, SandboxRecord]] = []

    async def create(self, backend: Backend | None = None, /, **spec: Any) -> SandboxRecord:
        """A running sandbox of ``spec`` on ``backend`` (default: the restoring one)."""
        backend = backend or self.fast
        rec = new_record(backend.name, self.image, **spec)
        self._live.append((backend, rec))
        await backend.create(rec, self.image)
        return rec

    async def first_exec(self, backend: Backend, /, **spec: Any) -> float:
        """Seconds from the create of a sandbox of ``spec`` to its first exec's answer; the sandbox is destroyed."""
        rec = new_record(backend.name, self.image, **spec)
        self._live.append((backend, rec))
        start = time.monotonic()
        await backend.create(rec, self.image)
        r = await backend.exec(rec, ExecRequest(command=["true"]))
        took = time.monotonic() - start
        assert r.exit_code == 0, r
        await backend.destroy(rec)
        return took

    async def idle(self, n: int, **spec: Any) -> tuple[list[SandboxRecord], int]:
        """``n`` sandboxes of ``spec`` created and left running, and the host's MemAvailable just before them."""
        await asyncio.sleep(1)
        before = mem_available()
        return [await self.create(**spec) for _ in range(n)], before

    async def idle_memory(self, recs: list[SandboxRecord], before: int, settle: float) -> tuple[float, float]:
        """Host memory per idle sandbox of ``recs`` after ``settle`` seconds: what MemAvailable lost since
        ``before``, and what their QEMU cgroups hold (page cache charged included)."""
        await asyncio.sleep(settle)
        per_vm = max(before - mem_available(), 0) / len(recs)
        cgroup = sum([(await self.fast.stats(r)).memory_bytes for r in recs]) / len(recs)
        return per_vm, cgroup

    async def aclose(self) -> None:
        for backend, rec in self._live:
            with contextlib.suppress(Exception):
                await backend.destroy(rec)
        await self.fast.cleanup_orphans(set())
        await self.fast.aclose()
        await self.cold.aclose()
