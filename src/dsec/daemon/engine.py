"""The engine: every sandbox of this node, its durable record, its timeout and its metrics.

Owns: sandbox ids, the record lifecycle (``creating`` -> ``running`` <-> ``paused`` -> gone), recovery
after a daemon restart, the wall-clock reaper and its tombstones, and metric counting. It calls
backends for mechanics and the image resolver for roots. It must never speak HTTP, never know about
sockets or tokens, and never touch a sandbox's processes or files except through its backend: the HTTP
app and in-process tests drive exactly the same object.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import importlib
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar, assert_never, get_args

import pydantic

from dsec._version import __version__
from dsec.backends.base import Backend, ImageRef, apply_image_defaults, collect_exec
from dsec.config import Settings
from dsec.daemon.admission import Admission, Deferred
from dsec.daemon.audit import OUTPUT_HEAD_BYTES, AuditLog, AuditQuery, caller
from dsec.daemon.auth import JOB_LABEL
from dsec.daemon.events import EventBus
from dsec.daemon.health import Health
from dsec.daemon.host_limits import HostLimits
from dsec.daemon.metrics import Metrics, host_load
from dsec.daemon.node_state import NodeState
from dsec.daemon.pools import POOL_LABEL, Pools
from dsec.daemon.ports import PortForwarder
from dsec.daemon.rollouts import Rollouts
from dsec.daemon.state import StateStore
from dsec.daemon.surface import Surface
from dsec.daemon.surface_ops import SurfaceOperations
from dsec.daemon.watchdog import Watchdog
from dsec.errors import (
    BackendUnavailable,
    DaemonStopping,
    DSecError,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SandboxTimeout,
)
from dsec.images.cache import free_reserve
from dsec.isolation import affinity
from dsec.models import (
    AuditEntry,
    AuditOutcome,
    BackendName,
    BatchCreateEvent,
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    CallRequest,
    CallResult,
    ComponentHealth,
    CounterSample,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageBuildEvent,
    ImageBuildRequest,
    ImageInfo,
    ImagePullRequest,
    KeyboardRequest,
    LifecycleEvent,
    LifecycleKind,
    LoggedCall,
    MouseRequest,
    NodeInfo,
    NodeLoad,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxRecord,
    SandboxSpec,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
    TrajectoryForkRequest,
    TrajectoryInfo,
    ids_digest,
    parse_network,
)
from dsec.trajectory.replay import Trajectories
from dsec.trajectory.snapshots import SnapshotStore
from dsec.trajectory.store import SQLiteStore, TrajectoryStore

__all__ = ["IMAGE_IDLE_SECONDS", "MAX_FILE_BYTES", "Engine", "ImageResolver", "backend_class"]

IMAGE_IDLE_SECONDS = 600.0
"""How long an image mount stays warm after its last sandbox is destroyed."""

log = logging.getLogger(__name__)

IMAGE_CACHE_REPORT_AGE = 5.0
"""Seconds a node's image cache listing in ``/v1/health`` may be old (reading it stats every chunk)."""

MAX_FILE_BYTES = 1024**3
"""Largest file body read or written through the API (1 GiB)."""
_RECOVERY_PARALLELISM = 32
SAMPLE_SECONDS = 5.0
"""How often the engine samples its counters for the overview's history."""
HISTORY_SECONDS = 1800.0
"""How far back the overview's history goes."""
_BACKGROUND_TEARDOWNS = 64
"""Pooled sandboxes torn down behind their destroy's answer at once; past it a destroy waits for its own
teardown (back-pressure: a client destroying faster than the node tears down must not pile up dead
sandboxes that still hold memory and mounts)."""
_DESTROY_MANY_AT_ONCE = 32
"""Sandboxes one batch destroy tears down at once (each is a few syscalls and an unmount or two)."""


_T = TypeVar("_T")


async def _pinning(fn: Callable[[], _T], undo: Callable[[_T], None]) -> _T:
    """``fn()`` (which pins something: an image mount, snapshot layers) in a worker thread. A caller cancelled
    meanwhile cannot stop the thread: what it pinned is given back by ``undo`` once it returns."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def late(done: asyncio.Future[_T]) -> None:
            if not done.cancelled() and done.exception() is None:
                undo(done.result())

        task.add_done_callback(late)
        raise


def backend_class(name: BackendName) -> tuple[str, str]:
    """The module and class of backend ``name`` (the names are :data:`dsec.models.BackendName`'s: a node loads
    each, and one that fails to import or construct is reported unavailable)."""
    match name:
        case "container":
            return "dsec.backends.container", "ContainerBackend"
        case "microvm":
            return "dsec.backends.microvm", "MicroVMBackend"
        case "vm":
            return "dsec.backends.vm", "VMBackend"
        case "function":
            return "dsec.backends.function", "FunctionBackend"
        case _:
            assert_never(name)


class ImageResolver(Protocol):
    """What the engine needs of an image source (``dsec.images.node.NodeImages`` implements it).

    ``resolve`` may block (it can mount an image and fetch its metadata): the engine calls it in a thread.
    Resolvers that pin images also offer ``release(ref)`` and ``explain(ref, since)`` (see ``NodeImages``).
    """

    def resolve(self, name: str) -> ImageRef:
        """The image's root and defaults; raises :class:`~dsec.errors.ImageNotFound`."""
        ...

    def list(self) -> builtins.list[ImageInfo]:
        """Every image in the store."""
        ...

    def get(self, name: str) -> ImageInfo:
        """One image; raises :class:`~dsec.errors.ImageNotFound`."""
        ...


def default_trajectory_store(settings: Settings) -> TrajectoryStore:
    """The node's trajectory log: PostgreSQL when ``settings.trajectory_log`` is a URL, else SQLite."""
    where = settings.trajectory_log
    if where.startswith(("postgresql://", "postgres://")):
        from dsec.trajectory.postgres import PostgresStore

        return PostgresStore(where)
    # The home's own file is made private like the other databases there (also when DSEC_TRAJECTORY_DB names it);
    # another path the operator named keeps its mode.
    path = Path(where)
    return SQLiteStore(path, sync=settings.trajectory_sync,
                       private=path.absolute() == settings.home_trajectory_db.absolute())


def _snapshot_store(settings: Settings, images: object) -> SnapshotStore:
    """Snapshots in the node's image store, mounted lazily through its image manager; in another store
    (``DSEC_SNAPSHOT_STORE``), or without the image manager, mounted whole (:class:`EagerLayers`)."""
    from dsec.images.node import NodeImages
    from dsec.images.store import ImageStore

    scratch = settings.home / "snapshot-work"
    if isinstance(images, NodeImages) and settings.snapshot_store == settings.image_store:
        return SnapshotStore(images.store, scratch, images)
    return SnapshotStore(ImageStore(settings.images, settings.snapshot_store), scratch)


