"""The engine's parts, as its operation groups see them, and the host accessors every group shares.

The engine (:mod:`dsec.daemon.engine`) is one façade over several operation groups, each in its own module:
creating (:mod:`~dsec.daemon.creation`), removing (:mod:`~dsec.daemon.removal`), forks and batches
(:mod:`~dsec.daemon.forks`), commands and files (:mod:`~dsec.daemon.commands`) and the display
(:mod:`~dsec.daemon.gui_ops`). Each group inherits :class:`EngineParts` and reaches the engine only through
what is declared here: its collaborators (records, pins, backends, metrics...) by their public methods, and
the few operations one group asks of another.

Owns the declaration of those parts and the accessors of the sandbox surface's and trajectory side's host protocols.
Must never hold state or logic of its own beyond a one-line accessor: the state is the collaborators'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from dsec.backends.base import Backend
from dsec.config import Settings
from dsec.daemon.admission import Admission
from dsec.daemon.audit import AuditLog
from dsec.daemon.events import EventBus
from dsec.daemon.image_pins import ImagePins, ImageResolver
from dsec.daemon.metrics import Metrics
from dsec.daemon.node_backends import NodeBackends
from dsec.daemon.pools import Pools
from dsec.daemon.records import Records
from dsec.daemon.surface import Surface
from dsec.daemon.trajectories import TrajectoryBinding
from dsec.models import SandboxInfo, SandboxRecord, SandboxSpec
from dsec.trajectory.snapshots import SnapshotStore

__all__ = ["EngineParts"]


class EngineParts:
    """What an operation group of the engine may use (the engine sets every attribute in its constructor)."""

    settings: Settings
    images: ImageResolver
    metrics: Metrics
    records: Records
    backends: NodeBackends
    pins: ImagePins
    snapshots: SnapshotStore
    trajectories: TrajectoryBinding
    admission: Admission
    pools: Pools
    audit: AuditLog
    events: EventBus
    surface: Surface
    teardowns: set[asyncio.Task[None]]
    """Background teardowns of destroyed pooled sandboxes (and discarded pool members) still running."""

    if TYPE_CHECKING:  # the operations one group asks of another (defined in the group named)
        @property
        def stopping(self) -> str | None: ...  # engine

        def refuse_if_stopping(self) -> None: ...  # engine

        async def create(self, spec: SandboxSpec) -> SandboxInfo: ...  # creation

        async def create_unpooled(self, spec: SandboxSpec, snapshot: str | None) -> SandboxInfo: ...  # creation

        async def destroy(self, sandbox_id: str) -> None: ...  # removal

        def retire(self, record: SandboxRecord) -> None: ...  # removal

        def in_background(self, work: Coroutine[Any, Any, None], name: str) -> None: ...  # removal

        async def drop_ephemeral(self, snap_id: str | None) -> None: ...  # forks

    # -- the host of the surface (daemon/surface.py) and of trajectories (daemon/trajectory_host.py) -------------

    def find_record(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of ``sandbox_id`` if this node has one (in any state)."""
        return self.records.find(sandbox_id)

    def info_of(self, record: SandboxRecord) -> SandboxInfo:
        """What a client is told of ``record``."""
        return self.records.info(record)

    def save_record(self, record: SandboxRecord) -> None:
        """Persist ``record`` (its backend state changed)."""
        self.records.save(record)

    def live_record(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        """The record of a running (or, if allowed, paused) sandbox."""
        return self.records.live(sandbox_id, allow_paused=allow_paused)

    def backend_for(self, record: SandboxRecord) -> Backend:
        """The backend that runs ``record``."""
        return self.backends.get(record.spec.backend)

    async def logged(self, record: SandboxRecord, seq: int | None, op: str, args: dict[str, Any],
                     body: bytes | None, run: Callable[[], Awaitable[Any]]) -> Any:
        """``run()`` as a logged call of ``record``'s trajectory, or directly for a sandbox bound to none."""
        if record.spec.trajectory is None:
            return await run()
        return await self.trajectories.call(record, seq, op, args, body, lambda _: run())

