"""``TrajectoryHost``: what the trajectory side (:mod:`dsec.daemon.trajectories`) needs of the engine.

Owns the contract only (the engine implements it, as it implements :class:`~dsec.daemon.pools.PoolHost` for
warm pools); must never import the engine: the protocol is what breaks the trajectories-engine import cycle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from dsec.backends.base import Backend
from dsec.models import AuditOutcome, ExecEvent, ExecRequest, ExecResult, SandboxInfo, SandboxRecord, SandboxSpec

if TYPE_CHECKING:
    from dsec.daemon.surface import Surface

__all__ = ["TrajectoryHost"]


class TrajectoryHost(Protocol):
    """The engine, as the trajectory side sees it: sandboxes made, found, run and saved."""

    @property
    def surface(self) -> Surface:
        """The sandbox surface (processes, shells, file operations) a logged call re-runs through."""
        ...

    async def create_unpooled(self, spec: SandboxSpec, snapshot: str | None) -> SandboxInfo:
        """Create one sandbox from its image, or restored from snapshot ``snapshot`` (never from a pool)."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo:
        ...

    async def destroy(self, sandbox_id: str) -> None:
        ...

    def find_record(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of ``sandbox_id`` if this node has one (in any state)."""
        ...

    def info_of(self, record: SandboxRecord) -> SandboxInfo:
        ...

    def live_record(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        """The record of a running (or, if allowed, paused) sandbox."""
        ...

    def backend_for(self, record: SandboxRecord) -> Backend:
        ...

    def save_record(self, record: SandboxRecord) -> None:
        """Persist ``record`` (its backend state changed)."""
        ...

    def exec_events(self, backend: Backend, record: SandboxRecord, request: ExecRequest
                    ) -> AsyncIterator[ExecEvent]:
        """Run a command, audited and counted, without the trajectory log."""
        ...

    def audit_command(self, record: SandboxRecord, op: str, command: str | list[str], cwd: str | None, at: float,
                      elapsed: float, outcome: AuditOutcome, result: ExecResult | None, error: str | None) -> None:
        """Queue the audit record of one command (a call answered from the log is audited too)."""
        ...

    async def exec_unlogged(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        ...

    async def take_snapshot(self, record: SandboxRecord, ephemeral: bool = False) -> str:
        ...

    async def remove_snapshot(self, snap_id: str) -> None:
        """Delete a snapshot's record from the store (a deleted trajectory's checkpoint; absent is fine)."""
        ...
