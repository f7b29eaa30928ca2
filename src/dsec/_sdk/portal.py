"""The portal: one background event-loop thread that runs the async SDK for blocking callers.

It owns that thread and loop, nothing else. It must never hold SDK state of its own: the sync API is the
async API driven through here. The thread is a daemon (a forgotten sandbox never blocks interpreter exit),
started lazily on first use, and restarted in a forked child, where the parent's thread does not exist.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["Portal", "portal"]

T = TypeVar("T")


class Portal:
    """Run coroutines and async iterators from plain threads on one shared event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The portal's loop, started on first use (and again after a fork)."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._start()
            assert self._loop is not None
            return self._loop

    @property
    def current_loop(self) -> asyncio.AbstractEventLoop | None:
        """The portal's loop if it is running in this process, without starting one."""
        return self._loop if self._pid == os.getpid() else None

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=main, name="dsec-portal", daemon=True)
        thread.start()
        ready.wait()
        self._loop, self._thread, self._pid = loop, thread, os.getpid()

    def in_portal(self) -> bool:
        """True when called from the portal thread itself (where blocking would deadlock)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the portal loop and block until it finishes; Ctrl-C cancels it."""
        if self.in_portal():
            coro.close()
            raise RuntimeError(
                "the blocking DSec API was called from inside its own event loop; use AsyncSandbox"
            )
        loop = self.loop
        done = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:
            task = loop.create_task(coro)
            task.add_done_callback(lambda _task: done.set())
            tasks.append(task)

        loop.call_soon_threadsafe(start)
        try:
            done.wait()
        except BaseException:
            # Ctrl-C in the caller must not leave the call running on the portal: cancel it and wait
            # (briefly) until it has unwound, so that cleanup such as closing a stream can follow.
            loop.call_soon_threadsafe(lambda: tasks[0].cancel() if tasks else coro.close())
            done.wait(5.0)
            raise
        return tasks[0].result()

    def iterate(self, aiter: AsyncIterator[T]) -> Iterator[T]:
        """Drive an async iterator from a plain thread; closing the sync generator closes it too."""

        async def step() -> tuple[bool, T | None]:
            try:
                return True, await aiter.__anext__()
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.run(step())
                if not more:
                    return
                yield item  # type: ignore[misc]  # item is a T whenever more is True
        finally:
            aclose = getattr(aiter, "aclose", None)
            if aclose is not None:
                if self.in_portal():
                    # Garbage-collected on the portal thread: cannot block here, so schedule it.
                    self.loop.create_task(aclose())
                else:
                    self.run(aclose())


portal = Portal()


def _after_fork() -> None:
    # The child has no portal thread; forget the parent's loop (its selector fd is shared, never close it).
    portal._loop = None
    portal._thread = None
    portal._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
