"""The engine's sandbox surface: users, file operations and watches, process handles, terminals, shell
sessions and exposed ports, from a node API call down to the backend.

Owns the per-sandbox tables of what outlives a call (:mod:`~dsec.daemon.processes`,
:mod:`~dsec.daemon.watches`, shell sessions, :mod:`~dsec.daemon.ports`), resolving a call's ``user=`` in
the sandbox's own files (a sandbox's ``SandboxSpec.user`` once per sandbox), relative paths against its
working directory, and the trajectory log of the calls that change state (through the host's
:meth:`SurfaceHost.logged`). It reaches sandboxes only through :class:`SurfaceHost`, never the engine's
private state, and never speaks HTTP.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from dsec.accounts import ROOT, Identity
from dsec.backends.base import Backend, resolve_user_in, workdir_of
from dsec.backends.surface import ProcessSpec
from dsec.daemon.ports import PortForwarder
from dsec.daemon.processes import ProcessTable
from dsec.daemon.shells import ShellSession
from dsec.daemon.watches import WatchTable
from dsec.errors import InvalidRequest, ProcessNotFound, QuotaExceeded
from dsec.models import SandboxRecord
from dsec.models.surface import (
    FileEvent,
    FileStat,
    PortInfo,
    ProcessEvent,
    ProcessInfo,
    ProcessRequest,
    PtySize,
    ShellInfo,
    ShellRequest,
    ShellResult,
    ShellRunRequest,
    WatchInfo,
)

__all__ = ["MAX_SHELLS", "Surface", "SurfaceHost"]

MAX_SHELLS = 64
"""Shell sessions one sandbox may have at once."""


class SurfaceHost(Protocol):
    """What the surface needs of the engine."""

    def live_record(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        """The record of a running (or, if allowed, paused) sandbox; the engine's errors otherwise."""
        ...

    def backend_for(self, record: SandboxRecord) -> Backend:
        """The backend that runs ``record``."""
        ...

    async def logged(self, record: SandboxRecord, seq: int | None, op: str, args: dict[str, Any],
                     body: bytes | None, run: Callable[[], Awaitable[Any]]) -> Any:
        """``run()`` as call ``seq`` of the sandbox's trajectory (replayed from the log when it is there), or
        simply ``run()`` for a sandbox bound to none."""
        ...


