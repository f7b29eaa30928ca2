"""The node's process table: processes started through DSec that outlive their request and their client.

Owns, per sandbox, every process a client started (``exec(background=True)``, ``sb.pty``): its
:class:`~dsec.backends.surface.ProcessIO`, a bounded buffer per output stream that keeps the newest bytes
(a reader asks from an offset and is told how many bytes before it are gone), its exit, and the readers
waiting for more. A process lives until it exits; its record, with the tail of its output, until the
sandbox goes or :data:`MAX_ENDED` newer ones ended. It never runs anything itself: backends start
processes, this table keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsec.backends.surface import ProcessIO, Stream
from dsec.errors import InvalidRequest, ProcessNotFound, QuotaExceeded
from dsec.models.surface import ProcessEvent, ProcessInfo, PtySize

__all__ = ["BUFFER_BYTES", "MAX_ENDED", "MAX_PROCESSES", "OutputBuffer", "ProcessEntry", "ProcessTable"]

BUFFER_BYTES = 4 * 1024 * 1024
"""Output kept per stream of a process; a reader further behind is told how much it missed."""
MAX_ENDED = 64
"""Ended processes whose records (and output) a sandbox keeps; the oldest go first."""
MAX_PROCESSES = 1024
"""Processes started through DSec that may run at once in one sandbox."""


class OutputBuffer:
    """The newest :data:`BUFFER_BYTES` of one stream, addressed by offset since the process started."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit or BUFFER_BYTES
        self._chunks: deque[tuple[int, bytes]] = deque()
        self.start = 0
        """Offset of the oldest byte kept."""
        self.end = 0
        """Offset past the newest byte (bytes written so far)."""

    def append(self, data: bytes) -> None:
        self._chunks.append((self.end, data))
        self.end += len(data)
        while self.end - self.start > self.limit:
            offset, chunk = self._chunks[0]
            excess = self.end - self.start - self.limit
            if len(chunk) <= excess:
                self._chunks.popleft()
                self.start = offset + len(chunk)
            else:
                self._chunks[0] = (offset + excess, chunk[excess:])
                self.start = offset + excess

    def read(self, offset: int) -> tuple[int, int, bytes]:
        """``(dropped, at, data)``: what is kept from ``offset`` on (``dropped`` bytes before it are gone)."""
        dropped = max(self.start - offset, 0)
        at = max(offset, self.start)
        parts = [chunk[max(at - start, 0):] for start, chunk in self._chunks if start + len(chunk) > at]
        return dropped, at, b"".join(parts)


@dataclass
class ProcessEntry:
    """One process of the table."""

    info: ProcessInfo
    io: ProcessIO
    buffers: dict[str, OutputBuffer] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    # ProcessSink: called by the backend's ProcessIO on the event loop.
    def output(self, stream: Stream, data: bytes) -> None:
        self.buffers[stream].append(data)
        self._changed()

    def exited(self, exit_code: int, signal: int | None) -> None:
        info = self.info
        info.running, info.stdin_open = False, False
        info.exit_code, info.signal, info.ended_at = exit_code, signal, time.time()
        self.ended.set()
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def snapshot(self) -> ProcessInfo:
        """Its info now, with the byte counts of its streams."""
        return self.info.model_copy(update={
            "output_bytes": {name: b.end for name, b in self.buffers.items()},
            "dropped_bytes": {name: b.start for name, b in self.buffers.items()}})


class _Starting:
    """A sink for the moments before a process's entry exists (output it writes at once is kept)."""

    def __init__(self, streams: tuple[Stream, ...]) -> None:
        self.buffers: dict[str, OutputBuffer] = {name: OutputBuffer() for name in streams}
        self.exit: tuple[int, int | None] | None = None
        self.entry: ProcessEntry | None = None

    def output(self, stream: Stream, data: bytes) -> None:
        if self.entry is not None:
            self.entry.output(stream, data)
        else:
            self.buffers[stream].append(data)

    def exited(self, exit_code: int, signal: int | None) -> None:
        if self.entry is not None:
            self.entry.exited(exit_code, signal)
        else:
            self.exit = (exit_code, signal)


