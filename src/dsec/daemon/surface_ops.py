"""The node API's surface operations (users, files, watches, processes, terminals, shell sessions, ports) as the
engine implements them: each one call of :class:`~dsec.daemon.surface.Surface`.

Owns only the translation from an operation's arguments (``dsec.api.NodeAPI``) to the surface's; the logic is
the surface's. The engine inherits these so that it implements the protocol without a hundred lines of
pass-through of its own; nothing else may use this class.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator

from dsec.daemon.surface import Surface
from dsec.models.surface import (
    ExposeRequest,
    FileEvent,
    FileStat,
    MkdirRequest,
    PortInfo,
    ProcessEvent,
    ProcessInfo,
    ProcessRequest,
    PtySize,
    RenameRequest,
    ShellInfo,
    ShellRequest,
    ShellResult,
    ShellRunRequest,
    WatchInfo,
    WatchRequest,
    XattrRequest,
)

__all__ = ["SurfaceOperations"]


class SurfaceOperations:
    """The surface's operations of ``dsec.api.NodeAPI``, on ``self.surface``."""

    surface: Surface

    # -- files --------------------------------------------------------------------------------------------

    async def stat_file(self, sandbox_id: str, path: str, user: str | None = None, seq: int | None = None
                        ) -> FileStat:
        return await self.surface.stat(sandbox_id, path, user, seq)

    async def make_dir(self, sandbox_id: str, request: MkdirRequest, user: str | None = None,
                       seq: int | None = None) -> FileStat:
        return await self.surface.mkdir(sandbox_id, request.path, request.parents, request.mode, user, seq)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False, user: str | None = None,
                          seq: int | None = None) -> None:
        await self.surface.remove(sandbox_id, path, recursive, user, seq)

    async def rename_file(self, sandbox_id: str, request: RenameRequest, user: str | None = None,
                          seq: int | None = None) -> FileStat:
        return await self.surface.rename(sandbox_id, request.source, request.destination, request.overwrite, user,
                                         seq)

    async def chmod_file(self, sandbox_id: str, path: str, mode: int, user: str | None = None,
                         seq: int | None = None) -> FileStat:
        return await self.surface.chmod(sandbox_id, path, mode, user, seq)

    async def chown_file(self, sandbox_id: str, path: str, owner: str, user: str | None = None,
                         seq: int | None = None) -> FileStat:
        return await self.surface.chown(sandbox_id, path, owner, user, seq)

    async def set_xattrs(self, sandbox_id: str, request: XattrRequest, user: str | None = None,
                         seq: int | None = None) -> FileStat:
        return await self.surface.set_xattrs(sandbox_id, request.path, request.set, request.remove, user, seq)

    async def watch_files(self, sandbox_id: str, request: WatchRequest, user: str | None = None) -> WatchInfo:
        return await self.surface.watch(sandbox_id, request.path, request.recursive, user)

    async def list_watches(self, sandbox_id: str) -> builtins.list[WatchInfo]:
        self.surface.host.live_record(sandbox_id, allow_paused=True)
        return self.surface.watches.list(sandbox_id)

    def watch_events(self, sandbox_id: str, watch_id: str, since: int = 0, follow: bool = True
                     ) -> AsyncIterator[FileEvent]:
        events = self.surface.watch_events(sandbox_id, watch_id, since, follow)  # refuses an unknown watch now

        async def numbered() -> AsyncIterator[FileEvent]:
            async for number, event in events:
                yield event.model_copy(update={"number": number})
        return numbered()

    async def unwatch(self, sandbox_id: str, watch_id: str) -> None:
        self.surface.unwatch(sandbox_id, watch_id)

    # -- processes ----------------------------------------------------------------------------------------

    async def start_process(self, sandbox_id: str, request: ProcessRequest, seq: int | None = None) -> ProcessInfo:
        return await self.surface.start_process(sandbox_id, request, seq)

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return self.surface.list_processes(sandbox_id)

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return self.surface.process(sandbox_id, pid)

    def process_output(self, sandbox_id: str, pid: int, stdout: int = 0, stderr: int = 0, pty: int = 0,
                       follow: bool = True) -> AsyncIterator[ProcessEvent]:
        return self.surface.process_output(sandbox_id, pid, {"stdout": stdout, "stderr": stderr, "pty": pty},
                                           follow)

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, seq: int | None = None) -> None:
        await self.surface.send_stdin(sandbox_id, pid, data, seq)

    async def close_stdin(self, sandbox_id: str, pid: int, seq: int | None = None) -> None:
        await self.surface.close_stdin(sandbox_id, pid, seq)

    async def signal_process(self, sandbox_id: str, pid: int, signal: int = 15, group: bool = True,
                             seq: int | None = None) -> None:
        await self.surface.signal_process(sandbox_id, pid, signal, group, seq)

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize, seq: int | None = None) -> None:
        await self.surface.resize(sandbox_id, pid, size, seq)

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float | None = None, seq: int | None = None
                           ) -> ProcessInfo:
        return await self.surface.wait_process(sandbox_id, pid, timeout, seq)

    # -- shell sessions -----------------------------------------------------------------------------------

    async def start_shell(self, sandbox_id: str, request: ShellRequest, seq: int | None = None) -> ShellInfo:
        return await self.surface.start_shell(sandbox_id, request, seq)

    async def list_shells(self, sandbox_id: str) -> builtins.list[ShellInfo]:
        return self.surface.list_shells(sandbox_id)

    async def run_shell(self, sandbox_id: str, session_id: str, request: ShellRunRequest, seq: int | None = None
                        ) -> ShellResult:
        return await self.surface.run_shell(sandbox_id, session_id, request, seq)

    async def close_shell(self, sandbox_id: str, session_id: str, seq: int | None = None) -> None:
        await self.surface.close_shell(sandbox_id, session_id, seq)

    # -- ports --------------------------------------------------------------------------------------------

    async def expose_port(self, sandbox_id: str, request: ExposeRequest) -> PortInfo:
        return await self.surface.expose(sandbox_id, request.port, request.protocol)

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        return self.surface.exposed(sandbox_id)

    async def get_port(self, sandbox_id: str, port: int) -> PortInfo:
        return self.surface.get_port(sandbox_id, port)

    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        await self.surface.unexpose(sandbox_id, port)
