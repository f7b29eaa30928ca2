"""Snapshots, forks and all-or-nothing batches: many sandboxes made at once, or none.

Owns taking a snapshot of a sandbox into the snapshot store, fork (one snapshot restored ``count`` times, its
record removed with its last copy), the batch create, and what a batch does when part of it fails (destroy
what it made) or when the daemon stops under it (retire what it made in the background and say so). Must
never make one sandbox itself (it asks :mod:`~dsec.daemon.creation`) and never reach the engine beyond
:class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import AsyncIterator

from dsec.daemon.engine_parts import EngineParts
from dsec.errors import DaemonStopping, DSecError, InvalidRequest
from dsec.models import BatchCreateEvent, BatchCreateRequest, SandboxInfo, SandboxRecord, SnapshotRef

__all__ = ["Forks"]

log = logging.getLogger(__name__)


class Forks(EngineParts):
    """The engine's snapshot, fork and batch-create operations."""

    async def create_many_stream(self, request: BatchCreateRequest) -> AsyncIterator[BatchCreateEvent]:
        """:meth:`create_many`, answered as a stream (one node creates its share at once: all come together)."""
        for info in await self.create_many(request):
            yield BatchCreateEvent(type="sandbox", sandbox=info)
        yield BatchCreateEvent(type="done")

    async def create_many(self, request: BatchCreateRequest) -> builtins.list[SandboxInfo]:
        """Create ``count`` sandboxes concurrently; all or nothing (the first error is raised)."""
        if request.spec.trajectory is not None:
            raise InvalidRequest("a trajectory binds one sandbox: create trajectory sandboxes one at a time")
        self.refuse_if_stopping()
        # No batch-level limit: admission queues every create (slots, memory, pids) in arrival order.
        tasks = [asyncio.create_task(self.create(request.spec)) for _ in range(request.count)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            def done() -> builtins.list[SandboxInfo]:
                return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]

            for task in tasks:
                task.cancel()
            if self.stopping is not None:  # cut off at the server's graceful timeout: nothing may await now
                self._retire_quietly(done())
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.stopping is not None:
                self._retire_quietly(done())
            else:
                await self._destroy_quietly(done())
            raise
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return made
        if self.stopping is not None:
            raise self._stopped_batch(f"create_many({request.count})", made, errors)
        await self._destroy_quietly(made)
        raise errors[0]

    def _stopped_batch(self, what: str, made: builtins.list[SandboxInfo], errors: builtins.list[BaseException]
                       ) -> BaseException:
        """A batch that failed while the daemon stops: retire what it made and return what to raise. It answers
        before the server's graceful timeout would cut the call off (an HTTP 500 then, and the rollback cancelled
        half-way); the sandboxes go in the background, and the engine's close waits for them."""
        undone = self._retire_quietly(made)
        stopped = next((e for e in errors if isinstance(e, DaemonStopping)), None)
        if stopped is None:
            return errors[0]
        detail = f"; the {undone} sandboxes it had made are destroyed again" if undone else ""
        err = DaemonStopping(f"{what} refused: {self.stopping}{detail}", kept=0)
        err.__cause__ = stopped
        return err

    def _retire_quietly(self, infos: builtins.list[SandboxInfo]) -> int:
        """Retire these sandboxes of a failed batch (those no destroy has taken yet); how many."""
        retired = 0
        for info in infos:
            record = self.records.find(info.id)
            if record is not None and info.id not in self.records.destroying:
                self.retire(record)
                retired += 1
        return retired

    async def _destroy_quietly(self, infos: builtins.list[SandboxInfo]) -> None:
        results = await asyncio.gather(*(self.destroy(i.id) for i in infos), return_exceptions=True)
        for info, result in zip(infos, results, strict=True):
            if isinstance(result, BaseException):
                log.error("sandbox %s: rollback destroy failed: %s", info.id, result)

    async def snapshot(self, sandbox_id: str, seq: int | None = None) -> SnapshotRef:
        """Save a sandbox's writable state in the snapshot store (a logged checkpoint on a trajectory)."""
        record = self.records.live(sandbox_id, allow_paused=True)
        if record.spec.trajectory is not None:
            return SnapshotRef(snapshot=await self.trajectories.snapshot(record, seq))
        return SnapshotRef(snapshot=await self.take_snapshot(record))

    async def take_snapshot(self, record: SandboxRecord, ephemeral: bool = False) -> str:
        """Snapshot ``record`` into the store and publish it; returns its id.

        A layered backend's snapshot is one new layer (the sandbox's changes) over the layers the sandbox
        was restored onto. ``ephemeral`` marks fork's own snapshot, removed when its last copy on this
        node is destroyed.
        """
        backend = self.backends.get(record.spec.backend)
        snap_id, work = await asyncio.to_thread(self.snapshots.begin)
        try:
            await backend.snapshot(record, work / "tree")
        except BaseException:
            await asyncio.to_thread(self.snapshots.abort, work)
            raise
        meta = {"image": record.spec.image, "backend": record.spec.backend, "source": record.id,
                "uid_shift": record.backend_state.get("uid_shift", 0), "ephemeral": ephemeral,
                "spec": record.spec.model_dump(mode="json"),
                # hidden paths already revealed: a restore reveals them again
                "revealed": [] if record.backend_state.get("hidden") else list(record.spec.hidden)}
        below = record.layers if backend.layered else []
        await asyncio.to_thread(self.snapshots.publish, snap_id, work, meta, below)
        log.info("sandbox %s: snapshot %s taken", record.id, snap_id)
        return snap_id

    async def fork(self, sandbox_id: str, count: int) -> builtins.list[SandboxInfo]:
        """``count`` independent sandboxes with the state of a live one (all or nothing).

        One snapshot, restored ``count`` times: on a layered backend the copies share its layers read-only
        (copy-on-write, nothing copied per copy). The copies are plain sandboxes (not bound to the
        parent's trajectory, not logged); the snapshot's record goes when the last of them is destroyed.
        """
        record = self.records.live(sandbox_id, allow_paused=True)
        self.refuse_if_stopping()
        snap_id = await self.take_snapshot(record, ephemeral=True)
        spec = record.spec.model_copy(update={"trajectory": None, "snapshot": None})
        results = await asyncio.gather(*(self.create_unpooled(spec, snap_id) for _ in range(count)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if self.stopping is not None:
                err = self._stopped_batch(f"fork of {sandbox_id} x{count}", made, errors)
                if not made:  # else the teardowns drop the snapshot after the last copy
                    await self.drop_ephemeral(snap_id)
                raise err
            await self._destroy_quietly(made)
            await self.drop_ephemeral(snap_id)
            raise errors[0]
        return made

    async def drop_ephemeral(self, snap_id: str | None) -> None:
        """Remove fork's snapshot ``snap_id`` once no sandbox of this node is restored from it (the records are
        read here, on the loop; the store in a thread)."""
        if snap_id is None or any(r.spec.snapshot == snap_id for r in self.records.values()):
            return
        await asyncio.to_thread(self._remove_ephemeral, snap_id)

    async def remove_snapshot(self, snap_id: str) -> None:
        """Delete snapshot ``snap_id``'s record (absent is fine); sandboxes restored from it keep running."""
        await asyncio.to_thread(self.snapshots.remove, snap_id)

    def _remove_ephemeral(self, snap_id: str) -> None:
        try:
            if self.snapshots.meta(snap_id).get("ephemeral"):
                self.snapshots.remove(snap_id)
                log.info("fork snapshot %s removed (its last copy is gone)", snap_id)
        except DSecError as exc:
            log.debug("fork snapshot %s: %s", snap_id, exc)
