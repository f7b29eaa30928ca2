"""Exposed ports: a listener on the node per exposed sandbox port, forwarding authenticated connections into
the sandbox through its backend's :meth:`~dsec.backends.base.Backend.open_port`.

Owns the listeners, the per-sandbox token and the relays. An ``http`` exposure reads the first request's
head: the token comes as an ``X-DSec-Token`` header, basic auth's password (a URL ``http://dsec:<token>@...``),
a ``dsec_token`` query parameter (answered with a redirect that sets it as a cookie, for browsers) or that
cookie; it is removed before the request goes on
(with every other exposure's token cookie: a browser sends them all), and the connection is then relayed
byte for byte in both directions, so keep-alive, chunked bodies and WebSocket upgrades pass as they are; a
request that carried token cookies is sent on with ``Connection: close``, so each of that client's requests
is read here. A ``tcp`` exposure takes one line ``DSEC <token>`` first and then relays.
Anything else is refused before the sandbox sees a byte. Nothing is opened to the sandbox: it gains no
route out; the node connects in. Listeners are the daemon's: they end with the exposure, the sandbox, or
the daemon.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dsec.backends.surface import PortStream
from dsec.errors import InvalidRequest, NotFound, QuotaExceeded
from dsec.isolation.ports import SocketStream
from dsec.models.surface import PortInfo

__all__ = ["MAX_EXPOSED", "PortForwarder", "Relay"]

Opener = Callable[[], Awaitable[PortStream]]
MAX_EXPOSED = 64
"""Ports one sandbox may expose at once."""
_MAX_HEAD = 64 * 1024
_CHUNK = 256 * 1024
_HEADER = b"x-dsec-token"
_PARAM = "dsec_token"
_HEAD_WITHIN_S = 30.0
"""How long a client has to send its first request head (or preamble) before it is cut off."""


_COOKIE_PREFIX = "dsec_token_"


def _basic_password(value: bytes) -> str | None:
    """The password of a ``Basic`` authorization header value, or None."""
    scheme, _, encoded = value.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None


def _cookie_name(host_port: int) -> str:
    return f"{_COOKIE_PREFIX}{host_port}"


def _answer(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{extra}\r\n").encode() + body


@dataclass
class _Exposure:
    info: PortInfo
    server: asyncio.Server
    opener: Opener
    connections: set[asyncio.Task[None]] = field(default_factory=set)


class Relay(asyncio.Protocol):
    """One side of a relay between two transports, with flow control both ways."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Relay | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)

    def eof_received(self) -> bool:
        if self.peer is not None and self.peer.transport is not None and self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
            return True
        return False

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Front(Relay):
    """The client's side of one connection: its first request head (or preamble) is read and checked here,
    then it becomes one side of a relay to the sandbox."""

    def __init__(self, forwarder: PortForwarder, exposure: _Exposure) -> None:
        super().__init__()
        self.forwarder = forwarder
        self.exposure = exposure
        self.head = bytearray()
        self.relaying = False
        self.inbound: asyncio.Queue[bytes | None] | None = None  # to a non-socket upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        task = asyncio.get_running_loop().create_task(self._hold())
        self.exposure.connections.add(task)
        task.add_done_callback(self.exposure.connections.discard)

    async def _hold(self) -> None:
        """In the exposure's set for the connection's life (cancelled: the connection is cut); a client that
        sends no head within ``_HEAD_WITHIN_S`` is cut off."""
        try:
            done, _ = await asyncio.wait({self.closed}, timeout=_HEAD_WITHIN_S)
            if not done and not self.relaying and self.transport is not None:
                self.transport.close()
            await self.closed
        finally:
            if self.transport is not None:
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.relaying:
            if self.inbound is not None:
                self.inbound.put_nowait(data)
                if self.inbound.qsize() > 16 and self.transport is not None:
                    self.transport.pause_reading()
                return
            super().data_received(data)
            return
        self.head += data
        end = self.head.find(b"\r\n\r\n" if self.exposure.info.protocol == "http" else b"\n")
        if end < 0:
            if len(self.head) > _MAX_HEAD and self.transport is not None:
                self.transport.write(_answer("431 Request Header Fields Too Large", "request head too large\n"))
                self.transport.close()
            return
        assert self.transport is not None
        self.transport.pause_reading()
        self.relaying = True
        asyncio.get_running_loop().create_task(self.forwarder._admit(self, bytes(self.head)))

    def eof_received(self) -> bool:
        if self.inbound is not None:
            self.inbound.put_nowait(None)
            return True
        return super().eof_received()


