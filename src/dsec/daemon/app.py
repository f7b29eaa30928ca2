"""The HTTP API of a node: the node API's server binding over an engine, and the layers around it.

Owns the FastAPI app of a node (or of the cluster gateway, which serves the same API over its own
implementation): error payloads, the bearer-token check, the dashboard's static files, and the order of the
layers (the fast path in front of the middleware stack on the unix socket, inside the token guard on TCP).
The routes themselves are bound from :class:`~dsec.api.protocol.NodeAPI` (:mod:`dsec.api.binding`): each
parses its input, calls one method of the engine and serialises the answer; logic about sandboxes belongs
in the engine, where in-process tests exercise it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec._version import __version__
from dsec.api.binding import ERROR_RESPONSES, FastPath, bind_routes, describe_errors
from dsec.api.protocol import NodeAPI
from dsec.daemon.auth import AuthGuard, TokenFile
from dsec.daemon.engine import MAX_FILE_BYTES, Engine
from dsec.errors import DaemonStopping, DSecError, InvalidRequest

__all__ = ["AnswerCutOffCalls", "ServedAPI", "create_app"]

log = logging.getLogger(__name__)


class ServedAPI(NodeAPI, Protocol):
    """What the app serves: the node API, and who owns a sandbox (the token guard's job scoping)."""

    async def owner_labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The labels of a sandbox, or None when there is no such sandbox."""
        ...


def _error_response(err: DSecError) -> JSONResponse:
    return JSONResponse(err.to_payload(), status_code=err.status_code)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = ".".join(str(p) for p in error.get("loc", ()))
        if error.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}")
        else:
            parts.append(f"{loc}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts)


class AnswerCutOffCalls:
    """The outermost layer of a stopping node: a call still running when the server's graceful shutdown
    timeout cancels it (an exec of a long command, a create that was already admitted) is answered
    :class:`DaemonStopping` (503, naming the node) instead of the server's bare HTTP 500. An exec's command
    is killed with it, as when a client hangs up; a create cut off is undone; a destroy goes on (shielded).
    A stream already under way just ends (the SDK then raises ConnectionFailed: no exit event); a call
    cancelled while the daemon is not stopping is left to the server."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            stopping = self.engine.stopping
            if started or stopping is None:
                raise
            killed = " (the command it was running is killed)" if "/exec" in scope["path"] else ""
            err = DaemonStopping(f"{scope['method']} {scope['path']} was cut off{killed}: {stopping}")
            await _error_response(err)(scope, receive, send)
            # The task ends here: the server cancelled it at shutdown and waits for nothing of it.


class _NodeAPI(FastAPI):
    """The FastAPI app, with the fast path's requests taken before its middleware stack when no token guard
    of the node's wraps it (the node's unix socket; the gateway, whose own guard then goes in front of the
    fast path): ServerErrorMiddleware, FastAPI's telemetry and body-limit layers and Starlette's wrap every
    ``send`` of an answer in a frame of their own, a visible share of the CPU per exec or per create.
    Behind the node's token guard the fast path stays inside it, where every route is."""

    front: ASGIApp | None = None
    """What takes every HTTP request first (it passes what it does not serve on to :meth:`full_stack`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front is not None and scope["type"] == "http":
            await self.front(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def full_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every request the fast path does not serve."""
        await super().__call__(scope, receive, send)


def create_app(api: ServedAPI, token: str | None = None, *, max_body: int = MAX_FILE_BYTES,
               tokens: TokenFile | None = None, guard: Callable[[ASGIApp], ASGIApp] | None = None) -> FastAPI:
    """The node's FastAPI app over ``api`` (a node's engine, or the cluster gateway); with ``token`` (admin)
    or ``tokens`` (the token file), every route but ``GET /v1/health`` needs a token (see
    :mod:`dsec.daemon.auth` for scopes, rate limits and the sandbox-scoped tokens of cluster mode);
    ``max_body``: the largest file body a route reads. ``guard``: the caller's own guard (the gateway's job
    guard) wrapped around the fast path, in front of the whole stack: every HTTP request passes it first."""
    app = _NodeAPI(
        title="DSec node API",
        version=__version__,
        description=(
            "Sandboxes of one DSec node. Errors are `{\"error\": {\"type\", \"message\", \"detail\"}}`. "
            "On TCP every route except `GET /v1/health` needs `Authorization: Bearer <token>`."
        ),
        responses=ERROR_RESPONSES,
    )

    @app.exception_handler(DSecError)
    async def _dsec_error(_request: Request, exc: DSecError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(InvalidRequest(_validation_message(exc)))

    bind_routes(app, api, max_body=max_body)
    from dsec.daemon.ui import mount_ui

    mount_ui(app)
    describe_errors(app)
    if token is not None or tokens is not None:
        app.add_middleware(FastPath, api=api)  # added first: the token guard wraps it
        app.add_middleware(AuthGuard, admin_token=token, tokens=tokens, owner_of=api.owner_labels)
    elif guard is not None:  # the caller's guard in front of the fast path, both in front of the whole stack
        app.front = guard(FastPath(app.full_stack, api))
    else:  # nothing guards the app (the node's unix socket): the fast path goes in front of the whole stack
        app.front = FastPath(app.full_stack, api)
    return app


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the node API (what ``scripts/gen-openapi`` writes to ``docs/openapi.json``)."""
    import tempfile
    from pathlib import Path

    from dsec.config import Settings
    from dsec.daemon.image_pins import NoImages

    with tempfile.TemporaryDirectory() as home:
        # Routes never touch the engine while the document is built; it only has to exist.
        engine = Engine(Settings(home=Path(home), node="openapi"), {}, NoImages("documentation only"))
        return create_app(engine).openapi()

