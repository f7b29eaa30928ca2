"""The gateway's share of the sandbox surface: exposed ports reachable by clients that talk to the gateway.

A node forwards an exposed port on a listener of its own (:mod:`dsec.daemon.ports`), which the SDK reaches
directly (it follows the sandbox's endpoint to the node). A client that only talks to the gateway gets from
it a :class:`~dsec.models.surface.PortInfo` naming a gateway listener instead: :class:`PortFronts` listens
there and relays each connection byte for byte to the node's listener, which checks the sandbox's port token
as it does for a direct client (so the token, WebSocket upgrades and raw TCP pass unchanged, and nothing
reaches the sandbox unauthenticated). :class:`GatewaySurface` is the gateway engine's part that answers the
port operations through it. Owns the gateway's port listeners; must never check tokens itself or hold a
sandbox's state beyond where its exposures are.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.api.operations import Operation
from dsec.api.protocol import NodeAPI
from dsec.daemon.ports import Relay
from dsec.errors import InvalidRequest, NotFound, SandboxNotFound
from dsec.models.surface import ExposeRequest, PortInfo

__all__ = ["GatewaySurface", "PortFronts", "ports_address"]


def ports_address(listen_host: str, advertise_url: str | None) -> tuple[str, str]:
    """Where the gateway's port listeners bind and the host name clients are given for them:
    ``DSEC_PORTS_BIND`` / ``DSEC_PORTS_ADVERTISE`` if set, else the gateway's own listen host and the host
    of its advertised URL (a wildcard bind is advertised as the machine's host name)."""
    bind = os.environ.get("DSEC_PORTS_BIND") or listen_host or "127.0.0.1"
    advertised = urllib.parse.urlsplit(advertise_url).hostname if advertise_url else None
    advertise = os.environ.get("DSEC_PORTS_ADVERTISE") or advertised or bind
    if advertise in ("0.0.0.0", "::"):  # a wildcard is no address to give: the machine's name is
        advertise = socket.gethostname()
    return bind, advertise


@dataclass
class _Front:
    """One gateway listener: where it relays to (the node's listener, updated when the node's changes)."""

    server: asyncio.Server
    info: PortInfo
    """The node's answer: its listener's ``host`` and ``host_port`` are the relay's target."""
    transports: set[asyncio.Transport] = field(default_factory=set)
    connecting: set[asyncio.Task[None]] = field(default_factory=set)


class _Client(Relay):
    """The client's side of one relayed connection: connects to the node's listener, then relays."""

    def __init__(self, front: _Front) -> None:
        super().__init__()
        self.front = front
        self.early = bytearray()
        """What came before the node's side was there (reading is paused then, but an event loop may already
        have read a first chunk)."""
        self.early_eof = False

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.early += data
            return
        super().data_received(data)

    def eof_received(self) -> bool:
        if self.peer is None:
            self.early_eof = True
            return True
        return super().eof_received()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()  # nothing is read before the node's side is there
        self.front.transports.add(self.transport)
        task = asyncio.get_running_loop().create_task(self._connect(self.front.info))
        self.front.connecting.add(task)
        task.add_done_callback(self.front.connecting.discard)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.front.transports.discard(self.transport)
        super().connection_lost(exc)

    async def _connect(self, target: PortInfo) -> None:
        transport = self.transport
        assert transport is not None
        try:
            _, node = await asyncio.get_running_loop().create_connection(Relay, target.host, target.host_port)
        except OSError as e:
            why = f"the node's listener for port {target.port} ({target.address}) is unreachable: {e.strerror or e}\n"
            if target.protocol == "http":
                body = why.encode()
                transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n"
                                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            else:
                transport.write(f"DSEC 502 Bad Gateway: {why}".encode())
            transport.close()
            return
        if transport.is_closing():
            assert node.transport is not None
            node.transport.close()
            return
        assert node.transport is not None
        if self.early:
            node.transport.write(bytes(self.early))
        if self.early_eof:
            node.transport.write_eof()
        self.peer, node.peer = node, self
        transport.resume_reading()


class PortFronts:
    """The gateway's listeners for exposed ports, one per exposed (sandbox, port), relaying to the node's."""

    def __init__(self, bind: str = "127.0.0.1", advertise: str | None = None) -> None:
        self.bind = bind
        self.advertise = advertise or bind
        self._fronts: dict[str, dict[int, _Front]] = {}

    async def front(self, sandbox_id: str, node_info: PortInfo) -> PortInfo:
        """``node_info`` as a client of the gateway reaches it: the gateway's listener for it (made once)."""
        table = self._fronts.setdefault(sandbox_id, {})
        current = table.get(node_info.port)
        if current is None:
            holder: list[_Front] = []
            try:
                server = await asyncio.get_running_loop().create_server(lambda: _Client(holder[0]), self.bind, 0)
            except OSError as e:
                raise InvalidRequest(f"the gateway cannot listen on {self.bind} for port {node_info.port}: "
                                     f"{e.strerror}") from None
            current = _Front(server, node_info)
            holder.append(current)
            table[node_info.port] = current
        current.info = node_info  # exposed again on the node (a new listener, or another protocol)
        return self._as_seen(current)

    def _as_seen(self, front: _Front) -> PortInfo:
        host_port = front.server.sockets[0].getsockname()[1]
        host = self.advertise
        url = None
        if front.info.protocol == "http":
            url = f"http://{host if ':' not in host else f'[{host}]'}:{host_port}"
        return front.info.model_copy(update={"url": url, "host": host, "host_port": host_port})

    async def keep(self, sandbox_id: str, node_infos: builtins.list[PortInfo]) -> builtins.list[PortInfo]:
        """The node's list of exposures as seen through the gateway (fronts it no longer has are closed)."""
        exposed = {info.port for info in node_infos}
        for port in [p for p in self._fronts.get(sandbox_id, {}) if p not in exposed]:
            await self.close(sandbox_id, port)
        return [await self.front(sandbox_id, info) for info in node_infos]

    async def close(self, sandbox_id: str, port: int) -> None:
        """End the gateway's listener for ``port`` and its connections (if it has one)."""
        table = self._fronts.get(sandbox_id, {})
        front = table.pop(port, None)
        if not table:
            self._fronts.pop(sandbox_id, None)
        if front is None:
            return
        front.server.close()
        for task in builtins.list(front.connecting):
            task.cancel()
        for transport in builtins.list(front.transports):
            transport.close()
        with contextlib.suppress(Exception):
            await front.server.wait_closed()

    async def drop(self, sandbox_id: str) -> None:
        """The sandbox is gone: every listener of it ends."""
        for port in builtins.list(self._fronts.get(sandbox_id, {})):
            await self.close(sandbox_id, port)

    def forget(self, sandbox_id: str) -> None:
        """:meth:`drop` from synchronous code (the gateway's records noticing the sandbox ended)."""
        if sandbox_id in self._fronts:
            asyncio.get_running_loop().create_task(self.drop(sandbox_id))

    async def aclose(self) -> None:
        for sandbox_id in builtins.list(self._fronts):
            await self.drop(sandbox_id)


class GatewaySurface:
    """The port operations of the gateway engine: forwarded to the sandbox's node, answered with the gateway's
    listener (:class:`PortFronts`) so the URL given is one the gateway's client reaches."""

    port_fronts: PortFronts

    if TYPE_CHECKING:
        async def perform(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> Any: ...

    async def expose_port(self, sandbox_id: str, request: ExposeRequest) -> PortInfo:
        info: PortInfo = await self.perform(NodeAPI.expose_port, sandbox_id, request)
        return await self.port_fronts.front(sandbox_id, info)

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        infos: builtins.list[PortInfo] = await self.perform(NodeAPI.list_ports, sandbox_id)
        return await self.port_fronts.keep(sandbox_id, infos)

    async def get_port(self, sandbox_id: str, port: int) -> PortInfo:
        try:
            info: PortInfo = await self.perform(NodeAPI.get_port, sandbox_id, port)
        except NotFound as exc:
            await self._gone(sandbox_id, port, exc)
            raise
        return await self.port_fronts.front(sandbox_id, info)

    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        try:
            await self.perform(NodeAPI.unexpose_port, sandbox_id, port)
        except NotFound as exc:
            await self._gone(sandbox_id, port, exc)
            raise
        await self.port_fronts.close(sandbox_id, port)

    async def _gone(self, sandbox_id: str, port: int, exc: NotFound) -> None:
        """The node no longer exposes ``port`` (unexposed on the node directly): neither does the gateway. A
        sandbox the caller may not see, or one that is gone, is the records' to handle."""
        if not isinstance(exc, SandboxNotFound):
            await self.port_fronts.close(sandbox_id, port)
