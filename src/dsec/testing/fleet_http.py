"""The fleet simulator's HTTP/1.1 server: one asyncio protocol per connection, requests parsed by httptools.

Owns the wire side of :mod:`dsec.testing.fleet`: it parses a request (method, path, query, headers, body),
hands it to a handler and writes the answer, a whole body or a chunked stream (the node's
``/v1/events``). It is deliberately small and cheap, so that one process can stand in for thousands of
node daemons and its CPU stays a small share of a benchmark. It must never know what a sandbox is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import parse_qsl

import httptools

__all__ = ["Answer", "HttpConnection", "Request", "Stream", "close_all", "serve_http"]

_REASONS = {200: "OK", 201: "Created", 204: "No Content", 304: "Not Modified", 400: "Bad Request", 401: "Unauthorized",
            404: "Not Found", 408: "Request Timeout", 409: "Conflict", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Request:
    """One parsed request."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[bytes, bytes]
    body: bytes


@dataclass
class Answer:
    """A whole answer: status and JSON body (``None``: no body, as for 204)."""

    status: int
    body: bytes | None = None
    delay: float = 0.0
    """Seconds to wait before writing it (the simulated node is slow)."""
    etag: str | None = None
    """An ``ETag`` header (the membership document's version)."""


@dataclass
class Stream:
    """A chunked NDJSON answer that stays open: lines already due, then whatever ``queue`` yields."""

    first: list[bytes]
    queue: asyncio.Queue[bytes]
    closed: Callable[[], None] = field(default=lambda: None)
    """Called once the client went away (the handler drops its subscriber)."""


Handler = Callable[[Request, "HttpConnection"], "Answer | Stream | Awaitable[Answer]"]


class HttpConnection(asyncio.Protocol):
    """One client connection; keep-alive; at most one request in flight on it (no pipelining)."""

    def __init__(self, handler: Handler, group: set[HttpConnection]) -> None:
        self.handler = handler
        self.group = group
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._stream_task: asyncio.Task[None] | None = None

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.group.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort()
        except httptools.HttpParserError:
            self._write(400, b'{"error":{"type":"InvalidRequest","message":"malformed HTTP","detail":{}}}', False)
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.group.discard(self)
        if self._stream_task is not None:
            self._stream_task.cancel()

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, raw_query = self._url.decode("latin-1").partition("?")
        query = dict(parse_qsl(raw_query)) if raw_query else {}
        request = Request(self.parser.get_method().decode(), path, query, self._headers, b"".join(self._body))
        keep = self.parser.should_keep_alive()
        answer = self.handler(request, self)
        if isinstance(answer, Stream):
            self._stream_task = asyncio.get_running_loop().create_task(self._stream(answer))
        elif not isinstance(answer, Answer):
            asyncio.get_running_loop().create_task(self._later(answer, keep))
        elif answer.delay > 0:
            asyncio.get_running_loop().call_later(answer.delay, self._write, answer.status, answer.body, keep)
        else:
            self._write(answer.status, answer.body, keep, answer.etag)

    # -- answers --
    async def _later(self, pending: Awaitable[Answer], keep: bool) -> None:
        answer = await pending
        self._write(answer.status, answer.body, keep)

    def _write(self, status: int, body: bytes | None, keep: bool, etag: str | None = None) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n"
        if etag is not None:
            head += f'ETag: "{etag}"\r\n'
        if body is None:
            head += "Content-Length: 0\r\n"
            body = b""
        else:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        if not keep:
            head += "Connection: close\r\n"
        self.transport.write(head.encode("latin-1") + b"\r\n" + body)
        if not keep:
            self.transport.close()

    async def _stream(self, stream: Stream) -> None:
        try:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
            for line in stream.first:
                self._chunk(line)
            while not self.transport.is_closing():
                line = await stream.queue.get()
                lines = [line]
                while not stream.queue.empty():  # what piled up goes out in one write
                    lines.append(stream.queue.get_nowait())
                self._chunk(b"".join(lines))
        finally:
            stream.closed()

    def _chunk(self, data: bytes) -> None:
        if self.transport is not None and data:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def abort(self) -> None:
        """Drop the connection at once (the simulated node died)."""
        if self.transport is not None:
            self.transport.abort()


async def serve_http(handler: Handler, host: str, port: int = 0, *, backlog: int = 1024
                     ) -> tuple[asyncio.Server, set[HttpConnection]]:
    """Listen on ``host:port`` (0: any free port); the server and the set of its open connections."""
    group: set[HttpConnection] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpConnection(handler, group), host, port, backlog=backlog,
                                      reuse_address=True)
    return server, group


def close_all(server: asyncio.Server, group: set[HttpConnection]) -> None:
    """Stop listening and drop every open connection (a node that dies takes its sockets with it)."""
    server.close()
    for conn in list(group):
        with contextlib.suppress(Exception):
            conn.abort()
    group.clear()
