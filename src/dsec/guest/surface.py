"""Host side of the guest agent's surface (``agent_exec.c``, ``agent_files.c``, ``agent_surface.c``): processes
that outlive a call, file operations as a sandbox user, directory watches and connections to the guest's own ports,
each over one channel.

Owns :class:`AgentProcess` (a :class:`~dsec.backends.surface.ProcessIO` fed by a channel's frames),
:class:`AgentPort` (a :class:`~dsec.backends.surface.PortStream`), :func:`agent_watch` (WATCH records as
:class:`~dsec.models.surface.FileEvent`\\ s, the two halves of a rename paired by cookie) and
:class:`AgentFiles` (FS requests as :class:`~dsec.models.surface.FileStat`\\ s). It never manages the VM:
:mod:`dsec.backends.qemu` does, and hands these a connected :class:`~dsec.guest.protocol.AgentClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import posixpath
import signal
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

from dsec.accounts import ROOT, Identity
from dsec.backends.base import default_identity
from dsec.backends.surface import ProcessIO, ProcessSink, Stream
from dsec.errors import SandboxError, file_error
from dsec.guest.protocol import (
    EXT_PTY,
    EXT_PTY_STDIN,
    EXT_REPORT_PID,
    FS,
    AgentClient,
    AgentGone,
    T,
    creds,
    guest_error,
    parse_exit,
    parse_list,
    parse_stat,
    parse_watch,
)
from dsec.models import FileEntry, SandboxRecord
from dsec.models.surface import FileEvent, FileStat

__all__ = ["AgentFiles", "AgentPort", "AgentProcess", "GuestSurface", "agent_watch", "creds_of"]

_PAIR_WITHIN_S = 0.05
"""How long the first half of a rename waits for its second before it counts as a move out of the tree."""


def creds_of(user: Identity) -> bytes:
    """The agent's CREDS block for ``user`` (the guest's own ids: no shift in a VM)."""
    return creds(user.uid, user.gid, user.groups)


class AgentProcess(ProcessIO):
    """A command the agent started with EXEC_EXT and STARTED, read from its channel by a task."""

    def __init__(self, client: AgentClient, channel: int, sink: ProcessSink, pty_io: bool, timeout: float | None
                 ) -> None:
        self._client = client
        self._channel = channel
        self._sink = sink
        self._terminal = pty_io
        self.streams: tuple[Stream, ...] = ("pty",) if pty_io else ("stdout", "stderr")
        self.pid = 0
        self._ended = False
        self._stdin_open = True
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.get_running_loop().create_task(self._read(timeout))

    async def wait_started(self, within: float = 60.0) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._started), within)
        except TimeoutError:
            await self.aclose()
            raise SandboxError(f"the guest agent did not start the process within {within:g} s") from None

    async def _read(self, timeout: float | None) -> None:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        code, sig = 255, None
        try:
            while True:
                left = None if deadline is None else max(deadline - asyncio.get_running_loop().time(), 0.01)
                try:
                    frame = await self._client.next_frame(self._channel, left)
                except TimeoutError:
                    await self._client.signal(self._channel, signal.SIGKILL)
                    deadline = None
                    continue
                if frame.type == T.STARTED and len(frame.payload) == 4:
                    self.pid = struct.unpack(">I", frame.payload)[0]
                    if not self._started.done():
                        self._started.set_result(None)
                elif frame.type in (T.STDOUT, T.STDERR):
                    self._sink.output("pty" if self._terminal else "stdout" if frame.type == T.STDOUT else "stderr",
                                      frame.payload)
                elif frame.type == T.EXIT:
                    code, sig, _ = parse_exit(frame.payload)
                    return
                elif frame.type == T.ERROR:
                    error = SandboxError(f"the guest agent could not start the process: "
                                         f"{frame.payload[4:300].decode(errors='replace')}")
                    if not self._started.done():
                        self._started.set_exception(error)
                        self._started.exception()
                    return
        except AgentGone as exc:
            if not self._started.done():
                self._started.set_exception(SandboxError(str(exc)))
                self._started.exception()
            self._sink.output(self.streams[-1], f"dsec: {exc}\n".encode())
        finally:
            self._ended = True
            self._client.close_channel(self._channel)
            if self._started.done() and self._started.exception() is None:
                self._sink.exited(code, sig)

    async def write(self, data: bytes) -> None:
        if self._ended or not self._stdin_open or not await self._client.stdin(self._channel, data):
            raise OSError(errno.EPIPE, "standard input is closed")

    async def close_stdin(self) -> None:
        if not self._ended and self._stdin_open:
            self._stdin_open = self._terminal  # a terminal only gets Ctrl-D (the agent sends it)
            await self._client.end_stdin(self._channel)

    def signal(self, signo: int, group: bool = True) -> None:
        if not self._ended:
            asyncio.get_running_loop().create_task(self._client.signal(self._channel, signo))

    async def signal_foreground(self, signo: int, include_self: bool = True) -> None:
        if not self._ended:
            await self._client.signal(self._channel, signo, 1 if include_self else 2)

    async def resize(self, cols: int, rows: int) -> None:
        if not self._ended:
            await self._client.send(T.RESIZE, self._channel, struct.pack(">HH", cols, rows))

    async def aclose(self) -> None:
        if not self._ended:
            with contextlib.suppress(AgentGone):
                await self._client.signal(self._channel, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 5)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class AgentPort:
    """A connection to a port on the guest's loopback, through the agent (CONNECT)."""

    def __init__(self, client: AgentClient, channel: int) -> None:
        self._client = client
        self._channel = channel
        self._done = False

    @classmethod
    async def open(cls, client: AgentClient, port: int) -> AgentPort:
        channel = await client.connect_port(port)
        try:
            frame = await client.next_frame(channel, 30)
        except BaseException:
            client.close_channel(channel)
            raise
        if frame.type == T.ERROR:
            client.close_channel(channel)
            code = int.from_bytes(frame.payload[:4], "big") if len(frame.payload) >= 4 else errno.EIO
            if code == errno.ECONNREFUSED:
                raise ConnectionRefusedError(code, f"nothing listens on port {port} in the guest")
            reason = frame.payload[4:300].decode(errors="replace")
            raise SandboxError(f"cannot connect to port {port} in the guest: {reason}")
        return cls(client, channel)

    async def read(self, n: int) -> bytes:
        if self._done:
            return b""
        frame = await self._client.next_frame(self._channel)
        if frame.type == T.DATA:
            return frame.payload
        self._done = True
        return b""

    async def write(self, data: bytes) -> None:
        await self._client.stdin(self._channel, data)  # within its window: a slow server holds the writer

    async def write_eof(self) -> None:
        with contextlib.suppress(AgentGone):
            await self._client.end_stdin(self._channel)

    async def aclose(self) -> None:
        await self._client.cancel(self._channel)


