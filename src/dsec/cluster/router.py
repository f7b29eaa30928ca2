"""The front of a gateway replica: calls for another replica's sandboxes are passed on to it.

Owns the one-hop forwarding between replicas that share the nodes in cells (:mod:`dsec.cluster.cells`):
a call on a sandbox this replica has no record of goes to the replica that owns the cell of the node the
database names for it (or, for a sandbox answered but not yet committed, to each other live replica in
turn until one knows it), and a create arriving while this replica places on no node goes to another
replica. The request is sent on as it came (method, path, query, body, the caller's token) with
``X-DSec-Forwarded`` so it is never passed on twice, and the answer streams back as it comes (an exec's
NDJSON included). Pure ASGI; it must never interpret an answer.
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["FORWARDED_HEADER", "ReplicaRouter", "Routing", "was_forwarded"]

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-DSec-Forwarded"
was_forwarded: contextvars.ContextVar[bool] = contextvars.ContextVar("dsec_forwarded", default=False)
"""Whether the request being served was passed on by another replica (it is passed on no further)."""
_SANDBOX = re.compile(r"^/v1/sandboxes/([^/]+)(/.*)?$")
_FORWARDED = FORWARDED_HEADER.lower().encode()
_CREATES = {"/v1/sandboxes", "/v1/sandboxes/batch", "/v1/sandboxes/batch/stream"}
_NOT_IDS = {"batch", "destroy"}
"""Path segments after ``/v1/sandboxes/`` that name a route on many sandboxes, not a sandbox."""
_KEEP = {b"content-type", b"retry-after"}
"""Answer headers passed back (the rest are the hop's own: length, encoding, connection)."""


class Routing(Protocol):
    """What the router asks the gateway engine."""

    def holds(self, sandbox_id: str) -> bool:
        """Whether this replica has a record of the sandbox."""

    async def owners_of(self, sandbox_id: str) -> Sequence[str]:
        """URLs of the replicas that may hold it, most likely first (empty: nobody else)."""

    def other_replicas(self) -> Sequence[str]:
        """URLs of the other live replicas."""

    def places(self) -> bool:
        """Whether this replica places on any node now."""


class ReplicaRouter:
    """ASGI middleware in front of the gateway app (see the module docstring)."""

    def __init__(self, app: ASGIApp, routing: Routing) -> None:
        self.app = app
        self.routing = routing
        self.forwarded = 0
        """Requests passed on to another replica (a counter)."""
        self._http: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.passed_on(scope):
            reset = was_forwarded.set(True)
            try:
                await self.app(scope, receive, send)
            finally:
                was_forwarded.reset(reset)
            return
        targets = await self._targets(scope)
        if not targets:
            await self.app(scope, receive, send)
            return
        body = await _body(receive)
        for i, target in enumerate(targets):
            last = i == len(targets) - 1
            if await self._forward(target, scope, body, send, only_if_found=not last):
                return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def passed_on(scope: Scope) -> bool:
        """Whether another replica passed this request on (it is served here, and passed on no further)."""
        return _FORWARDED in dict(scope["headers"])

    def serves_here(self, scope: Scope) -> bool:
        """Whether a request that was not passed on is this replica's own, known without waiting (False: it
        may be another replica's; :meth:`__call__` finds out)."""
        path, method = scope["path"], scope["method"]
        if path in _CREATES and method == "POST":
            return self.routing.places()
        found = _SANDBOX.match(path)
        return found is None or found.group(1) in _NOT_IDS or self.routing.holds(found.group(1))

    async def _targets(self, scope: Scope) -> Sequence[str]:
        if self.serves_here(scope):
            return []
        if scope["path"] in _CREATES and scope["method"] == "POST":
            return self.routing.other_replicas()[:1]
        found = _SANDBOX.match(scope["path"])
        assert found is not None
        return await self.routing.owners_of(found.group(1))

    async def _forward(self, target: str, scope: Scope, body: bytes, send: Send, *, only_if_found: bool) -> bool:
        """Pass the request to ``target`` and stream its answer back; with ``only_if_found``, a 404 there is
        not passed back (False: try the next replica)."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=60.0),
                                           limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        headers.append((FORWARDED_HEADER.encode(), b"1"))
        url = target.rstrip("/") + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"]
                                                    else "")
        try:
            request = self._http.build_request(scope["method"], url, headers=headers, content=body)
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("replica %s did not answer a forwarded %s %s: %r", target, scope["method"], scope["path"],
                        exc)
            return False
        try:
            if only_if_found and response.status_code == 404:
                return False
            self.forwarded += 1
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() in _KEEP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, then: Receive) -> Receive:
    """The body already read, then the client's own messages (a disconnect while an answer streams)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
        return message

    return receive
