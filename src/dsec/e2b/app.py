"""One ASGI app for an E2B listener: the control plane, each sandbox's envd, and each sandbox's ports.

Owns the routing of a request by what the SDK sends: ``api.<domain>`` (or no sandbox named) is the
control plane; ``<port>-<id>.<domain>``, or the ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers of the
``E2B_SANDBOX_URL`` form, is a sandbox's port: envd when the port is 49983, else relayed through DSec's port
exposure (:mod:`dsec.e2b.ports`). It checks envd's access token,
answers ``/health`` and a dead sandbox as E2B's proxy does (502), and cuts the connection of a stream
whose sandbox went away mid-call. It must never translate a call itself (control.py, process.py and
filesystem.py do).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from dsec.api.protocol import NodeAPI
from dsec.daemon.audit import caller
from dsec.e2b.control import ControlPlane
from dsec.e2b.files import download, upload
from dsec.e2b.filesystem import FilesystemService
from dsec.e2b.keys import EnvdTokens, Keys, Principal
from dsec.e2b.options import E2BOptions
from dsec.e2b.ports import PortForwarder
from dsec.e2b.process import ProcessService, Target, current_target
from dsec.e2b.wire import ENVD_PORT, filesystem_connect, process_connect
from dsec.errors import DSecError
from dsec.models import SandboxInfo

__all__ = ["RESET", "E2BApp"]

RESET = "dsec.connection_reset"
"""The scope extension (:class:`dsec.e2b.serve.ResettableHttp`) whose ``reset`` drops the request's connection with
a TCP reset."""

_ID = r"[a-z0-9][a-z0-9-]{0,62}"
_ENVD = Principal("e2b-envd", None)


class _CutOff(Exception):
    """Raised by the wrapped ``send`` instead of ending a stream whose sandbox went away."""


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class E2BApp:
    """The E2B listener's ASGI app over one node API."""

    def __init__(self, api: NodeAPI, options: E2BOptions, keys: Keys, tokens: EnvdTokens) -> None:
        self.api = api
        self.options = options
        self.keys = keys
        self.tokens = tokens
        self.control = ControlPlane(api, options, keys, tokens).router()
        self.process = process_connect.ProcessASGIApplication(ProcessService(api))
        self.filesystem = filesystem_connect.FilesystemASGIApplication(FilesystemService(api))
        self.ports = PortForwarder(api)
        domain = options.bare_domain
        self._api_host = None if domain is None else f"api.{domain}"
        self._port_host = None if domain is None else re.compile(rf"^(\d{{1,5}})-({_ID})\.{re.escape(domain)}$")

    def route(self, scope: Scope) -> tuple[str, int] | None:
        """``(sandbox id, port)`` a request is for, or None for the control plane."""
        headers = dict(scope.get("headers") or ())
        host = headers.get(b"host", b"").decode("latin-1").rsplit(":", 1)[0].lower()
        if self._port_host is not None:
            if host == self._api_host:
                return None
            match = self._port_host.match(host)
            if match is not None:
                return match.group(2), int(match.group(1))
        sandbox_id = headers.get(b"e2b-sandbox-id")
        if sandbox_id is None:
            return None
        port = headers.get(b"e2b-sandbox-port", str(ENVD_PORT).encode())
        return sandbox_id.decode("latin-1"), int(port) if port.isdigit() else -1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        routed = self.route(scope)
        if routed is None and scope["type"] == "http":
            await self.control(scope, receive, send)
            return
        caller.set("e2b-envd")
        # envd calls carry the sandbox's access token, not an API key: they act on that one sandbox as admin.
        with self.keys.acting(_ENVD):
            if scope["type"] == "websocket":
                await self._websocket(scope, receive, send, routed)
            elif routed is not None:
                await self._sandbox_call(scope, receive, send, *routed)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, routed: tuple[str, int] | None) -> None:
        """A WebSocket to a running sandbox's port (not envd's, not the control plane's: they have none)."""
        info = None
        if routed is not None and routed[1] != ENVD_PORT:
            with contextlib.suppress(DSecError):
                info = await self.api.get(routed[0])
        if routed is None or info is None or info.state != "running" or not self._traffic_allowed(scope, info):
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.ports.websocket(scope, receive, send, routed[0], routed[1])

    def _traffic_allowed(self, scope: Scope, info: SandboxInfo) -> bool:
        """A sandbox created with ``allowPublicTraffic: false`` answers on its ports only to its traffic token."""
        given = dict(scope.get("headers") or ()).get(b"e2b-traffic-access-token")
        return self.tokens.traffic_allowed(info.id, info.labels, given)

    async def _sandbox_call(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        try:
            info = await self.api.get(sandbox_id)
        except DSecError:
            info = None
        if info is None or info.state not in ("running", "paused"):
            await _json_error(502, f"The sandbox {sandbox_id} was not found")(scope, receive, send)
            return
        if info.state == "paused":
            await _json_error(502, f"The sandbox {sandbox_id} is paused: connect to it to resume it")(
                scope, receive, send)
            return
        if port != ENVD_PORT:
            if not self._traffic_allowed(scope, info):
                await _json_error(403, f"the sandbox {sandbox_id}'s ports are private: send its traffic access token "
                                       "in the e2b-traffic-access-token header")(scope, receive, send)
                return
            await self.ports(scope, receive, send, sandbox_id, port)
            return
        await self._envd(scope, receive, send, Target(info))

    async def _envd(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await Response(status_code=204)(scope, receive, send)
            return
        if path == "/files" and method in ("GET", "POST"):
            request = Request(scope, receive)
            handler = download if method == "GET" else upload
            await (await handler(request, self.api, self.tokens, target.info))(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"x-access-token", b"").decode("latin-1")
        if not self.tokens.check(target.info.id, given):
            await _json_error(401, "unauthorized access, please provide a valid access token or method signing if "
                                   "supported")(scope, receive, send)
            return
        if path.startswith("/process.Process/"):
            app: Any = self.process
        elif path.startswith("/filesystem.Filesystem/"):
            app = self.filesystem
        else:
            await _json_error(404, f"no envd route {method} {path}")(scope, receive, send)
            return
        reset = current_target.set(target)

        async def guarded(message: Message) -> None:
            if target.aborted and message["type"] == "http.response.body" and not message.get("more_body"):
                raise _CutOff
            await send(message)

        try:
            await app(scope, receive, guarded)
        except _CutOff:
            # the connection is reset mid-stream (a clean close where the server cannot reset): the SDK then
            # asks /health, which answers 502, and says the sandbox was killed
            cut = (scope.get("extensions") or {}).get(RESET)
            if cut is not None:
                cut["reset"]()
        finally:
            current_target.reset(reset)
