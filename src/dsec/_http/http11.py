"""A small HTTP/1.1 client: keep-alive connections on bare asyncio protocols, answers parsed by httptools.

Every unary call of the node API goes here (the SDK's and the gateway's: :mod:`dsec._http.connections`
builds the request bytes). ``sb.exec`` is the call an RL rollout makes thousands of times, and the client
shares the node's CPU with the daemon in every local benchmark: on httpcore, one exec cost the client ~1 ms
of CPU (anyio streams and locks, h11's pure-Python parser, the pool's bookkeeping), as much as the daemon
spent serving it. Here a request is one ``write`` of head and body, and the answer is parsed by httptools
(the C parser uvicorn serves with) in the protocol's ``data_received``: one wake-up of the caller per
answer. A whole request in, a ``Content-Length``, chunked or empty answer read whole, keep-alive, a connect
timeout and an optional read timeout; and a streamed answer (:meth:`Http11Pool.stream`: the gateway follows
every node's event stream this way) read chunk by chunk on a connection of its own, with no read timeout and
reading paused while its reader lags. Streamed uploads stay on httpx.

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal, cast

import httptools

__all__ = ["Http11Error", "Http11Pool"]

Kind = Literal["connect", "timeout", "lost"]

_PAUSE_AT = 256 * 1024
"""A streamed answer's unread bytes at which the connection stops reading (the peer then waits on TCP)."""


class Http11Error(Exception):
    """A request that got no complete answer: ``kind`` says whether it never connected, ran out of time
    or lost its connection mid-call."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


_FRESH_TRIES = 3
"""Connections a request tries when each is found closed by the server before the request was written."""


class _Unsent(Exception):
    """The connection was closed by the server before the request was written on it: nothing was sent."""


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
        self.chunks: asyncio.Queue[bytes | Http11Error | None] | None = None
        """A streamed answer's body as it comes (None: its end); None when the answer is read whole."""
        self.head: asyncio.Future[int] | None = None
        """A streamed answer's status, once its head is read."""
        self.queued = 0
        self.paused = False
        self.ended = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport, so no isinstance check).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Http11Error("lost", f"the answer is not HTTP/1.1: {exc}"))

    def eof_received(self) -> bool | None:
        # The transport closes once this returns; connection_lost comes a loop iteration later, and a request
        # taking this connection in between would be written to a closed transport.
        self.closed = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Http11Error("lost", f"the connection closed before a complete answer ({exc or 'EOF'})"))

    # -- httptools callbacks --
    def on_headers_complete(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.chunks is None:
            self.body.append(body)
            return
        self.chunks.put_nowait(body)
        self.queued += len(body)
        if self.queued >= _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.chunks is not None:
            self.ended = True
            self.chunks.put_nowait(None)
        elif self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), b"".join(self.body),
                                    self.parser.should_keep_alive()))

    def _fail(self, error: Http11Error) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        if self.chunks is not None and not self.ended:
            self.ended = True
            self.chunks.put_nowait(error)
        self.close()

    async def chunk(self) -> bytes | None:
        """The streamed answer's next piece of body; None once it ended (a lost connection raises)."""
        assert self.chunks is not None
        item = await self.chunks.get()
        if isinstance(item, Http11Error):
            self.chunks.put_nowait(item)  # every later read fails the same way
            raise item
        if item is None:
            self.chunks.put_nowait(None)
            return None
        self.queued -= len(item)
        if self.paused and self.queued < _PAUSE_AT // 2 and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return item

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def exchange(self, request: bytes, body: bytes, read_timeout: float | None) -> tuple[int, bytes, bool]:
        """Write ``request`` (and ``body``, when it came apart) and wait for the whole answer."""
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            raise _Unsent
        self.body = []
        self.answer = self.loop.create_future()
        self.transport.write(request)
        if body:
            self.transport.write(body)
        if read_timeout is None:
            return await self.answer
        # A timer on the loop rather than wait_for: no task and no shield per call.
        timer = self.loop.call_later(read_timeout, self._time_out, self.answer, read_timeout)
        try:
            return await self.answer
        finally:
            timer.cancel()

    @staticmethod
    def _time_out(answer: asyncio.Future[tuple[int, bytes, bool]], after: float) -> None:
        if not answer.done():
            answer.set_exception(Http11Error("timeout", f"no answer within {after:g} s"))


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
        """Idle connections, the longest idle first."""
        self._sweep: asyncio.TimerHandle | None = None
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

    def _park(self, conn: _Connection) -> None:
        """Keep ``conn`` for the next request; a timer closes it once idle too long even if no request comes
        (a gateway holds a pool per node: a burst to one node would otherwise leave its connections open for
        good, and across thousands of nodes run the node daemons out of file descriptors)."""
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_expiry, self._close_expired)

    def _close_expired(self) -> None:
        self._sweep = None
        now = time.monotonic()
        while self._idle and (self._idle[0].closed or now - self._idle[0].idle_since >= self.keepalive_expiry):
            self._idle.popleft().close()
        if self._idle:
            wait = self._idle[0].idle_since + self.keepalive_expiry - now
            self._sweep = asyncio.get_running_loop().call_later(max(wait, 0.05), self._close_expired)

    async def request(self, request: bytes, *, body: bytes = b"", connect_timeout: float | None,
                      read_timeout: float | None) -> tuple[int, bytes]:
        """Send one whole HTTP/1.1 request (``body``: a large body sent after it rather than copied into it); the
        answer's status and body. A caller cancelled mid-call closes the connection, which tells the daemon to
        stop (a cancelled exec kills its command)."""
        if self._closed:
            raise Http11Error("connect", "the client is closed")
        async with self._slots:
            for _ in range(_FRESH_TRIES):
                conn = self._reuse() or await self._connect(connect_timeout)
                try:
                    status, answer, keep = await conn.exchange(request, body, read_timeout)
                    break
                except _Unsent:  # closed by the peer before anything was written: safe on another connection
                    conn.close()
                except BaseException:
                    conn.close()
                    raise
            else:
                raise Http11Error("lost", f"the server closed {_FRESH_TRIES} connections in a row before a request "
                                          "was written on them")
            if keep and not conn.closed and not self._closed:
                self._park(conn)
            else:
                conn.close()
            return status, answer

    @asynccontextmanager
    async def stream(self, request: bytes, *, connect_timeout: float | None) -> AsyncIterator[tuple[int, _Body]]:
        """Send one whole HTTP/1.1 request on a connection of its own (not counted among the unary calls') and
        give its answer's status and body as it comes, with no read timeout: the server ends the answer.
        Leaving the block closes the connection, which tells the server to stop."""
        if self._closed:
            raise Http11Error("connect", "the client is closed")
        conn = await self._connect(connect_timeout)
        assert conn.transport is not None
        conn.chunks, conn.head = asyncio.Queue(), conn.loop.create_future()
        try:
            conn.transport.write(request)
            status = await conn.head
            yield status, _Body(conn)
        finally:
            conn.close()

    def close(self) -> None:
        """Close every idle connection; requests in flight close theirs when they end."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self._idle:
            with contextlib.suppress(Exception):
                self._idle.pop().close()

    async def aclose(self) -> None:
        """:meth:`close`, awaitable."""
        self.close()


class _Body:
    """A streamed answer's body, piece by piece as it comes (``async for``), or whole (:meth:`read`)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._conn.chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])
