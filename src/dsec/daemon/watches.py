"""File watches as resources of a sandbox: started once, read by any client, polled or followed.

Owns, per sandbox, each watch a client started: the backend's event iterator, drained by a task into a
bounded list of numbered events (a reader asks from a number; events older than the list are counted as
dropped), and its end. A watch nobody read for :data:`IDLE_S` is stopped, so an abandoned one does not
hold an inotify instance for the sandbox's lifetime. Backends watch; this module keeps what they saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsec.errors import ProcessNotFound, QuotaExceeded
from dsec.models.surface import FileEvent, WatchInfo

__all__ = ["IDLE_S", "MAX_EVENTS", "MAX_WATCHES", "WatchTable"]

MAX_EVENTS = 10_000
"""Events kept per watch for readers."""
MAX_WATCHES = 64
"""Watches one sandbox may have at once."""
IDLE_S = 600.0
"""A watch no client has read for this long is stopped."""


@dataclass
class _Watch:
    info: WatchInfo
    events: AsyncIterator[FileEvent]
    kept: deque[tuple[int, FileEvent]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    count: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    read_at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None

    async def drain(self) -> None:
        try:
            async for event in self.events:
                self.kept.append((self.count, event))
                self.count += 1
                self._changed()
        finally:
            self.done = True
            self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class WatchTable:
    """Every sandbox's watches."""

    def __init__(self) -> None:
        self._sandboxes: dict[str, dict[str, _Watch]] = {}

    def add(self, sandbox_id: str, path: str, recursive: bool, events: AsyncIterator[FileEvent]) -> WatchInfo:
        """Keep a watch the backend has started (its iterator is drained from now on)."""
        table = self._sandboxes.setdefault(sandbox_id, {})
        self._expire(table)
        if len(table) >= MAX_WATCHES:
            raise QuotaExceeded(f"sandbox {sandbox_id} has {len(table)} file watches (at most {MAX_WATCHES}): "
                                "stop one first", sandbox=sandbox_id)
        info = WatchInfo(id="w-" + secrets.token_hex(6), path=path, recursive=recursive)
        watch = _Watch(info=info, events=events)
        watch.task = asyncio.get_running_loop().create_task(watch.drain(), name=f"dsec-watch-{info.id}")
        table[info.id] = watch
        return info

    def _expire(self, table: dict[str, _Watch]) -> None:
        now = time.monotonic()
        for watch_id, watch in list(table.items()):
            if now - watch.read_at > IDLE_S:
                self._stop(table.pop(watch_id))

    def _get(self, sandbox_id: str, watch_id: str) -> _Watch:
        watch = self._sandboxes.get(sandbox_id, {}).get(watch_id)
        if watch is None:
            raise ProcessNotFound(f"sandbox {sandbox_id} has no file watch {watch_id}", watch=watch_id)
        watch.read_at = time.monotonic()
        return watch

    def list(self, sandbox_id: str) -> list[WatchInfo]:
        return [w.info for w in self._sandboxes.get(sandbox_id, {}).values()]

    def events(self, sandbox_id: str, watch_id: str, since: int = 0, follow: bool = True
               ) -> AsyncIterator[tuple[int, FileEvent]]:
        """``(number, event)`` from event number ``since`` on; with ``follow`` as they come, until the watch is
        stopped. Events no longer kept are reported in the ``dropped`` of the first one given. An unknown watch
        is refused here, before a stream of its events begins."""
        return self._events(self._get(sandbox_id, watch_id), since, follow)

    async def _events(self, watch: _Watch, since: int, follow: bool) -> AsyncIterator[tuple[int, FileEvent]]:
        at = since
        while True:
            changed = watch.changed
            for number, event in list(watch.kept):
                if number < at:
                    continue
                if number > at:
                    event = event.model_copy(update={"dropped": event.dropped + number - at})
                yield number, event
                at = number + 1
            watch.read_at = time.monotonic()
            if watch.done or not follow:
                return
            await changed.wait()

    def remove(self, sandbox_id: str, watch_id: str) -> None:
        table = self._sandboxes.get(sandbox_id, {})
        self._get(sandbox_id, watch_id)
        self._stop(table.pop(watch_id))

    @staticmethod
    def _stop(watch: _Watch) -> None:
        if watch.task is not None:
            watch.task.cancel()

    async def drop(self, sandbox_id: str) -> None:
        """The sandbox is going: stop every watch of it."""
        watches = list(self._sandboxes.pop(sandbox_id, {}).values())
        for watch in watches:
            self._stop(watch)
        for watch in watches:
            if watch.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watch.task