async def agent_watch(client: AgentClient, path: str, recursive: bool, user: Identity) -> AsyncIterator[FileEvent]:
    """Start a WATCH of ``path`` as ``user``; returns once it is in place, with its events."""
    channel = client.open_channel()
    try:
        await client.send(T.WATCH, channel, bytes([int(recursive)]) + creds_of(user) + path.encode() + b"\0")
        frame = await client.next_frame(channel, 60)
        if frame.type == T.ERROR:
            raise guest_error(frame.payload, path, "watch")
    except BaseException:
        client.close_channel(channel)
        raise
    return _watch_events(client, channel, path)


async def _watch_events(client: AgentClient, channel: int, root: str) -> AsyncIterator[FileEvent]:
    dropped = 0
    moves: dict[int, tuple[str, bool]] = {}
    try:
        while True:
            try:  # a rename's second half may come in the next batch: wait a moment for it
                frame = await client.next_frame(channel, _PAIR_WITHIN_S if moves else None)
            except TimeoutError:
                for path, is_dir in moves.values():
                    yield FileEvent(type="move", path=path, is_dir=is_dir)
                moves.clear()
                continue
            if frame.type != T.DATA:
                return
            events: list[FileEvent] = []
            for kind, is_dir, cookie, path in parse_watch(frame.payload):
                if kind == "o":
                    dropped += 1
                elif kind == "f":
                    moves[cookie] = (path, is_dir)
                elif kind == "t" and cookie in moves:
                    source = moves.pop(cookie)[0]
                    events.append(FileEvent(type="move", path=source, dest=path, is_dir=is_dir))
                else:
                    kinds = {"c": "create", "t": "create", "m": "modify", "d": "delete", "a": "chmod", "x": "delete"}
                    events.append(FileEvent(type=kinds[kind], path=path, is_dir=is_dir or kind == "x"))
            for event in events:
                if dropped:
                    event = event.model_copy(update={"dropped": dropped})
                    dropped = 0
                yield event
    finally:
        await client.cancel(channel)