class Surface:
    """The surface of every sandbox of one node."""

    def __init__(self, host: SurfaceHost, ports: PortForwarder | None = None) -> None:
        self.host = host
        self.processes = ProcessTable()
        self.watches = WatchTable()
        self.ports = ports or PortForwarder()
        self._shells: dict[str, dict[str, ShellSession]] = {}
        self._default_users: dict[str, Identity] = {}

    # -- who and where -----------------------------------------------------------------------------------

    async def identity(self, record: SandboxRecord, backend: Backend, user: str | None) -> Identity | None:
        """Who a call of ``record`` acts as: ``user`` resolved in the sandbox now, else its spec's user (resolved
        once, where its backend could not at create), else None (the backend's default)."""
        if user is not None:
            return ROOT if user in ("root", "0", "0:0") else await resolve_user_in(backend, record, user)
        spec_user = record.spec.user
        if spec_user is None or record.backend_state.get("user_spec") == spec_user:
            return None
        cached = self._default_users.get(record.id)
        if cached is None:
            cached = self._default_users[record.id] = await resolve_user_in(backend, record, spec_user)
        return cached

    @staticmethod
    def path(record: SandboxRecord, path: str) -> str:
        """``path`` made absolute: a relative one is resolved against the sandbox's working directory."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidRequest(f"path must be a non-empty string without NUL bytes, got {path!r}", path=path)
        if not path.startswith("/"):
            path = posixpath.join(workdir_of(record), path)
        return posixpath.normpath(path)

    def _target(self, sandbox_id: str, *, paused: bool = True) -> tuple[SandboxRecord, Backend]:
        record = self.host.live_record(sandbox_id, allow_paused=paused)
        return record, self.host.backend_for(record)

    # -- files ----------------------------------------------------------------------------------------

    async def stat(self, sandbox_id: str, path: str, user: str | None = None, seq: int | None = None) -> FileStat:
        record, backend = self._target(sandbox_id)
        path = self.path(record, path)

        async def run() -> FileStat:
            found = await backend.stat_file(record, path, await self.identity(record, backend, user))
            return await self._named(record, backend, found)

        stat: FileStat = await self.host.logged(record, seq, "stat", {"path": path, "user": user}, None, run)
        return stat

    async def _named(self, record: SandboxRecord, backend: Backend, found: FileStat) -> FileStat:
        """``found`` with its owner's and group's names from the sandbox's files (when they have them)."""
        names: dict[str, str | None] = {"owner": None, "group": None}
        for key, path, ident in (("owner", "/etc/passwd", found.uid), ("group", "/etc/group", found.gid)):
            try:
                text = (await backend.read_file(record, path, 4 << 20, ROOT)).decode(errors="replace")
            except (FileNotFoundError, NotADirectoryError):
                continue
            names[key] = next((row.split(":")[0] for row in text.splitlines()
                               if row.count(":") >= 2 and row.split(":")[2] == str(ident)), None)
        return found.model_copy(update=names)

    async def mkdir(self, sandbox_id: str, path: str, parents: bool = False, mode: int = 0o755,
                    user: str | None = None, seq: int | None = None) -> FileStat:
        record, backend = self._target(sandbox_id)
        path = self.path(record, path)

        async def run() -> FileStat:
            made = await backend.make_dir(record, path, parents, mode, await self.identity(record, backend, user))
            return await self._named(record, backend, made)

        args = {"path": path, "parents": parents, "mode": mode, "user": user}
        made: FileStat = await self.host.logged(record, seq, "mkdir", args, None, run)
        return made

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False, user: str | None = None,
                     seq: int | None = None) -> None:
        record, backend = self._target(sandbox_id)
        path = self.path(record, path)

        async def run() -> None:
            await backend.remove_file(record, path, recursive, await self.identity(record, backend, user))

        await self.host.logged(record, seq, "remove", {"path": path, "recursive": recursive, "user": user}, None,
                               run)

    async def rename(self, sandbox_id: str, source: str, destination: str, overwrite: bool = True,
                     user: str | None = None, seq: int | None = None) -> FileStat:
        record, backend = self._target(sandbox_id)
        source, destination = self.path(record, source), self.path(record, destination)

        async def run() -> FileStat:
            moved = await backend.rename_file(record, source, destination, overwrite,
                                              await self.identity(record, backend, user))
            return await self._named(record, backend, moved)

        args = {"source": source, "destination": destination, "overwrite": overwrite, "user": user}
        moved: FileStat = await self.host.logged(record, seq, "rename", args, None, run)
        return moved

    async def _change(self, sandbox_id: str, path: str, user: str | None, seq: int | None, op: str,
                      args: dict[str, Any], act: Callable[[SandboxRecord, Backend, str, Identity | None],
                                                          Awaitable[FileStat]]) -> FileStat:
        """A logged change of one path (``act`` on the record, its backend, the absolute path and the identity),
        answered with the path's stat and its owner's names; ``args`` (with the path and user) are what is logged."""
        record, backend = self._target(sandbox_id)
        path = self.path(record, path)

        async def run() -> FileStat:
            changed = await act(record, backend, path, await self.identity(record, backend, user))
            return await self._named(record, backend, changed)

        changed: FileStat = await self.host.logged(record, seq, op, {"path": path, **args, "user": user}, None, run)
        return changed

    async def chmod(self, sandbox_id: str, path: str, mode: int, user: str | None = None, seq: int | None = None
                    ) -> FileStat:
        return await self._change(sandbox_id, path, user, seq, "chmod", {"mode": mode},
                                  lambda record, backend, at, who: backend.chmod_file(record, at, mode, who))

    async def chown(self, sandbox_id: str, path: str, owner: str, user: str | None = None, seq: int | None = None
                    ) -> FileStat:
        async def act(record: SandboxRecord, backend: Backend, at: str, who: Identity | None) -> FileStat:
            return await backend.chown_file(record, at, await resolve_user_in(backend, record, owner), who)

        return await self._change(sandbox_id, path, user, seq, "chown", {"owner": owner}, act)

    async def set_xattrs(self, sandbox_id: str, path: str, values: dict[str, str], remove: list[str],
                         user: str | None = None, seq: int | None = None) -> FileStat:
        return await self._change(sandbox_id, path, user, seq, "xattrs", {"set": values, "remove": remove},
                                  lambda record, backend, at, who: backend.set_xattrs(record, at, values, remove, who))

    async def watch(self, sandbox_id: str, path: str, recursive: bool = False, user: str | None = None
                    ) -> WatchInfo:
        """Start watching a directory (an observation: never logged)."""
        record, backend = self._target(sandbox_id)
        path = self.path(record, path)
        events = await backend.watch_files(record, path, recursive, await self.identity(record, backend, user))
        try:
            return self.watches.add(sandbox_id, path, recursive, events)
        except QuotaExceeded:
            await events.aclose()  # type: ignore[attr-defined]
            raise

    def watch_events(self, sandbox_id: str, watch_id: str, since: int = 0, follow: bool = True
                     ) -> AsyncIterator[tuple[int, FileEvent]]:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.watches.events(sandbox_id, watch_id, since, follow)

    def unwatch(self, sandbox_id: str, watch_id: str) -> None:
        self.host.live_record(sandbox_id, allow_paused=True)
        self.watches.remove(sandbox_id, watch_id)

    # -- processes --------------------------------------------------------------------------------------

    async def start_process(self, sandbox_id: str, request: ProcessRequest, seq: int | None = None
                            ) -> ProcessInfo:
        record, backend = self._target(sandbox_id, paused=False)

        async def run() -> ProcessInfo:
            self.processes.check_room(sandbox_id)
            identity = await self.identity(record, backend, request.user)
            argv = (["/bin/sh", "-c", request.command] if isinstance(request.command, str) else
                    list(request.command) if request.command is not None else
                    [(identity.shell if identity is not None else "/bin/sh"), "-l"])
            cwd = self.path(record, request.cwd) if request.cwd else workdir_of(record)
            pty = (request.pty.cols, request.pty.rows) if request.pty else None
            spec = ProcessSpec(argv=argv, env=request.env or {}, cwd=cwd, pty=pty, timeout=request.timeout)
            sink = self.processes.sink(pty is not None)
            io = await backend.start_process(record, spec, sink, identity)
            if request.stdin:
                await io.write(request.stdin)
            if not request.keep_stdin:
                await io.close_stdin()
            return self.processes.add(sandbox_id, io, sink, argv, cwd, request.user, request.tag, request.pty,
                                      request.keep_stdin, request.env)

        args = request.model_dump(mode="python", exclude_none=True)
        info: ProcessInfo = await self.host.logged(record, seq, "process", args, request.stdin, run)
        return info

    def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.processes.list(sandbox_id)

    def process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.processes.get(sandbox_id, pid).snapshot()

    def process_output(self, sandbox_id: str, pid: int, offsets: dict[str, int] | None = None, follow: bool = True
                       ) -> AsyncIterator[ProcessEvent]:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.processes.stream(sandbox_id, pid, offsets, follow)

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, seq: int | None = None) -> None:
        record = self.host.live_record(sandbox_id, allow_paused=False)
        await self.host.logged(record, seq, "process.stdin", {"pid": pid, "data": data}, data,
                               lambda: self.processes.write(sandbox_id, pid, data))

    async def close_stdin(self, sandbox_id: str, pid: int, seq: int | None = None) -> None:
        record = self.host.live_record(sandbox_id, allow_paused=False)
        await self.host.logged(record, seq, "process.close_stdin", {"pid": pid}, None,
                               lambda: self.processes.close_stdin(sandbox_id, pid))

    async def signal_process(self, sandbox_id: str, pid: int, signo: int, group: bool = True,
                             seq: int | None = None) -> None:
        record = self.host.live_record(sandbox_id, allow_paused=True)

        async def run() -> None:
            self.processes.signal(sandbox_id, pid, signo, group)

        await self.host.logged(record, seq, "process.signal", {"pid": pid, "signal": signo, "group": group}, None,
                               run)

    async def resize(self, sandbox_id: str, pid: int, size: PtySize, seq: int | None = None) -> None:
        record = self.host.live_record(sandbox_id, allow_paused=False)
        await self.host.logged(record, seq, "process.resize", {"pid": pid, **size.model_dump()}, None,
                               lambda: self.processes.resize(sandbox_id, pid, size))

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float | None = None, seq: int | None = None
                           ) -> ProcessInfo:
        record = self.host.live_record(sandbox_id, allow_paused=True)

        async def run() -> ProcessInfo:
            return await self.processes.wait(sandbox_id, pid, timeout)

        info: ProcessInfo = await self.host.logged(record, seq, "process.wait", {"pid": pid, "timeout": timeout},
                                                   None, run)
        return info

    # -- shell sessions -----------------------------------------------------------------------------------

    async def start_shell(self, sandbox_id: str, request: ShellRequest, seq: int | None = None) -> ShellInfo:
        record, backend = self._target(sandbox_id, paused=False)

        async def run() -> ShellInfo:
            table = self._shells.setdefault(sandbox_id, {})
            if len(table) >= MAX_SHELLS:
                raise QuotaExceeded(f"sandbox {sandbox_id} has {len(table)} shell sessions (at most {MAX_SHELLS})")
            identity = await self.identity(record, backend, request.user)
            cwd = self.path(record, request.cwd) if request.cwd else None
            session = await ShellSession.start("sh-" + secrets.token_hex(6), backend, record, identity, cwd,
                                               request.env, request.user)
            table[session.id] = session
            return self._shell_info(session)

        info: ShellInfo = await self.host.logged(record, seq, "shell", request.model_dump(exclude_none=True), None,
                                                 run)
        return info

    @staticmethod
    def _shell_info(session: ShellSession) -> ShellInfo:
        pid = session.process.pid if session.process is not None else 0
        return ShellInfo(id=session.id, pid=pid, user=session.user, alive=session.alive, busy=session.busy)

    def _shell(self, sandbox_id: str, session_id: str) -> ShellSession:
        session = self._shells.get(sandbox_id, {}).get(session_id)
        if session is None:
            raise ProcessNotFound(f"sandbox {sandbox_id} has no shell session {session_id}", session=session_id)
        return session

    def list_shells(self, sandbox_id: str) -> list[ShellInfo]:
        self.host.live_record(sandbox_id, allow_paused=True)
        return [self._shell_info(s) for s in self._shells.get(sandbox_id, {}).values()]

    async def run_shell(self, sandbox_id: str, session_id: str, request: ShellRunRequest, seq: int | None = None
                        ) -> ShellResult:
        record = self.host.live_record(sandbox_id, allow_paused=False)

        async def run() -> ShellResult:
            session = self._shell(sandbox_id, session_id)
            return await session.run(request.command, request.timeout, request.max_output)

        args = {"session": session_id, **request.model_dump()}
        result: ShellResult = await self.host.logged(record, seq, "shell.run", args, None, run)
        return result

    async def close_shell(self, sandbox_id: str, session_id: str, seq: int | None = None) -> None:
        record = self.host.live_record(sandbox_id, allow_paused=True)

        async def run() -> None:
            session = self._shell(sandbox_id, session_id)
            del self._shells[sandbox_id][session_id]
            await session.aclose()

        await self.host.logged(record, seq, "shell.close", {"session": session_id}, None, run)

    # -- ports ----------------------------------------------------------------------------------------------

    async def expose(self, sandbox_id: str, port: int, protocol: str = "http") -> PortInfo:
        """Listen on the node for ``port`` of the sandbox (a node-side route: never logged, always live)."""
        record, backend = self._target(sandbox_id)
        if not backend.ports:
            await backend.open_port(record, port)  # the backend's own refusal, naming it

        async def opener() -> Any:
            current = self.host.live_record(sandbox_id, allow_paused=False)
            return await backend.open_port(current, port)

        return await self.ports.expose(sandbox_id, port, protocol, opener)

    def exposed(self, sandbox_id: str) -> list[PortInfo]:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.ports.list(sandbox_id)

    def get_port(self, sandbox_id: str, port: int) -> PortInfo:
        self.host.live_record(sandbox_id, allow_paused=True)
        return self.ports.get(sandbox_id, port)

    async def unexpose(self, sandbox_id: str, port: int) -> None:
        self.host.live_record(sandbox_id, allow_paused=True)
        await self.ports.unexpose(sandbox_id, port)

    async def rerun(self, record: SandboxRecord, op: str, args: dict[str, Any]) -> bool:
        """Run a logged file operation again on a rebuilt sandbox (not logged again); False for any other."""
        backend = self.host.backend_for(record)
        user = await self.identity(record, backend, args.get("user"))
        if op == "mkdir":
            await backend.make_dir(record, args["path"], args["parents"], args["mode"], user)
        elif op == "remove":
            await backend.remove_file(record, args["path"], args["recursive"], user)
        elif op == "rename":
            await backend.rename_file(record, args["source"], args["destination"], args["overwrite"], user)
        elif op == "chmod":
            await backend.chmod_file(record, args["path"], args["mode"], user)
        elif op == "chown":
            await backend.chown_file(record, args["path"], await resolve_user_in(backend, record, args["owner"]),
                                     user)
        elif op == "xattrs":
            await backend.set_xattrs(record, args["path"], args["set"], args["remove"], user)
        else:
            return False
        return True

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def forget(self, sandbox_id: str) -> None:
        """The sandbox is being destroyed: its exposures, watches, sessions and process records go."""
        self._default_users.pop(sandbox_id, None)
        await self.ports.drop(sandbox_id)
        await self.watches.drop(sandbox_id)
        for session in self._shells.pop(sandbox_id, {}).values():
            await session.aclose()
        await self.processes.drop(sandbox_id)

    async def aclose(self) -> None:
        """The daemon stops: listeners close (processes stay with their sandboxes, for nobody to read)."""
        await self.ports.aclose()
