"""Connections to DSec nodes: URL parsing, connection pools per event loop, and the mapping of failures to errors.

One :class:`Connections` serves any number of nodes (the SDK's daemon, the cluster nodes a gateway named,
every node of a gateway): per event loop it keeps one :class:`~dsec._http.http11.Http11Pool` per origin for
unary calls and one httpx client for streamed answers (per unix socket, and one for every TCP origin, or one
per origin when streams are not bounded); one TLS context serves every https origin. Adding a node costs a
dict entry, not a client: no TLS setup, no pool of its own until it is first called.

It owns the wire details (unix socket vs TCP, bearer token, timeouts) and the translation of every failure
into a :class:`dsec.DSecError`: a non-2xx answer becomes the error class the server named, and a transport
failure becomes :class:`dsec.ConnectionFailed`. It must never know about sandboxes or operations, and never
retry anything on its own: a retried ``exec`` could run a command twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from dsec.errors import ConnectionFailed, DSecError, InvalidRequest, error_from_payload

from .http11 import Http11Error, Http11Pool

__all__ = ["CONTROL_TIMEOUT", "STREAM_TIMEOUT", "Connections", "Origin", "RunOn", "parse_url"]

# Creating sandboxes in bulk or moving large files can take minutes on a loaded node; a read that
# stalls longer than this means the daemon is wedged, not busy. A burst of thousands of calls from one
# client queues for the pool's connections (each bounded by its own read timeout): waiting there is
# the client's own backlog, not a failure, so the pool wait is long.
CONTROL_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=600.0)
# Exec output may be silent for as long as the command runs; the server enforces the exec timeout and
# closes the stream, so the client must not race it with a read timeout of its own.
STREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=300.0, pool=600.0)

RunOn = Callable[[asyncio.AbstractEventLoop, Coroutine[Any, Any, None]], bool]
"""Runs a coroutine to completion on a running event loop its caller owns, or says it cannot (False)."""

_UNIX_HOST = "dsec"
_HINT = "is the daemon running? start it with `dsec up`"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JOINED = 64 * 1024
"""A body up to this size goes out in one write with its head; a larger one after it, not copied."""


@dataclass(frozen=True, eq=False)
class Origin:
    """A parsed node URL: where to connect (a unix socket, or a host and port with or without TLS) and the
    ``Host`` and path prefix of its requests. ``key`` names the connections it shares with equal origins."""

    url: str
    uds: str | None
    host: str
    port: int
    tls: bool
    prefix: str
    """The URL's path (no trailing ``/``), put before every request's path."""
    netloc: str = field(init=False)
    """The ``Host`` header's value."""
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if self.uds is not None:
            netloc, key = _UNIX_HOST, f"unix:{self.uds}"
        else:
            host = f"[{self.host}]" if ":" in self.host else self.host
            netloc = host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"
            key = f"{'https' if self.tls else 'http'}://{host}:{self.port}"
        object.__setattr__(self, "netloc", netloc)
        object.__setattr__(self, "key", key)

    @property
    def base_url(self) -> str:
        """The URL httpx is given (``http://dsec`` for a unix socket)."""
        if self.uds is not None:
            return f"http://{_UNIX_HOST}{self.prefix}"
        return f"{'https' if self.tls else 'http'}://{self.netloc}{self.prefix}"


def parse_url(url: str) -> Origin:
    """Accept ``unix:///abs/path.sock`` or ``http(s)://host[:port][/prefix]``; anything else is InvalidRequest."""
    if url.startswith("unix://"):
        path = url[len("unix://"):]
        if not path.startswith("/"):
            raise InvalidRequest(f"a unix socket URL needs an absolute path (unix:///x.sock), got {url!r}")
        return Origin(url=url, uds=path, host=_UNIX_HOST, port=0, tls=False, prefix="")
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.hostname:
        tls = parts.scheme == "https"
        try:
            port = parts.port or (443 if tls else 80)
        except ValueError:
            raise InvalidRequest(f"daemon URL has a bad port: {url!r}") from None
        return Origin(url=url, uds=None, host=parts.hostname, port=port, tls=tls, prefix=parts.path.rstrip("/"))
    raise InvalidRequest(f"daemon URL must be unix:///path.sock or http(s)://host:port, got {url!r}")


