"""The engine: the one façade over every sandbox of this node, which the node API, the daemon and in-process
tests all drive.

Owns the wiring of the node's parts and the operations that are one or two calls of them: the start-up and
close sequence, draining, listing, pause/resume/timeouts, images, the audit trail, trajectories and what the
watchdog reaches. The rest lives in one module per responsibility, which the engine composes:

- records and tombstones: :mod:`~dsec.daemon.records`; image and layer pins: :mod:`~dsec.daemon.image_pins`;
  the backends and why some cannot be used: :mod:`~dsec.daemon.node_backends`; health, overview and the
  counters' history: :mod:`~dsec.daemon.observation`;
- operation groups (each inherits :class:`~dsec.daemon.engine_parts.EngineParts`, which says what it may
  reach): creating (:mod:`~dsec.daemon.creation`), removing and the reaper (:mod:`~dsec.daemon.removal`),
  snapshots, forks and batches (:mod:`~dsec.daemon.forks`), commands and files (:mod:`~dsec.daemon.commands`),
  the display (:mod:`~dsec.daemon.gui_ops`), re-adoption at start (:mod:`~dsec.daemon.recovery`) and the
  sandbox surface (:mod:`~dsec.daemon.surface_ops`).

Must never speak HTTP, never know about sockets or tokens, and never touch a sandbox's processes or files
except through its backend: the HTTP app and in-process tests drive exactly the same object.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import pydantic

from dsec.backends.base import Backend
from dsec.config import Settings
from dsec.daemon.admission import Admission
from dsec.daemon.audit import AuditLog, AuditQuery
from dsec.daemon.commands import MAX_FILE_BYTES, Commands
from dsec.daemon.creation import Creation
from dsec.daemon.events import EventBus
from dsec.daemon.forks import Forks
from dsec.daemon.gui_ops import GuiOperations
from dsec.daemon.health import Health
from dsec.daemon.host_limits import HostLimits
from dsec.daemon.image_pins import ImagePins, ImageResolver, NoImages, snapshot_store
from dsec.daemon.metrics import Metrics
from dsec.daemon.node_backends import NodeBackends
from dsec.daemon.node_state import NodeState
from dsec.daemon.observation import Observation
from dsec.daemon.pools import Pools
from dsec.daemon.ports import PortForwarder
from dsec.daemon.records import Records
from dsec.daemon.recovery import Recovery
from dsec.daemon.removal import Removal
from dsec.daemon.state import StateStore
from dsec.daemon.surface import Surface
from dsec.daemon.surface_ops import SurfaceOperations
from dsec.daemon.trajectories import TrajectoryBinding
from dsec.daemon.watchdog import Watchdog
from dsec.errors import BackendUnavailable, DaemonStopping, InvalidRequest, NotSupported, SandboxNotFound
from dsec.images.cache import free_reserve
from dsec.isolation import affinity
from dsec.models import (
    AuditEntry,
    AuditOutcome,
    ImageBuildEvent,
    ImageBuildRequest,
    ImageInfo,
    ImagePullRequest,
    LifecycleEvent,
    LoggedCall,
    NodeInfo,
    NodeOverview,
    PoolConfig,
    SandboxInfo,
    SandboxRecord,
    SandboxStats,
    TimeoutRequest,
    TrajectoryForkRequest,
    TrajectoryInfo,
    parse_network,
)
from dsec.trajectory.replay import TrajectoryLog
from dsec.trajectory.store import SQLiteStore, TrajectoryStore

__all__ = ["IMAGE_IDLE_SECONDS", "MAX_FILE_BYTES", "Engine"]

IMAGE_IDLE_SECONDS = 600.0
"""How long an image mount stays warm after its last sandbox is destroyed."""

log = logging.getLogger(__name__)


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


class Engine(Creation, Removal, Forks, Commands, GuiOperations, Recovery, SurfaceOperations):
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
        self.backends = NodeBackends(backends, unavailable)
        for name in self.backends.loaded:  # exported at 0 from the start: a first failure is an increase to alert on
            self.metrics.teardown_failures.labels(name)
        self.records = Records(StateStore(settings.state_db, settings.legacy_state_dir), settings.node,
                               lambda record: self.trajectories.status(record), tombstone_limit=tombstone_limit)
        self.teardowns: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._stopping: str | None = None  # why creates are refused (drain)
        self.snapshots = snapshot_store(settings, images)
        self.pins = ImagePins(images, self.snapshots)
        """The image version and snapshot layers each sandbox sits on."""
        self.trajectories = TrajectoryBinding(
            self, TrajectoryLog(trajectory_store or default_trajectory_store(settings)))
        self.admission = Admission(settings.create_slots)
        self.pools = Pools(self, self.metrics)
        # Parsed now: a bad --pool stops the daemon before it adopts anything, with the entry named; so does a
        # bad image cache reserve (the image store would otherwise be replaced by a stand-in refusing all).
        free_reserve(settings.image_cache_min_free, 1 << 40)
        self._declared = [PoolConfig.parse(text) for text in settings.pools]
        for config in self._declared:
            if config.backend in backends:
                self.check_pool(config, backends[config.backend])
        self.host_limits = HostLimits() if settings.host_limits else None
        # Checked now, pinned at start (isolation/affinity.py): a CPU the daemon may not use stops it here.
        self._control_cpus = affinity.control_cpus(settings.control_cpus)
        self._pinned = False
        self.audit = AuditLog(settings.audit_path, max_rows=settings.audit_max_rows)
        self.events = EventBus(settings.node)
        self.components = Health()
        self.observation = Observation(settings, self.records, self.backends, images, self.metrics, self.pools,
                                       self.audit, self.components, lambda: self._stopping)
        self.node_state = NodeState(self.events, self.observation.cached_images, lambda: self._stopping)
        self._announcer: asyncio.Task[None] | None = None
        self.on_phase = lambda what: log.info("start-up: %s", what)
        """Told each start-up phase as it begins (the daemon logs them and shows them to ``dsec up``)."""
        self.watchdog = Watchdog(self, interval=reaper_interval)
        self.surface = Surface(self, PortForwarder(settings.ports_bind, settings.ports_advertise))
        """Users, file operations, processes, terminals, shell sessions and exposed ports (daemon/surface.py)."""

    @classmethod
    def from_settings(cls, settings: Settings, *, reaper_interval: float = 1.0) -> Engine:
        """The default engine: the image store at ``settings.images`` and every backend that imports."""
        images = cls.default_images(settings)
        loaded = NodeBackends.load(settings)
        return cls(settings, loaded.loaded, images, unavailable=loaded.unavailable, reaper_interval=reaper_interval)

    @staticmethod
    def default_images(settings: Settings) -> ImageResolver:
        """The node's image store, or a stand-in that explains why it cannot be used."""
        try:
            from dsec.images.node import NodeImages

            return NodeImages(settings, cache_limit=settings.image_cache_limit, daemon=True)
        except Exception as exc:  # a broken store must not keep the daemon (and its sandboxes) down
            log.exception("image store unavailable")
            return NoImages(f"the image store at {settings.images} cannot be used: {exc}")

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
        await self.trajectories.start()
        self.on_phase("opening the audit trail")
        await self.audit.start()
        await self.backends.start(self.on_phase)
        await self.recover_all()
        self.on_phase("re-attaching trajectories")
        await self.trajectories.adopt(self.records.values())
        self.on_phase("sweeping snapshot layers")
        await asyncio.to_thread(self.snapshots.sweep)  # layers only dead sandboxes of the last daemon used
        self._reaper = asyncio.create_task(self._reap_forever(), name="dsec-reaper")
        self._announcer = asyncio.create_task(self.node_state.run_forever(), name="dsec-node-state")
        self.watchdog.start()
        for config in self._declared:
            self.pools.declare(config)
        self.pools.start()

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

    def refuse_if_stopping(self) -> None:
        """Raise why a create is refused now (the daemon drains, or the node's disk is down)."""
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
        self.pins.aclose()
        for background in (self._reaper, self._announcer):
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
        self._reaper = None
        self._announcer = None
        await self.surface.aclose()
        await self.backends.aclose()
        await self.trajectories.aclose()
        await self.audit.aclose()
        self.records.store.close()
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

    # -- lookups and listing -------------------------------------------------------------------------

    async def owner_labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The labels of a live sandbox (the token guard reads the job that owns it), None if there is none.

        A sandbox that expired or was destroyed lately answers only its owning job's label, so that job's
        token reaches the route and is told why it is gone (SandboxTimeout with the reason), while other
        jobs still get the 404 of an id that does not exist."""
        return self.records.owner_labels(sandbox_id)

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
        return [self.records.info(r) for r in self.records.select(labels, backend, state, after, limit)]

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox."""
        return self.records.info(self.records.lookup(sandbox_id))

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reaper_interval)
            try:
                self.observation.sample()
                await self.reap()
                await self._unmount_idle_images()
            except Exception:
                log.exception("reaper pass failed")

    async def _unmount_idle_images(self) -> None:
        """Image mounts stay warm for ``IMAGE_IDLE_SECONDS`` after their last sandbox, then go (idle snapshot
        layers beyond the images' ``idle_layers`` go at once)."""
        idle = getattr(self.images, "idle", None)
        if idle is not None and idle(IMAGE_IDLE_SECONDS):
            done = await asyncio.to_thread(self.images.unmount_idle, IMAGE_IDLE_SECONDS)  # type: ignore[attr-defined]
            log.info("unmounted %d idle images", len(done))

    # -- sandbox state ----------------------------------------------------------------------------------

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """Resource usage now."""
        record = self.records.live(sandbox_id, allow_paused=True)
        return await self.backends.get(record.spec.backend).stats(record)

    async def pause(self, sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Freeze a sandbox (idempotent); with ``release_memory`` also save it to disk and give its memory
        back to the host (a VM: its whole state; resume restores it), also for one already paused."""
        record = self.records.live(sandbox_id, allow_paused=True)
        backend = self.backends.get(record.spec.backend)
        if release_memory:
            await backend.hibernate(record)
        elif record.state == "running":
            await backend.pause(record)
        record.state = "paused"
        self.records.save(record)
        info = self.records.info(record)
        self.events.publish("paused", info, release_memory=release_memory)
        return info

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        """Destroy the sandbox ``timeout`` seconds from now instead of at its current deadline (sooner or later;
        ``info().expires_at`` says when)."""
        try:
            TimeoutRequest(timeout=timeout)  # its bounds, as the HTTP route's model checks them
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid timeout: {exc.errors()[0]['msg']}") from None
        record = self.records.live(sandbox_id, allow_paused=True)
        record.expires_at = time.time() + timeout
        self.records.save(record)
        return self.records.info(record)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (idempotent)."""
        record = self.records.live(sandbox_id, allow_paused=True)
        if record.state == "paused":
            await self.backends.get(record.spec.backend).resume(record)
            record.state = "running"
            self.records.save(record)
            self.events.publish("resumed", self.records.info(record))
        return self.records.info(record)

    async def set_network(self, sandbox_id: str, network: str | builtins.list[str]) -> SandboxInfo:
        """Replace a live sandbox's network policy; the record keeps the new one."""
        try:
            parse_network(network)  # as the HTTP route's model does: in process too, a bad entry is refused here
        except ValueError as exc:
            raise InvalidRequest(f"invalid network policy: {exc}") from None
        record = self.records.live(sandbox_id, allow_paused=True)
        await self.backends.get(record.spec.backend).set_network(record, network)
        record.spec = record.spec.model_copy(update={"network": network})
        self.records.save(record)
        return self.records.info(record)

    async def reveal(self, sandbox_id: str, seq: int | None = None) -> SandboxInfo:
        """Make a sandbox's hidden paths visible (read-only), e.g. before grading; a logged call on a
        trajectory (``seq``: its call number), which a rebuilt sandbox re-runs like a write."""
        record = self.records.live(sandbox_id, allow_paused=False)

        async def act(_: int) -> None:
            await self.backends.get(record.spec.backend).reveal(record)
            self.records.save(record)

        if record.spec.trajectory is None:
            await act(0)
        else:
            await self.trajectories.call(record, seq, "reveal", {}, None, act)
        return self.records.info(record)

    # -- trajectories ---------------------------------------------------------------------------------

    async def branch_trajectory(self, request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch a trajectory at a call onto a rebuilt sandbox (the SDK's ``on_divergence="fork"``)."""
        return await self.trajectories.branch(request.name, request.at, request.rerun_missing)

    async def renew_lease(self, sandbox_id: str) -> SandboxInfo:
        """Renew the lease of a trajectory-bound sandbox; :class:`InvalidRequest` for an unbound one."""
        record = self.records.live(sandbox_id, allow_paused=True)
        self.trajectories.renew(record)
        return self.records.info(record)

    async def list_trajectories(self, prefix: str = "", limit: int = 1000) -> builtins.list[TrajectoryInfo]:
        """Trajectories in the log whose name starts with ``prefix``."""
        return await self.trajectories.listing(prefix, limit)

    async def end_trajectory(self, name: str) -> TrajectoryInfo:
        """End trajectory ``name`` (its sandbox goes; re-opening the name starts a new one)."""
        return await self.trajectories.end(name)

    async def delete_trajectory(self, name: str) -> None:
        """Delete trajectory ``name``: its sandbox, its log and its unshared checkpoints."""
        await self.trajectories.delete(name)

    async def trajectory_log(self, name: str, start: int = 0, limit: int = 1000) -> builtins.list[LoggedCall]:
        """Logged calls of trajectory ``name`` from ``start``; fetching renews its sandbox's lease."""
        return await self.trajectories.log.logged(name, start, limit)

    # -- node ----------------------------------------------------------------------------------------

    async def list_images(self) -> builtins.list[ImageInfo]:
        """Images in the store."""
        return self.images.list()

    async def get_image(self, name: str) -> ImageInfo:
        """One image."""
        return self.images.get(name)

    async def pull_image(self, request: ImagePullRequest) -> ImageInfo:
        """Pull an image from a registry into the node's store (in a thread: the loop keeps serving)."""
        from dsec.images.image_store import ImageStore
        from dsec.images.registry import pull

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
        if not entries and sandbox_id not in self.records and not self.records.gone(sandbox_id):
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
        return await self.observation.overview()

    async def health(self) -> NodeInfo:
        """Identity, version, backend availability (``ok``, ``pending: <what it waits for>`` or why it cannot be
        used), the live sandbox count, the images cached and whether the daemon is stopping."""
        return await self.observation.health()

    # -- what the watchdog (daemon/watchdog.py) reaches --------------------------------------------------

    def watched_backends(self) -> dict[str, Backend]:
        """The backends that started."""
        return self.backends.started()

    def running(self) -> builtins.list[SandboxRecord]:
        """Sandboxes running now and not being destroyed."""
        return self.records.running()

    def image_roots(self, sandbox_id: str) -> builtins.list[Path]:
        """The image mount and snapshot layers a sandbox was made on."""
        return self.pins.roots(sandbox_id)

    async def probe_trajectories(self) -> str | None:
        """None if the trajectory store takes a durable write now."""
        return await self.trajectories.log.store.probe(self.settings.node)