class AgentFiles:
    """File operations as a user, through FS requests."""

    def __init__(self, client: AgentClient, user: Identity) -> None:
        self._client = client
        self._creds = creds_of(user)

    async def stat(self, path: str) -> FileStat:
        return self._stat(path, await self._client.fs(FS.STAT, self._creds, _path(path), path, "stat"))

    @staticmethod
    def _stat(path: str, chunks: list[bytes]) -> FileStat:
        if len(chunks) != 1:
            raise SandboxError(f"the guest agent answered a stat of {path} with {len(chunks)} records")
        kind, mode, size, mtime, uid, gid, target = parse_stat(chunks[0])
        return FileStat(name=posixpath.basename(path) or "/", path=path, type=kind, size=size,
                        mode=mode & 0o7777, uid=uid, gid=gid, mtime=mtime, symlink_target=target)

    async def mkdir(self, path: str, parents: bool, mode: int) -> FileStat:
        args = struct.pack(">IB", mode, int(parents)) + _path(path)
        return self._stat(path, await self._client.fs(FS.MKDIR, self._creds, args, path, "mkdir"))

    async def remove(self, path: str, recursive: bool) -> None:
        await self._client.fs(FS.REMOVE, self._creds, bytes([int(recursive)]) + _path(path), path, "remove")

    async def rename(self, source: str, destination: str, overwrite: bool) -> FileStat:
        args = bytes([int(overwrite)]) + _path(source) + _path(destination)
        return self._stat(destination, await self._client.fs(FS.RENAME, self._creds, args, source, "rename"))

    async def chmod(self, path: str, mode: int) -> FileStat:
        args = struct.pack(">I", mode) + _path(path)
        return self._stat(path, await self._client.fs(FS.CHMOD, self._creds, args, path, "chmod"))

    async def chown(self, path: str, owner: Identity) -> FileStat:
        args = struct.pack(">II", owner.uid, owner.gid) + _path(path)
        return self._stat(path, await self._client.fs(FS.CHOWN, self._creds, args, path, "chown"))

    async def read(self, path: str, max_bytes: int) -> bytes:
        args = max_bytes.to_bytes(8, "big") + _path(path)
        return b"".join(await self._client.fs(FS.READ, self._creds, args, path, "read"))

    async def list(self, path: str) -> list[FileEntry]:
        return [e for chunk in await self._client.fs(FS.LIST, self._creds, _path(path), path, "list")
                for e in parse_list(path, chunk)]

    async def write(self, path: str, data: bytes, mode: int | None) -> None:
        await self._client.write_as(self._creds, path, data, mode)


def _path(path: str) -> bytes:
    if "\0" in path:
        raise file_error(errno.EINVAL, path)
    return path.encode() + b"\0"


class GuestSurface:
    """The surface of a backend whose sandboxes are guests with the agent (microvm, vm), written once for both:
    ``client`` gives a sandbox's connected agent, ``why_gone`` the reason a connection ended (its VM's fate)."""

    def __init__(self, client: Callable[[SandboxRecord], AgentClient],
                 why_gone: Callable[[str, Exception], Awaitable[str]]) -> None:
        self._client = client
        self._why_gone = why_gone

    @contextlib.asynccontextmanager
    async def _agent(self, record: SandboxRecord) -> AsyncIterator[AgentClient]:
        try:
            yield self._client(record)
        except AgentGone as exc:
            raise SandboxError(f"sandbox {record.id}: {await self._why_gone(record.id, exc)}") from None

    @contextlib.asynccontextmanager
    async def files(self, record: SandboxRecord, user: Identity | None) -> AsyncIterator[AgentFiles]:
        async with self._agent(record) as client:
            yield AgentFiles(client, user or default_identity(record))

    async def watch(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None
                    ) -> AsyncIterator[FileEvent]:
        async with self._agent(record) as client:
            return await agent_watch(client, path, recursive, user or default_identity(record))

    async def start(self, record: SandboxRecord, argv: list[str], env: dict[str, str], cwd: str,
                    user: Identity, sink: ProcessSink, pty: tuple[int, int] | None, pty_stdin: bool,
                    timeout: float | None) -> ProcessIO:
        flags = EXT_REPORT_PID | (0 if pty is None else EXT_PTY_STDIN if pty_stdin else EXT_PTY)
        async with self._agent(record) as client:
            channel = await client.start_ext(argv, env, cwd, creds_of(user), flags, pty or (0, 0))
            process = AgentProcess(client, channel, sink, pty is not None and not pty_stdin, timeout)
            await process.wait_started()
            return process

    async def make_workdir(self, record: SandboxRecord, workdir: str) -> None:
        """The working directory, created if the image lacks it, as the default user's when that is not root."""
        user = default_identity(record)
        async with self._agent(record) as client:
            files = AgentFiles(client, ROOT)
            try:
                await files.stat(workdir)
            except FileNotFoundError:
                await files.mkdir(workdir, True, 0o755)
                if not user.is_root:
                    await files.chown(workdir, user)

    async def open_port(self, record: SandboxRecord, port: int) -> AgentPort:
        async with self._agent(record) as client:
            return await AgentPort.open(client, port)
