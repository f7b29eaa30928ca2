"""Host side of the guest agent's protocol: framing, strict parsing, and one client multiplexing channels.

Frame (both directions): ``u32 length`` (big-endian, counts the bytes after it) ``| u8 type | u32 channel
| payload``. The guest is hostile: :class:`FrameParser` bounds every frame (:data:`MAX_GUEST_PAYLOAD`),
rejects unknown types and malformed payloads, and any violation ends the connection (the sandbox is
then reported dead with the reason); it never allocates more than one frame's worth of bytes.

Stdin flows within a window: on a channel that asked for it (an agent announcing :data:`FEATURE_CREDIT`), the host
has at most :data:`STDIN_WINDOW` bytes of stdin the agent has not yet credited (CREDIT frames, sent as the command or
socket takes them), so any amount streams through with bounded memory on both sides. An older agent announces
nothing: its channels get the older protocol (the agent buffers up to 8 MiB, then refuses with ENOBUFS).

Output flows within a window the same way, the other way round: on a channel that asked (an agent announcing
:data:`FEATURE_OUTPUT_CREDIT`), the agent has at most :data:`OUTPUT_WINDOW` bytes of output (STDOUT, STDERR, a
connection's DATA) the host has not credited (OUT_CREDIT frames, sent as the channel's consumer takes frames off its
queue), and stops reading the command's pipes or the socket while the window is full. So a consumer that reads
slowly (an exec streamed to a slow client, a port forward's) holds the command in the guest, and what the daemon
queues per channel stays within the window whatever the guest writes; a guest sending past it ends the connection.

This module does no QEMU management; :mod:`dsec.backends.qemu` owns the VM.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dsec.errors import InvalidRequest, SandboxError, file_error
from dsec.models import FileEntry

__all__ = ["EXT_CREDIT", "EXT_OUTPUT_CREDIT", "EXT_PRISTINE", "EXT_PTY", "EXT_PTY_STDIN", "EXT_REPORT_PID",
           "EXT_SYSTEM", "FEATURE_CREDIT", "FEATURE_OUTPUT_CREDIT", "FS", "MAX_GUEST_PAYLOAD", "OUTPUT_WINDOW",
           "STDIN_WINDOW", "AgentClient", "AgentGone", "Frame", "FrameParser", "ProtocolError", "T", "creds",
           "parse_exit", "parse_list", "parse_stat", "parse_watch"]

MAX_GUEST_PAYLOAD = 65536
"""Largest payload the guest may send (its output chunks are 64 KiB)."""
MAX_HOST_PAYLOAD = (2 << 20) + (64 << 10) - 5
"""Largest payload the agent accepts from us (``MAX_IN`` in ``agent.h``, less the frame's type and channel)."""
_WRITE_CHUNK = 256 * 1024
_HDR = struct.Struct(">IBI")
STDIN_WINDOW = 2 << 20
"""Stdin a channel may have in flight, not yet credited by the agent: well below its ``STDIN_BUF_MAX`` (8 MiB), and
wide enough that a command reading fast never waits for credit."""
OUTPUT_WINDOW = 1 << 20
"""Output a channel's agent may have sent that the host has not credited back (``OUTPUT_WINDOW`` in ``agent.h``):
the most the daemon queues per channel, so a guest's worst case is the channels its callers opened times this.
16 of the agent's 64 KiB frames: credited at half of it, a reader keeping up is never short of credit (a credit's
round trip over the port is far shorter than 512 KiB of output takes to arrive), while a stalled one costs 1 MiB."""
FEATURE_CREDIT, FEATURE_OUTPUT_CREDIT = 1, 2
"""The agent's READY (and PING's END) announces them: it credits stdin on the channels that ask; it keeps the
output of the channels that ask within the window the host credits."""
EXT_PRISTINE, EXT_SYSTEM, EXT_PTY, EXT_PTY_STDIN, EXT_REPORT_PID, EXT_CREDIT, EXT_OUTPUT_CREDIT = 1, 2, 4, 8, 16, 32, 64
"""EXEC_EXT flags (``agent_exec.c``)."""
_CONNECT_CREDIT, _CONNECT_OUTPUT_CREDIT = 1, 2
_RELEASE = 0xFFFFFFFF
"""OUT_CREDIT's "stop counting": the host gave the channel up (it drops what comes), so the agent must not wait."""


class T:
    """Frame types (host -> guest below 0x80, guest -> host above)."""

    EXEC, STDIN, SIGNAL, READ, WRITE, LIST, IDENTITY, SHUTDOWN, PING, MKDIR, EXEC_PRISTINE, EXEC_SYSTEM = range(1, 13)
    CONFINE, REVEAL, EXEC_EXT, RESIZE, FS, WATCH, CANCEL, CONNECT, OUT_CREDIT = range(16, 25)
    STDOUT, STDERR, EXIT, DATA, END, ERROR, READY, STARTED, CREDIT = range(0x81, 0x8A)


_GUEST_TYPES = frozenset({T.STDOUT, T.STDERR, T.EXIT, T.DATA, T.END, T.ERROR, T.READY, T.STARTED, T.CREDIT})
_CHANNEL_ENDS = frozenset({T.EXIT, T.END, T.ERROR})
"""Frames after which a channel takes no more stdin (its command exited or could not start, its connection ended)."""
_OUTPUT = frozenset({T.STDOUT, T.STDERR, T.DATA})
"""Frames counted in an output window."""


class ProtocolError(SandboxError):
    """The guest sent something the protocol does not allow."""


class AgentGone(SandboxError):
    """The connection to the guest agent ended (VM dead, agent killed, or a protocol violation)."""


@dataclass(frozen=True)
class Frame:
    type: int
    channel: int
    payload: bytes


class FrameParser:
    """Incremental, bounded parser of guest -> host frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by ``data``; raises ProtocolError on anything malformed."""
        self._buf += data
        frames = []
        while len(self._buf) >= 4:
            length = int.from_bytes(self._buf[:4], "big")
            if length < 5 or length > MAX_GUEST_PAYLOAD + 5:
                raise ProtocolError(f"guest agent sent a frame of {length} bytes (allowed 5..{MAX_GUEST_PAYLOAD + 5})")
            if len(self._buf) < 4 + length:
                break
            _, ftype, channel = _HDR.unpack_from(self._buf)
            if ftype not in _GUEST_TYPES:
                raise ProtocolError(f"guest agent sent unknown frame type {ftype:#x}")
            frames.append(Frame(ftype, channel, bytes(self._buf[9:4 + length])))
            del self._buf[:4 + length]
        return frames


def encode(ftype: int, channel: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_HOST_PAYLOAD:
        raise InvalidRequest(f"request too large for the guest agent ({len(payload)} bytes)")
    return _HDR.pack(len(payload) + 5, ftype, channel) + payload


def parse_exit(payload: bytes) -> tuple[int, int | None, bool]:
    """``(exit_code, signal, oom)`` of an EXIT frame; ``oom``: the guest OOM-killed something meanwhile."""
    if len(payload) != 6:
        raise ProtocolError(f"malformed exit frame ({len(payload)} bytes)")
    code, sig, flags = struct.unpack(">iBB", payload)
    if not 0 <= code <= 255 + 128 or sig > 64 or flags > 1:
        raise ProtocolError(f"impossible exit status {code} / signal {sig} / flags {flags}")
    return code, (sig or None), bool(flags)


_FILE_ERRNOS = frozenset({errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY, errno.EACCES,
                          errno.EPERM, errno.EROFS, errno.ELOOP, errno.ENAMETOOLONG, errno.EXDEV, errno.EBUSY})
_LIST_REC = struct.Struct(">BIQQH")
_KINDS: dict[int, Literal["file", "dir", "symlink", "other"]] = {
    ord("f"): "file", ord("d"): "dir", ord("l"): "symlink", ord("o"): "other"}


def parse_list(directory: str, payload: bytes) -> list[FileEntry]:
    """Entries of one LIST data frame: ``u8 kind | u32 mode | u64 size | u64 mtime_ns | u16 len | name``."""
    out, pos = [], 0
    while pos < len(payload):
        if len(payload) - pos < _LIST_REC.size:
            raise ProtocolError("truncated directory entry")
        kind, mode, size, mtime_ns, nlen = _LIST_REC.unpack_from(payload, pos)
        pos += _LIST_REC.size
        raw = payload[pos:pos + nlen]
        pos += nlen
        if len(raw) != nlen or kind not in _KINDS or not raw or b"/" in raw or b"\0" in raw or raw in (b".", b".."):
            raise ProtocolError("malformed directory entry")
        name = raw.decode(errors="surrogateescape")
        out.append(FileEntry(name=name, path=f"{directory.rstrip('/')}/{name}", type=_KINDS[kind],
                             size=size, mode=mode & 0o7777, mtime=mtime_ns / 1e9))
    return out


def guest_error(payload: bytes, path: str, what: str = "") -> Exception:
    """The DSec error for an ERROR frame (errno + message), mapped like the container's file API."""
    if len(payload) < 4:
        return ProtocolError("malformed error frame")
    err = int.from_bytes(payload[:4], "big")
    message = payload[4:512].decode(errors="replace")
    if err in _FILE_ERRNOS:
        return file_error(err, path, what)
    if err == errno.EFBIG:
        return InvalidRequest(f"{path} is over the read limit", path=path)
    if err in (errno.EINVAL, errno.ENOSYS):
        return InvalidRequest(f"guest agent refused the request: {message}", path=path)
    if err in (errno.ENOSPC, errno.EDQUOT):
        return SandboxError(f"sandbox disk is full writing {path}", path=path)
    return SandboxError(f"guest agent: {message}", path=path)


class _Window:
    """A channel's stdin sent and not yet credited by the agent (at most :data:`STDIN_WINDOW`)."""

    def __init__(self) -> None:
        self.unacked = 0
        self.closed = False
        self.changed = asyncio.Event()
        self.lock = asyncio.Lock()
        """One writer at a time: concurrent writes must not interleave their chunks."""

    def sent(self, n: int) -> None:
        self.unacked += n

    def credit(self, n: int) -> None:
        if not 0 < n <= self.unacked:
            raise ProtocolError(f"guest agent credited {n} bytes of stdin with {self.unacked} in flight")
        self.unacked -= n
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()

    async def wait_room(self, want: int) -> int:
        """Room for up to ``want`` bytes (at least one chunk's worth, or ``want``); 0 once the channel ended."""
        while not self.closed:
            room = STDIN_WINDOW - self.unacked
            if room >= min(want, _WRITE_CHUNK):
                return min(room, want, _WRITE_CHUNK)
            self.changed.clear()
            await self.changed.wait()
        return 0


class _OutputWindow:
    """A channel's output the agent sent within :data:`OUTPUT_WINDOW`: received and not credited back yet, of it
    taken by the channel's consumer (the rest is in its queue)."""

    def __init__(self) -> None:
        self.unacked = 0
        self.taken = 0
        self.ended = False
        """The channel's EXIT, END or ERROR came: the agent waits for no more credit."""

    def received(self, n: int) -> None:
        self.unacked += n
        if self.unacked > OUTPUT_WINDOW:
            raise ProtocolError(f"guest agent sent {self.unacked} bytes of output past a window of {OUTPUT_WINDOW}")

    def take(self, n: int) -> int:
        """``n`` bytes consumed; what to credit now (0: not yet, batched to half the window)."""
        self.taken += n
        if self.ended or self.taken < OUTPUT_WINDOW // 2:
            return 0
        credit, self.taken = self.taken, 0
        self.unacked -= credit
        return credit


class AgentClient:
    """One connection to a guest agent; any number of concurrent operations, each on its own channel."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._channels: dict[int, asyncio.Queue[Frame | None]] = {}
        self._windows: dict[int, _Window] = {}
        self._outputs: dict[int, _OutputWindow] = {}
        self._queued: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._ready = asyncio.Event()
        self.features = 0
        """What the agent announced (:data:`FEATURE_CREDIT`, :data:`FEATURE_OUTPUT_CREDIT`); 0 for an agent older
        than announcing."""
        self.dead_reason: str | None = None
        self._task = asyncio.create_task(self._read_loop(), name="dsec-agent-reader")
        self._write_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: str) -> AgentClient:
        reader, writer = await asyncio.open_unix_connection(path, limit=MAX_GUEST_PAYLOAD * 2)
        return cls(reader, writer)

    async def wait_ready(self, timeout: float) -> None:
        """Wait for the agent's READY frame (sent once at boot)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            raise AgentGone(self.dead_reason or f"guest agent did not answer within {timeout:.0f}s") from None
        if self.dead_reason is not None:
            raise AgentGone(self.dead_reason)

    async def _read_loop(self) -> None:
        parser = FrameParser()
        try:
            while True:
                data = await self._reader.read(MAX_GUEST_PAYLOAD)
                if not data:
                    raise AgentGone("connection to the guest agent closed")
                for frame in parser.feed(data):
                    if frame.type == T.READY:
                        self.features = _features(frame.payload)
                        self._ready.set()
                        continue
                    window = self._windows.get(frame.channel)
                    if frame.type == T.CREDIT:
                        if len(frame.payload) != 4:
                            raise ProtocolError(f"malformed credit frame ({len(frame.payload)} bytes)")
                        if window is not None:  # (none: a channel we gave up on)
                            window.credit(int.from_bytes(frame.payload, "big"))
                        continue
                    if window is not None and frame.type in _CHANNEL_ENDS:
                        window.close()  # its command ended: the rest of its stdin is moot
                    output = self._outputs.get(frame.channel)
                    if output is not None:
                        if frame.type in _OUTPUT:
                            output.received(len(frame.payload))
                        elif frame.type in _CHANNEL_ENDS:
                            output.ended = True
                    queue = self._channels.get(frame.channel)
                    if queue is None:
                        continue  # a channel we gave up on (killed exec): late output is dropped
                    if frame.type in _OUTPUT:
                        self._queued[frame.channel] += len(frame.payload)
                    queue.put_nowait(frame)
        except (AgentGone, ProtocolError, OSError) as exc:
            self.dead_reason = str(exc) if isinstance(exc, SandboxError) else f"agent connection failed: {exc}"
        finally:
            if self.dead_reason is None:
                self.dead_reason = "agent connection closed"
            self._ready.set()
            for queue in self._channels.values():
                queue.put_nowait(None)
            for window in self._windows.values():
                window.close()
            self._writer.close()

    def mark_dead(self, reason: str) -> None:
        """Give every waiter ``reason`` (the VM died) and stop reading."""
        if self.dead_reason is None:
            self.dead_reason = reason
        self._task.cancel()

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    def open_channel(self) -> int:
        if self.dead_reason is not None:
            raise AgentGone(self.dead_reason)
        channel = next(self._ids)
        self._channels[channel] = asyncio.Queue()
        self._queued[channel] = 0
        return channel

    def close_channel(self, channel: int) -> None:
        self._channels.pop(channel, None)
        self._queued.pop(channel, None)
        window = self._windows.pop(channel, None)
        if window is not None:
            window.close()
        output = self._outputs.pop(channel, None)
        if output is not None and not output.ended:
            # Given up before its end (a killed exec, a closed port): what it still sends is dropped here, and an
            # agent waiting for credit that never comes would keep its command's pipes (and the channel) forever.
            self._send_nowait(T.OUT_CREDIT, channel, _RELEASE.to_bytes(4, "big"))

    def queued(self, channel: int) -> int:
        """Bytes of output the channel's queue holds (what its consumer has not taken yet)."""
        return self._queued.get(channel, 0)

    def _send_nowait(self, ftype: int, channel: int, payload: bytes) -> None:
        """A small frame into the transport now, without waiting for the port (a credit: it must not be lost to
        a consumer's cancellation, and frames are whole in the transport, so it never splits another's)."""
        if self.dead_reason is None and not self._writer.is_closing():
            self._writer.write(encode(ftype, channel, payload))

    @property
    def credits(self) -> bool:
        """Whether the agent credits stdin (new channels then ask for it and keep to :data:`STDIN_WINDOW`)."""
        return bool(self.features & FEATURE_CREDIT)

    @property
    def output_credits(self) -> bool:
        """Whether the agent keeps output within a window (new channels then ask for :data:`OUTPUT_WINDOW`)."""
        return bool(self.features & FEATURE_OUTPUT_CREDIT)

    async def _start(self, ftype: int, payload: bytes, stdin: bool, output: bool = False) -> int:
        """A new channel and its first request (``stdin``: it takes stdin, within a window when the agent credits;
        ``output``: the request asked for an output window); the channel is closed again if the request cannot be
        sent."""
        channel = self.open_channel()
        if stdin and self.credits:
            self._windows[channel] = _Window()
        if output:
            self._outputs[channel] = _OutputWindow()  # before the request: its output may follow at once
        try:
            await self.send(ftype, channel, payload)
        except BaseException:
            self.close_channel(channel)
            raise
        return channel

    async def send(self, ftype: int, channel: int, payload: bytes = b"",
                   written: Callable[[], None] | None = None) -> None:
        """Send one frame (``written``: called once it is in the transport, which sends it whatever happens next)."""
        if self.dead_reason is not None:
            raise AgentGone(self.dead_reason)
        async with self._write_lock:
            self._writer.write(encode(ftype, channel, payload))
            if written is not None:
                written()
            try:
                await self._writer.drain()
            except OSError as e:
                raise AgentGone(f"guest agent connection failed: {e}") from e

    async def next_frame(self, channel: int, timeout: float | None = None) -> Frame:
        """The next frame of ``channel``; AgentGone when the connection died."""
        queue = self._channels[channel]
        frame = await asyncio.wait_for(queue.get(), timeout) if timeout else await queue.get()
        if frame is None:
            queue.put_nowait(None)  # later waiters on this channel see it too
            raise AgentGone(self.dead_reason or "guest agent connection closed")
        if frame.type in _OUTPUT:
            if channel in self._queued:
                self._queued[channel] -= len(frame.payload)
            output = self._outputs.get(channel)
            credit = output.take(len(frame.payload)) if output is not None else 0
            if credit:
                self._send_nowait(T.OUT_CREDIT, channel, credit.to_bytes(4, "big"))
        return frame

    async def _simple(self, ftype: int, payload: bytes, path: str, timeout: float = 60.0) -> list[bytes]:
        """Send one request; collect DATA payloads until END (or raise the guest's ERROR)."""
        channel = self.open_channel()
        try:
            await self.send(ftype, channel, payload)
            return await self._collect(channel, path, timeout)
        finally:
            self.close_channel(channel)

    async def _collect(self, channel: int, path: str, timeout: float, limit: int | None = None, what: str = ""
                       ) -> list[bytes]:
        chunks: list[bytes] = []
        total = 0
        while True:
            frame = await self.next_frame(channel, timeout)
            if frame.type == T.END:
                return chunks
            if frame.type == T.ERROR:
                raise guest_error(frame.payload, path, what)
            if frame.type != T.DATA:
                raise ProtocolError(f"unexpected frame {frame.type:#x} in a file reply")
            total += len(frame.payload)
            if limit is not None and total > limit:
                raise ProtocolError(f"guest sent more than the {limit} bytes asked for")
            chunks.append(frame.payload)

    # -- operations ---------------------------------------------------------------------------------

    async def ping(self, timeout: float = 10.0) -> None:
        """A round trip; learns what the agent announces (a restored guest sent its READY long ago)."""
        channel = self.open_channel()
        try:
            await self.send(T.PING, channel)
            frame = await self.next_frame(channel, timeout)
            if frame.type != T.END:
                raise ProtocolError(f"unexpected frame {frame.type:#x} in reply to a ping")
            self.features = _features(frame.payload)
        finally:
            self.close_channel(channel)

    async def read(self, path: str, max_bytes: int) -> bytes:
        channel = self.open_channel()
        try:
            await self.send(T.READ, channel, max_bytes.to_bytes(8, "big") + _path(path))
            return b"".join(await self._collect(channel, path, 120.0, limit=max_bytes))
        finally:
            self.close_channel(channel)

    async def write(self, path: str, data: bytes, mode: int | None) -> None:
        channel = self.open_channel()
        try:
            await self.send(T.WRITE, channel, (0xFFFFFFFF if mode is None else mode).to_bytes(4, "big") + _path(path))
            for i in range(0, len(data), _WRITE_CHUNK):
                await self.send(T.STDIN, channel, data[i:i + _WRITE_CHUNK])
            await self.send(T.STDIN, channel, b"")
            await self._collect(channel, path, 120.0, limit=0)
        finally:
            self.close_channel(channel)

    async def list(self, path: str) -> builtins.list[FileEntry]:
        return [e for chunk in await self._simple(T.LIST, _path(path), path) for e in parse_list(path, chunk)]

    async def mkdir(self, path: str) -> None:
        await self._simple(T.MKDIR, _path(path), path)

    async def identity(self, hostname: str, machine_id: str, seed: bytes) -> None:
        await self._simple(T.IDENTITY, hostname.encode() + b"\0" + machine_id.encode() + b"\0" + seed, "")

    async def confine(self, protected: builtins.list[str], hidden: builtins.list[str],
                      extra: builtins.list[tuple[str, str]] | None = None) -> builtins.list[str]:
        """Confine every later command (own mount namespace, capabilities dropped, no_new_privs) with
        ``protected`` read-only and ``hidden`` covered; returns the paths still hidden (a guest restored from a
        snapshot of a confined one keeps its own setup and reports it). ``extra``: ``(kind, path)`` entries of
        the full-VM setup (``C`` covered, ``T`` own tmpfs, ``W`` writable in a read-only root, ``B`` block
        devices covered; see docs/design/vm.md)."""
        payload = b"".join(b"P" + _path(p) for p in protected) + b"".join(b"H" + _path(h) for h in hidden)
        payload += b"".join(kind.encode() + _path(p) for kind, p in extra or [])
        chunks = await self._simple(T.CONFINE, payload, "", 60.0)
        return [p.decode(errors="replace") for p in b"".join(chunks).split(b"\0") if p]

    async def reveal(self) -> None:
        """Uncover every hidden path, leaving it read-only."""
        await self._simple(T.REVEAL, b"", "", 60.0)

    async def shutdown(self) -> None:
        await self._simple(T.SHUTDOWN, b"", "", 10.0)

    async def start_exec(self, argv: builtins.list[str], env: dict[str, str], cwd: str, uid: int = 0,
                         gid: int = 0, pristine: bool = False, system: bool = False) -> int:
        """Start a command as ``uid:gid`` (``pristine``: on the image's untouched root, with ``cwd`` bound in;
        ``system``: the backend's own upkeep, never confined); returns its channel (read it with
        :meth:`next_frame`)."""
        if self.credits or self.output_credits:  # windows: only the extended request asks for them
            return await self.start_ext(argv, env, cwd, creds(uid, gid, ()),
                                        (EXT_PRISTINE if pristine else 0) | (EXT_SYSTEM if system else 0))
        if len(argv) > 0xFFFF or len(env) > 0xFFFF:
            raise InvalidRequest("too many arguments or environment entries")
        strings = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
        payload = struct.pack(">HHII", len(argv), len(env), uid, gid) + b"".join(s.encode() + b"\0" for s in strings)
        return await self._start(T.EXEC_SYSTEM if system else T.EXEC_PRISTINE if pristine else T.EXEC, payload, False)

    async def stdin(self, channel: int, data: bytes) -> bool:
        """Send ``data`` as the channel's stdin, within its window (waiting for the agent's credit); False when the
        channel ended first (its command exited: the rest was not sent)."""
        window = self._windows.get(channel)
        if window is None:  # an older agent (or a channel that takes no credit): as fast as the port goes
            for i in range(0, len(data), _WRITE_CHUNK):
                await self.send(T.STDIN, channel, data[i:i + _WRITE_CHUNK])
            return True
        async with window.lock:
            pos = 0
            while pos < len(data):
                room = await window.wait_room(len(data) - pos)
                if not room:
                    if self.dead_reason is not None:
                        raise AgentGone(self.dead_reason)
                    return False
                # Counted once the frame is in the transport: a write cancelled while it waits for the port was
                # never sent, and the agent never credits it.
                await self.send(T.STDIN, channel, data[pos:pos + room], written=functools.partial(window.sent, room))
                pos += room
        return True

    async def end_stdin(self, channel: int) -> None:
        """The end of the channel's stdin (a terminal's: Ctrl-D), after what a write still waiting for credit sends."""
        window = self._windows.get(channel)
        async with window.lock if window is not None else contextlib.nullcontext():
            await self.send(T.STDIN, channel, b"")

    async def signal(self, channel: int, signo: int, how: int = 0) -> None:
        """``signo`` to the command's process group (``how`` 1: its terminal's foreground group; 2: the same
        unless that is the command's own)."""
        with contextlib.suppress(AgentGone):
            await self.send(T.SIGNAL, channel, bytes([signo]) if how == 0 else bytes([signo, how]))

    # -- the surface (agent_exec.c, agent_files.c, agent_surface.c) --------------------------------

    async def start_ext(self, argv: builtins.list[str], env: dict[str, str], cwd: str, creds: bytes, flags: int,
                        size: tuple[int, int] = (0, 0)) -> int:
        """EXEC_EXT (see ``agent_exec.c``): ``creds`` from :func:`creds`; returns its channel."""
        if len(argv) > 0xFFFF or len(env) > 0xFFFF:
            raise InvalidRequest("too many arguments or environment entries")
        strings = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
        if self.credits:
            flags |= EXT_CREDIT
        if self.output_credits:
            flags |= EXT_OUTPUT_CREDIT
        payload = (struct.pack(">HHIHH", len(argv), len(env), flags, *size) + creds
                   + b"".join(text.encode() + b"\0" for text in strings))
        return await self._start(T.EXEC_EXT, payload, True, bool(flags & EXT_OUTPUT_CREDIT))

    async def fs(self, op: int, creds: bytes, args: bytes, path: str, what: str, timeout: float = 120.0
                 ) -> builtins.list[bytes]:
        """One FS request as a user: its DATA payloads (raises the guest's error as a file error)."""
        channel = self.open_channel()
        try:
            await self.send(T.FS, channel, bytes([op]) + creds + args)
            return await self._collect(channel, path, timeout, what=what)
        finally:
            self.close_channel(channel)

    async def write_as(self, creds: bytes, path: str, data: bytes, mode: int | None) -> None:
        """Write ``path`` in place as a user (FS WRITE): the user's permissions on the file itself count."""
        channel = self.open_channel()
        try:
            await self.send(T.FS, channel, bytes([FS.WRITE]) + creds
                            + (0xFFFFFFFF if mode is None else mode).to_bytes(4, "big") + _path(path))
            for i in range(0, len(data), _WRITE_CHUNK):
                await self.send(T.STDIN, channel, data[i:i + _WRITE_CHUNK])
            await self.send(T.STDIN, channel, b"")
            await self._collect(channel, path, 120.0, limit=0)
        finally:
            self.close_channel(channel)

    async def cancel(self, channel: int) -> None:
        """End a watch or a connection."""
        with contextlib.suppress(AgentGone):
            await self.send(T.CANCEL, channel, b"")
        self.close_channel(channel)

    async def connect_port(self, port: int) -> int:
        """CONNECT to the guest's own ``127.0.0.1:port``; returns its channel (STARTED or ERROR come first)."""
        flags = (_CONNECT_CREDIT if self.credits else 0) | (_CONNECT_OUTPUT_CREDIT if self.output_credits else 0)
        payload = struct.pack(">H", port) + (bytes([flags]) if flags else b"")
        return await self._start(T.CONNECT, payload, True, bool(flags & _CONNECT_OUTPUT_CREDIT))


def _features(payload: bytes) -> int:
    """What an agent announces in READY or PING's END: ``u32`` bits (an older agent's payload is empty; a longer
    one is a newer agent's, whose first word still counts)."""
    return int.from_bytes(payload[:4], "big") if len(payload) >= 4 else 0


class FS:
    """Operations of an FS frame."""

    STAT, MKDIR, REMOVE, RENAME, CHMOD, CHOWN, READ, LIST, WRITE = range(1, 10)


def creds(uid: int, gid: int, groups: tuple[int, ...]) -> bytes:
    """The CREDS block of a request made as a user."""
    if len(groups) > 64:
        raise InvalidRequest(f"a user of at most 64 supplementary groups can act in a microVM, not {len(groups)}")
    return struct.pack(f">IIH{len(groups)}I", uid, gid, len(groups), *groups)


_STAT_REC = struct.Struct(">BIQQIIH")


def parse_stat(payload: bytes) -> tuple[str, int, int, float, int, int, str | None]:
    """``(kind, mode, size, mtime, uid, gid, symlink target)`` of a STAT reply."""
    if len(payload) < _STAT_REC.size:
        raise ProtocolError("truncated stat reply")
    kind, mode, size, mtime_ns, uid, gid, tlen = _STAT_REC.unpack_from(payload)
    target = payload[_STAT_REC.size:_STAT_REC.size + tlen]
    if kind not in _KINDS or len(target) != tlen:
        raise ProtocolError("malformed stat reply")
    return (_KINDS[kind], mode, size, mtime_ns / 1e9, uid, gid,
            target.decode(errors="surrogateescape") if kind == ord("l") else None)


_WATCH_REC = struct.Struct(">BBIH")


def parse_watch(payload: bytes) -> builtins.list[tuple[str, bool, int, str]]:
    """``(kind, is_dir, cookie, path)`` records of one WATCH data frame (kind: ``c m d a f t x o``)."""
    out, pos = [], 0
    while pos < len(payload):
        if len(payload) - pos < _WATCH_REC.size:
            raise ProtocolError("truncated watch record")
        kind, is_dir, cookie, plen = _WATCH_REC.unpack_from(payload, pos)
        pos += _WATCH_REC.size
        raw = payload[pos:pos + plen]
        pos += plen
        if len(raw) != plen or chr(kind) not in "cmdaftxo" or is_dir > 1 or b"\0" in raw:
            raise ProtocolError("malformed watch record")
        out.append((chr(kind), bool(is_dir), cookie, raw.decode(errors="surrogateescape")))
    return out


def _path(path: str) -> bytes:
    return path.encode() + b"\0"
