"""A sandbox's ports the E2B way (``<port>-<id>.<domain>``, or the ``E2b-Sandbox-Port`` header) over DSec's
port exposure.

Owns exposing a port the first time a request names it (an existing exposure is reused) and relaying each
HTTP request to the node's listener for it with the sandbox's port token, streaming both bodies, and each
WebSocket message by message (``websockets``, in the ``e2b`` extra). As E2B's,
a sandbox's ports are reachable by whoever knows its id (E2B's public traffic); DSec's port token never
reaches the client. It must never open a connection into a sandbox itself (the node's listener does).
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from dsec.api.protocol import NodeAPI
from dsec.errors import DSecError, NotFound, SandboxNotFound
from dsec.models.surface import ExposeRequest, PortInfo

__all__ = ["PortForwarder"]

_HOP = {b"host", b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
        b"upgrade", b"x-dsec-token", b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token"}
"""Headers that belong to one hop (or to the E2B routing) and are not relayed."""
_WS_OWN = {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions", b"sec-websocket-protocol",
           b"sec-websocket-accept"}
"""A WebSocket handshake's own headers: each leg negotiates its own."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class PortForwarder:
    """Relays HTTP requests for a sandbox's ports to the node's listeners."""

    def __init__(self, api: NodeAPI) -> None:
        self.api = api

    async def _exposure(self, sandbox_id: str, port: int) -> PortInfo:
        try:
            return await self.api.get_port(sandbox_id, port)
        except SandboxNotFound:
            raise
        except NotFound:  # not exposed yet: expose it (expose_port is idempotent, so two at once are fine)
            return await self.api.expose_port(sandbox_id, ExposeRequest(port=port))

    async def __call__(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        if not 1 <= port <= 65535:
            await _error(400, f"port {port} is not a TCP port")(scope, receive, send)
            return
        try:
            exposed = await self._exposure(sandbox_id, port)
        except DSecError as exc:
            await _error(502, f"port {port} of sandbox {sandbox_id} cannot be reached: {exc.message}")(
                scope, receive, send)
            return
        request = Request(scope, receive)
        query = scope.get("query_string", b"").decode("latin-1")
        url = f"{exposed.url}{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        headers.append((b"x-dsec-token", exposed.token.encode()))
        body = request.stream() if scope["method"] not in ("GET", "HEAD") else None
        # A client per request: it ends with the response, so nothing outlives the listener.
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), follow_redirects=False)
        try:
            answer = await client.send(client.build_request(scope["method"], url, headers=headers, content=body),
                                       stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            await _error(502, f"The sandbox is running but port {port} could not be reached: {exc}")(
                scope, receive, send)
            return
        response = StreamingResponse(answer.aiter_raw(), status_code=answer.status_code)
        response.raw_headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP]
        try:
            await response(scope, receive, send)
        finally:
            await answer.aclose()
            await client.aclose()

    async def websocket(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        """Relay one WebSocket to the sandbox's port, message by message, until either side closes."""
        import websockets

        if (await receive())["type"] != "websocket.connect":
            return
        try:
            exposed = await self._exposure(sandbox_id, port)
        except DSecError:
            await send({"type": "websocket.close", "code": 1011})
            return
        query = scope.get("query_string", b"").decode("latin-1")
        url = (exposed.url or "").replace("http", "ws", 1) + scope["path"] + (f"?{query}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in _HOP and k.lower() not in _WS_OWN]
        headers.append(("X-DSec-Token", exposed.token))
        try:
            upstream = await websockets.connect(url, additional_headers=headers, max_size=None,
                                                subprotocols=scope.get("subprotocols") or None, open_timeout=10)
        except (OSError, websockets.WebSocketException, TimeoutError):
            await send({"type": "websocket.close", "code": 1011})  # before accepting: the client sees a 403
            return
        async with upstream:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            await _pump(upstream, receive, send)


async def _pump(upstream: Any, receive: Receive, send: Send) -> None:
    """Both directions at once; the first to end closes the other."""
    import asyncio

    import websockets

    async def down() -> None:
        try:
            async for message in upstream:
                key = "text" if isinstance(message, str) else "bytes"
                await send({"type": "websocket.send", key: message})
        except websockets.ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        await send({"type": "websocket.close", "code": 1000 if code in (1005, 1006) else code})

    async def up() -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(message.get("code", 1000))
                return
            data = message.get("text") if message.get("text") is not None else message.get("bytes")
            if data is not None:
                await upstream.send(data)

    tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
