"""Removing sandboxes: destroy (one, many, all), the wall-clock reaper, loss, and background teardowns.

A destroyed sandbox is gone for its client at once: its id leaves the records for a tombstone that says
why (destroyed, expired, lost). A pooled one is torn down behind the answer (:meth:`Removal.retire`), up to
:data:`BACKGROUND_TEARDOWNS` at a time; the others before it. Owns that order, the teardown tasks the
engine's close waits for, and the ``destroyed``/``expired``/``lost`` events. Must never create a sandbox
and never reach the engine beyond :class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from dsec.daemon.auth import JOB_LABEL
from dsec.daemon.engine_parts import EngineParts
from dsec.errors import DSecError, SandboxError, SandboxNotFound, SandboxStateError
from dsec.models import BatchDestroyRequest, BatchDestroyResult, LifecycleKind, SandboxRecord

__all__ = ["BACKGROUND_TEARDOWNS", "DESTROY_MANY_AT_ONCE", "Removal"]

log = logging.getLogger(__name__)

BACKGROUND_TEARDOWNS = 64
"""Pooled sandboxes torn down behind their destroy's answer at once; past it a destroy waits for its own
teardown (back-pressure: a client destroying faster than the node tears down must not pile up dead
sandboxes that still hold memory and mounts)."""
DESTROY_MANY_AT_ONCE = 32
"""Sandboxes one batch destroy tears down at once (each is a few syscalls and an unmount or two)."""


class Removal(EngineParts):
    """The engine's destroy operations and reaper."""

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy a sandbox. Idempotent: destroying a destroyed or expired sandbox is not an error."""
        pending = self.records.destroying.get(sandbox_id)
        if pending is not None:
            await asyncio.shield(pending)
            return
        if sandbox_id not in self.records and self.records.gone(sandbox_id):
            return
        record = self.records.lookup(sandbox_id)
        if record.state == "creating":
            raise SandboxStateError(f"sandbox {sandbox_id} is still being created", sandbox_id=sandbox_id)
        if record.pooled and record.spec.trajectory is None and len(self.teardowns) < BACKGROUND_TEARDOWNS:
            self.retire(record)
            return
        task = asyncio.create_task(self._remove(record, "destroyed", f"sandbox {sandbox_id} was destroyed"))
        self.records.destroying[sandbox_id] = task
        try:
            # Shielded: a client that hangs up mid-DELETE must not leave a half-destroyed sandbox.
            await asyncio.shield(task)
        finally:
            if task.done():
                self.records.destroying.pop(sandbox_id, None)
            else:
                task.add_done_callback(lambda _t: self.records.destroying.pop(sandbox_id, None))

    async def destroy_many(self, request: BatchDestroyRequest) -> BatchDestroyResult:
        """Destroy each of ``request.ids`` on its own, at most :data:`DESTROY_MANY_AT_ONCE` at a time."""
        result = BatchDestroyResult()
        at_once = asyncio.Semaphore(DESTROY_MANY_AT_ONCE)

        async def one(sandbox_id: str) -> None:
            record = self.records.find(sandbox_id)
            if record is None or (request.job is not None and record.spec.labels.get(JOB_LABEL) != request.job):
                result.missing.append(sandbox_id)
                return
            async with at_once:
                try:
                    await self.destroy(sandbox_id)
                except SandboxNotFound:
                    result.missing.append(sandbox_id)
                except DSecError as exc:
                    result.failed[sandbox_id] = f"{type(exc).__name__}: {exc.message}"
                else:
                    result.destroyed.append(sandbox_id)

        await asyncio.gather(*(one(i) for i in request.ids))
        return result

    async def destroy_all(self) -> int:
        """Destroy every sandbox; returns how many were destroyed."""
        ids = list(self.records)
        results = await asyncio.gather(*(self.destroy(i) for i in ids), return_exceptions=True)
        for sandbox_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException):
                log.error("sandbox %s: destroy failed: %s", sandbox_id, result)
        await self.wait_teardowns()
        return sum(1 for r in results if not isinstance(r, BaseException))

    async def wait_teardowns(self) -> None:
        """Wait until every background teardown of a destroyed pooled sandbox has finished."""
        while self.teardowns:
            await asyncio.gather(*list(self.teardowns), return_exceptions=True)

    def retire(self, record: SandboxRecord) -> None:
        """Destroy a pooled sandbox (or one of a batch failed by the daemon stopping) as the client sees it
        now, and tear it down in the background (:meth:`aclose` waits for it).

        From here on the id is gone (lookups answer "destroyed") and no call reaches the sandbox. Its
        record is saved as ``stopped`` first: a daemon restarted before the teardown ends destroys it
        instead of re-adopting it. A teardown that fails keeps the record (``failed``) for the next start.
        """
        info = self.records.info(record)
        record.state = "stopped"
        self.records.save(record)
        if self.records.pop(record.id) is not None:
            self.metrics.live.labels(record.spec.backend).dec()
        self.records.tombstone(record, "destroyed", f"sandbox {record.id} was destroyed")
        self.events.publish("destroyed", info, reason=None)
        self.in_background(self._teardown(record), f"dsec-teardown-{record.id}")

    def in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run a teardown as a task that :meth:`aclose` (``wait_teardowns``) waits for."""
        task = asyncio.create_task(work, name=name)
        self.teardowns.add(task)
        task.add_done_callback(self.teardowns.discard)

    async def _revived(self, sandbox_id: str) -> None:
        """Wait for a revive of the sandbox under way (the watchdog's): its new zygote and image pin are then
        the sandbox's, which the teardown after this releases (never a revive finishing on a destroyed one)."""
        reviving = self.records.reviving.get(sandbox_id)
        if reviving is not None:
            await asyncio.wait([reviving])

    async def _teardown(self, record: SandboxRecord) -> None:
        try:
            await self._revived(record.id)
            await self.surface.forget(record.id)
            await self.backends.get(record.spec.backend).destroy(record)
        except Exception as exc:
            record.state = "failed"
            record.reason = f"destroy failed: {type(exc).__name__}: {exc}"
            self.records.save(record)
            self.metrics.teardown_failures.labels(record.spec.backend).inc()
            log.exception("sandbox %s: background teardown failed; record kept for the next start", record.id)
            return
        self.pins.release_sandbox(record.id)
        self.records.delete(record.id)
        log.debug("sandbox %s torn down", record.id)
        if record.spec.snapshot is not None:
            await self.drop_ephemeral(record.spec.snapshot)

    async def _remove(self, record: SandboxRecord, state: str, message: str) -> None:
        backend = self.backends.get(record.spec.backend)
        try:
            await self._revived(record.id)
            await self.surface.forget(record.id)
            await backend.destroy(record)
        except Exception as exc:
            failed = f"destroy failed: {type(exc).__name__}: {exc}"
            if state == "lost":  # still lost to its client (a destroy tries again), with both reasons
                record.reason = f"{record.reason}; {failed}"
            else:
                record.state, record.reason = "failed", failed
            self.records.save(record)
            log.exception("sandbox %s: destroy failed", record.id)
            if isinstance(exc, DSecError):
                raise
            raise SandboxError(f"destroying sandbox {record.id} failed: {exc}") from exc
        self.pins.release_sandbox(record.id)
        if self.records.pop(record.id) is not None:
            self.metrics.live.labels(record.spec.backend).dec()
            if state == "expired":
                self.metrics.expired.labels(record.spec.backend).inc()
        self.records.delete(record.id)
        self.records.tombstone(record, state, message)
        kind: LifecycleKind = "expired" if state == "expired" else "lost" if state == "lost" else "destroyed"
        self.events.publish(kind, self.records.info(record), reason=record.reason if kind != "destroyed" else None)
        self.trajectories.forget(record)
        log.info("sandbox %s %s", record.id, state, extra={"sandbox": record.id})
        if record.spec.snapshot is not None:
            await self.drop_ephemeral(record.spec.snapshot)

    async def reap(self) -> int:
        """Destroy every sandbox past its wall-clock timeout now; returns how many."""
        now = time.time()
        due = [
            r for r in self.records.values()
            if (r.expires_at <= now or self.trajectories.lease_expired(r, now))
            and r.state in ("running", "paused") and r.id not in self.records.destroying
        ]

        async def expire(record: SandboxRecord) -> None:
            if record.expires_at <= now:
                lifetime = round(record.expires_at - record.created_at, 3)  # set_timeout may have moved it
                message = f"sandbox {record.id} passed its timeout of {lifetime:g} s and was destroyed"
                record.reason = f"timeout of {lifetime:g} s passed"
            else:
                message = (f"sandbox {record.id} of trajectory {record.spec.trajectory!r} had no call for its "
                           f"lease of {record.spec.lease:g} s and was destroyed")
                record.reason = f"trajectory lease of {record.spec.lease:g} s passed"
            record.state = "expired"
            task = asyncio.create_task(self._remove(record, "expired", message))
            self.records.destroying[record.id] = task
            try:
                await task
            finally:
                self.records.destroying.pop(record.id, None)

        results = await asyncio.gather(*(expire(r) for r in due), return_exceptions=True)
        return sum(1 for r in results if not isinstance(r, BaseException))

    async def lose(self, record: SandboxRecord, reason: str, component: str) -> None:
        """Report a sandbox lost (its next call raises :class:`SandboxLost` with ``reason``) and destroy its
        leftovers; a trajectory-bound one is rebuilt from its checkpoint when the trajectory is re-opened."""
        if (self.records.find(record.id) is not record or record.id in self.records.destroying
                or record.state != "running"):
            return
        log.warning("sandbox %s lost: %s", record.id, reason,
                    extra={"component": component, "sandbox": record.id, "error": reason})
        record.state, record.reason = "lost", reason
        self.metrics.lost.labels(record.spec.backend, component).inc()
        task = asyncio.create_task(self._remove(record, "lost", f"sandbox {record.id} was lost: {reason}"))
        self.records.destroying[record.id] = task
        try:
            await task
        finally:
            self.records.destroying.pop(record.id, None)
