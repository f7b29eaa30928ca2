"""The node's state pushed on its event stream: its image cache and whether it stops, as ``node`` events.

Owns :class:`NodeState`: every ``interval`` seconds it reads the image cache as ``health`` reports it and
publishes a ``node`` event (``detail``: ``images``, ``stopping``) when that changed, at once when the daemon
starts to stop, and it gives the current state as the first event of a subscription that asks for it
(``subscribe(node_state=True)``). A cluster gateway following the stream thus knows each node's cache and
drain without polling its ``/v1/health``: the reading is done by each node for itself. Must never publish
an unchanged state (every subscriber is sent each event).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dsec.daemon.events import EventBus
from dsec.models import LifecycleEvent

__all__ = ["NodeState"]

log = logging.getLogger(__name__)


class NodeState:
    """Announces the node's state on ``events`` (see the module docstring)."""

    def __init__(self, events: EventBus, images: Callable[[], Awaitable[dict[str, int]]],
                 stopping: Callable[[], str | None], interval: float = 5.0) -> None:
        self.events = events
        self.images = images
        self.stopping = stopping
        self.interval = interval
        self._last: dict[str, Any] | None = None

    async def current(self) -> LifecycleEvent:
        """The state now, as a ``node`` event numbered like the last one published (it is not kept)."""
        detail = {"images": await self.images(), "stopping": self.stopping()}
        return LifecycleEvent(seq=self.events.statistics()["published"], at=time.time(), kind="node",
                              node=self.events.node, detail=detail)

    async def check(self) -> None:
        """Publish the state if it changed since the last one published."""
        self._publish({"images": await self.images(), "stopping": self.stopping()})

    def stopped(self) -> None:
        """The daemon began to stop: say so now (with the images last read)."""
        images = self._last["images"] if self._last is not None else {}
        self._publish({"images": images, "stopping": self.stopping()})

    def _publish(self, detail: dict[str, Any]) -> None:
        if detail != self._last:
            self._last = detail
            self.events.publish("node", **detail)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:
                log.exception("reading the node's state failed")
