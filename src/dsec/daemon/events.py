"""The node's lifecycle event bus: sandbox created, destroyed, expired, paused, resumed, failed to create.

Owns the event sequence, a bounded history (so a subscriber can resume ``since`` a sequence number) and
the fan-out to subscribers. Publishing is synchronous and never blocks: each subscriber has a bounded
queue, and one that falls behind gets a single ``lagged`` event saying how many it missed instead of
holding the daemon's memory. The engine publishes; ``GET /v1/events`` subscribes. This module never
looks at sandboxes beyond the fields it is handed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from dsec.models import LifecycleEvent, LifecycleKind, SandboxInfo, SandboxSpec

__all__ = ["EventBus"]


class _Subscriber:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[LifecycleEvent] = asyncio.Queue(size)
        self.dropped = 0
        self.gap_from = 0
        """Sequence number of the first event dropped since the last ``lagged`` notice."""


class EventBus:
    """Fan-out of lifecycle events with a bounded history."""

    def __init__(self, node: str, *, history: int = 1000, queue_size: int = 1000) -> None:
        self.node = node
        self.queue_size = queue_size
        self._history: deque[LifecycleEvent] = deque(maxlen=history)
        self._subscribers: set[_Subscriber] = set()
        self._seq = 0

    def publish(self, kind: LifecycleKind, info: SandboxInfo | None = None, *, spec: SandboxSpec | None = None,
                reason: str | None = None, **detail: Any) -> LifecycleEvent:
        """Record and fan out one event about sandbox ``info`` (or one of ``spec`` that has no id yet, such as
        a failed create); never blocks, never raises for a slow subscriber."""
        self._seq += 1
        if info is not None:
            spec = info.spec
        event = LifecycleEvent(
            seq=self._seq, at=time.time(), kind=kind, node=self.node, reason=reason, detail=detail,
            sandbox_id=info.id if info else None, backend=spec.backend if spec else None,
            image=spec.image if spec else None, labels=dict(spec.labels) if spec else {},
        )
        return self._fan_out(event)

    def forward(self, event: LifecycleEvent) -> LifecycleEvent:
        """Record and fan out an event another bus numbered (the gateway merging its nodes' streams): it is
        given this bus's next sequence number in place (the caller decoded it and hands it over: no copy per
        event) and keeps everything else (its node, time, reason)."""
        self._seq += 1
        event.seq = self._seq
        return self._fan_out(event)

    def _fan_out(self, event: LifecycleEvent) -> LifecycleEvent:
        self._history.append(event)
        for sub in self._subscribers:
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                if not sub.dropped:
                    sub.gap_from = event.seq
                sub.dropped += 1
        return event

    def _lagged(self, sub: _Subscriber) -> LifecycleEvent:
        dropped, sub.dropped = sub.dropped, 0
        return LifecycleEvent(seq=sub.gap_from, at=time.time(), kind="lagged", node=self.node,
                              reason="this subscriber read too slowly", detail={"dropped": dropped})

    def recent(self, since: int = 0) -> list[LifecycleEvent]:
        """Events of the history after sequence number ``since``."""
        return [e for e in self._history if e.seq > since]

    async def subscribe(self, since: int | None = None,
                        first: Callable[[], Awaitable[LifecycleEvent]] | None = None) -> AsyncIterator[LifecycleEvent]:
        """Events after ``since`` still in the history (none when ``None``), then every new one, forever;
        ``first``: an event made once subscribed, yielded before all of them (the node's state now)."""
        sub = _Subscriber(self.queue_size)
        self._subscribers.add(sub)  # before replaying: nothing published meanwhile is missed
        try:
            if first is not None:
                yield await first()
            last = 0
            if since is not None:
                for event in self.recent(since):
                    last = event.seq
                    yield event
            while True:
                event = await sub.queue.get()
                if sub.dropped and event.seq > sub.gap_from:
                    yield self._lagged(sub)  # the gap came before this event
                if event.seq > last:
                    yield event
                if sub.dropped and sub.queue.empty():
                    yield self._lagged(sub)  # the gap is everything after what was queued
        finally:
            self._subscribers.discard(sub)

    def statistics(self) -> dict[str, int]:
        """Events published, kept in the history, and subscribers now."""
        return {"published": self._seq, "history": len(self._history), "subscribers": len(self._subscribers)}