class PortForwarder:
    """The node's listeners for exposed ports. ``bind``: the address listeners take; ``advertise``: the host
    name clients are given for them (the node's address as clients know it)."""

    def __init__(self, bind: str = "127.0.0.1", advertise: str | None = None) -> None:
        self.bind = bind
        self.advertise = advertise or bind
        self._tokens: dict[str, str] = {}
        self._exposed: dict[str, dict[int, _Exposure]] = {}

    def token(self, sandbox_id: str) -> str:
        """The sandbox's port token (one for all its ports)."""
        return self._tokens.setdefault(sandbox_id, secrets.token_urlsafe(24))

    def list(self, sandbox_id: str) -> list[PortInfo]:
        return [e.info for e in self._exposed.get(sandbox_id, {}).values()]

    def get(self, sandbox_id: str, port: int) -> PortInfo:
        exposure = self._exposed.get(sandbox_id, {}).get(port)
        if exposure is None:
            raise NotFound(f"port {port} of sandbox {sandbox_id} is not exposed (expose it first)", port=port)
        return exposure.info

    async def expose(self, sandbox_id: str, port: int, protocol: str, opener: Opener) -> PortInfo:
        """Listen for ``port`` of the sandbox (again: the same exposure, or a new one if the protocol changed)."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidRequest(f"port must be a TCP port number from 1 to 65535, got {port!r}", port=port)
        if protocol not in ("http", "tcp"):
            raise InvalidRequest(f"protocol must be 'http' or 'tcp', got {protocol!r}", protocol=protocol)
        table = self._exposed.setdefault(sandbox_id, {})
        current = table.get(port)
        if current is not None:
            if current.info.protocol == protocol:
                return current.info
            await self.unexpose(sandbox_id, port)
        if len(table) >= MAX_EXPOSED:
            raise QuotaExceeded(f"sandbox {sandbox_id} exposes {len(table)} ports (at most {MAX_EXPOSED})")
        token = self.token(sandbox_id)
        holder: list[_Exposure] = []
        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(lambda: _Front(self, holder[0]), self.bind, 0)
        except OSError as e:
            raise InvalidRequest(f"cannot listen on {self.bind} for port {port}: {e.strerror}") from None
        host_port = server.sockets[0].getsockname()[1]
        host = self.advertise
        url = f"http://{host if ':' not in host else f'[{host}]'}:{host_port}" if protocol == "http" else None
        info = PortInfo(port=port, protocol=protocol, url=url, host=host, host_port=host_port, token=token)
        exposure = _Exposure(info=info, server=server, opener=opener)
        holder.append(exposure)
        table[port] = exposure
        return info

    async def unexpose(self, sandbox_id: str, port: int) -> None:
        """Stop listening for ``port`` and cut its connections."""
        exposure = self._exposed.get(sandbox_id, {}).pop(port, None)
        if exposure is None:
            raise NotFound(f"port {port} of sandbox {sandbox_id} is not exposed", port=port)
        await self._close(exposure)

    @staticmethod
    async def _close(exposure: _Exposure) -> None:
        exposure.server.close()
        for task in list(exposure.connections):
            task.cancel()
        for task in list(exposure.connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await exposure.server.wait_closed()

    async def drop(self, sandbox_id: str) -> None:
        """The sandbox is going: every exposure of it ends."""
        for exposure in self._exposed.pop(sandbox_id, {}).values():
            await self._close(exposure)
        self._tokens.pop(sandbox_id, None)

    async def aclose(self) -> None:
        for sandbox_id in list(self._exposed):
            await self.drop(sandbox_id)

    # -- one connection ----------------------------------------------------------------------------------

    async def _admit(self, front: _Front, received: bytes) -> None:
        """Check the token in what the client sent first, then connect into the sandbox and relay."""
        transport = front.transport
        assert transport is not None
        exposure = front.exposure
        try:
            if exposure.info.protocol == "http":
                cut = received.index(b"\r\n\r\n") + 4
                head, answer = self._http_head(exposure, received[:cut])
            else:
                cut = received.index(b"\n") + 1
                head, answer = self._tcp_preamble(exposure, received[:cut])
            if answer is not None:
                transport.write(answer)
                transport.close()
                return
            try:
                upstream = await exposure.opener()
            except ConnectionRefusedError:
                transport.write(self._refusal(exposure, "502 Bad Gateway",
                                              f"nothing listens on port {exposure.info.port} in the sandbox\n"))
                transport.close()
                return
            pending = head + received[cut:]
            if isinstance(upstream, SocketStream):
                await self._splice(front, upstream, pending)
            else:
                await self._pump(front, upstream, pending)
        except Exception as exc:  # the connection's own failure (reset, sandbox gone): it ends, nothing else
            transport.write(self._refusal(exposure, "502 Bad Gateway", f"{type(exc).__name__}: {exc}\n"))
            transport.close()

    @staticmethod
    def _refusal(exposure: _Exposure, status: str, text: str) -> bytes:
        if exposure.info.protocol == "http":
            return _answer(status, text)
        return f"DSEC {status}: {text}".encode()

    def _tcp_preamble(self, exposure: _Exposure, line: bytes) -> tuple[bytes, bytes | None]:
        word, _, token = line.strip().decode(errors="replace").partition(" ")
        if word != "DSEC" or not hmac.compare_digest(token, exposure.info.token):
            return b"", self._refusal(exposure, "401 Unauthorized", "the first line must be: DSEC <token>\n")
        return b"", None

    def _http_head(self, exposure: _Exposure, raw: bytes) -> tuple[bytes, bytes | None]:
        """The head to forward (token removed), or the answer that ends the connection instead."""
        request_line, *lines = raw[:-4].split(b"\r\n")
        parts = request_line.split(b" ")
        if len(parts) != 3:
            return b"", _answer("400 Bad Request", "malformed request line\n")
        method, target, version = parts
        given: str | None = None
        kept: list[bytes] = []
        cookie = _cookie_name(exposure.info.host_port)
        carries_tokens = upgrade = False
        for line in lines:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == _HEADER:
                given = value.strip().decode(errors="replace")
                continue
            if key == b"authorization" and given is None:
                # ``http://dsec:<token>@host:port``: clients that take a URL but no headers (SWE-ReX's remote
                # runtime, curl -u) send the token as basic auth. Any other credentials go on to the server.
                basic = _basic_password(value)
                if basic is not None and hmac.compare_digest(basic, exposure.info.token):
                    given = basic
                    continue
            if key == b"upgrade":
                upgrade = True
            if key == b"cookie":
                # Browsers send a host's cookies to all its ports: every exposure's token cookie (this sandbox's
                # and others') is taken out, so that no sandbox's server ever sees a port token.
                jar = [c.strip() for c in value.decode(errors="replace").split(";") if c.strip()]
                ours = [c for c in jar if c.startswith(_COOKIE_PREFIX)]
                if ours:
                    carries_tokens = True
                    mine = [c for c in ours if c.startswith(cookie + "=")]
                    given = given or (mine[0].split("=", 1)[1] if mine else None)
                    rest = [c for c in jar if not c.startswith(_COOKIE_PREFIX)]
                    if not rest:
                        continue
                    line = b"Cookie: " + "; ".join(rest).encode()
            kept.append(line)
        if carries_tokens and not upgrade:
            # Only this first head is read: later requests on the connection would reach the server with their
            # cookies as sent. A client that sends token cookies gets one request per connection instead.
            kept = [line for line in kept if line.partition(b":")[0].strip().lower() != b"connection"]
            kept.append(b"Connection: close")
        url = urllib.parse.urlsplit(target.decode(errors="replace"))
        query = urllib.parse.parse_qsl(url.query, keep_blank_values=True)
        in_query = [v for k, v in query if k == _PARAM]
        token = exposure.info.token
        if in_query:
            target = (urllib.parse.urlunsplit(url._replace(query=urllib.parse.urlencode(
                [(k, v) for k, v in query if k != _PARAM]))) or "/").encode()
            if hmac.compare_digest(in_query[0], token):
                if method in (b"GET", b"HEAD"):  # a browser: keep it as a cookie, go on without it in the URL
                    return b"", _answer("302 Found", "", f"Location: {target.decode()}\r\nSet-Cookie: {cookie}="
                                                         f"{token}; HttpOnly; SameSite=Strict; Path=/\r\n")
                given = in_query[0]
        if given is None or not hmac.compare_digest(given, token):
            return b"", _answer("401 Unauthorized", "this port is exposed by DSec: send the sandbox's port token "
                                                    "(X-DSec-Token header, or ?dsec_token= once)\n")
        return b"\r\n".join([b" ".join([method, target, version]), *kept]) + b"\r\n\r\n", None

    @staticmethod
    async def _splice(front: _Front, upstream: SocketStream, pending: bytes) -> None:
        """Socket to socket: both sides protocols of the loop (no task per direction)."""
        loop = asyncio.get_running_loop()
        up_transport, up = await loop.create_connection(Relay, sock=upstream.socket)
        front.peer, up.peer = up, front
        if pending:
            up_transport.write(pending)
        assert front.transport is not None
        front.transport.resume_reading()
        await asyncio.wait({front.closed, up.closed}, return_when=asyncio.FIRST_COMPLETED)

    @staticmethod
    async def _pump(front: _Front, upstream: PortStream, pending: bytes) -> None:
        """To a stream that is not a socket (a guest agent's channel): a task each way."""
        transport = front.transport
        assert transport is not None
        inbound: asyncio.Queue[bytes | None] = asyncio.Queue()
        front.inbound = inbound
        if pending:
            inbound.put_nowait(pending)
        transport.resume_reading()

        async def to_sandbox() -> None:
            while (data := await inbound.get()) is not None:
                await upstream.write(data)
                if inbound.qsize() <= 4:
                    transport.resume_reading()
            await upstream.write_eof()

        async def to_client() -> None:
            while data := await upstream.read(_CHUNK):
                transport.write(data)
            if transport.can_write_eof():
                transport.write_eof()

        tasks = [asyncio.create_task(to_sandbox()), asyncio.create_task(to_client())]
        closed = asyncio.ensure_future(front.closed)
        try:
            await asyncio.wait([*tasks, closed], return_when=asyncio.FIRST_COMPLETED)
            if not closed.done():
                await asyncio.wait([*tasks, closed], return_when=asyncio.ALL_COMPLETED, timeout=None)
        finally:
            for task in tasks:
                task.cancel()
            await upstream.aclose()
            transport.close()
