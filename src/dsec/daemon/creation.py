"""Creating sandboxes: a claim from a warm pool, or the create pipeline, one step per method.

The pipeline (:meth:`Creation._make`): refuse while draining → find the backend and, for a restore, the
snapshot's image and layers (:meth:`~Creation._source`) → pin the image and layers (:meth:`~Creation._pin`)
→ write the record before the backend acts, so a daemon killed mid-create cleans up on restart
(:meth:`~Creation._record`) → wait for admission and let the backend build or restore
(:meth:`~Creation._build`) → count and announce it (:meth:`~Creation._created`). A failure undoes what was
done (:meth:`~Creation._undo_create`) and says why (:meth:`~Creation._failure`).

Owns both paths and the warm pools' host side (:class:`~dsec.daemon.pools.PoolHost`: members made,
checked, discarded). Must never tear down a client's sandbox (that is :mod:`~dsec.daemon.removal`'s) and
never reach the engine beyond :class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import secrets
import time
from pathlib import Path

from dsec.backends.base import Backend, ImageRef, apply_image_defaults
from dsec.daemon.admission import Deferred
from dsec.daemon.engine_parts import EngineParts
from dsec.daemon.image_pins import pinning
from dsec.daemon.pools import POOL_LABEL
from dsec.errors import DaemonStopping, DSecError, InvalidRequest, SandboxError
from dsec.models import NodeStatistics, PoolConfig, PoolStatistics, SandboxInfo, SandboxRecord, SandboxSpec

__all__ = ["Creation"]

log = logging.getLogger(__name__)


class Creation(EngineParts):
    """The engine's create operations (see the module docstring)."""

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create one sandbox and return it running; with ``spec.trajectory``, open that trajectory."""
        if POOL_LABEL in spec.labels:
            raise InvalidRequest(f"label {POOL_LABEL!r} is reserved for warm-pool sandboxes")
        if spec.trajectory is not None:
            return await self.trajectories.open(spec)  # re-attaching makes nothing; a rebuild is refused in _make
        self.refuse_if_stopping()
        if spec.snapshot is None and self._poolable(spec):
            claimed = await self._claim(spec)
            if claimed is not None:
                return claimed
        return await self.create_unpooled(spec, spec.snapshot)

    async def create_unpooled(self, spec: SandboxSpec, snapshot: str | None) -> SandboxInfo:
        """Create one sandbox, from its image or restored from snapshot ``snapshot`` of the snapshot store."""
        record, queued = await self._make(spec, snapshot, visible=True)
        return self.records.info(record).model_copy(update={"queue_seconds": queued})

    # -- the warm pools ----------------------------------------------------------------------------------------

    def _poolable(self, spec: SandboxSpec) -> bool:
        """Whether everything ``spec`` asks beyond its pool shape can be applied to a running sandbox (a network
        policy other than the member's needs ``set_network``)."""
        backend = self.backends.loaded.get(spec.backend)
        if backend is None:
            return False
        return spec.network == "none" or type(backend).set_network is not Backend.set_network

    async def _claim(self, spec: SandboxSpec) -> SandboxInfo | None:
        """Hand out a ready pool member with ``spec``'s labels, env, timeout and network; None: pool empty.

        A member is handed out only while it runs and is of the image version a fresh create would get now
        (a re-import moves the tag; idle members can wait for days): others are destroyed on the way."""
        backend = self.backends.usable(spec.backend)
        if backend is None:
            return None  # the create path raises (and counts) BackendUnavailable
        digest = self.pins.known_digest(backend, spec.image) if spec.image and self.pools.has_ready(spec) else None
        record, unusable = self.pools.take(spec, lambda member: self._usable(backend, digest, member))
        for member in unusable:
            self._discard_later(member)
        if record is None:
            return None
        started = time.monotonic()
        try:
            if spec.network != record.spec.network:  # a member with a device, made with the pool's policy
                try:
                    await backend.set_network(record, spec.network)
                except Exception:
                    log.exception("pool member %s: applying network %r failed; creating afresh", record.id,
                                  spec.network)
                    self._discard_later(record)
                    return None
            now = time.time()
            # The request's spec is this call's own object: no deep copy (the pool shape's workdir stays).
            record.spec = spec.model_copy(update={"workdir": record.spec.workdir})
            record.created_at, record.expires_at = now, now + spec.timeout
            record.pooled = True
            # The one write of a claim (no fsync, see StateStore): without it a daemon restarted now would
            # take this client's sandbox for an unclaimed pool member and destroy it.
            self.records.save(record)
        except BaseException:  # cancelled (a client gone, a batch failed) or the save failed: nobody has it
            self._discard_later(record)
            raise
        self.records.add(record)
        self.metrics.create_seconds.labels(spec.backend).observe(time.monotonic() - started)
        self.metrics.created.labels(spec.backend).inc()
        self.metrics.live.labels(spec.backend).inc()
        log.debug("sandbox %s claimed from pool (%s, image %s)", record.id, spec.backend, spec.image)
        info = self.records.info(record, pooled=True)
        self.events.publish("created", info, pooled=True, seconds=round(time.monotonic() - started, 6))
        return info

    def _usable(self, backend: Backend, digest: str | None, member: SandboxRecord) -> bool:
        """Whether pool member ``member`` may be handed out: it runs, and its image is version ``digest`` (the
        one its tag names; None: unknown, any version goes)."""
        if not backend.alive(member):
            log.warning("pool member %s died while it waited; destroyed", member.id)
            return False
        ref = self.pins.image_of(member.id)
        if ref is not None and self.pins.stale(ref.rootfs) is not None:
            log.warning("pool member %s sits on a dead image mount; destroyed", member.id)
            return False
        if digest is not None and ref is not None and ref.digest is not None and ref.digest != digest:
            log.info("pool member %s is of an earlier version of image %s; destroyed", member.id, member.spec.image)
            return False
        return True

    def member_usable(self, record: SandboxRecord) -> bool:
        """Whether pool member ``record`` may still be handed out (see :meth:`_usable`)."""
        backend = self.backends.loaded.get(record.spec.backend)
        if backend is None:
            return False
        image = record.spec.image
        return self._usable(backend, self.pins.known_digest(backend, image) if image else None, record)

    def _discard_later(self, record: SandboxRecord) -> None:
        """Destroy an unclaimed pool member in the background (the engine's close waits for it)."""
        self.in_background(self.discard_member(record), f"dsec-discard-{record.id}")

    async def create_member(self, spec: SandboxSpec) -> SandboxRecord:
        """Create a pool member: recorded on disk (so a crash cleans it up) but invisible until claimed."""
        record, _ = await self._make(spec, None, visible=False)
        return record

    async def discard_member(self, record: SandboxRecord) -> None:
        """Destroy an unclaimed pool member (its record stays on disk if that fails: the next start retries)."""
        try:
            await self.backends.get(record.spec.backend).destroy(record)
        except Exception:
            log.exception("pool member %s: destroy failed; record kept for the next start", record.id)
            return
        self.pins.release_sandbox(record.id)
        self.records.delete(record.id)

    @staticmethod
    def check_pool(config: PoolConfig, backend: Backend) -> None:
        """Refuse a pool whose claims would need a network change the backend cannot make live."""
        if config.network != "none" and type(backend).set_network is Backend.set_network:
            raise InvalidRequest(f"a pool on the {config.backend!r} backend takes network='none' only: it cannot "
                                 "apply a claim's network policy to a running sandbox")

    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Add a warm pool or change its bounds (``max=0`` empties it)."""
        self.check_pool(config, self.backends.get(config.backend))
        return self.pools.declare(config)

    async def statistics(self) -> NodeStatistics:
        """Warm pools and the create admission queue now."""
        return NodeStatistics(pools=self.pools.statistics(), admission=self.admission.statistics(),
                              teardowns=len(self.teardowns))

    # -- the create pipeline -------------------------------------------------------------------------------

    async def _make(self, spec: SandboxSpec, snapshot: str | None, *, visible: bool) -> tuple[SandboxRecord, float]:
        """Create a sandbox after admission; returns its record (running, persisted) and the seconds queued.

        ``visible``: a client sandbox (listed, counted live) rather than a pool member.
        """
        self.refuse_if_stopping()
        if not visible and (busy := self.admission.busy()) is not None:
            raise Deferred(busy)  # a refill: before it pins an image or writes a record it would undo at once
        try:
            backend = self.backends.get(spec.backend)
            spec, layers, revealed = await self._source(spec, snapshot)
            image, roots = await self._pin(backend, spec, layers, restore=snapshot is not None)
        except DSecError as exc:
            self._count_failure(spec, exc.message, type(exc).__name__, visible=visible)
            raise
        record = self._record(spec, image, layers, roots, visible=visible)
        queued, started = await self._build(backend, spec, record, image, roots, revealed,
                                            restore=snapshot is not None, visible=visible)
        record.state = "running"
        self.records.save(record)
        if visible:
            self._created(record, queued, started)
        return record, queued

    async def _source(self, spec: SandboxSpec, snapshot: str | None
                      ) -> tuple[SandboxSpec, builtins.list[str], builtins.list[str]]:
        """``spec`` completed from snapshot ``snapshot`` (its image; the snapshot named), the snapshot's layers
        and the hidden paths revealed when it was taken; ``spec`` as it is without a snapshot."""
        if snapshot is not None:
            meta = await asyncio.to_thread(self.snapshots.meta, snapshot)
            if meta.get("backend") != spec.backend:
                raise InvalidRequest(f"snapshot {snapshot} was taken on backend {meta.get('backend')!r}; "
                                     f"it cannot be restored on {spec.backend!r}")
            if spec.image is None:
                spec = spec.model_copy(update={"image": meta.get("image")})
            elif spec.image != meta.get("image"):
                raise InvalidRequest(f"snapshot {snapshot} is of image {meta.get('image')!r}, not {spec.image!r}")
            spec = spec.model_copy(update={"snapshot": snapshot})
            return spec, list(meta.get("layers", [])), list(meta.get("revealed", []))
        return spec, [], []

    async def _pin(self, backend: Backend, spec: SandboxSpec, layers: builtins.list[str], *, restore: bool
                   ) -> tuple[ImageRef, builtins.list[Path]]:
        """Pin ``spec``'s image and, to ``restore`` a snapshot, its ``layers``; both given back on failure."""
        if not spec.image:
            raise InvalidRequest("spec.image is required unless a snapshot is given")
        warm = self.pins.resolve_warm(backend, spec.image)
        image = warm if warm is not None else await pinning(
            functools.partial(self.pins.resolve, backend, spec.image), self.pins.release)
        try:
            roots = await pinning(functools.partial(self.snapshots.open, layers),
                                  self.snapshots.close) if restore else []
        except BaseException:
            self.pins.release(image)
            raise
        return image, roots

    def _record(self, spec: SandboxSpec, image: ImageRef, layers: builtins.list[str], roots: builtins.list[Path],
                *, visible: bool) -> SandboxRecord:
        """The new sandbox's record (``creating``), persisted before the backend acts, so a daemon killed
        mid-create cleans up on restart; it holds the pins from here on."""
        now = time.time()
        record = SandboxRecord(
            id="sb-" + secrets.token_hex(6),
            spec=spec.model_copy(deep=True),  # own copy: image defaults are filled in per record
            state="creating",
            created_at=now,
            expires_at=now + spec.timeout,
            layers=layers,
            image_digest=image.digest,
        )
        apply_image_defaults(record, image)
        try:
            self.records.save(record)
        except BaseException:  # the state disk is full, say: nothing was made, give the pins back
            self.pins.release(image)
            self.snapshots.close(roots)
            raise
        if visible:
            self.records.add(record)
        self.pins.hold(record.id, image, roots)
        return record

    async def _build(self, backend: Backend, spec: SandboxSpec, record: SandboxRecord, image: ImageRef,
                     roots: builtins.list[Path], revealed: builtins.list[str], *, restore: bool, visible: bool
                     ) -> tuple[float, float]:
        """Wait for admission, then let the backend create (or restore) the sandbox; returns the seconds queued
        and when the backend started (monotonic). A failure is undone and raised as :meth:`_failure` says."""
        admitted = False
        try:
            async with self.admission.admit(background=not visible) as queued:
                admitted = True
                self.metrics.admission_seconds.labels(spec.backend).observe(queued)
                started = time.monotonic()
                if restore:
                    await backend.restore(record, image, roots)
                    if record.backend_state.get("hidden") and set(record.spec.hidden) <= set(revealed):
                        # Taken in the grading phase: what was revealed then is visible in the copy too
                        # (a trajectory rebuilt from a checkpoint after its reveal must not hide it again).
                        await backend.reveal(record)
                else:
                    await backend.create(record, image)
        except BaseException as exc:
            await self._undo_create(backend, record, started=admitted)
            error = self._failure(exc, spec, image, record.created_at, admitted=admitted, visible=visible)
            if error is exc:
                raise
            raise error from exc
        return queued, started

    def _failure(self, exc: BaseException, spec: SandboxSpec, image: ImageRef, since: float, *, admitted: bool,
                 visible: bool) -> BaseException:
        """What a create that failed with ``exc`` raises, counted and announced: ``exc`` itself if refused
        (draining, deferred: no failure is counted, a whole queue is refused at once) or already a DSec error
        or not an ``Exception``; the image-loading error behind it if the lazy filesystem recorded one since
        ``since``; else a :class:`SandboxError`."""
        if isinstance(exc, (DaemonStopping, Deferred)):
            return exc
        cause = self.pins.explain(image, since) if admitted and not isinstance(exc, asyncio.CancelledError) else None
        if cause is not None:
            self._count_failure(spec, cause.message, type(cause).__name__, visible=visible)
            return cause
        reason = type(exc).__name__ if isinstance(exc, DSecError) else "SandboxError"
        if isinstance(exc, asyncio.CancelledError):
            reason = "cancelled"
        self._count_failure(spec, str(exc) or reason, reason, visible=visible)
        if isinstance(exc, DSecError) or not isinstance(exc, Exception):
            return exc
        return SandboxError(f"creating a {spec.backend} sandbox failed: {type(exc).__name__}: {exc}")

    def _count_failure(self, spec: SandboxSpec, message: str, error: str, *, visible: bool) -> None:
        self.metrics.failed.labels(spec.backend, error).inc()
        if visible:
            self.events.publish("create_failed", spec=spec, reason=message, error=error)

    def _created(self, record: SandboxRecord, queued: float, started: float) -> None:
        """Count a client's new sandbox and announce it."""
        name = record.spec.backend
        self.metrics.create_seconds.labels(name).observe(time.monotonic() - started)
        self.metrics.created.labels(name).inc()
        self.metrics.live.labels(name).inc()
        log.info("sandbox %s created (%s, image %s, queued %.3f s)", record.id, name, record.spec.image, queued)
        self.events.publish("created", self.records.info(record), seconds=round(time.monotonic() - started, 6))

    async def _undo_create(self, backend: Backend, record: SandboxRecord, *, started: bool) -> None:
        """Forget a create that failed; ``started``: the backend was called, so it may have made something.
        A create that never left the admission queue (timed out, or refused by the daemon stopping) costs no
        backend call: a stopping daemon fails a queue of thousands at once."""
        self.records.pop(record.id)
        if not started:
            self.pins.release_sandbox(record.id)
            self.records.delete(record.id)
            return
        try:
            await backend.destroy(record)
        except BaseException:
            # Keep the record: the next daemon start retries the cleanup.
            log.exception("sandbox %s: cleanup after failed create failed; record kept", record.id)
            return
        self.pins.release_sandbox(record.id)
        self.records.delete(record.id)
