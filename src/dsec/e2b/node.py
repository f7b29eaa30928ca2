"""The part of DSec's node API the E2B facade calls, as a protocol.

The node's :class:`~dsec.daemon.engine.Engine` and the cluster gateway's engine both provide it, so one
facade serves ``dsec serve --e2b`` and the gateway's ``--e2b``. This module only declares; it must never
implement an operation.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import Protocol

from dsec.models import ExecEvent, ExecRequest, FileEntry, SandboxInfo, SandboxSpec, SandboxStats

__all__ = ["NodeAPI"]


class NodeAPI(Protocol):
    """Sandboxes of a node (or of a cluster, through its gateway)."""

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create a sandbox."""

    async def list(self, labels: dict[str, str], backend: str | None = None,
                   state: str | None = None) -> builtins.list[SandboxInfo]:
        """Sandboxes with every label of ``labels``."""

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox."""

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy a sandbox (idempotent)."""

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        """Move its deadline to ``timeout`` seconds from now."""

    async def pause(self, sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Freeze it."""

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw it."""

    async def fork(self, sandbox_id: str, count: int) -> builtins.list[SandboxInfo]:
        """Copies of its state."""

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """Its resource usage now."""

    async def set_network(self, sandbox_id: str, network: str | builtins.list[str]) -> SandboxInfo:
        """Replace its network policy."""

    def exec_stream(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> AsyncIterator[ExecEvent]:
        """Run a command, streaming its output; closing the stream kills it."""

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int, seq: int | None = None) -> bytes:
        """A file's bytes."""

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None,
                         seq: int | None = None) -> None:
        """Create or replace a file (parents created)."""

    async def list_files(self, sandbox_id: str, path: str, seq: int | None = None) -> builtins.list[FileEntry]:
        """A directory's entries."""
