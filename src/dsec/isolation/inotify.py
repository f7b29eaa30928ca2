"""Watching a sandbox directory from the host with inotify, as create, modify, delete, move and chmod events.

Owns :class:`DirectoryWatch`: one inotify instance per watch, read on the event loop; directories are added
by fds their caller resolved inside the sandbox's root (``/proc/self/fd/N``, never a host path), so a
symlink planted by the sandbox cannot point a watch at a host directory. A recursive watch adds each new
directory as it appears (and reports what was already in it). The two halves of a rename come with the same
cookie, in one read or the next, and become one ``move``; a first half whose second does not follow within
50 ms is a move out of the tree (a second half alone, a ``create``: a move in). Written on ctypes rather than
an inotify package: pairing needs the reads' boundaries, which the packages' one-event-at-a-time interfaces
hide.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import posixpath
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Literal

from dsec.models.surface import FileEvent

__all__ = ["DirectoryWatch"]

_libc = ctypes.CDLL(None, use_errno=True)
_IN_MODIFY, _IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR, _IN_ONLYDIR = 0x4000, 0x8000, 0x40000000, 0x01000000
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF
         | _IN_ONLYDIR)
_HEADER = struct.Struct("iIII")
_NONBLOCK, _CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_PAIR_WITHIN_S = 0.05
"""How long the first half of a rename waits for its second (it may come in the next read)."""
MAX_QUEUED = 10_000
"""Events kept for a slow reader; past it they are dropped and the next event says how many."""

OpenDir = Callable[[str], int]
"""Opens a sandbox directory (absolute sandbox path) and returns an O_PATH fd of it, resolved in its root."""
ListDir = Callable[[str], list[tuple[str, bool]]]
"""``(name, is_dir)`` of a sandbox directory's entries."""


def _kind(mask: int) -> Literal["create", "modify", "delete", "chmod"] | None:
    if mask & _IN_CREATE:
        return "create"
    if mask & _IN_MODIFY:
        return "modify"
    if mask & _IN_DELETE:
        return "delete"
    if mask & _IN_ATTRIB:
        return "chmod"
    return None


class DirectoryWatch:
    """Events below one sandbox directory. ``open_dir`` and ``list_dir`` run in a worker thread (they may act
    as a sandbox user); :meth:`start` raises what they raise for the watched directory itself."""

    def __init__(self, path: str, recursive: bool, open_dir: OpenDir, list_dir: ListDir) -> None:
        self.path = path
        self.recursive = recursive
        self._open_dir = open_dir
        self._list_dir = list_dir
        self._fd = -1
        self._dirs: dict[int, str] = {}
        self._queue: deque[FileEvent] = deque()
        self._dropped = 0
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._moves: dict[int, tuple[str, bool]] = {}
        self._pairing: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = _libc.inotify_init1(_NONBLOCK | _CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)} (fs.inotify.max_user_instances?)")
        try:
            await asyncio.to_thread(self._add, self.path)
            if self.recursive:
                await self._add_tree(self.path, report=False)
        except BaseException:
            self.close()
            raise
        self._loop.add_reader(self._fd, self._ready)

    def _add(self, path: str) -> None:
        fd = self._open_dir(path)
        try:
            wd = _libc.inotify_add_watch(self._fd, f"/proc/self/fd/{fd}".encode(), _MASK)
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), path)
        finally:
            os.close(fd)
        self._dirs[wd] = path

    async def _add_tree(self, path: str, report: bool) -> None:
        """Watch every directory below ``path`` (already watched itself); ``report``: what is found is news."""
        try:
            entries = await asyncio.to_thread(self._list_dir, path)
        except OSError:
            return  # gone again, or not ours to read: its own events say so
        for name, is_dir in entries:
            child = posixpath.join(path, name)
            if report:
                self._push(FileEvent(type="create", path=child, is_dir=is_dir))
            if is_dir:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self._add, child)
                    await self._add_tree(child, report)

    def _ready(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        moves = self._moves
        pos = 0
        while pos + _HEADER.size <= len(data):
            wd, mask, cookie, size = _HEADER.unpack_from(data, pos)
            raw = data[pos + _HEADER.size:pos + _HEADER.size + size].split(b"\0", 1)[0]
            pos += _HEADER.size + size
            self._one(wd, mask, cookie, raw.decode(errors="surrogateescape"), moves)
        if moves and self._pairing is None and self._loop is not None:  # a rename's second half may come next
            self._pairing = self._loop.call_later(_PAIR_WITHIN_S, self._moved_out)

    def _moved_out(self) -> None:
        """First halves of renames whose second never came: moved out of the watched tree."""
        self._pairing = None
        for source, is_dir in self._moves.values():
            self._forget(source)
            self._push(FileEvent(type="move", path=source, is_dir=is_dir))
        self._moves.clear()

    def _one(self, wd: int, mask: int, cookie: int, name: str, moves: dict[int, tuple[str, bool]]) -> None:
        if mask & _IN_Q_OVERFLOW:
            self._dropped += 1
            return
        if mask & _IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        base = self._dirs.get(wd)
        if base is None:
            return
        path, is_dir = posixpath.join(base, name) if name else base, bool(mask & _IN_ISDIR)
        if mask & _IN_DELETE_SELF:
            if base == self.path:
                self._push(FileEvent(type="delete", path=base, is_dir=True))
            return
        if mask & _IN_MOVED_FROM:
            moves[cookie] = (path, is_dir)
            return
        if mask & _IN_MOVED_TO:
            moved = moves.pop(cookie, None)
            if moved is None:
                self._push(FileEvent(type="create", path=path, is_dir=is_dir))
            else:
                self._rename(moved[0], path)
                self._push(FileEvent(type="move", path=moved[0], dest=path, is_dir=is_dir))
            if is_dir and self.recursive and moved is None:
                self._watch_new(path)
            return
        kind = _kind(mask)
        if kind is not None:
            self._push(FileEvent(type=kind, path=path, is_dir=is_dir))
            if kind == "create" and is_dir and self.recursive:
                self._watch_new(path)

    def _watch_new(self, path: str) -> None:
        async def add() -> None:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._add, path)
                await self._add_tree(path, report=True)

        assert self._loop is not None
        self._loop.create_task(add())

    def _rename(self, source: str, dest: str) -> None:
        for wd, path in list(self._dirs.items()):
            if path == source or path.startswith(source + "/"):
                self._dirs[wd] = dest + path[len(source):]

    def _forget(self, source: str) -> None:
        for wd, path in list(self._dirs.items()):
            if path == source or path.startswith(source + "/"):
                _libc.inotify_rm_watch(self._fd, wd)
                del self._dirs[wd]

    def _push(self, event: FileEvent) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self._dropped += 1
            return
        if self._dropped:
            event = event.model_copy(update={"dropped": self._dropped})
            self._dropped = 0
        self._queue.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def events(self) -> AsyncIterator[FileEvent]:
        """The events as they come, until :meth:`close` (or the watched directory's filesystem goes)."""
        while True:
            while self._queue:
                yield self._queue.popleft()
            if self._closed:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pairing is not None:
            self._pairing.cancel()
        if self._fd >= 0:
            if self._loop is not None:
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    self._loop.remove_reader(self._fd)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

