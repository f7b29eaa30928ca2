"""A small HTTP/1.1 client: keep-alive connections on bare asyncio protocols, answers parsed by httptools.

Every unary call of the node API goes here (the SDK's and the gateway's: :mod:`dsec._http.connections`
builds the request bytes). ``sb.exec`` is the call an RL rollout makes thousands of times, and the client
shares the node's CPU with the daemon in every local benchmark: on httpcore, one exec cost the client ~1 ms
of CPU (anyio streams and locks, h11's pure-Python parser, the pool's bookkeeping), as much as the daemon
spent serving it. Here a request is one ``write`` of head and body, and the answer is parsed by httptools
(the C parser uvicorn serves with) in the protocol's ``data_received``: one wake-up of the caller per
answer. Only what unary calls need: a whole request in, a ``Content-Length``, chunked or empty answer read
whole, keep-alive, a connect timeout and an optional read timeout; streamed answers stay on httpx.

Failures are raised as :class:`Http11Error` naming their kind (connect, timeout, lost); the connections
map them to :class:`dsec.ConnectionFailed`. Nothing here retries: a request written to a connection that
then drops may have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from typing import Literal, cast

import httptools

__all__ = ["Http11Error", "Http11Pool"]

Kind = Literal["connect", "timeout", "lost"]


class Http11Error(Exception):
    """A request that got no complete answer: ``kind`` says whether it never connected, ran out of time
    or lost its connection mid-call."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.body: list[bytes] = []
        self.closed = False
        self.idle_since = 0.0

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport, so no isinstance check).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Http11Error("lost", f"the answer is not HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Http11Error("lost", f"the connection closed before a complete answer ({exc or 'EOF'})"))

    # -- httptools callbacks --
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), b"".join(self.body),
                                    self.parser.should_keep_alive()))

    def _fail(self, error: Http11Error) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def exchange(self, request: bytes, body: bytes, read_timeout: float | None) -> tuple[int, bytes, bool]:
        """Write ``request`` (and ``body``, when it came apart) and wait for the whole answer."""
        assert self.transport is not None
        self.body = []
        self.answer = self.loop.create_future()
        self.transport.write(request)
        if body:
            self.transport.write(body)
        if read_timeout is None:
            return await self.answer
        try:
            return await asyncio.wait_for(asyncio.shield(self.answer), read_timeout)
        except TimeoutError:
            self.answer.cancel()  # nobody will read it: the connection closing later must not set an error on it
            raise Http11Error("timeout", f"no answer within {read_timeout:g} s") from None


class Http11Pool:
    """Keep-alive connections to one origin (a unix socket, or a TCP host and port, optionally TLS) for one
    event loop; at most ``max_connections`` requests in flight, the rest wait for a free one."""

    def __init__(self, *, uds: str | None = None, host: str = "", port: int = 0,
                 tls: ssl.SSLContext | None = None, max_connections: int = 100,
                 keepalive_expiry: float = 4.0) -> None:
        self.uds, self.host, self.port, self.tls = uds, host, port, tls
        # Idle connections are dropped a second before uvicorn's 5 s keep-alive timeout closes them from its
        # end, so a request is never written to a connection the daemon is closing.
        self.keepalive_expiry = keepalive_expiry
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()
        self._closed = False

    async def _connect(self, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            if self.uds is not None:
                opening = loop.create_unix_connection(lambda: _Connection(loop), self.uds)
            else:
                opening = loop.create_connection(lambda: _Connection(loop), self.host, self.port, ssl=self.tls)
            _, conn = await asyncio.wait_for(opening, timeout)
        except TimeoutError as exc:  # kept as the cause: the peer did not answer, unlike a local OSError
            raise Http11Error("connect", f"no connection within {timeout:g} s") from exc
        except OSError as exc:
            raise Http11Error("connect", str(exc) or type(exc).__name__) from exc
        return conn

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.close()
        return None

    async def request(self, request: bytes, *, body: bytes = b"", connect_timeout: float | None,
                      read_timeout: float | None) -> tuple[int, bytes]:
        """Send one whole HTTP/1.1 request (``body``: a large body sent after it rather than copied into it); the
        answer's status and body. A caller cancelled mid-call closes the connection, which tells the daemon to
        stop (a cancelled exec kills its command)."""
        if self._closed:
            raise Http11Error("connect", "the client is closed")
        async with self._slots:
            conn = self._reuse() or await self._connect(connect_timeout)
            try:
                status, answer, keep = await conn.exchange(request, body, read_timeout)
            except BaseException:
                conn.close()
                raise
            if keep and not conn.closed and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return status, answer

    def close(self) -> None:
        """Close every idle connection; requests in flight close theirs when they end."""
        self._closed = True
        while self._idle:
            with contextlib.suppress(Exception):
                self._idle.pop().close()

    async def aclose(self) -> None:
        """:meth:`close`, awaitable."""
        self.close()
