"""One epoll instance for the pipes of every running command, itself a single reader of the event loop.

An exec reads three pipes (the command's stdout and stderr, and the status pipe its helper or zygote reports
on). Registering each with the event loop and removing it again cost uvloop ~8 syscalls a pipe (a probe
``EPOLL_CTL_ADD``/``DEL`` pair, two ``FIONBIO``, three ``DEL`` on removal, a handle to close), a third of the
daemon's syscalls per exec of ``true``; here a pipe costs one ``epoll_ctl`` to add and one to remove, and one
wake-up of the loop serves every pipe ready at that moment.

Owns the epoll instance of each event loop and the callback of each pipe registered on it. Must never read,
write or close a pipe: the callers do, and remove a pipe before closing it (epoll keys registrations by the
open file, so a pipe closed while still registered could leave its number reporting for the file after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import weakref
from collections.abc import Callable

__all__ = ["PipeWatch", "pipe_watch"]

_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PipeWatch] = weakref.WeakKeyDictionary()
"""Each loop's watch. A watch holds its loop weakly: the entry (a strong value) must not keep its key alive, or
every loop that ever ran a command would stay, with its watch's epoll fd."""


class PipeWatch:
    """Level-triggered readiness of many fds through one reader of ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self._epoll.fileno(), self._dispatch)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever ``fd`` is readable (or hung up), until :meth:`remove`."""
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:
            self._epoll.modify(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def replace(self, fd: int, callback: Callable[[], None]) -> None:
        """Give ``fd``, registered here, another callback (no syscall: the pipe changes hands, not its watch)."""
        if fd not in self._callbacks:
            self.add(fd, callback)
            return
        self._callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed); nothing if it was not watched."""
        if self._callbacks.pop(fd, None) is None:
            return
        with contextlib.suppress(OSError):  # ENOENT/EBADF: closed already, which removed it from the set
            self._epoll.unregister(fd)

    def _dispatch(self) -> None:
        try:
            ready = self._epoll.poll(0)
        except InterruptedError:
            return
        for fd, _ in ready:
            callback = self._callbacks.get(fd)
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:  # one pipe's failure must not starve the others of their events
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler({"message": "pipe callback failed", "exception": exc})

    def close(self) -> None:
        loop = self._loop()
        with contextlib.suppress(OSError, RuntimeError, ValueError):  # (ValueError: the epoll is closed already)
            if loop is not None:
                loop.remove_reader(self._epoll.fileno())
        self._callbacks.clear()
        with contextlib.suppress(OSError):
            self._epoll.close()


def pipe_watch(loop: asyncio.AbstractEventLoop | None = None) -> PipeWatch:
    """The running (or given) loop's :class:`PipeWatch`, made on first use and dropped with the loop (its epoll
    closed as the loop is collected, even if something still holds the watch)."""
    loop = loop or asyncio.get_running_loop()
    found = _watches.get(loop)
    if found is None or found._epoll.closed:
        found = _watches[loop] = PipeWatch(loop)
        weakref.finalize(loop, found.close)
    return found

