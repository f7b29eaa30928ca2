"""``NodeClient``: the node API over HTTP, for one node among any number that share connections.

Every operation of :class:`~dsec.api.protocol.NodeAPI` is sent as its declaration says (``NodeClient``
inherits them: each is bound to :meth:`NodeClient.perform`, or :meth:`NodeClient.perform_stream` for a
streamed answer). Unary calls go on the keep-alive HTTP/1.1 connections of :mod:`dsec._http`, streams on
httpx; many clients (one per node, or per sandbox-scoped token) share one :class:`Connections`, so a new
node costs no pool, TLS context or client of its own. Owns the mapping of a call to a request and of an
answer to a value; must never retry (a retried exec could run a command twice) nor know about sandboxes
beyond what the operations say.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import IO, Any, TypeVar

import httpx

from dsec._http.connections import CONTROL_TIMEOUT, STREAM_TIMEOUT, Connections, Origin, parse_url
from dsec.errors import ConnectionFailed, DaemonStopping, DSecError

from .operations import Operation
from .protocol import NodeAPI

__all__ = ["FailoverClient", "NodeClient", "call_blocking", "serves"]

T = TypeVar("T")


class NodeClient(NodeAPI):
    """The node API of the daemon (or gateway) at ``url`` (``unix:///path.sock`` or ``http(s)://host:port``),
    with bearer ``token`` on every request, over ``connections`` (its own when none is given; those it made
    are closed by :meth:`aclose`). ``timeout``: every call's, instead of each operation's default (a read
    timeout of 300 s, none for the calls that may wait: create, exec, streams)."""

    def __init__(self, url: str, token: str | None = None, *, connections: Connections | None = None,
                 timeout: httpx.Timeout | None = None) -> None:
        self.origin: Origin = parse_url(url)
        self.token = token
        self.connections = connections if connections is not None else Connections()
        self._owns = connections is None
        self._timeout = timeout
        self._header = f"Authorization: Bearer {token}\r\n" if token else ""
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._last_view: tuple[dict[str, str], NodeClient] | None = None

    @property
    def url(self) -> str:
        return self.origin.url

    def __repr__(self) -> str:
        return f"NodeClient({self.origin.url!r})"

    def at(self, url: str, token: str | None = None) -> NodeClient:
        """The node at ``url``, over the same connections (a cluster node the gateway named, with the token it
        gave)."""
        return NodeClient(url, token, connections=self.connections, timeout=self._timeout)

    def _view(self) -> NodeClient:
        """A client of this origin on the same connections (it never closes them), made without parsing the
        URL again."""
        view = object.__new__(NodeClient)
        view.origin, view.token, view.connections, view._owns = self.origin, self.token, self.connections, False
        view._timeout, view._header, view._headers, view._last_view = self._timeout, self._header, self._headers, None
        return view

    def with_timeout(self, timeout: httpx.Timeout) -> NodeClient:
        """This node with ``timeout`` on every call (a health probe that must answer quickly)."""
        view = self._view()
        view._timeout = timeout
        return view

    def with_headers(self, headers: dict[str, str] | None) -> NodeClient:
        """This node with ``headers`` on every call too (a gateway replica's fence); itself when None. The
        same headers as the last call's give the same view (a gateway's every create on a node carries its
        cell's fence)."""
        if not headers:
            return self
        last = self._last_view
        if last is not None and last[0] == headers:
            return last[1]
        view = self._view()
        view._header = self._header + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        view._headers = {**(self._headers or {}), **headers}
        self._last_view = (dict(headers), view)
        return view

    def _lines(self, extra: dict[str, str] | None) -> str:
        """The ``Name: value\\r\\n`` header lines of a call: the token's, then the operation's ``extra``."""
        return self._header if extra is None else self._header + "".join(f"{k}: {v}\r\n" for k, v in extra.items())

    async def perform(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> Any:
        """Send one unary operation and decode its answer."""
        plan = op.plan
        target, body, content_type, extra = plan.encode(args, kwargs)
        timeout = self._timeout or (STREAM_TIMEOUT if op.no_read_timeout else CONTROL_TIMEOUT)
        headers = self._lines(extra)
        if body is not None and not isinstance(body, bytes):  # an upload on a unary call: sent whole
            body = await asyncio.to_thread(body.read)
        _, content = await self.connections.request(self.origin, op.method, target, body, content_type=content_type,
                                                    headers=headers, timeout=timeout)
        return plan.decode(content)

    async def perform_stream(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Send an operation whose answer is an NDJSON stream and yield its items; leaving early closes the
        stream (the server stops: an exec's command is killed)."""
        plan = op.plan
        target, body, content_type, extra = plan.encode(args, kwargs)
        if self.connections.lean_streams and (body is None or isinstance(body, bytes)):
            async with self.connections.lean_stream(self.origin, op.method, target, body, content_type=content_type,
                                                    headers=self._lines(extra)) as chunks:
                async for item in _items(plan, chunks):
                    yield item
            return
        headers = {**(self._headers or {}), **(extra or {})}
        if body is not None:
            headers["Content-Type"] = content_type
        content = body if body is None or isinstance(body, bytes) else _chunks(body)
        async with self.connections.stream(self.origin, op.method, target, content, headers=headers) as response:
            async for item in _items(plan, response.aiter_bytes()):
                yield item

    async def aclose(self) -> None:
        """Close this loop's connections, if this client made them."""
        if self._owns:
            await self.connections.aclose()

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class FailoverClient(NodeClient):
    """The node API of a gateway tier of several replicas at ``urls`` (any of which answers for the whole
    cluster): each call goes to the replica that answered last; when that one cannot be reached (nothing was
    sent: its address refuses or does not answer the connect) or is stopping and kept nothing of the call, the
    call goes to the next, each at most once. A call a replica received is never sent again (it may have
    acted), and neither are uploads and streams (they fail as on one address)."""

    def __init__(self, urls: Sequence[str], token: str | None = None, *, connections: Connections | None = None,
                 timeout: httpx.Timeout | None = None) -> None:
        if not urls:
            raise ValueError("FailoverClient needs at least one address")
        super().__init__(urls[0], token, connections=connections, timeout=timeout)
        self.replicas = [NodeClient(url, token, connections=self.connections, timeout=timeout) for url in urls]
        self._current = 0

    def __repr__(self) -> str:
        return f"FailoverClient({[r.url for r in self.replicas]!r})"

    @property
    def url(self) -> str:
        """The replica calls go to now."""
        return self.replicas[self._current].url

    async def perform(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> Any:
        if op.plan.body is not None and op.plan.body.where == "upload":
            return await self.replicas[self._current].perform(op, *args, **kwargs)
        first = self._current
        for attempt in range(len(self.replicas)):
            i = (first + attempt) % len(self.replicas)
            try:
                answer = await self.replicas[i].perform(op, *args, **kwargs)
            except ConnectionFailed as exc:
                if attempt == len(self.replicas) - 1 or not _not_acted(exc):
                    raise
                continue
            self._current = i
            return answer
        raise AssertionError("unreachable: the last attempt returns or raises")

    def perform_stream(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        return self.replicas[self._current].perform_stream(op, *args, **kwargs)


def _not_acted(exc: ConnectionFailed) -> bool:
    """Whether the replica that raised ``exc`` did nothing with the call (safe to send it to another)."""
    return exc.detail.get("sent") is False or (isinstance(exc, DaemonStopping) and exc.detail.get("kept") == 0)


async def _items(plan: Any, chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The items of an NDJSON answer, decoded by ``plan`` as its lines complete."""
    pending = b""
    async for chunk in chunks:
        # Split by hand on bytes: httpx's text line iterator costs a visible share of a short exec.
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield plan.decode_item(line)
    if pending.strip():
        yield plan.decode_item(pending)


async def _chunks(upload: IO[bytes], size: int = 1024 * 1024) -> AsyncIterator[bytes]:
    """A file's bytes as a streamed request body, read in a worker thread."""
    while chunk := await asyncio.to_thread(upload.read, size):
        yield chunk


def call_blocking(url: str, token: str | None, call: Callable[[NodeClient], Awaitable[T]], *,
                  timeout: float = 60.0) -> T:
    """``call`` on the node at ``url`` from blocking code (a harness, a CLI, a Ray actor's method), on a client
    of its own, closed after; in a worker thread when the caller's thread already runs an event loop."""

    async def run() -> T:
        async with NodeClient(url, token, timeout=httpx.Timeout(timeout)) as api:
            return await call(api)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with ThreadPoolExecutor(1, thread_name_prefix="dsec-node-call") as worker:
        return worker.submit(asyncio.run, run()).result()


def serves(url: str, timeout: float = 2.0) -> bool:
    """Whether the node (or gateway) at ``url`` answers ``health`` within ``timeout`` seconds."""
    try:
        call_blocking(url, None, lambda api: api.health(), timeout=timeout)
    except (DSecError, OSError):
        return False
    return True