class ProcessTable:
    """Every sandbox's processes. Methods are called on the event loop."""

    def __init__(self) -> None:
        self._sandboxes: dict[str, dict[int, ProcessEntry]] = {}

    def sink(self, pty: bool) -> _Starting:
        """The sink to hand a backend's ``start_process``; :meth:`add` then makes its entry."""
        return _Starting(("pty",) if pty else ("stdout", "stderr"))

    def add(self, sandbox_id: str, io: ProcessIO, sink: _Starting, command: list[str], cwd: str, user: str | None,
            tag: str | None, pty: PtySize | None, stdin_open: bool, env: dict[str, str] | None = None
            ) -> ProcessInfo:
        """Record a started process (pids are unique among a sandbox's live processes: an ended record with
        the same pid is dropped)."""
        table = self._sandboxes.setdefault(sandbox_id, {})
        info = ProcessInfo(pid=io.pid, command=command, tag=tag, user=user, cwd=cwd, env=env or {}, pty=pty,
                           started_at=time.time(), running=True, stdin_open=stdin_open)
        entry = ProcessEntry(info=info, io=io, buffers=sink.buffers)
        sink.entry = entry
        table[io.pid] = entry
        if sink.exit is not None:
            entry.exited(*sink.exit)
        self._trim(table)
        return entry.snapshot()

    def check_room(self, sandbox_id: str) -> None:
        """Refuse a start past :data:`MAX_PROCESSES` running ones."""
        running = sum(1 for e in self._sandboxes.get(sandbox_id, {}).values() if e.info.running)
        if running >= MAX_PROCESSES:
            raise QuotaExceeded(f"sandbox {sandbox_id} already runs {running} processes started through DSec "
                                f"(at most {MAX_PROCESSES})", sandbox=sandbox_id)

    def _trim(self, table: dict[int, ProcessEntry]) -> None:
        ended = sorted((e for e in table.values() if not e.info.running), key=lambda e: e.info.ended_at or 0.0)
        for entry in ended[:max(len(ended) - MAX_ENDED, 0)]:
            del table[entry.info.pid]

    def list(self, sandbox_id: str) -> list[ProcessInfo]:
        """The sandbox's processes, oldest first."""
        entries = self._sandboxes.get(sandbox_id, {}).values()
        return [e.snapshot() for e in sorted(entries, key=lambda e: e.info.started_at)]

    def get(self, sandbox_id: str, pid: int) -> ProcessEntry:
        entry = self._sandboxes.get(sandbox_id, {}).get(pid)
        if entry is None:
            raise ProcessNotFound(f"sandbox {sandbox_id} has no process {pid} started through DSec (see "
                                  "processes.list(); a process ended long ago is forgotten)", pid=pid)
        return entry

    async def stream(self, sandbox_id: str, pid: int, offsets: dict[str, int] | None = None, follow: bool = True
                     ) -> AsyncIterator[ProcessEvent]:
        """The process's output from ``offsets`` (default: all that is kept), then, with ``follow``, as it comes,
        and finally its ``exit``. A reader that fell behind the buffer first gets a ``dropped`` event."""
        entry = self.get(sandbox_id, pid)
        at = {name: (offsets or {}).get(name, 0) for name in entry.buffers}
        while True:
            changed = entry.changed
            for name, buffer in entry.buffers.items():
                dropped, start, data = buffer.read(at[name])
                if dropped:
                    yield ProcessEvent(type="dropped", stream=name, dropped=dropped, offset=start)
                if data:
                    yield ProcessEvent(type=name, data=data, offset=start)
                at[name] = start + len(data)
            if entry.ended.is_set() and all(at[n] >= b.end for n, b in entry.buffers.items()):
                info = entry.info
                yield ProcessEvent(type="exit", exit_code=info.exit_code, signal=info.signal)
                return
            if not follow:
                return
            await changed.wait()

    async def write(self, sandbox_id: str, pid: int, data: bytes) -> None:
        entry = self._live(sandbox_id, pid)
        if not entry.info.stdin_open:
            raise InvalidRequest(f"process {pid}'s standard input is closed", pid=pid)
        try:
            await entry.io.write(data)
        except OSError as e:
            entry.info.stdin_open = False
            raise InvalidRequest(f"process {pid}'s standard input is closed ({e.strerror})", pid=pid) from None

    async def close_stdin(self, sandbox_id: str, pid: int) -> None:
        entry = self._live(sandbox_id, pid)
        if entry.info.stdin_open:
            await entry.io.close_stdin()
            entry.info.stdin_open = entry.info.pty is not None  # a terminal only got Ctrl-D

    def signal(self, sandbox_id: str, pid: int, signo: int, group: bool) -> None:
        self._live(sandbox_id, pid).io.signal(signo, group)

    async def resize(self, sandbox_id: str, pid: int, size: PtySize) -> None:
        entry = self._live(sandbox_id, pid)
        if entry.info.pty is None:
            raise InvalidRequest(f"process {pid} has no terminal to resize", pid=pid)
        await entry.io.resize(size.cols, size.rows)
        entry.info.pty = size

    async def wait(self, sandbox_id: str, pid: int, timeout: float | None) -> ProcessInfo:
        """Its info once it ended, or when ``timeout`` passed (``running`` tells which)."""
        entry = self.get(sandbox_id, pid)
        if timeout is None or timeout > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(entry.ended.wait()), timeout)
        return entry.snapshot()

    def _live(self, sandbox_id: str, pid: int) -> ProcessEntry:
        entry = self.get(sandbox_id, pid)
        if not entry.info.running:
            raise InvalidRequest(f"process {pid} has ended (exit status {entry.info.exit_code})", pid=pid,
                                 exit_code=entry.info.exit_code)
        return entry

    async def drop(self, sandbox_id: str) -> None:
        """The sandbox is going: release every process record (the processes die with it)."""
        for entry in self._sandboxes.pop(sandbox_id, {}).values():
            await entry.io.aclose()
            if not entry.ended.is_set():
                entry.exited(137, 9)