class _NoImages:
    """Stand-in when the image store cannot be loaded: every lookup says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def resolve(self, name: str) -> ImageRef:
        raise ImageNotFound(f"image {name!r} not found: {self.reason}")

    def list(self) -> builtins.list[ImageInfo]:
        return []

    def get(self, name: str) -> ImageInfo:
        raise ImageNotFound(f"image {name!r} not found: {self.reason}")


class Engine(SurfaceOperations):
    """All sandboxes of one node. Every public method is safe to call concurrently."""

    def __init__(
        self,
        settings: Settings,
        backends: Mapping[str, Backend],
        images: ImageResolver,
        *,
        unavailable: Mapping[str, str] | None = None,
        reaper_interval: float = 1.0,
        tombstone_limit: int = 10_000,
        trajectory_store: TrajectoryStore | None = None,
    ) -> None:
        self.settings = settings
        self.images = images
        self.metrics = Metrics()
        self.reaper_interval = reaper_interval
        self._backends: dict[str, Backend] = dict(backends)
        for name in self._backends:  # exported at 0 from the start: a first failure is an increase to alert on
            self.metrics.teardown_failures.labels(name)
        # Backend name -> why it cannot be used; filled from imports that failed and from available().
        self._unavailable: dict[str, str] = dict(unavailable or {})
        self._store = StateStore(settings.state_db, settings.legacy_state_dir)
        self._records: dict[str, SandboxRecord] = {}
        self._destroying: dict[str, asyncio.Task[None]] = {}
        # Teardowns of destroyed pooled sandboxes still running after the destroy was answered.
        self._teardowns: set[asyncio.Task[None]] = set()
        # Ids destroyed recently -> (state, message). Bounded: a long-lived daemon creates millions.
        self._tombstones: OrderedDict[str, tuple[str, str, str | None]] = OrderedDict()  # state, message, job
        self._tombstone_limit = tombstone_limit
        self._reaper: asyncio.Task[None] | None = None
        self._stopping: str | None = None  # why creates are refused (drain)
        self.snapshots = _snapshot_store(settings, images)
        store = trajectory_store or default_trajectory_store(settings)
        self.rollouts = Rollouts(self, Trajectories(store))
        self._image_refs: dict[str, ImageRef] = {}
        self._tag_refreshes: dict[str, asyncio.Task[None]] = {}
        self.admission = Admission(settings.create_slots)
        self.pools = Pools(self, self.metrics)
        # Parsed now: a bad --pool stops the daemon before it adopts anything, with the entry named; so does a
        # bad image cache reserve (the image store would otherwise be replaced by a stand-in refusing all).
        free_reserve(settings.image_cache_min_free, 1 << 40)
        self._declared = [PoolConfig.parse(text) for text in settings.pools]
        for config in self._declared:
            if config.backend in backends:
                self._check_pool(config, backends[config.backend])
        self.host_limits = HostLimits() if settings.host_limits else None
        # Checked now, pinned at start (isolation/affinity.py): a CPU the daemon may not use stops it here.
        self._control_cpus = affinity.control_cpus(settings.control_cpus)
        self._pinned = False
        self._layer_roots: dict[str, builtins.list[Path]] = {}
        self.audit = AuditLog(settings.audit_path, max_rows=settings.audit_max_rows)
        self.events = EventBus(settings.node)
        self.node_state = NodeState(self.events, self._cached_images, lambda: self._stopping)
        self._announcer: asyncio.Task[None] | None = None
        # The counters every SAMPLE_SECONDS (by the reaper), so a dashboard opened now can chart the past.
        self._samples: deque[CounterSample] = deque(maxlen=int(HISTORY_SECONDS / SAMPLE_SECONDS))
        self._sampled_at = 0.0
        self.on_phase: Callable[[str], None] = lambda what: log.info("start-up: %s", what)
        """Told each start-up phase as it begins (the daemon logs them and shows them to ``dsec up``)."""
        self.components = Health()
        self.watchdog = Watchdog(self, interval=reaper_interval)
        self.surface = Surface(self, PortForwarder(settings.ports_bind, settings.ports_advertise))
        """Users, file operations, processes, terminals, shell sessions and exposed ports (daemon/surface.py)."""

    @classmethod
    def from_settings(cls, settings: Settings, *, reaper_interval: float = 1.0) -> Engine:
        """The default engine: the image store at ``settings.images`` and every backend that imports."""
        images = cls.default_images(settings)
        backends: dict[str, Backend] = {}
        unavailable: dict[str, str] = {}
        for name in get_args(BackendName):
            module, cls_name = backend_class(name)
            try:
                backend_cls = getattr(importlib.import_module(module), cls_name)
                backends[name] = backend_cls(settings)
            except Exception as exc:
                unavailable[name] = f"cannot load the {name} backend: {type(exc).__name__}: {exc}"
        return cls(settings, backends, images, unavailable=unavailable, reaper_interval=reaper_interval)

    @staticmethod
    def default_images(settings: Settings) -> ImageResolver:
        """The node's image store, or a stand-in that explains why it cannot be used."""
        try:
            from dsec.images.node import NodeImages

            return NodeImages(settings, cache_limit=settings.image_cache_limit, daemon=True)
        except Exception as exc:  # a broken store must not keep the daemon (and its sandboxes) down
            log.exception("image store unavailable")
            return _NoImages(f"the image store at {settings.images} cannot be used: {exc}")

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start backends, re-adopt or clean up recorded sandboxes, remove orphans, start the reaper."""
        if self._control_cpus is not None:  # before anything is spawned: the helpers inherit the mask
            node = affinity.node_cpus()
            # Sized for the node, not the pin (Python 3.13 sizes a default pool by the calling thread's CPUs).
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(max_workers=min(32, len(node) + 4), thread_name_prefix="dsec-worker"))
            affinity.pin_control(self._control_cpus)
            self._pinned = True
            log.info("control path pinned to CPUs %s; sandboxes run on %s", affinity.cpu_list(self._control_cpus),
                     affinity.cpu_list(node))
        try:
            await self._start()
        except BaseException:
            if self._pinned:  # an engine run inside another process must not leave it pinned
                affinity.release()
                self._pinned = False
            raise

    async def _start(self) -> None:
        if self.host_limits is not None:
            self.on_phase("raising the host's limits")
            await asyncio.to_thread(self.host_limits.raise_all)
        self.on_phase("opening the trajectory log")
        await self.rollouts.start()
        self.on_phase("opening the audit trail")
        await self.audit.start()
        for name, backend in list(self._backends.items()):
            reason = backend.available()
            if reason == "ok":
                self.on_phase(f"starting the {name} backend")
                try:
                    await backend.start()
                except Exception as exc:
                    log.exception("backend %s failed to start", name)
                    reason = f"failed to start: {type(exc).__name__}: {exc}"
            if reason != "ok":
                self._unavailable[name] = reason
        drop_stale_pins = getattr(self.images, "drop_stale_pins", None)
        if drop_stale_pins is not None:  # before recovery mounts (and pins) again what the sandboxes use
            self.on_phase("dropping stale image pins")
            await asyncio.to_thread(drop_stale_pins)
        sem = asyncio.Semaphore(_RECOVERY_PARALLELISM)
        records = self._store.load_all()
        done = 0

        async def recover(record: SandboxRecord) -> None:
            nonlocal done
            async with sem:
                await self._recover(record)
            done += 1
            if done % 16 == 0:  # progress within a long phase is progress too
                self.on_phase(f"recovering sandboxes ({done}/{len(records)})")

        self.on_phase(f"recovering sandboxes (0/{len(records)})")
        await asyncio.gather(*(recover(r) for r in records))
        for name, backend in self._backends.items():
            if name in self._unavailable:
                continue
            self.on_phase(f"removing orphans of the {name} backend")
            known = {r.id for r in self._records.values() if r.spec.backend == name}
            try:
                removed = await backend.cleanup_orphans(known)
            except Exception:
                log.exception("backend %s: orphan cleanup failed", name)
                continue
            if removed:
                log.warning("backend %s: removed %d orphaned sandboxes: %s", name, len(removed), removed)
        self.on_phase("re-attaching trajectories")
        await self.rollouts.adopt(list(self._records.values()))
        self.on_phase("sweeping snapshot layers")
        await asyncio.to_thread(self.snapshots.sweep)  # layers only dead sandboxes of the last daemon used
        self._reaper = asyncio.create_task(self._reap_forever(), name="dsec-reaper")
        self._announcer = asyncio.create_task(self.node_state.run_forever(), name="dsec-node-state")
        self.watchdog.start()
        for config in self._declared:
            self.pools.declare(config)
        self.pools.start()

    async def _recover(self, record: SandboxRecord) -> None:
        name = record.spec.backend
        backend = self._backends.get(name)
        if backend is None or name in self._unavailable:
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
            self._records[record.id] = record
            if record.spec.image:
                try:  # re-pin the image mount this sandbox's root sits on
                    self._image_refs[record.id] = await asyncio.to_thread(self._repin_image, backend, record)
                except DSecError as exc:
                    log.warning("sandbox %s: its image %s cannot be re-pinned: %s", record.id, record.spec.image, exc)
            if record.layers:
                try:  # and the snapshot layers under it
                    self._layer_roots[record.id] = await asyncio.to_thread(self.snapshots.open, record.layers)
                except DSecError as exc:
                    log.warning("sandbox %s: its snapshot layers cannot be re-pinned: %s", record.id, exc)
            self.metrics.live.labels(name).inc()
            self._store.save(record)  # the backend may have refreshed backend_state
            log.info("sandbox %s re-adopted (%s)", record.id, record.state)
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
        self._store.delete(record.id)
        log.info("sandbox %s (%s) was gone after restart; record dropped", record.id, record.state)

    def drain(self, reason: str) -> None:
        """The daemon is stopping (``reason`` says why): refuse new creates and fail the queued ones with
        :class:`DaemonStopping` at once (a batch or fork then retires what it had made), and stop refilling the pools.
        Creates already admitted, execs and destroys run on; the sandboxes stay for the next daemon. Without
        it a batch still queued held the shutdown for the server's graceful timeout and its caller got an HTTP
        500 when the server gave up."""
        if self._stopping is None:
            self._stopping = reason
            log.info("draining: %s; new and queued creates are refused", reason)
            self.admission.close(reason)
            self.pools.drain()
            self.node_state.stopped()

    @property
    def stopping(self) -> str | None:
        """Why the engine refuses creates (see :meth:`drain`), or None while it serves."""
        return self._stopping

    def _refuse_if_stopping(self) -> None:
        if self._stopping is not None:
            raise DaemonStopping(f"create refused: {self._stopping}", kept=0)
        disk = self.components.get("node-disk")
        if disk is not None and disk.state == "down":
            raise BackendUnavailable(f"create refused on node {self.settings.node}: {disk.error}",
                                     component="node-disk")

    async def aclose(self) -> None:
        """Drain the warm pools, stop the reaper and the backends. Sandboxes stay alive for the next daemon
        to re-adopt."""
        await self.watchdog.aclose()
        drained = await self.pools.aclose()
        if drained:
            log.info("destroyed %d unclaimed pool sandboxes", drained)
        await self.wait_teardowns()
        for task in list(self._tag_refreshes.values()):  # (the store lookup's thread ends on its own)
            task.cancel()
        for background in (self._reaper, self._announcer):
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
        self._reaper = None
        self._announcer = None
        await self.surface.aclose()
        for name, backend in self._backends.items():
            try:
                await backend.aclose()
            except Exception:
                log.exception("backend %s failed to close", name)
        await self.rollouts.aclose()
        await self.audit.aclose()
        self._store.close()
        if self.host_limits is not None:
            await asyncio.to_thread(self.host_limits.restore)
        if self._pinned:
            affinity.release()
            self._pinned = False
        close_images = getattr(self.images, "close_idle", None)
        if close_images is not None:  # image mounts stay only under live sandboxes (for the next daemon)
            try:
                await close_images()
            except Exception:
                log.exception("closing the image mounts failed")

    async def destroy_all(self) -> int:
        """Destroy every sandbox; returns how many were destroyed."""
        ids = list(self._records)
        results = await asyncio.gather(*(self.destroy(i) for i in ids), return_exceptions=True)
        for sandbox_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException):
                log.error("sandbox %s: destroy failed: %s", sandbox_id, result)
        await self.wait_teardowns()
        return sum(1 for r in results if not isinstance(r, BaseException))

    async def wait_teardowns(self) -> None:
        """Wait until every background teardown of a destroyed pooled sandbox has finished."""
        while self._teardowns:
            await asyncio.gather(*list(self._teardowns), return_exceptions=True)

    # -- lookups -------------------------------------------------------------------------------------

    def _backend(self, name: str) -> Backend:
        backend = self._backends.get(name)
        if backend is None or name in self._unavailable:
            reason = self._unavailable.get(name, "it is not implemented on this node yet")
            raise BackendUnavailable(f"backend {name!r} is not available: {reason}", backend=name)
        return backend

    async def owner_labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The labels of a live sandbox (the token guard reads the job that owns it), None if there is none.

        A sandbox that expired or was destroyed lately answers only its owning job's label, so that job's
        token reaches the route and is told why it is gone (SandboxTimeout with the reason), while other
        jobs still get the 404 of an id that does not exist."""
        record = self._records.get(sandbox_id)
        if record is not None:
            return dict(record.spec.labels)
        tomb = self._tombstones.get(sandbox_id)
        return None if tomb is None or tomb[2] is None else {JOB_LABEL: tomb[2]}

    def _resolve_image(self, backend: Backend, name: str) -> ImageRef:
        """The backend's own image ``name`` if it has such images (``vm``), else the store's. Blocking."""
        return backend.resolve_image(name) or self.images.resolve(name)

    def _repin_image(self, backend: Backend, record: SandboxRecord) -> ImageRef:
        """Pin again the image version a re-adopted sandbox was made of (by digest: its tag may have moved
        while no daemon ran, and resolving the name would pin the new version, leaving the sandbox's own
        mount unpinned: idle for the reaper, its chunks evictable). Blocking."""
        pin = getattr(self.images, "pin_manifest", None)
        assert record.spec.image is not None
        if record.image_digest and pin is not None and type(backend).resolve_image is Backend.resolve_image:
            root: Path = pin("sha256:" + record.image_digest)
            return ImageRef(name=record.spec.image, rootfs=root, digest=record.image_digest)
        return self._resolve_image(backend, record.spec.image)

    def _resolve_warm(self, backend: Backend, name: str) -> ImageRef | None:
        """:meth:`_resolve_image` without a worker-thread hop when the store's image is mounted and its tag
        fresh (most creates); None otherwise."""
        warm = getattr(self.images, "resolve_warm", None)
        if warm is None or type(backend).resolve_image is not Backend.resolve_image:
            return None
        found: ImageRef | None = warm(name)
        return found

    def _lookup(self, sandbox_id: str) -> SandboxRecord:
        record = self._records.get(sandbox_id)
        if record is not None:
            return record
        tomb = self._tombstones.get(sandbox_id)
        if tomb is not None and tomb[0] == "expired":
            raise SandboxTimeout(tomb[1], sandbox_id=sandbox_id)
        if tomb is not None and tomb[0] == "lost":
            raise SandboxLost(tomb[1], sandbox_id=sandbox_id, node=self.settings.node)
        if tomb is not None:
            raise SandboxNotFound(tomb[1], sandbox_id=sandbox_id)
        message = f"no sandbox {sandbox_id!r} on node {self.settings.node}"
        raise SandboxNotFound(message, sandbox_id=sandbox_id)

    def _live(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        record = self._lookup(sandbox_id)
        if record.state == "running" or (allow_paused and record.state == "paused"):
            return record
        raise SandboxStateError(
            f"sandbox {sandbox_id} is {record.state}; the operation needs it running",
            sandbox_id=sandbox_id,
            state=record.state,
        )

    def _info(self, record: SandboxRecord, *, pooled: bool = False) -> SandboxInfo:
        return SandboxInfo(
            id=record.id,
            backend=record.spec.backend,
            image=record.spec.image,
            state=record.state,
            created_at=record.created_at,
            expires_at=record.expires_at,
            labels=dict(record.spec.labels),
            spec=record.spec,
            node=self.settings.node,
            reason=record.reason,
            trajectory=self.rollouts.status(record),
            pooled=pooled,
        )

    def _tombstone(self, record: SandboxRecord, state: str, message: str) -> None:
        # The owning job is kept so that its token is told why the sandbox is gone (not a bare 404).
        self._tombstones[record.id] = (state, message, record.spec.labels.get(JOB_LABEL))
        self._tombstones.move_to_end(record.id)
        while len(self._tombstones) > self._tombstone_limit:
            self._tombstones.popitem(last=False)

    # -- sandboxes -----------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create one sandbox and return it running; with ``spec.trajectory``, open that trajectory."""
        if POOL_LABEL in spec.labels:
            raise InvalidRequest(f"label {POOL_LABEL!r} is reserved for warm-pool sandboxes")
        if spec.trajectory is not None:
            return await self.rollouts.open(spec)  # re-attaching makes nothing; a rebuild is refused in _make
        self._refuse_if_stopping()
        if spec.snapshot is None and self._poolable(spec):
            claimed = await self._claim(spec)
            if claimed is not None:
                return claimed
        return await self.create_unpooled(spec, spec.snapshot)

    def _poolable(self, spec: SandboxSpec) -> bool:
        """Whether everything ``spec`` asks beyond its pool shape can be applied to a running sandbox (a network
        policy other than the member's needs ``set_network``)."""
        backend = self._backends.get(spec.backend)
        if backend is None:
            return False
        return spec.network == "none" or type(backend).set_network is not Backend.set_network

    async def _claim(self, spec: SandboxSpec) -> SandboxInfo | None:
        """Hand out a ready pool member with ``spec``'s labels, env, timeout and network; None: pool empty.

        A member is handed out only while it runs and is of the image version a fresh create would get now
        (a re-import moves the tag; idle members can wait for days): others are destroyed on the way."""
        backend = self._backends.get(spec.backend)
        if backend is None or spec.backend in self._unavailable:
            return None  # the create path raises (and counts) BackendUnavailable
        digest = self._known_digest(backend, spec.image) if spec.image and self.pools.has_ready(spec) else None
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
            self._store.save(record)
        except BaseException:  # cancelled (a client gone, a batch failed) or the save failed: nobody has it
            self._discard_later(record)
            raise
        self._records[record.id] = record
        self.metrics.create_seconds.labels(spec.backend).observe(time.monotonic() - started)
        self.metrics.created.labels(spec.backend).inc()
        self.metrics.live.labels(spec.backend).inc()
        log.debug("sandbox %s claimed from pool (%s, image %s)", record.id, spec.backend, spec.image)
        info = self._info(record, pooled=True)
        self.events.publish("created", info, pooled=True, seconds=round(time.monotonic() - started, 6))
        return info

    def _usable(self, backend: Backend, digest: str | None, member: SandboxRecord) -> bool:
        """Whether pool member ``member`` may be handed out: it runs, and its image is version ``digest`` (the
        one its tag names; None: unknown, any version goes)."""
        if not backend.alive(member):
            log.warning("pool member %s died while it waited; destroyed", member.id)
            return False
        ref = self._image_refs.get(member.id)
        stale = getattr(self.images, "stale", None)
        if ref is not None and stale is not None and stale(ref.rootfs) is not None:
            log.warning("pool member %s sits on a dead image mount; destroyed", member.id)
            return False
        if digest is not None and ref is not None and ref.digest is not None and ref.digest != digest:
            log.info("pool member %s is of an earlier version of image %s; destroyed", member.id, member.spec.image)
            return False
        return True

    def member_usable(self, record: SandboxRecord) -> bool:
        backend = self._backends.get(record.spec.backend)
        if backend is None:
            return False
        image = record.spec.image
        return self._usable(backend, self._known_digest(backend, image) if image else None, record)

    def _known_digest(self, backend: Backend, name: str) -> str | None:
        """The digest (hex) image ``name`` resolved to when last looked up (None: unknown: a backend's own
        images, a directory image, never looked up). Never waits for the store: an answer older than the
        tag's time to live is refreshed in the background (one lookup per image at a time), and the claims
        until it lands use the older answer."""
        if type(backend).resolve_image is not Backend.resolve_image:
            return None
        known = getattr(self.images, "known_digest", None)
        if known is None:
            return None
        digest, fresh = known(name)
        if not fresh and name not in self._tag_refreshes:
            task = asyncio.create_task(self._refresh_tag(name), name=f"dsec-tag-{name}")
            self._tag_refreshes[name] = task
            task.add_done_callback(lambda _t: self._tag_refreshes.pop(name, None))
        return digest  # type: ignore[no-any-return]

    async def _refresh_tag(self, name: str) -> None:
        try:
            await asyncio.to_thread(self.images.current_digest, name)  # type: ignore[attr-defined]
        except DSecError as exc:  # a warm node keeps serving the images it has
            log.debug("image %s: cannot look its tag up (%s); pool members served as they are", name, exc)

    def _discard_later(self, record: SandboxRecord) -> None:
        """Destroy an unclaimed pool member in the background (:meth:`aclose` waits for it)."""
        self._in_background(self.discard_member(record), f"dsec-discard-{record.id}")

    async def create_member(self, spec: SandboxSpec) -> SandboxRecord:
        """Create a pool member: recorded on disk (so a crash cleans it up) but invisible until claimed."""
        record, _ = await self._make(spec, None, visible=False)
        return record

    async def discard_member(self, record: SandboxRecord) -> None:
        """Destroy an unclaimed pool member (its record stays on disk if that fails: the next start retries)."""
        try:
            await self._backend(record.spec.backend).destroy(record)
        except Exception:
            log.exception("pool member %s: destroy failed; record kept for the next start", record.id)
            return
        self._release_image(record.id)
        self._store.delete(record.id)

    @staticmethod
    def _check_pool(config: PoolConfig, backend: Backend) -> None:
        if config.network != "none" and type(backend).set_network is Backend.set_network:
            raise InvalidRequest(f"a pool on the {config.backend!r} backend takes network='none' only: it cannot "
                                 "apply a claim's network policy to a running sandbox")

    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Add a warm pool or change its bounds (``max=0`` empties it)."""
        self._check_pool(config, self._backend(config.backend))
        return self.pools.declare(config)

    async def statistics(self) -> NodeStatistics:
        """Warm pools and the create admission queue now."""
        return NodeStatistics(pools=self.pools.statistics(), admission=self.admission.statistics(),
                              teardowns=len(self._teardowns))

    async def create_unpooled(self, spec: SandboxSpec, snapshot: str | None) -> SandboxInfo:
        """Create one sandbox, from its image or restored from snapshot ``snapshot`` of the snapshot store."""
        record, queued = await self._make(spec, snapshot, visible=True)
        return self._info(record).model_copy(update={"queue_seconds": queued})

    async def _make(self, spec: SandboxSpec, snapshot: str | None, *, visible: bool) -> tuple[SandboxRecord, float]:
        """Create a sandbox after admission; returns its record (running, persisted) and the seconds queued.

        ``visible``: a client sandbox (listed, counted live) rather than a pool member.
        """
        self._refuse_if_stopping()
        if not visible and (busy := self.admission.busy()) is not None:
            raise Deferred(busy)  # a refill: before it pins an image or writes a record it would undo at once
        name = spec.backend
        layers: builtins.list[str] = []
        revealed: builtins.list[str] = []
        try:
            backend = self._backend(name)
            if snapshot is not None:
                meta = await asyncio.to_thread(self.snapshots.meta, snapshot)
                revealed = list(meta.get("revealed", []))
                if meta.get("backend") != name:
                    raise InvalidRequest(f"snapshot {snapshot} was taken on backend {meta.get('backend')!r}; "
                                         f"it cannot be restored on {name!r}")
                if spec.image is None:
                    spec = spec.model_copy(update={"image": meta.get("image")})
                elif spec.image != meta.get("image"):
                    raise InvalidRequest(f"snapshot {snapshot} is of image {meta.get('image')!r}, "
                                         f"not {spec.image!r}")
                spec = spec.model_copy(update={"snapshot": snapshot})
                layers = list(meta.get("layers", []))
            if not spec.image:
                raise InvalidRequest("spec.image is required unless a snapshot is given")
            warm = self._resolve_warm(backend, spec.image)
            image = warm if warm is not None else await _pinning(
                functools.partial(self._resolve_image, backend, spec.image), self._release)
            try:
                roots = await _pinning(functools.partial(self.snapshots.open, layers),
                                       self.snapshots.close) if snapshot is not None else []
            except BaseException:
                self._release(image)
                raise
        except DSecError as exc:
            self.metrics.failed.labels(name, type(exc).__name__).inc()
            if visible:
                self.events.publish("create_failed", spec=spec, reason=exc.message, error=type(exc).__name__)
            raise
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
        # Persisted before the backend acts, so a daemon killed mid-create cleans up on restart.
        try:
            self._store.save(record)
        except BaseException:  # the state disk is full, say: nothing was made, give the pins back
            self._release(image)
            self.snapshots.close(roots)
            raise
        if visible:
            self._records[record.id] = record
        self._image_refs[record.id] = image
        self._layer_roots[record.id] = roots
        queued = 0.0
        admitted = False
        try:
            async with self.admission.admit(background=not visible) as queued:
                admitted = True
                self.metrics.admission_seconds.labels(name).observe(queued)
                started = time.monotonic()
                if snapshot is not None:
                    await backend.restore(record, image, roots)
                    if record.backend_state.get("hidden") and set(record.spec.hidden) <= set(revealed):
                        # Taken in the grading phase: what was revealed then is visible in the copy too
                        # (a trajectory rebuilt from a checkpoint after its reveal must not hide it again).
                        await backend.reveal(record)
                else:
                    await backend.create(record, image)
        except BaseException as exc:
            await self._undo_create(backend, record, started=admitted)
            if isinstance(exc, (DaemonStopping, Deferred)):
                raise  # refused, not failed: no failure count, no create_failed (a whole queue is refused at once)
            cause = self._explain_image(image, now) if admitted and not isinstance(exc, asyncio.CancelledError) \
                else None
            if cause is not None:
                self.metrics.failed.labels(name, type(cause).__name__).inc()
                if visible:
                    self.events.publish("create_failed", spec=spec, reason=cause.message, error=type(cause).__name__)
                raise cause from exc
            reason = type(exc).__name__ if isinstance(exc, DSecError) else "SandboxError"
            if isinstance(exc, asyncio.CancelledError):
                reason = "cancelled"
            self.metrics.failed.labels(name, reason).inc()
            if visible:
                self.events.publish("create_failed", spec=spec, reason=str(exc) or reason, error=reason)
            if isinstance(exc, DSecError) or not isinstance(exc, Exception):
                raise
            raise SandboxError(f"creating a {name} sandbox failed: {type(exc).__name__}: {exc}") from exc
        record.state = "running"
        self._store.save(record)
        if not visible:
            return record, queued
        self.metrics.create_seconds.labels(name).observe(time.monotonic() - started)
        self.metrics.created.labels(name).inc()
        self.metrics.live.labels(name).inc()
        log.info("sandbox %s created (%s, image %s, queued %.3f s)", record.id, name, spec.image, queued)
        self.events.publish("created", self._info(record), seconds=round(time.monotonic() - started, 6))
        return record, queued

    async def _undo_create(self, backend: Backend, record: SandboxRecord, *, started: bool) -> None:
        """Forget a create that failed; ``started``: the backend was called, so it may have made something.
        A create that never left the admission queue (timed out, or refused by the daemon stopping) costs no
        backend call: a stopping daemon fails a queue of thousands at once."""
        self._records.pop(record.id, None)
        if not started:
            self._release_image(record.id)
            self._store.delete(record.id)
            return
        try:
            await backend.destroy(record)
        except BaseException:
            # Keep the record: the next daemon start retries the cleanup.
            log.exception("sandbox %s: cleanup after failed create failed; record kept", record.id)
            return
        self._release_image(record.id)
        self._store.delete(record.id)

    def _explain_image(self, image: ImageRef, since: float) -> DSecError | None:
        """The image-loading error (store down, corrupt chunk, cache full) behind a create that failed, if the
        lazy filesystem recorded one since the create began (``since``, wall clock)."""
        explain = getattr(self.images, "explain", None)
        return explain(image, since) if explain is not None else None

    def _release_image(self, sandbox_id: str) -> None:
        ref = self._image_refs.pop(sandbox_id, None)
        if ref is not None:
            self._release(ref)
        self.snapshots.close(self._layer_roots.pop(sandbox_id, []))

    def _release(self, ref: ImageRef) -> None:
        release = getattr(self.images, "release", None)
        if release is not None:
            release(ref)

    async def create_many_stream(self, request: BatchCreateRequest) -> AsyncIterator[BatchCreateEvent]:
        """:meth:`create_many`, answered as a stream (one node creates its share at once: all come together)."""
        for info in await self.create_many(request):
            yield BatchCreateEvent(type="sandbox", sandbox=info)
        yield BatchCreateEvent(type="done")

    async def create_many(self, request: BatchCreateRequest) -> builtins.list[SandboxInfo]:
        """Create ``count`` sandboxes concurrently; all or nothing (the first error is raised)."""
        if request.spec.trajectory is not None:
            raise InvalidRequest("a trajectory binds one sandbox: create trajectory sandboxes one at a time")
        self._refuse_if_stopping()
        # No batch-level limit: admission queues every create (slots, memory, pids) in arrival order.
        tasks = [asyncio.create_task(self.create(request.spec)) for _ in range(request.count)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            def done() -> builtins.list[SandboxInfo]:
                return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]

            for task in tasks:
                task.cancel()
            if self._stopping is not None:  # cut off at the server's graceful timeout: nothing may await now
                self._retire_quietly(done())
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._stopping is not None:
                self._retire_quietly(done())
            else:
                await self._destroy_quietly(done())
            raise
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return made
        if self._stopping is not None:
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
        err = DaemonStopping(f"{what} refused: {self._stopping}{detail}", kept=0)
        err.__cause__ = stopped
        return err

    def _retire_quietly(self, infos: builtins.list[SandboxInfo]) -> int:
        """Retire these sandboxes of a failed batch (those no destroy has taken yet); how many."""
        retired = 0
        for info in infos:
            record = self._records.get(info.id)
            if record is not None and info.id not in self._destroying:
                self._retire(record)
                retired += 1
        return retired

    async def _destroy_quietly(self, infos: builtins.list[SandboxInfo]) -> None:
        results = await asyncio.gather(*(self.destroy(i.id) for i in infos), return_exceptions=True)
        for info, result in zip(infos, results, strict=True):
            if isinstance(result, BaseException):
                log.error("sandbox %s: rollback destroy failed: %s", info.id, result)

    async def list(
        self,
        labels: Mapping[str, str] | None = None,
        backend: str | None = None,
        state: str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes whose labels include ``labels`` (and of that backend / state, if given); with ``after`` or
        ``limit``, the page of them in id order after the id ``after``, at most ``limit`` long."""
        wanted = dict(labels or {})
        found = [
            r
            for r in self._records.values()
            if (backend is None or r.spec.backend == backend)
            and (state is None or r.state == state)
            and all(r.spec.labels.get(k) == v for k, v in wanted.items())
            and (after is None or r.id > after)
        ]
        if after is not None or limit is not None:
            found.sort(key=lambda r: r.id)
            found = found[:limit]
        return [self._info(r) for r in found]

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox."""
        return self._info(self._lookup(sandbox_id))

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy a sandbox. Idempotent: destroying a destroyed or expired sandbox is not an error."""
        pending = self._destroying.get(sandbox_id)
        if pending is not None:
            await asyncio.shield(pending)
            return
        if sandbox_id not in self._records and sandbox_id in self._tombstones:
            return
        record = self._lookup(sandbox_id)
        if record.state == "creating":
            raise SandboxStateError(f"sandbox {sandbox_id} is still being created", sandbox_id=sandbox_id)
        if record.pooled and record.spec.trajectory is None and len(self._teardowns) < _BACKGROUND_TEARDOWNS:
            self._retire(record)
            return
        task = asyncio.create_task(self._remove(record, "destroyed", f"sandbox {sandbox_id} was destroyed"))
        self._destroying[sandbox_id] = task
        try:
            # Shielded: a client that hangs up mid-DELETE must not leave a half-destroyed sandbox.
            await asyncio.shield(task)
        finally:
            if task.done():
                self._destroying.pop(sandbox_id, None)
            else:
                task.add_done_callback(lambda _t: self._destroying.pop(sandbox_id, None))

    async def destroy_many(self, request: BatchDestroyRequest) -> BatchDestroyResult:
        """Destroy each of ``request.ids`` on its own, at most :data:`_DESTROY_MANY_AT_ONCE` at a time."""
        result = BatchDestroyResult()
        at_once = asyncio.Semaphore(_DESTROY_MANY_AT_ONCE)

        async def one(sandbox_id: str) -> None:
            record = self._records.get(sandbox_id)
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

    def _retire(self, record: SandboxRecord) -> None:
        """Destroy a pooled sandbox (or one of a batch failed by the daemon stopping) as the client sees it
        now, and tear it down in the background (:meth:`aclose` waits for it).

        From here on the id is gone (lookups answer "destroyed") and no call reaches the sandbox. Its
        record is saved as ``stopped`` first: a daemon restarted before the teardown ends destroys it
        instead of re-adopting it. A teardown that fails keeps the record (``failed``) for the next start.
        """
        info = self._info(record)
        record.state = "stopped"
        self._store.save(record)
        if self._records.pop(record.id, None) is not None:
            self.metrics.live.labels(record.spec.backend).dec()
        self._tombstone(record, "destroyed", f"sandbox {record.id} was destroyed")
        self.events.publish("destroyed", info, reason=None)
        self._in_background(self._teardown(record), f"dsec-teardown-{record.id}")

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run a teardown as a task that :meth:`aclose` (``wait_teardowns``) waits for."""
        task = asyncio.create_task(work, name=name)
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def _teardown(self, record: SandboxRecord) -> None:
        try:
            await self.surface.forget(record.id)
            await self._backend(record.spec.backend).destroy(record)
        except Exception as exc:
            record.state = "failed"
            record.reason = f"destroy failed: {type(exc).__name__}: {exc}"
            self._store.save(record)
            self.metrics.teardown_failures.labels(record.spec.backend).inc()
            log.exception("sandbox %s: background teardown failed; record kept for the next start", record.id)
            return
        self._release_image(record.id)
        self._store.delete(record.id)
        log.debug("sandbox %s torn down", record.id)
        if record.spec.snapshot is not None:
            await self._drop_ephemeral(record.spec.snapshot)

    async def _remove(self, record: SandboxRecord, state: str, message: str) -> None:
        backend = self._backend(record.spec.backend)
        try:
            await self.surface.forget(record.id)
            await backend.destroy(record)
        except Exception as exc:
            record.state = "failed"
            record.reason = f"destroy failed: {type(exc).__name__}: {exc}"
            self._store.save(record)
            log.exception("sandbox %s: destroy failed", record.id)
            if isinstance(exc, DSecError):
                raise
            raise SandboxError(f"destroying sandbox {record.id} failed: {exc}") from exc
        self._release_image(record.id)
        if self._records.pop(record.id, None) is not None:
            self.metrics.live.labels(record.spec.backend).dec()
            if state == "expired":
                self.metrics.expired.labels(record.spec.backend).inc()
        self._store.delete(record.id)
        self._tombstone(record, state, message)
        kind: LifecycleKind = "expired" if state == "expired" else "lost" if state == "lost" else "destroyed"
        self.events.publish(kind, self._info(record), reason=record.reason if kind != "destroyed" else None)
        self.rollouts.forget(record)
        log.info("sandbox %s %s", record.id, state, extra={"sandbox": record.id})
        if record.spec.snapshot is not None:
            await self._drop_ephemeral(record.spec.snapshot)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reaper_interval)
            try:
                self._sample()
                await self.reap()
                await self._unmount_idle_images()
            except Exception:
                log.exception("reaper pass failed")

    def _counters(self, totals: dict[str, float]) -> CounterSample:
        failures = sum(self.metrics.failures().values())
        return CounterSample(
            at=time.time(), created=int(totals.get("dsec_sandboxes_created_total", 0)),
            create_seconds_sum=totals.get("dsec_create_seconds_sum", 0.0),
            exec_count=int(totals.get("dsec_exec_seconds_count", 0)),
            exec_seconds_sum=totals.get("dsec_exec_seconds_sum", 0.0), failures=failures)

    def _sample(self) -> None:
        """Append the counters to the history when ``SAMPLE_SECONDS`` have passed since the last sample."""
        now = time.monotonic()
        if now - self._sampled_at >= SAMPLE_SECONDS:
            self._sampled_at = now
            self._samples.append(self._counters(self.metrics.totals()))

    async def _unmount_idle_images(self) -> None:
        """Image mounts stay warm for ``IMAGE_IDLE_SECONDS`` after their last sandbox, then go."""
        idle = getattr(self.images, "idle", None)
        if idle is not None and idle(IMAGE_IDLE_SECONDS):
            done = await asyncio.to_thread(self.images.unmount_idle, IMAGE_IDLE_SECONDS)  # type: ignore[attr-defined]
            log.info("unmounted %d idle images", len(done))

    async def reap(self) -> int:
        """Destroy every sandbox past its wall-clock timeout now; returns how many."""
        now = time.time()
        due = [
            r for r in self._records.values()
            if (r.expires_at <= now or self.rollouts.lease_expired(r, now))
            and r.state in ("running", "paused") and r.id not in self._destroying
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
            self._destroying[record.id] = task
            try:
                await task
            finally:
                self._destroying.pop(record.id, None)

        results = await asyncio.gather(*(expire(r) for r in due), return_exceptions=True)
        return sum(1 for r in results if not isinstance(r, BaseException))

    # -- commands and files --------------------------------------------------------------------------

    def exec_stream(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> AsyncIterator[ExecEvent]:
        """Start streaming a command's events. Lookup errors raise here, before the first event.

        Closing the returned iterator early kills the command (the backend's contract), except on a
        trajectory-bound sandbox, where the command runs on and is logged (``seq``: its call number).
        """
        record = self._live(sandbox_id, allow_paused=False)
        backend = self._backend(record.spec.backend)
        if record.spec.trajectory is not None:
            return self.rollouts.exec_stream(record, backend, request, seq)
        return self.exec_events(backend, record, request)

    async def exec_unlogged(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        """Run a command on a sandbox without its trajectory log (recovery re-runs logged calls this way)."""
        return await collect_exec(self.exec_events(self._backend(record.spec.backend), record, request))

    async def exec_events(
        self, backend: Backend, record: SandboxRecord, request: ExecRequest
    ) -> AsyncIterator[ExecEvent]:
        name = record.spec.backend
        at, started = time.time(), time.monotonic()
        outcome: AuditOutcome = "cancelled"
        result: ExecResult | None = None
        error: str | None = None
        user = None
        if request.user is not None or record.spec.user is not None:
            user = await self.surface.identity(record, backend, request.user)
        if request.cwd is not None and not request.cwd.startswith("/"):
            request = request.model_copy(update={"cwd": self.surface.path(record, request.cwd)})
        stream = backend.exec_stream(record, request, user)
        try:
            async for event in stream:
                if event.type == "exit" and event.result is not None:
                    result = event.result
                    outcome = "ok" if result.exit_code == 0 else "limit" if result.limit else "nonzero"
                    if result.limit is not None:
                        self.metrics.limit_hits.labels(name, result.limit).inc()
                elif event.type == "error":
                    outcome = "error"
                    error = str((event.error or {}).get("message", ""))
                yield event
        except Exception as exc:
            outcome, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # Metrics and the audit record first: the awaits below may be cancelled when the client hung up.
            elapsed = time.monotonic() - started
            self.metrics.execs.labels(name, outcome).inc()
            self.metrics.exec_seconds.labels(name).observe(elapsed)
            self.audit_command(record, "exec", request.command, request.cwd, at, elapsed, outcome, result, error)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def exec(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> ExecResult:
        """Run a command to completion."""
        record = self._live(sandbox_id, allow_paused=False)
        if record.spec.trajectory is None:
            return await collect_exec(self.exec_stream(sandbox_id, request, seq))
        return await self.rollouts.exec(record, self._backend(record.spec.backend), request, seq)

    async def call(self, sandbox_id: str, request: CallRequest) -> CallResult:
        """Run a pickled Python callable; the reply goes back undecoded (the daemon never unpickles it)."""
        record = self._live(sandbox_id, allow_paused=False)
        backend = self._backend(record.spec.backend)
        name = record.spec.backend
        at, started = time.time(), time.monotonic()
        outcome: AuditOutcome = "error"
        result: ExecResult | None = None
        error: str | None = None
        try:
            out = await backend.call(record, request)
            result = out.result
            outcome = "ok" if result.exit_code == 0 else "limit" if result.limit else "nonzero"
            if result.limit is not None:
                self.metrics.limit_hits.labels(name, result.limit).inc()
            return out
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            elapsed = time.monotonic() - started
            self.metrics.execs.labels(name, outcome).inc()
            self.metrics.exec_seconds.labels(name).observe(elapsed)
            self.audit_command(record, "call", [request.python, "<pickled callable>"], None, at, elapsed, outcome,
                               result, error)

    def audit_command(self, record: SandboxRecord, op: str, command: str | builtins.list[str], cwd: str | None,
                      at: float, elapsed: float, outcome: AuditOutcome, result: ExecResult | None,
                      error: str | None) -> None:
        """Queue the audit record of one command (in memory; the audit log's flusher writes it)."""
        spec = record.spec
        # A plain tuple in audit.COLUMNS order: the flusher decodes and serialises it off the event loop.
        who, job, node = caller.get(), spec.labels.get(JOB_LABEL), self.settings.node
        if result is None:
            self.audit.record((at, record.id, node, spec.backend, who, job, op, command, cwd, outcome, None, None,
                               elapsed, b"", b"", 0, spec.trajectory, error))
        else:
            self.audit.record((at, record.id, node, spec.backend, who, job, op, command, cwd, outcome,
                               result.exit_code, result.limit, elapsed, result.stdout[:OUTPUT_HEAD_BYTES],
                               result.stderr[:OUTPUT_HEAD_BYTES], len(result.stdout) + len(result.stderr),
                               spec.trajectory, error))

    async def read_file(self, sandbox_id: str, path: str, seq: int | None = None, *,
                        max_bytes: int = MAX_FILE_BYTES, user: str | None = None) -> bytes:
        """A file's bytes (``path`` absolute or relative to the sandbox's workdir; as ``user``; a file larger
        than ``max_bytes`` is refused)."""
        record = self._live(sandbox_id, allow_paused=True)
        backend = self._backend(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> bytes:
            return await backend.read_file(record, path, max_bytes, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            return await run()
        args: dict[str, Any] = {"path": path} if user is None else {"path": path, "user": user}
        data: bytes = await self.rollouts.call(record, seq, "read", args, None, lambda _: run())
        return data

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int | None = None, seq: int | None = None,
        user: str | None = None,
    ) -> None:
        """Create or replace a file (parents created; as ``user``)."""
        if mode is not None and not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"file mode must be between 0 and 0o7777, got {mode:o}")
        record = self._live(sandbox_id, allow_paused=True)
        backend = self._backend(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> None:
            await backend.write_file(record, path, data, mode, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            await run()
            return
        args: dict[str, Any] = {"path": path, "mode": mode, "data": data}
        if user is not None:
            args["user"] = user
        await self.rollouts.call(record, seq, "write", args, data, lambda _: run())

    async def list_files(self, sandbox_id: str, path: str, seq: int | None = None, user: str | None = None
                         ) -> builtins.list[FileEntry]:
        """A directory's entries (as ``user``)."""
        record = self._live(sandbox_id, allow_paused=True)
        backend = self._backend(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> builtins.list[FileEntry]:
            return await backend.list_files(record, path, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            return await run()
        args: dict[str, Any] = {"path": path} if user is None else {"path": path, "user": user}
        entries: builtins.list[FileEntry] = await self.rollouts.call(record, seq, "list", args, None,
                                                                     lambda _: run())
        return entries

    # -- the surface's host (daemon/surface.py) --------------------------------------------------------

    def find_record(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of ``sandbox_id`` if this node has one (in any state)."""
        return self._records.get(sandbox_id)

    def info_of(self, record: SandboxRecord) -> SandboxInfo:
        """What a client is told of ``record``."""
        return self._info(record)

    def save_record(self, record: SandboxRecord) -> None:
        """Persist ``record`` (its backend state changed)."""
        self._store.save(record)

    def live_record(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        """The record of a running (or, if allowed, paused) sandbox."""
        return self._live(sandbox_id, allow_paused=allow_paused)

    def backend_for(self, record: SandboxRecord) -> Backend:
        """The backend that runs ``record``."""
        return self._backend(record.spec.backend)

    async def logged(self, record: SandboxRecord, seq: int | None, op: str, args: dict[str, Any],
                     body: bytes | None, run: Callable[[], Awaitable[Any]]) -> Any:
        """``run()`` as a logged call of ``record``'s trajectory, or directly for a sandbox bound to none."""
        if record.spec.trajectory is None:
            return await run()
        return await self.rollouts.call(record, seq, op, args, body, lambda _: run())

    # -- snapshots and forks -------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, seq: int | None = None) -> SnapshotRef:
        """Save a sandbox's writable state in the snapshot store (a logged checkpoint on a trajectory)."""
        record = self._live(sandbox_id, allow_paused=True)
        if record.spec.trajectory is not None:
            return SnapshotRef(snapshot=await self.rollouts.snapshot(record, seq))
        return SnapshotRef(snapshot=await self.take_snapshot(record))

    async def take_snapshot(self, record: SandboxRecord, ephemeral: bool = False) -> str:
        """Snapshot ``record`` into the store and publish it; returns its id.

        A layered backend's snapshot is one new layer (the sandbox's changes) over the layers the sandbox
        was restored onto. ``ephemeral`` marks fork's own snapshot, removed when its last copy on this
        node is destroyed.
        """
        backend = self._backend(record.spec.backend)
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
        record = self._live(sandbox_id, allow_paused=True)
        self._refuse_if_stopping()
        snap_id = await self.take_snapshot(record, ephemeral=True)
        spec = record.spec.model_copy(update={"trajectory": None, "snapshot": None})
        results = await asyncio.gather(*(self.create_unpooled(spec, snap_id) for _ in range(count)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if self._stopping is not None:
                err = self._stopped_batch(f"fork of {sandbox_id} x{count}", made, errors)
                if not made:  # else the teardowns drop the snapshot after the last copy
                    await self._drop_ephemeral(snap_id)
                raise err
            await self._destroy_quietly(made)
            await self._drop_ephemeral(snap_id)
            raise errors[0]
        return made

    async def _drop_ephemeral(self, snap_id: str | None) -> None:
        """Remove fork's snapshot ``snap_id`` once no sandbox of this node is restored from it (the records are
        read here, on the loop; the store in a thread)."""
        if snap_id is None or any(r.spec.snapshot == snap_id for r in self._records.values()):
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

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """Resource usage now."""
        record = self._live(sandbox_id, allow_paused=True)
        return await self._backend(record.spec.backend).stats(record)

    async def pause(self, sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Freeze a sandbox (idempotent); with ``release_memory`` also save it to disk and give its memory
        back to the host (a VM: its whole state; resume restores it), also for one already paused."""
        record = self._live(sandbox_id, allow_paused=True)
        backend = self._backend(record.spec.backend)
        if release_memory:
            await backend.hibernate(record)
        elif record.state == "running":
            await backend.pause(record)
        record.state = "paused"
        self._store.save(record)
        info = self._info(record)
        self.events.publish("paused", info, release_memory=release_memory)
        return info

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        """Destroy the sandbox ``timeout`` seconds from now instead of at its current deadline (sooner or later;
        ``info().expires_at`` says when)."""
        try:
            TimeoutRequest(timeout=timeout)  # its bounds, as the HTTP route's model checks them
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid timeout: {exc.errors()[0]['msg']}") from None
        record = self._live(sandbox_id, allow_paused=True)
        record.expires_at = time.time() + timeout
        self._store.save(record)
        return self._info(record)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (idempotent)."""
        record = self._live(sandbox_id, allow_paused=True)
        if record.state == "paused":
            await self._backend(record.spec.backend).resume(record)
            record.state = "running"
            self._store.save(record)
            self.events.publish("resumed", self._info(record))
        return self._info(record)

    async def screenshot(self, sandbox_id: str, seq: int | None = None) -> bytes:
        """The sandbox's display as PNG bytes (backends without a display raise NotSupported); logged on a
        trajectory like a file read."""
        record = self._live(sandbox_id, allow_paused=True)
        backend = self._backend(record.spec.backend)
        if record.spec.trajectory is None:
            return await backend.screenshot(record)
        data: bytes = await self.rollouts.call(record, seq, "screenshot", {}, None,
                                               lambda _: backend.screenshot(record))
        return data

    async def mouse(self, sandbox_id: str, request: MouseRequest, seq: int | None = None) -> None:
        """A pointer action on the sandbox's display (a logged call on a trajectory)."""
        record = self._live(sandbox_id, allow_paused=False)
        backend = self._backend(record.spec.backend)

        async def act(_: int) -> None:
            await backend.mouse(record, request.x, request.y, request.button, request.action)

        if record.spec.trajectory is None:
            await act(0)
            return
        await self.rollouts.call(record, seq, "mouse", request.model_dump(mode="json"), None, act)

    async def keyboard(self, sandbox_id: str, request: KeyboardRequest, seq: int | None = None) -> None:
        """Type text or press key combos on the sandbox's display (a logged call on a trajectory)."""
        record = self._live(sandbox_id, allow_paused=False)
        backend = self._backend(record.spec.backend)

        async def act(_: int) -> None:
            await backend.keyboard(record, text=request.text, keys=request.keys)

        if record.spec.trajectory is None:
            await act(0)
            return
        await self.rollouts.call(record, seq, "keyboard", request.model_dump(mode="json", exclude_none=True), None,
                                 act)

    async def set_network(self, sandbox_id: str, network: str | builtins.list[str]) -> SandboxInfo:
        """Replace a live sandbox's network policy; the record keeps the new one."""
        try:
            parse_network(network)  # as the HTTP route's model does: in process too, a bad entry is refused here
        except ValueError as exc:
            raise InvalidRequest(f"invalid network policy: {exc}") from None
        record = self._live(sandbox_id, allow_paused=True)
        await self._backend(record.spec.backend).set_network(record, network)
        record.spec = record.spec.model_copy(update={"network": network})
        self._store.save(record)
        return self._info(record)

    async def reveal(self, sandbox_id: str, seq: int | None = None) -> SandboxInfo:
        """Make a sandbox's hidden paths visible (read-only), e.g. before grading; a logged call on a
        trajectory (``seq``: its call number), which a rebuilt sandbox re-runs like a write."""
        record = self._live(sandbox_id, allow_paused=False)

        async def act(_: int) -> None:
            await self._backend(record.spec.backend).reveal(record)
            self._store.save(record)

        if record.spec.trajectory is None:
            await act(0)
        else:
            await self.rollouts.call(record, seq, "reveal", {}, None, act)
        return self._info(record)

    async def branch_trajectory(self, request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch a trajectory at a call onto a rebuilt sandbox (the SDK's ``on_divergence="fork"``)."""
        return await self.rollouts.branch(request.name, request.at, request.rerun_missing)

    async def renew_lease(self, sandbox_id: str) -> SandboxInfo:
        """Renew the lease of a trajectory-bound sandbox; :class:`InvalidRequest` for an unbound one."""
        record = self._live(sandbox_id, allow_paused=True)
        self.rollouts.renew(record)
        return self._info(record)

    async def list_trajectories(self, prefix: str = "", limit: int = 1000) -> builtins.list[TrajectoryInfo]:
        """Trajectories in the log whose name starts with ``prefix``."""
        return await self.rollouts.listing(prefix, limit)

    async def end_trajectory(self, name: str) -> TrajectoryInfo:
        """End trajectory ``name`` (its sandbox goes; re-opening the name starts a new one)."""
        return await self.rollouts.end(name)

    async def delete_trajectory(self, name: str) -> None:
        """Delete trajectory ``name``: its sandbox, its log and its unshared checkpoints."""
        await self.rollouts.delete(name)

    async def trajectory_log(self, name: str, start: int = 0, limit: int = 1000) -> builtins.list[LoggedCall]:
        """Logged calls of trajectory ``name`` from ``start``; fetching renews its sandbox's lease."""
        return await self.rollouts.log.logged(name, start, limit)

    # -- node ----------------------------------------------------------------------------------------

    async def list_images(self) -> builtins.list[ImageInfo]:
        """Images in the store."""
        return self.images.list()

    async def get_image(self, name: str) -> ImageInfo:
        """One image."""
        return self.images.get(name)

    async def pull_image(self, request: ImagePullRequest) -> ImageInfo:
        """Pull an image from a registry into the node's store (in a thread: the loop keeps serving)."""
        from dsec.images.registry import pull
        from dsec.images.store import ImageStore

        # NodeImages (the daemon's resolver) pulls into the store it mounts from.
        store = getattr(self.images, "store", self.images)
        if not isinstance(store, ImageStore):
            raise NotSupported("this node's image store cannot pull images")
        info, _ = await asyncio.to_thread(
            pull, store, request.reference, uid_shift=self.settings.uid_shift, name=request.name,
            insecure=request.insecure, username=request.username, password=request.password,
            replace=request.replace,
        )
        log.info("image %s pulled from %s", info.name, info.source)
        return info

    def build_image(self, request: ImageBuildRequest, context: IO[bytes]) -> AsyncIterator[ImageBuildEvent]:
        """Build an image from a Dockerfile and the tar ``context`` into the store, streaming the builder's
        output (``dsec.daemon.builds``); closing the stream cancels the build."""
        from dsec.daemon.builds import build_events

        return build_events(self.images, self.settings, request, context)

    async def audit_log(self, *, sandbox_id: str | None = None, who: str | None = None, job: str | None = None,
                        outcome: AuditOutcome | None = None, since: float | None = None, until: float | None = None,
                        before: int | None = None, limit: int = 100) -> builtins.list[AuditEntry]:
        """Commands of the node's audit trail matching every filter given, newest first."""
        return await self.audit.query(AuditQuery(sandbox_id=sandbox_id, who=who, job=job, outcome=outcome,
                                                 since=since, until=until, before=before, limit=limit))

    async def sandbox_logs(self, sandbox_id: str, limit: int = 100, before: int | None = None
                           ) -> builtins.list[AuditEntry]:
        """A sandbox's command history, newest first (also after it is gone, while the trail keeps it)."""
        entries = await self.audit.query(AuditQuery(sandbox_id=sandbox_id, limit=limit, before=before))
        if not entries and sandbox_id not in self._records and sandbox_id not in self._tombstones:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on node {self.settings.node}, and no command of one "
                                  "in its audit trail", sandbox_id=sandbox_id)
        return entries

    def subscribe(self, since: int | None = None, node_state: bool = False) -> AsyncIterator[LifecycleEvent]:
        """Lifecycle events after ``since`` (still in the bus's history), then live ones; ``node_state``: the
        node's state first."""
        return self.events.subscribe(since, self.node_state.current if node_state else None)

    async def metrics_text(self) -> bytes:
        """This node's metrics in Prometheus' text format."""
        return self.metrics.render()

    async def overview(self) -> NodeOverview:
        """The node's counters, load, failures, image cache, pools and audit trail, for the dashboard."""
        by_backend: dict[str, int] = {}
        for r in self._records.values():
            by_backend[r.spec.backend] = by_backend.get(r.spec.backend, 0) + 1
        node = NodeLoad(node=self.settings.node, sandboxes=len(self._records), by_backend=by_backend,
                        **await asyncio.to_thread(host_load))
        totals = self.metrics.totals()
        image_stats = getattr(self.images, "statistics", None)
        return NodeOverview(
            at=time.time(), nodes=[node], created=int(totals.get("dsec_sandboxes_created_total", 0)),
            create_seconds_sum=totals.get("dsec_create_seconds_sum", 0.0),
            execs={k: int(v) for k, v in self.metrics.by_label("dsec_exec_total", "outcome").items()},
            exec_seconds_sum=totals.get("dsec_exec_seconds_sum", 0.0),
            exec_count=int(totals.get("dsec_exec_seconds_count", 0)),
            failures=self.metrics.failures(),
            images=await asyncio.to_thread(image_stats) if image_stats is not None else {},
            pools=self.pools.statistics(), audit=self.audit.statistics(),
            history=[*self._samples, self._counters(totals)],
        )

    # -- what the watchdog (daemon/watchdog.py) reaches --------------------------------------------------

    def watched_backends(self) -> dict[str, Backend]:
        """The backends that started."""
        return {n: b for n, b in self._backends.items() if n not in self._unavailable}

    def running(self) -> builtins.list[SandboxRecord]:
        """Sandboxes running now and not being destroyed."""
        return [r for r in self._records.values() if r.state == "running" and r.id not in self._destroying]

    def image_roots(self, sandbox_id: str) -> builtins.list[Path]:
        """The image mount and snapshot layers a sandbox was made on."""
        ref = self._image_refs.get(sandbox_id)
        return ([ref.rootfs] if ref is not None else []) + self._layer_roots.get(sandbox_id, [])

    async def revive(self, record: SandboxRecord) -> bool:
        """Ask the backend to bring the sandbox back, on its image mounted afresh if its own mount died."""
        backend = self._backends[record.spec.backend]
        old = self._image_refs.get(record.id)
        stale = getattr(self.images, "stale", None)
        if old is None or (stale is not None and any(stale(root) for root in self._layer_roots.get(record.id, []))):
            return False  # snapshot layers cannot be swapped under a sandbox
        fresh = old
        if stale is not None and stale(old.rootfs) is not None:
            try:
                fresh = await asyncio.to_thread(self._repin_image, backend, record)
            except DSecError as exc:
                log.warning("sandbox %s: its image cannot be mounted afresh: %s", record.id, exc,
                            extra={"sandbox": record.id, "error": exc.message})
                return False
        revived = record.id in self._records and await backend.revive(record, fresh)
        if fresh is not old:
            self._release(old if revived else fresh)
            if revived:
                self._image_refs[record.id] = fresh
        if revived:
            self._store.save(record)
        return revived

    async def lose(self, record: SandboxRecord, reason: str, component: str) -> None:
        """Report a sandbox lost (its next call raises :class:`SandboxLost` with ``reason``) and destroy its
        leftovers; a trajectory-bound one is rebuilt from its checkpoint when the trajectory is re-opened."""
        if self._records.get(record.id) is not record or record.id in self._destroying or record.state != "running":
            return
        log.warning("sandbox %s lost: %s", record.id, reason,
                    extra={"component": component, "sandbox": record.id, "error": reason})
        record.state, record.reason = "lost", reason
        self.metrics.lost.labels(record.spec.backend, component).inc()
        task = asyncio.create_task(self._remove(record, "lost", f"sandbox {record.id} was lost: {reason}"))
        self._destroying[record.id] = task
        try:
            await task
        finally:
            self._destroying.pop(record.id, None)

    async def probe_trajectories(self) -> str | None:
        """None if the trajectory store takes a durable write now."""
        return await self.rollouts.log.store.probe(self.settings.node)

    async def _cached_images(self) -> dict[str, int]:
        """The images this node's chunk cache holds (name -> bytes), as ``health`` and ``node`` events say."""
        cached = getattr(self.images, "cached", None)
        if cached is None:
            return {}
        try:
            return dict(await asyncio.to_thread(cached, IMAGE_CACHE_REPORT_AGE))
        except OSError as exc:  # a cache being swept under us: report none rather than fail health
            log.warning("cannot list the image cache: %s", exc)
            return {}

    async def health(self) -> NodeInfo:
        """Identity, version, backend availability (``ok``, ``pending: <what it waits for>`` or why it cannot be
        used), the live sandbox count, the images cached and whether the daemon is stopping."""
        backends = {}
        for name in get_args(BackendName):
            if name in self._unavailable:
                backends[name] = self._unavailable[name]
            elif name in self._backends:
                pending = self._backends[name].pending()
                backends[name] = "ok" if pending is None else f"pending: {pending}"
            else:
                backends[name] = "not implemented on this node yet"
        images = await self._cached_images()
        components = [ComponentHealth(name=c.name, state=c.state, error=c.error, since=c.since, detail=c.detail,
                                      faults=c.faults, last_error=c.last_error)
                      for c in self.components.components()]
        # What a cluster gateway reconciles against (the sandboxes it placed): its count and digest agreeing
        # with the gateway's records spares it a listing.
        placed = [sid for sid, record in self._records.items() if JOB_LABEL in record.spec.labels]
        return NodeInfo(
            node=self.settings.node, version=__version__, backends=backends, sandboxes=len(self._records),
            images=images, stopping=self._stopping, status=self.components.status(), components=components,
            placed=len(placed), digest=ids_digest(placed),
        )
