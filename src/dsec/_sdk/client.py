"""``dsec.Client``: which daemon to talk to, with which token, over which connections.

The client owns connection settings and the connections themselves (per event loop: the blocking API runs
on the portal's loop while async callers run on theirs); ``Client.api`` is the node API over them
(:class:`dsec.api.NodeClient`), which every SDK call goes through. It must never know about sandboxes
beyond the node-wide calls it offers itself; AsyncSandbox builds every sandbox call.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from types import TracebackType
from typing import Any, cast

from dsec._http.connections import Connections
from dsec.api.client import FailoverClient, NodeClient
from dsec.api.operations import close_stream
from dsec.config import Settings
from dsec.models import (
    AuditEntry,
    AuditOutcome,
    LifecycleEvent,
    NodeInfo,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
)

from .portal import portal

__all__ = ["Client", "default_client"]


class Client:
    """Connection to one DSec daemon.

    ``url`` is ``unix:///path.sock`` or ``http(s)://host:port`` (default: ``$DSEC_URL``, else the local
    daemon's socket), or several addresses of a cluster's gateway replicas, comma-separated or as a list: a
    call goes to another when the one in use cannot be reached (:class:`dsec.api.client.FailoverClient`: a
    call a replica received is never sent twice). ``token`` is the bearer token for TCP (default:
    ``$DSEC_TOKEN``). Usable as ``async with`` (closes with :meth:`aclose`) and as ``with`` (closes with
    :meth:`close`). ``client.api`` is every operation of the daemon's API, typed and async
    (:class:`dsec.api.NodeClient`, over this client's connections; see the node API page).
    """

    def __init__(self, url: str | Sequence[str] | None = None, token: str | None = None) -> None:
        given = url if isinstance(url, str) or url is None else ",".join(url)
        self.url: str = given or os.environ.get("DSEC_URL") or Settings().default_url
        self.token: str | None = token if token is not None else (os.environ.get("DSEC_TOKEN") or None)
        self._connections = Connections()
        urls = [u.strip() for u in self.url.split(",") if u.strip()]
        if len(urls) > 1:
            self.api: NodeClient = FailoverClient(urls, self.token, connections=self._connections)
        else:
            self.api = NodeClient(self.url.strip().rstrip(","), self.token, connections=self._connections)
        """Every operation of the daemon's API (:class:`dsec.api.NodeAPI`), typed, over this client's
        connections; a cluster node's is ``client.api.at(url, token)``."""

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    async def health(self) -> NodeInfo:
        """The daemon's identity, version and which backends work on its host."""
        return await self.api.health()

    async def statistics(self) -> NodeStatistics:
        """The daemon's warm pools (ready, target, hits, misses) and its create admission queue."""
        return await self.api.statistics()

    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Declare a warm pool on the daemon (or change the bounds of the pool of that shape)."""
        return await self.api.declare_pool(config)

    async def overview(self) -> NodeOverview:
        """Counters, node load, failures by reason, image cache, pools and audit-trail size (admin)."""
        return await self.api.overview()

    async def audit(
        self, *, sandbox_id: str | None = None, who: str | None = None, job: str | None = None,
        outcome: str | None = None, since: float | None = None, until: float | None = None,
        before: int | None = None, limit: int = 100,
    ) -> list[AuditEntry]:
        """Commands of the daemon's audit trail matching every filter given, newest first (admin)."""
        return await self.api.audit_log(sandbox_id=sandbox_id, who=who, job=job,
                                        outcome=cast("AuditOutcome | None", outcome), since=since, until=until,
                                        before=before, limit=limit)

    async def sandbox_logs(self, sandbox_id: str, *, limit: int = 100, before: int | None = None) -> list[AuditEntry]:
        """A sandbox's command history with the head of each output, newest first (also once it is gone)."""
        return await self.api.sandbox_logs(sandbox_id, limit, before)

    async def events(self, since: int | None = None) -> AsyncIterator[LifecycleEvent]:
        """Sandbox lifecycle events as they happen, after replaying those kept after ``since``; endless."""
        events = self.api.subscribe(since)
        try:
            async for event in events:
                yield event
        finally:
            await close_stream(events)

    async def aclose(self) -> None:
        """Close this loop's connections (and forget those of loops that have closed)."""
        await self._connections.aclose()

    def close(self) -> None:
        """Close the connections the blocking API opened (they live on the portal's loop)."""
        self._connections.close(_on_portal)

    def _close_soon(self) -> None:
        """Schedule closing every connection without blocking (safe from any thread, even a loop thread)."""
        self._connections.close_soon()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _on_portal(loop: asyncio.AbstractEventLoop, closing: Coroutine[Any, Any, None]) -> bool:
    """Run ``closing`` on the portal's loop when ``loop`` is it (the blocking API's connections live there)."""
    if loop is not portal.current_loop:
        return False
    portal.run(closing)
    return True


_default: Client | None = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client used when none is passed; rebuilt when ``DSEC_URL``/``DSEC_TOKEN`` change."""
    global _default
    url = os.environ.get("DSEC_URL") or Settings().default_url
    token = os.environ.get("DSEC_TOKEN") or None
    with _default_lock:
        if _default is None or _default.url != url or _default.token != token:
            if _default is not None:
                _default._close_soon()
            _default = Client(url, token)
        return _default