@dataclass
class _OnLoop:
    """One event loop's connections (pools cannot cross loops: the blocking SDK runs on the portal's loop
    while async callers run on theirs)."""

    loop: asyncio.AbstractEventLoop
    pools: dict[str, Http11Pool] = field(default_factory=dict)
    streams: dict[str | None, httpx.AsyncClient] = field(default_factory=dict)
    closing: set[asyncio.Task[None]] = field(default_factory=set)
    """Stream clients of forgotten origins being closed."""

    async def aclose(self) -> None:
        await asyncio.gather(*self.closing, return_exceptions=True)
        for client in list(self.streams.values()):
            with contextlib.suppress(Exception):
                await client.aclose()
        for pool in list(self.pools.values()):
            await pool.aclose()
        self.streams.clear()
        self.pools.clear()


class Connections:
    """Keep-alive connections to any number of DSec nodes, for every event loop that uses them.

    ``max_per_origin`` bounds the unary calls in flight to one node (the rest wait for a connection);
    ``stream_limit`` bounds the streamed answers open at once across all nodes (``None``: no bound, for a
    gateway that follows every node's events); ``lean_streams``: streamed answers whose request is sent whole
    go on the lean client (:meth:`lean_stream`) rather than httpx; idle connections are dropped after
    ``keepalive_expiry`` seconds, before the server's own keep-alive timeout (uvicorn: 5 s) closes them under a
    request."""

    def __init__(self, *, max_per_origin: int = 100, keepalive_expiry: float = 4.0,
                 stream_limit: int | None = 100, user_agent: str = "dsec-sdk", lean_streams: bool = False) -> None:
        self.max_per_origin = max_per_origin
        self.lean_streams = lean_streams
        self.keepalive_expiry = keepalive_expiry
        self.stream_limit = stream_limit
        self.user_agent = user_agent
        self._lock = threading.Lock()
        self._loops: dict[int, _OnLoop] = {}
        self._tls: ssl.SSLContext | None = None

    def _here(self) -> _OnLoop:
        loop = asyncio.get_running_loop()
        entry = self._loops.get(id(loop))
        if entry is not None and entry.loop is loop:
            return entry
        with self._lock:
            for key, other in list(self._loops.items()):
                if other.loop.is_closed():  # a finished asyncio.run(): its connections went with it
                    del self._loops[key]
            entry = self._loops[id(loop)] = _OnLoop(loop)
            return entry

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _pool(self, origin: Origin) -> Http11Pool:
        loop = asyncio.get_running_loop()
        entry = self._loops.get(id(loop))
        pools = entry.pools if entry is not None and entry.loop is loop else self._here().pools
        pool = pools.get(origin.key)
        if pool is None:
            if origin.uds is not None:
                pool = Http11Pool(uds=origin.uds, max_connections=self.max_per_origin,
                                  keepalive_expiry=self.keepalive_expiry)
            else:
                pool = Http11Pool(host=origin.host, port=origin.port,
                                  tls=self._tls_context() if origin.tls else None,
                                  max_connections=self.max_per_origin, keepalive_expiry=self.keepalive_expiry)
            pools[origin.key] = pool
        return pool

    def _stream_key(self, origin: Origin) -> str | None:
        # Bounded: one client for every TCP origin, whose pool holds the bound. Unbounded (a gateway following
        # every node's events): one client per origin, since an httpx pool scans all its connections for each
        # request, and one pool holding 2,000 nodes' streams makes opening them quadratic.
        return origin.uds if self.stream_limit is not None else origin.key

    def _stream_client(self, origin: Origin) -> httpx.AsyncClient:
        streams = self._here().streams
        key = self._stream_key(origin)
        client = streams.get(key)
        if client is None:
            limits = httpx.Limits(max_connections=self.stream_limit, max_keepalive_connections=20,
                                  keepalive_expiry=self.keepalive_expiry)
            # A unix socket has no TLS: no context (loading the CA store is most of an httpx client's cost).
            verify: ssl.SSLContext | bool = False if origin.uds is not None else self._tls_context()
            transport = httpx.AsyncHTTPTransport(uds=origin.uds, limits=limits, verify=verify)
            client = streams[key] = httpx.AsyncClient(
                transport=transport, headers={"User-Agent": self.user_agent}, timeout=STREAM_TIMEOUT)
        return client

    def _head(self, origin: Origin, method: str, target: str, body: bytes | None, content_type: str,
              headers: str) -> bytes:
        head = (f"{method} {origin.prefix}{target} HTTP/1.1\r\nHost: {origin.netloc}\r\n"
                f"User-Agent: {self.user_agent}\r\n")
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        elif method in _BODY_METHODS:
            head += "Content-Length: 0\r\n"
        return (head + headers + "\r\n").encode("latin-1")

    async def request(self, origin: Origin, method: str, target: str, body: bytes | None = None, *,
                      content_type: str = "application/json", headers: str = "",
                      timeout: httpx.Timeout = CONTROL_TIMEOUT) -> tuple[int, bytes]:
        """Send one request (``target``: path and query; ``headers``: ready ``Name: value\\r\\n`` lines) on the
        origin's keep-alive connections; the 2xx answer's status and body. Any other answer raises the error it
        carries, a transport failure :class:`ConnectionFailed`."""
        data = self._head(origin, method, target, body, content_type, headers)
        tail = b""
        if body:
            if len(body) <= _JOINED:
                data += body
            else:
                tail = body
        try:
            status, content = await self._pool(origin).request(data, body=tail, connect_timeout=timeout.connect,
                                                               read_timeout=timeout.read)
        except Http11Error as exc:
            raise _failed(origin, exc) from exc
        if not 200 <= status < 300:
            raise _error(status, content)
        return status, content

    @asynccontextmanager
    async def lean_stream(self, origin: Origin, method: str, target: str, body: bytes | None = None, *,
                          content_type: str = "application/json",
                          headers: str = "") -> AsyncIterator[AsyncIterator[bytes]]:
        """Open a streamed answer on the lean client (a connection of its own, no read timeout: the server ends
        it) and give its body's pieces as they come; a non-2xx answer raises the error it carries, a transport
        failure (then or mid-stream) :class:`ConnectionFailed`. Leaving the block closes the connection, which
        tells the server to stop."""
        data = self._head(origin, method, target, body, content_type, headers) + (body or b"")
        try:
            async with self._pool(origin).stream(data, connect_timeout=STREAM_TIMEOUT.connect) as (status, content):
                if not 200 <= status < 300:
                    raise _error(status, await content.read())
                yield _lean_chunks(origin, content)
        except Http11Error as exc:
            raise _failed(origin, exc) from exc

    @asynccontextmanager
    async def stream(self, origin: Origin, method: str, target: str,
                     body: bytes | AsyncIterator[bytes] | None = None, *,
                     headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
        """Open a streamed answer (no read timeout: the server ends it); ``body`` may itself be streamed (an
        upload; ``headers`` name its content type). Leaving the block closes the answer, which tells the server
        to stop (an exec stream's command is killed, a build cancelled)."""
        client = self._stream_client(origin)
        with _mapped(origin):
            async with client.stream(method, origin.base_url + target, content=body, headers=headers) as response:
                if not response.is_success:
                    await response.aread()
                    raise _error(response.status_code, response.content)
                yield response

    def statistics(self) -> dict[str, int]:
        """What is open: event loops with connections, origins with a pool, streaming clients."""
        entries = list(self._loops.values())
        return {"loops": len(entries), "origins": sum(len(e.pools) for e in entries),
                "stream_clients": sum(len(e.streams) for e in entries)}

    def forget(self, origin: Origin) -> None:
        """Close this loop's idle connections to ``origin`` (a node that left or moved)."""
        here = self._here()
        pool = here.pools.pop(origin.key, None)
        if pool is not None:
            pool.close()
        if self.stream_limit is None and (client := here.streams.pop(origin.key, None)) is not None:
            closing = here.loop.create_task(client.aclose())
            here.closing.add(closing)
            closing.add_done_callback(here.closing.discard)

    async def aclose(self) -> None:
        """Close this loop's connections (and forget those of loops that have closed)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            mine = self._loops.pop(id(loop), None)
            for key, other in list(self._loops.items()):
                if other.loop.is_closed():
                    del self._loops[key]
        if mine is not None:
            await mine.aclose()

    def close(self, run_on: RunOn | None = None) -> None:
        """Close the connections of every loop that is not running; ``run_on(loop, coro)`` may run ``coro`` on a
        running loop the caller owns (the SDK's portal) and say whether it did."""
        with self._lock:
            entries = list(self._loops.values())
            self._loops.clear()
        for entry in entries:
            if entry.loop.is_closed():
                continue
            if not entry.loop.is_running():
                entry.loop.run_until_complete(entry.aclose())
                continue
            closing = entry.aclose()
            if run_on is None or not run_on(entry.loop, closing):
                closing.close()
                # Connections on a loop running in another thread are that thread's to close (aclose there).

    def close_soon(self) -> None:
        """Schedule closing every loop's connections without blocking (safe from any thread)."""
        with self._lock:
            entries = list(self._loops.values())
            self._loops.clear()
        for entry in entries:
            if not entry.loop.is_closed():
                entry.loop.call_soon_threadsafe(_spawn, entry)


def _spawn(entry: _OnLoop) -> None:
    entry.loop.create_task(entry.aclose())


async def _lean_chunks(origin: Origin, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A lean streamed body with a connection lost mid-stream raised as :class:`ConnectionFailed`."""
    try:
        async for chunk in content:
            yield chunk
    except Http11Error as exc:
        raise _failed(origin, exc) from exc


def _failed(origin: Origin, exc: Http11Error) -> ConnectionFailed:
    """The :class:`ConnectionFailed` a lean request's transport failure is."""
    if exc.kind == "connect":
        return ConnectionFailed(f"cannot reach the DSec daemon at {origin.url}: {exc}; {_HINT}", sent=False)
    if exc.kind == "timeout":
        return ConnectionFailed(f"the DSec daemon at {origin.url} did not answer in time: {exc}")
    return ConnectionFailed(f"connection to the DSec daemon at {origin.url} was lost mid-call: {exc}")


def _error(status: int, content: bytes) -> DSecError:
    """The error a non-2xx answer carries (the server sends ``{"error": {...}}``)."""
    try:
        payload: Any = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        payload = content.decode(errors="replace")
    return error_from_payload(payload, status)


@contextmanager
def _mapped(origin: Origin) -> Iterator[None]:
    """httpx's transport failures raised inside the block as ConnectionFailed."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise ConnectionFailed(f"cannot reach the DSec daemon at {origin.url}: {exc}; {_HINT}", sent=False) from exc
    except httpx.TimeoutException as exc:
        raise ConnectionFailed(f"the DSec daemon at {origin.url} did not answer in time: {exc!r}") from exc
    except httpx.TransportError as exc:
        # ReadError, RemoteProtocolError...: the daemon died or dropped us mid-call.
        raise ConnectionFailed(f"connection to the DSec daemon at {origin.url} was lost mid-call: {exc!r}") from exc
