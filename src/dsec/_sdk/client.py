"""``dsec.Client``: which daemon to talk to, with which token, over which connections.

The client owns connection settings and one httpx connection pool per event loop (pools cannot cross
loops, and the blocking API runs on the portal's loop while async callers run on theirs). It must never
know about sandboxes beyond sending requests for them; AsyncSandbox builds every request.
"""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import httpx

from dsec.config import Settings
from dsec.models import (
    AuditEntry,
    LifecycleEvent,
    NodeInfo,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
)

from .lean import LeanPool
from .portal import portal
from .transport import Transport

__all__ = ["Client", "default_client"]

_Pools = tuple[asyncio.AbstractEventLoop, httpx.AsyncClient, LeanPool]
"""One event loop's connections: the httpx client, and the lean connections of ``sb.exec``."""


class Client:
    """Connection to one DSec daemon.

    ``url`` is ``unix:///path.sock`` or ``http(s)://host:port`` (default: ``$DSEC_URL``, else the local
    daemon's socket); ``token`` is the bearer token for TCP (default: ``$DSEC_TOKEN``). Usable as
    ``async with`` (closes with :meth:`aclose`) and as ``with`` (closes with :meth:`close`).
    """

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        self.url: str = url or os.environ.get("DSEC_URL") or Settings().default_url
        self.token: str | None = token if token is not None else (os.environ.get("DSEC_TOKEN") or None)
        self._transport = Transport(self.url, self.token)
        self._lock = threading.Lock()
        # id(loop) -> (loop, client, lean pool); keeping the loop lets us notice it closed and drop its pools.
        self._pools: dict[int, _Pools] = {}
        # Cluster mode: one client per node URL the gateway sent us to, closed with this one.
        self._nodes: dict[str, Client] = {}

    def _node(self, url: str) -> Client:
        """The connections to a cluster node (``SandboxInfo.endpoint.url``), shared by every sandbox on it;
        each request carries its sandbox's scoped token, so the pool itself holds no credential."""
        with self._lock:
            client = self._nodes.get(url)
            if client is None:
                client = self._nodes[url] = Client(url, token="")
            return client

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    def _entry(self) -> _Pools:
        loop = asyncio.get_running_loop()
        with self._lock:
            for key, (other, _, _) in list(self._pools.items()):
                if other.is_closed():
                    del self._pools[key]
            entry = self._pools.get(id(loop))
            if entry is None or entry[0] is not loop:
                entry = (loop, self._transport.build(), self._transport.build_lean())
                self._pools[id(loop)] = entry
            return entry

    def _http(self) -> httpx.AsyncClient:
        return self._entry()[1]

    async def _post_json(self, path: str, body: bytes, *, params: dict[str, Any] | None = None,
                         headers: dict[str, str] | None = None, timeout: httpx.Timeout | None = None) -> bytes:
        """POST a serialised JSON body on this loop's lean pool; the answer's body (see Transport.post_json)."""
        return await self._transport.post_json(self._entry()[2], path, body, params=params, headers=headers,
                                               **({"timeout": timeout} if timeout is not None else {}))

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: Any = None,
        timeout: httpx.Timeout | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        return await self._transport.request(
            self._http(), method, path, json_body=json, content=content, params=params, timeout=timeout,
            headers=headers,
        )

    def _stream(
        self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None,
        params: Any = None, content: AsyncIterator[bytes] | None = None,
    ) -> AbstractAsyncContextManager[httpx.Response]:
        return self._transport.stream(self._http(), method, path, json_body=json, headers=headers, params=params,
                                      content=content)

    async def health(self) -> NodeInfo:
        """The daemon's identity, version and which backends work on its host."""
        response = await self._request("GET", "/v1/health")
        return NodeInfo.model_validate(response.json())

    async def statistics(self) -> NodeStatistics:
        """The daemon's warm pools (ready, target, hits, misses) and its create admission queue."""
        response = await self._request("GET", "/v1/statistics")
        return NodeStatistics.model_validate(response.json())

    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Declare a warm pool on the daemon (or change the bounds of the pool of that shape)."""
        response = await self._request("POST", "/v1/pools", json=config.model_dump(mode="json"))
        return PoolStatistics.model_validate(response.json())

    async def overview(self) -> NodeOverview:
        """Counters, node load, failures by reason, image cache, pools and audit-trail size (admin)."""
        response = await self._request("GET", "/v1/overview")
        return NodeOverview.model_validate(response.json())

    async def audit(
        self, *, sandbox_id: str | None = None, who: str | None = None, job: str | None = None,
        outcome: str | None = None, since: float | None = None, until: float | None = None,
        before: int | None = None, limit: int = 100,
    ) -> list[AuditEntry]:
        """Commands of the daemon's audit trail matching every filter given, newest first (admin)."""
        filters = {"sandbox_id": sandbox_id, "who": who, "job": job, "outcome": outcome, "since": since,
                   "until": until, "before": before, "limit": limit}
        response = await self._request("GET", "/v1/audit", params={k: v for k, v in filters.items() if v is not None})
        return [AuditEntry.model_validate(item) for item in response.json()]

    async def sandbox_logs(self, sandbox_id: str, *, limit: int = 100, before: int | None = None) -> list[AuditEntry]:
        """A sandbox's command history with the head of each output, newest first (also once it is gone)."""
        params: dict[str, int] = {"limit": limit} if before is None else {"limit": limit, "before": before}
        path = f"/v1/sandboxes/{urllib.parse.quote(sandbox_id, safe='')}/logs"
        response = await self._request("GET", path, params=params)
        return [AuditEntry.model_validate(item) for item in response.json()]

    async def events(self, since: int | None = None) -> AsyncIterator[LifecycleEvent]:
        """Sandbox lifecycle events as they happen, after replaying those kept after ``since``; endless."""
        path = "/v1/events" if since is None else f"/v1/events?since={int(since)}"
        async with self._stream("GET", path) as response:
            async for line in response.aiter_lines():
                if line:
                    yield LifecycleEvent.model_validate_json(line)

    async def aclose(self) -> None:
        """Close this loop's connections (and forget pools of loops that have closed)."""
        for node in list(self._nodes.values()):
            await node.aclose()
        loop = asyncio.get_running_loop()
        with self._lock:
            mine = self._pools.pop(id(loop), None)
            for key, (other, _, _) in list(self._pools.items()):
                if other.is_closed():
                    del self._pools[key]
        if mine is not None:
            await _close_pools(mine[1], mine[2])

    def close(self) -> None:
        """Close the connections the blocking API opened (they live on the portal's loop)."""
        for node in list(self._nodes.values()):
            node.close()
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for loop, http, lean in pools:
            if loop is portal.current_loop:
                portal.run(_close_pools(http, lean))
            elif not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(_close_pools(http, lean))
            # A pool on a loop running in another thread is that thread's to close (aclose there).

    def _close_soon(self) -> None:
        """Schedule closing every pool without blocking (safe from any thread, even a loop thread)."""
        for node in list(self._nodes.values()):
            node._close_soon()
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for loop, http, lean in pools:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_spawn_close, loop, http, lean)

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


async def _close_pools(http: httpx.AsyncClient, lean: LeanPool) -> None:
    try:
        await http.aclose()
    finally:
        await lean.aclose()


def _spawn_close(loop: asyncio.AbstractEventLoop, http: httpx.AsyncClient, lean: LeanPool) -> None:
    loop.create_task(_close_pools(http, lean))


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

