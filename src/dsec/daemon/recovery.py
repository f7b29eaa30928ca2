"""Bringing sandboxes back: re-adoption after a daemon restart, orphan cleanup, and revival on a fresh image mount.

At start every durable record is offered to its backend: a sandbox still alive is adopted again (with its
image version and snapshot layers pinned again), a dead one or one caught mid-create is destroyed and its
record dropped, and whatever a backend finds that no record names is removed. Later the watchdog may ask to
revive a sandbox whose image mount died (:meth:`Recovery.revive`); one re-adopted on an image mount that died
while no daemon ran (its lazy server killed meanwhile) is revived so at start, else left to the watchdog to report.

Owns that sequence and its progress phases. Must never keep a record it could not settle out of the store
(the next start retries it) and never reach the engine beyond :class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable

from dsec.backends.base import Backend, ImageRef
from dsec.daemon.engine_parts import EngineParts
from dsec.daemon.pools import POOL_LABEL
from dsec.errors import DSecError
from dsec.models import SandboxRecord

__all__ = ["RECOVERY_PARALLELISM", "Recovery"]

log = logging.getLogger(__name__)

RECOVERY_PARALLELISM = int(os.environ.get("DSEC_RECOVERY_PARALLELISM") or 32)
"""Records offered to their backends at once at start (``DSEC_RECOVERY_PARALLELISM``: tests force a start with
more sandboxes than that cheaply)."""


class Recovery(EngineParts):
    """The engine's re-adoption at start and revival for the watchdog."""

    on_phase: Callable[[str], None]

    async def recover_all(self) -> None:
        """Re-adopt or clean up every recorded sandbox, then remove each backend's orphans."""
        drop_stale_pins = getattr(self.images, "drop_stale_pins", None)
        if drop_stale_pins is not None:  # before recovery mounts (and pins) again what the sandboxes use
            self.on_phase("dropping stale image pins")
            await asyncio.to_thread(drop_stale_pins)
        sem = asyncio.Semaphore(RECOVERY_PARALLELISM)
        records = self.records.store.load_all()
        done = 0

        async def recover(record: SandboxRecord) -> None:
            nonlocal done
            async with sem:
                try:
                    await self._recover(record)
                except Exception:  # one sandbox must never keep the daemon from starting; its record stays
                    log.exception("sandbox %s: recovery failed (its record stays for the next start)", record.id)
            done += 1
            if done % 16 == 0:  # progress within a long phase is progress too
                self.on_phase(f"recovering sandboxes ({done}/{len(records)})")

        self.on_phase(f"recovering sandboxes (0/{len(records)})")
        # A mount that died while no daemon ran is let go only once every sandbox was offered: the first re-pin
        # finds it dead, and a function sandbox not yet recovered starts its zygote on its path (then revives).
        keep, let_go = getattr(self.images, "keep_dead_mounts", None), getattr(self.images, "let_dead_mounts_go", None)
        if keep is not None:
            await asyncio.to_thread(keep)  # (it takes the image manager's lock)
        try:
            await asyncio.gather(*(recover(r) for r in records))
        finally:
            if let_go is not None:
                await asyncio.to_thread(let_go)
        for name, backend in self.backends.started().items():
            self.on_phase(f"removing orphans of the {name} backend")
            known = {r.id for r in self.records.values() if r.spec.backend == name}
            try:
                removed = await backend.cleanup_orphans(known)
            except Exception:
                log.exception("backend %s: orphan cleanup failed", name)
                continue
            if removed:
                log.warning("backend %s: removed %d orphaned sandboxes: %s", name, len(removed), removed)

    async def _recover(self, record: SandboxRecord) -> None:
        name = record.spec.backend
        backend = self.backends.usable(name)
        if backend is None:
            # Keep the file: a daemon that has this backend again can still adopt or clean it up.
            log.warning("sandbox %s: backend %s unavailable; record kept on disk", record.id, name)
            return
        alive = False
        if POOL_LABEL in record.spec.labels:
            pass  # an unclaimed pool member of the previous daemon: drained like any dead sandbox
        elif record.state in ("running", "paused"):
            try:
                alive = await backend.recover(record)
            except Exception:
                log.exception("sandbox %s: recover failed; destroying it", record.id)
        if alive:
            self.records.add(record)
            if record.spec.image:
                try:  # re-pin the image mount this sandbox's root sits on
                    self.pins.hold(record.id, await asyncio.to_thread(self.pins.repin, backend, record))
                except Exception as exc:  # (an OSError too: the watchdog then reports the sandbox if it must)
                    log.warning("sandbox %s: its image %s cannot be re-pinned: %s", record.id, record.spec.image, exc)
            if record.layers:
                try:  # and the snapshot layers under it
                    self.pins.hold(record.id, layers=await asyncio.to_thread(self.snapshots.open, record.layers))
                except DSecError as exc:
                    log.warning("sandbox %s: its snapshot layers cannot be re-pinned: %s", record.id, exc)
            self.metrics.live.labels(name).inc()
            self.records.save(record)  # the backend may have refreshed backend_state
            log.info("sandbox %s re-adopted (%s)", record.id, record.state)
            try:
                await self._off_dead_mounts(backend, record)
            except Exception:  # not revived: the watchdog's first pass finds the dead mount and reports it
                log.exception("sandbox %s: moving it off a dead image mount failed", record.id)
            return
        # Dead, or caught mid-create by the previous daemon's death: release whatever is left.
        try:
            await backend.destroy(record)
        except Exception:
            # Keep the record: it is what lets the next start find and release this sandbox's resources
            # with a verified init pid; without it only a cgroup sweep would be left.
            log.exception("sandbox %s: destroy after failed recovery failed; record kept for the next start",
                          record.id)
            return
        self.records.delete(record.id)
        log.info("sandbox %s (%s) was gone after restart; record dropped", record.id, record.state)

    async def _off_dead_mounts(self, backend: Backend, record: SandboxRecord) -> None:
        """A re-adopted sandbox whose root sits on image mounts that died while no daemon ran (their lazy server
        killed meanwhile; the re-pin above mounted the image afresh, elsewhere): it holds the dead mounts again,
        as it would had they died under this daemon, and is revived on the fresh ones now (a function sandbox gets
        a new zygote) -- else the watchdog's first pass reports it lost with the reason, before a call fails."""
        sits = backend.image_mounts(record)
        if not sits or not any(self.pins.stale(root) is not None for root in sits):
            return
        fresh, layers = self.pins.image_of(record.id), self.pins.layers_of(record.id)
        if self.pins.stale(sits[-1]) is not None:
            if fresh is not None:
                self.pins.release(fresh)
            # (Held even when the re-pin failed: the watchdog then finds the dead mount and reports the sandbox.)
            self.pins.hold(record.id, dataclasses.replace(fresh, rootfs=sits[-1]) if fresh is not None else
                           ImageRef(name=record.spec.image or "", rootfs=sits[-1], digest=record.image_digest))
        if layers and any(self.pins.stale(root) is not None for root in sits[:-1]):
            self.snapshots.close(layers)
            self.pins.hold(record.id, layers=sits[:-1])
        if record.state == "running" and await self.revive(record):
            log.info("sandbox %s revived: its image mount had died while no daemon ran", record.id,
                     extra={"component": "lazy-server", "sandbox": record.id})

    async def revive(self, record: SandboxRecord) -> bool:
        """Ask the backend to bring the sandbox back, on its image mounted afresh if its own mount died. One revive
        of a sandbox at a time; a destroy, expiry or loss of it waits for the one under way (``records.reviving``),
        and none starts once those have. Never raises: anything unexpected is logged and means not revived."""
        pending = self.records.reviving.get(record.id)
        if pending is not None:
            return await asyncio.shield(pending)
        if self.records.find(record.id) is not record or record.id in self.records.destroying:
            return False
        task = asyncio.create_task(self._revive(record), name=f"dsec-revive-{record.id}")
        self.records.reviving[record.id] = task

        def done(_t: asyncio.Task[bool]) -> None:
            if self.records.reviving.get(record.id) is task:
                del self.records.reviving[record.id]

        task.add_done_callback(done)
        return await asyncio.shield(task)  # a watchdog pass cut short leaves it to finish (a destroy waits for it)

    async def _revive(self, record: SandboxRecord) -> bool:
        backend = self.backends.loaded[record.spec.backend]
        old = self.pins.image_of(record.id)
        if old is None or any(self.pins.stale(root) for root in self.pins.layers_of(record.id)):
            return False  # snapshot layers cannot be swapped under a sandbox
        fresh, revived = old, False
        try:
            if self.pins.stale(old.rootfs) is not None:
                try:
                    fresh = await asyncio.to_thread(self.pins.repin, backend, record)
                except DSecError as exc:
                    log.warning("sandbox %s: its image cannot be mounted afresh: %s", record.id, exc,
                                extra={"sandbox": record.id, "error": exc.message})
                    return False
            if self.records.find(record.id) is not record or record.id in self.records.destroying:
                return False  # destroyed meanwhile
            revived = await backend.revive(record, fresh)
        except Exception:
            log.exception("sandbox %s: revive failed", record.id, extra={"sandbox": record.id})
            return False
        finally:
            # The pin the sandbox now sits on is the one it holds (a destroy waiting for this releases it).
            if fresh is not old:
                self.pins.release(old if revived else fresh)
                if revived:
                    self.pins.hold(record.id, fresh)
        if self.records.find(record.id) is not record:
            return False  # retired meanwhile: its teardown, which waited for this, closes the new zygote
        if revived:
            self.records.save(record)
        return revived
