"""dsec._http.http11: the keep-alive HTTP/1.1 connections of every unary API call, against a real unix-socket server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from dsec._http.http11 import Http11Error, Http11Pool

Reply = Callable[[bytes], bytes | None]
"""What the server answers to one request (None: say nothing)."""


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


class _Server:
    """Counts connections and requests; answers each request with ``reply``."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.ended = 0
        self.requests: list[bytes] = []
        self.hangups = asyncio.Event()
        self.close_after = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = self.reply(request)
                if answer is not None:
                    writer.write(answer)
                    await writer.drain()
                if self.close_after:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hangups.set()
        finally:
            self.ended += 1
            writer.close()


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, reply: Reply) -> AsyncIterator[tuple[_Server, Http11Pool]]:
    server = _Server(reply)
    sock = str(tmp_path / "h11.sock")
    listener = await asyncio.start_unix_server(server.handle, sock)
    pool = Http11Pool(uds=sock)
    try:
        yield server, pool
    finally:
        await pool.aclose()
        listener.close()
        await listener.wait_closed()


def _post(body: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: dsec\r\nContent-Length: %d\r\n\r\n" % len(body) + body


async def test_answers_come_back_whole_on_one_kept_alive_connection(tmp_path: Path) -> None:
    async with _serving(tmp_path, lambda req: _ok(req.rsplit(b"\r\n\r\n", 1)[1].upper())) as (server, pool):
        answers = [await pool.request(_post(b"call %d" % i), connect_timeout=5, read_timeout=None) for i in range(3)]
        assert answers == [(200, b"CALL 0"), (200, b"CALL 1"), (200, b"CALL 2")]
        assert server.connections == 1 and len(server.requests) == 3
        # concurrent calls each get a connection of their own, and their own answer
        many = await asyncio.gather(*(pool.request(_post(b"c%d" % i), connect_timeout=5, read_timeout=None)
                                      for i in range(5)))
        assert many == [(200, b"C%d" % i) for i in range(5)]


def test_the_connections_work_on_uvloop(tmp_path: Path) -> None:
    """The daemon's and the benchmarks' loop: its transports are not asyncio.Transport subclasses."""
    uvloop = pytest.importorskip("uvloop")

    async def calls() -> list[tuple[int, bytes]]:
        async with _serving(tmp_path, lambda _: _ok(b"ok")) as (_, pool):
            return [await pool.request(_post(b""), connect_timeout=5, read_timeout=1) for _ in range(2)]

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(calls()) == [(200, b"ok"), (200, b"ok")]


async def test_chunked_and_error_answers(tmp_path: Path) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    error = b'HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}'
    replies = iter([chunked, error, _ok(b"after")])
    async with _serving(tmp_path, lambda _: next(replies)) as (server, pool):
        assert await pool.request(_post(b""), connect_timeout=5, read_timeout=None) == (200, b"abcde")
        assert await pool.request(_post(b""), connect_timeout=5, read_timeout=None) == (404, b"{}")
        # "Connection: close" is honoured: the next call opens a new connection
        assert await pool.request(_post(b""), connect_timeout=5, read_timeout=None) == (200, b"after")
        assert server.connections == 2


async def test_idle_connections_expire_before_the_server_drops_them(tmp_path: Path) -> None:
    async with _serving(tmp_path, lambda _: _ok(b"ok")) as (server, pool):
        pool.keepalive_expiry = 0.05
        await pool.request(_post(b""), connect_timeout=5, read_timeout=None)
        await asyncio.sleep(0.1)
        await pool.request(_post(b""), connect_timeout=5, read_timeout=None)
        assert server.connections == 2


async def test_idle_connections_are_closed_without_another_request(tmp_path: Path) -> None:
    """A burst to one origin leaves several idle connections: they are closed once expired even if no request
    comes again (a gateway with a pool per node would otherwise hold them for good)."""
    async with _serving(tmp_path, lambda _: _ok(b"ok")) as (server, pool):
        pool.keepalive_expiry = 0.05
        await asyncio.gather(*(pool.request(_post(b""), connect_timeout=5, read_timeout=None) for _ in range(4)))
        assert server.connections == 4 and len(pool._idle) == 4
        for _ in range(100):
            await asyncio.sleep(0.02)
            if server.ended == 4:
                break
        assert server.ended == 4 and not pool._idle


async def test_a_connection_closed_before_the_request_is_written_is_replaced(tmp_path: Path) -> None:
    """The server closed a connection before anything was written on it (its end of file is in, the protocol not
    told yet, as on uvloop): the request goes on a new connection, since nothing was sent; a server that does so
    to every new connection fails the call as lost, having received nothing."""
    async with _serving(tmp_path, lambda _: _ok(b"ok")) as (server, pool):
        connect = pool._connect
        closing = [1]

        async def closed_first(timeout: float | None) -> Any:
            conn = await connect(timeout)
            if closing[0]:
                closing[0] -= 1
                assert conn.transport is not None
                conn.transport.close()  # closing now, connection_lost still to come
            return conn

        pool._connect = closed_first  # type: ignore[method-assign]
        assert await pool.request(_post(b"x"), connect_timeout=5, read_timeout=None) == (200, b"ok")
        assert server.connections == 2 and len(server.requests) == 1
        closing[0] = 10
        pool._idle.clear()
        with pytest.raises(Http11Error) as caught:
            await pool.request(_post(b"y"), connect_timeout=5, read_timeout=None)
        assert caught.value.kind == "lost" and len(server.requests) == 1


async def test_a_connection_the_server_closed_while_idle_is_not_reused(tmp_path: Path) -> None:
    replies = iter([_ok(b"one"), _ok(b"two")])
    async with _serving(tmp_path, lambda _: next(replies)) as (server, pool):
        assert await pool.request(_post(b""), connect_timeout=5, read_timeout=None) == (200, b"one")
        idle = pool._idle[0]
        assert idle.transport is not None
        idle.transport.close()  # as if the daemon had closed it: the protocol learns of it
        await asyncio.sleep(0.05)
        assert await pool.request(_post(b""), connect_timeout=5, read_timeout=None) == (200, b"two")
        assert server.connections == 2


async def test_failures_name_their_kind(tmp_path: Path) -> None:
    with pytest.raises(Http11Error, match="No such file") as info:
        await Http11Pool(uds=str(tmp_path / "absent.sock")).request(_post(b""), connect_timeout=5, read_timeout=None)
    assert info.value.kind == "connect"
    async with _serving(tmp_path, lambda _: None) as (server, pool):
        with pytest.raises(Http11Error, match="no answer within") as info:
            await pool.request(_post(b""), connect_timeout=5, read_timeout=0.1)
        assert info.value.kind == "timeout"
        await asyncio.wait_for(server.hangups.wait(), 5)  # the timed-out connection was closed, not kept
        assert not pool._idle
    async with _serving(tmp_path, lambda _: b"SSH-2.0-OpenSSH\r\n\r\n") as (server, pool):
        with pytest.raises(Http11Error, match="not HTTP") as info:
            await pool.request(_post(b""), connect_timeout=5, read_timeout=None)
        assert info.value.kind == "lost"
    async with _serving(tmp_path, lambda _: b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\npartial") as (server, pool):
        server.close_after = True  # the daemon dies mid-answer
        with pytest.raises(Http11Error, match="closed before a complete answer") as info:
            await pool.request(_post(b""), connect_timeout=5, read_timeout=None)
        assert info.value.kind == "lost"
    pool = Http11Pool(uds=str(tmp_path / "h11.sock"))
    await pool.aclose()
    with pytest.raises(Http11Error, match="closed"):
        await pool.request(_post(b""), connect_timeout=5, read_timeout=None)


async def test_a_cancelled_call_closes_its_connection(tmp_path: Path) -> None:
    async with _serving(tmp_path, lambda _: None) as (server, pool):
        task = asyncio.ensure_future(pool.request(_post(b"slow"), connect_timeout=5, read_timeout=None))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the daemon sees the hang-up (that is what kills a cancelled exec's command)
        await asyncio.wait_for(server.hangups.wait(), 5)
        assert not pool._idle


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_a_streamed_answer_comes_piece_by_piece_and_leaving_hangs_up(tmp_path: Path) -> None:
    more = asyncio.Event()
    hangup = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _chunk(b"first\n"))
        await more.wait()  # the first piece reaches the reader before the answer goes on
        writer.write(_chunk(b"second\n"))
        await reader.read()  # until the client hangs up
        hangup.set()
        writer.close()

    sock = str(tmp_path / "s.sock")
    async with await asyncio.start_unix_server(handle, sock):
        pool = Http11Pool(uds=sock)
        async with pool.stream(b"GET /events HTTP/1.1\r\nHost: dsec\r\n\r\n", connect_timeout=5) as (status, body):
            assert status == 200
            assert await anext(body) == b"first\n"
            more.set()
            assert await anext(body) == b"second\n"
        await asyncio.wait_for(hangup.wait(), 5)  # leaving closed the connection: the server stops
        assert not pool._idle  # a stream's connection is its own, never reused
        await pool.aclose()


async def test_a_streamed_answer_ends_or_fails_with_its_connection(tmp_path: Path) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _chunk(b"a") + _chunk(b"b"))
        if b"/whole" in head:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()  # /lost: the daemon dies mid-stream

    sock = str(tmp_path / "s.sock")
    async with await asyncio.start_unix_server(handle, sock):
        pool = Http11Pool(uds=sock)
        async with pool.stream(b"GET /whole HTTP/1.1\r\nHost: dsec\r\n\r\n", connect_timeout=5) as (_, body):
            assert await body.read() == b"ab"
        got = []
        with pytest.raises(Http11Error, match="closed before a complete answer") as info:
            async with pool.stream(b"GET /lost HTTP/1.1\r\nHost: dsec\r\n\r\n", connect_timeout=5) as (_, body):
                async for piece in body:
                    got.append(piece)
        assert info.value.kind == "lost" and got == [b"a", b"b"]  # what came before the loss is kept
        with pytest.raises(Http11Error) as info:
            async with Http11Pool(uds=str(tmp_path / "absent.sock")).stream(b"GET / HTTP/1.1\r\n\r\n",
                                                                            connect_timeout=5):
                pass
        assert info.value.kind == "connect"
        await pool.aclose()


async def test_a_lagging_reader_pauses_the_connection(tmp_path: Path) -> None:
    piece = b"x" * 65536
    sent = 0
    stalled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD)
        with contextlib.suppress(ConnectionError):
            for _ in range(256):  # 16 MiB: far more than the socket buffers hold
                writer.write(_chunk(piece))
                try:
                    await asyncio.wait_for(writer.drain(), 0.5)
                except TimeoutError:
                    stalled.set()  # the client stopped reading: the server waits on the socket
                    await writer.drain()
                sent += 1
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    sock = str(tmp_path / "s.sock")
    async with await asyncio.start_unix_server(handle, sock):
        pool = Http11Pool(uds=sock)
        async with pool.stream(b"GET / HTTP/1.1\r\nHost: dsec\r\n\r\n", connect_timeout=5) as (_, body):
            await anext(body)
            await asyncio.wait_for(stalled.wait(), 10)
            assert sent < 256
            assert len(await body.read()) == 255 * len(piece)  # then everything comes once read
        await pool.aclose()
