"""E2B's control plane (REST, ``spec/openapi.yml`` of e2b-dev/E2B) over DSec's node API.

Owns the routes E2B's SDK calls to create, list, inspect, time, pause, resume, connect, fork and kill
sandboxes, and a clear "not supported by DSec" for the rest of E2B's API (templates builds, volumes,
secrets, teams...). Each route checks the API key, translates, makes one node API call (two for connect
and resume) and translates back. It must never keep sandbox state of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from dsec.api.protocol import NodeAPI
from dsec.daemon.audit import caller
from dsec.e2b import translate
from dsec.e2b.keys import JOB_LABEL, EnvdTokens, Keys, Principal
from dsec.e2b.options import E2BOptions
from dsec.errors import (
    DSecError,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    SandboxNotFound,
    SandboxStateError,
    Unauthorized,
)
from dsec.models import SandboxInfo

__all__ = ["ControlPlane"]

Handler = Callable[[Request, Principal], Awaitable[Response]]

UNSUPPORTED = ("/templates", "/v2/templates", "/v3/templates", "/volumes", "/volumecontent", "/secrets", "/teams",
               "/snapshots", "/nodes", "/admin", "/access-tokens", "/api-keys", "/default-templates")
"""Path prefixes of E2B's API that DSec does not offer."""


def error_response(exc: DSecError) -> JSONResponse:
    """E2B's ``Error`` body for a DSec error."""
    status, body = translate.rest_status(exc)
    return JSONResponse(body, status_code=status)


async def _json(request: Request, *, required: bool) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidRequest("this call needs a JSON body")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def _seconds(body: dict[str, Any], key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{key} must be a non-negative integer of seconds, got {value!r}")
    return value


def _metadata_query(request: Request) -> dict[str, str]:
    """``?metadata=k1%3Dv1%26k2%3Dv2`` (each key and value URL-encoded once more) as a dict."""
    raw = request.query_params.get("metadata")
    if not raw:
        return {}
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=False)
    if not pairs and raw:
        raise InvalidRequest(f"metadata filter must look like key=value&key2=value2, got {raw!r}")
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _started_after(value: str | None) -> int:
    """``startedAfter`` (RFC 3339) in microseconds since the epoch; 0 when absent."""
    if not value:
        return 0
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"startedAfter must be an RFC 3339 time, got {value!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return translate.micros(when)


@dataclass
class ControlPlane:
    """The REST routes over one node API."""

    api: NodeAPI
    options: E2BOptions
    keys: Keys
    tokens: EnvdTokens

    def router(self) -> Router:
        """The Starlette router of every control-plane route."""
        routes = [
            Route("/health", self._health, methods=["GET"]),
            Route("/sandboxes", self._guard(self._list_v1), methods=["GET"]),
            Route("/v2/sandboxes", self._guard(self._list_v2), methods=["GET"]),
            Route("/sandboxes", self._guard(self._create), methods=["POST"]),
            Route("/v2/sandboxes", self._guard(self._create), methods=["POST"]),
            Route("/sandboxes/{sid}", self._guard(self._get), methods=["GET"]),
            Route("/sandboxes/{sid}", self._guard(self._kill), methods=["DELETE"]),
            Route("/sandboxes/{sid}/timeout", self._guard(self._timeout), methods=["POST"]),
            Route("/sandboxes/{sid}/refreshes", self._guard(self._refresh), methods=["POST"]),
            Route("/sandboxes/{sid}/connect", self._guard(self._connect), methods=["POST"]),
            Route("/v2/sandboxes/{sid}/connect", self._guard(self._connect), methods=["POST"]),
            Route("/sandboxes/{sid}/pause", self._guard(self._pause), methods=["POST"]),
            Route("/sandboxes/{sid}/resume", self._guard(self._resume), methods=["POST"]),
            Route("/sandboxes/{sid}/fork", self._guard(self._fork), methods=["POST"]),
            Route("/sandboxes/{sid}/metrics", self._guard(self._metrics), methods=["GET"]),
            Route("/sandboxes/{sid}/network", self._guard(self._network), methods=["PUT"]),
        ]
        return Router(routes=routes, default=self._not_here)

    # -- plumbing ---------------------------------------------------------------------------------------

    def principal(self, request: Request) -> Principal:
        """The caller of ``request`` (``X-API-Key``, or the deprecated bearer access token)."""
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        found = self.keys.principal(key) if key else None
        if found is None:
            raise Unauthorized("missing or unknown API key: set E2B_API_KEY to a DSec token (`dsec token create`, "
                               "or the daemon's --token)")
        return found

    def _guard(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            try:
                who = self.principal(request)
                caller.set(who.name)
                with self.keys.acting(who):
                    return await handler(request, who)
            except DSecError as exc:
                return error_response(exc)

        return guarded

    async def owned(self, sandbox_id: str, who: Principal) -> SandboxInfo:
        """The sandbox, if this caller may see it (else the 404 of a sandbox that does not exist)."""
        try:
            info = await self.api.get(sandbox_id)
        except SandboxNotFound:
            info = None
        if info is None or not who.owns(info.labels) or info.state not in ("running", "paused", "creating"):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return info

    def _sandbox(self, info: SandboxInfo, status: int) -> JSONResponse:
        body = translate.sandbox(info, self.tokens.token(info.id), self.tokens.traffic_token(info.id, info.labels),
                                 self.options.domain)
        return JSONResponse(body, status_code=status)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=204)

    async def _not_here(self, scope: Any, receive: Any, send: Any) -> None:
        path, method = scope.get("path", ""), scope.get("method", "")
        if any(path == p or path.startswith(p + "/") for p in UNSUPPORTED):
            await error_response(NotSupported(
                f"{method} {path} is not supported by DSec: it serves E2B sandboxes, commands, files and ports, not "
                "E2B's template builds, volumes, secrets or teams"))(scope, receive, send)
            return
        await JSONResponse({"code": 404, "message": f"no E2B API route {method} {path}"}, status_code=404)(
            scope, receive, send)

    # -- routes -------------------------------------------------------------------------------------------

    async def _create(self, request: Request, who: Principal) -> Response:
        spec = translate.spec_from_new(await _json(request, required=True), self.options, who)
        if spec.backend == "container" and spec.image is not None:
            with contextlib.suppress(ImageNotFound):  # create names the missing image itself
                spec = translate.with_image(spec, await self.api.get_image(spec.image))
        return self._sandbox(await self.api.create(spec), 201)

    async def _mine(self, request: Request, who: Principal) -> list[SandboxInfo]:
        labels = _metadata_query(request)
        if who.job is not None:
            labels[JOB_LABEL] = who.job
        infos = await self.api.list(labels)
        return [i for i in infos if i.state in ("running", "paused") and who.owns(i.labels)]

    async def _list_v1(self, request: Request, who: Principal) -> Response:
        return JSONResponse([translate.listed(i) for i in await self._mine(request, who) if i.state == "running"])

    async def _list_v2(self, request: Request, who: Principal) -> Response:
        states = {s for s in request.query_params.get("state", "running,paused").split(",") if s}
        if not states <= {"running", "paused"}:
            raise InvalidRequest(f"state must be running and/or paused, got {sorted(states)}")
        template = request.query_params.get("template")
        after = _started_after(request.query_params.get("startedAfter"))
        # startedAt went out rounded to the microsecond: compare at that resolution, so a sandbox's own
        # startedAt given back as startedAfter still lists it.
        infos = [i for i in await self._mine(request, who) if (i.state in states)
                 and translate.micros(i.created_at) >= after
                 and (template is None or translate.listed(i)["templateID"] == template)]
        infos.sort(key=lambda i: (i.created_at, i.id), reverse=request.query_params.get("order", "desc") != "asc")
        limit = int(request.query_params.get("limit") or 100)
        if not 1 <= limit <= 100:
            raise InvalidRequest(f"limit must be between 1 and 100, got {limit}")
        start = 0
        token = request.query_params.get("nextToken")
        if token:
            ids = [i.id for i in infos]
            if token not in ids:
                raise InvalidRequest(f"nextToken {token!r} names no listed sandbox (the list changed; start over)")
            start = ids.index(token)
        page = infos[start:start + limit]
        headers = {"X-Total-Running": str(sum(1 for i in infos if i.state == "running"))}
        if start + limit < len(infos):
            headers["X-Next-Token"] = infos[start + limit].id
        return JSONResponse([translate.listed(i) for i in page], headers=headers)

    async def _get(self, request: Request, who: Principal) -> Response:
        info = await self.owned(request.path_params["sid"], who)
        return JSONResponse(translate.detail(info, self.tokens.token(info.id), self.options.domain))

    async def _kill(self, request: Request, who: Principal) -> Response:
        info = await self.owned(request.path_params["sid"], who)
        await self.api.destroy(info.id)
        return Response(status_code=204)

    async def _timeout(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=True)
        info = await self.owned(request.path_params["sid"], who)
        await self.api.set_timeout(info.id, max(_seconds(body, "timeout"), 1))
        return Response(status_code=204)

    async def _refresh(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=False)
        info = await self.owned(request.path_params["sid"], who)
        duration = _seconds(body, "duration", 60)
        if info.expires_at < time.time() + duration:  # a refresh only extends
            await self.api.set_timeout(info.id, max(duration, 1))
        return Response(status_code=204)

    async def _connect(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=False)
        info = await self.owned(request.path_params["sid"], who)
        status = 200
        if info.state == "paused":
            info, status = await self.api.resume(info.id), 201
        if "timeout" in body:
            timeout = _seconds(body, "timeout")
            if info.expires_at < time.time() + timeout:  # connect only extends
                info = await self.api.set_timeout(info.id, max(timeout, 1))
        return self._sandbox(info, status)

    async def _pause(self, request: Request, who: Principal) -> Response:
        info = await self.owned(request.path_params["sid"], who)
        if info.state == "paused":
            raise SandboxStateError(f"sandbox {info.id} is already paused", sandbox_id=info.id)
        await self.api.pause(info.id)
        return Response(status_code=204)

    async def _resume(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=False)
        info = await self.owned(request.path_params["sid"], who)
        if info.state != "paused":
            raise SandboxStateError(f"sandbox {info.id} is already running", sandbox_id=info.id)
        info = await self.api.resume(info.id)
        info = await self.api.set_timeout(info.id, max(_seconds(body, "timeout", 15), 1))
        return self._sandbox(info, 201)

    async def _fork(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=False)
        info = await self.owned(request.path_params["sid"], who)
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 100:
            raise InvalidRequest(f"count must be an integer between 1 and 100, got {count!r}")
        copies = await self.api.fork(info.id, count)
        timeout = body.get("timeout")
        results = []
        for copy in copies:
            if timeout is not None:
                copy = await self.api.set_timeout(copy.id, max(_seconds(body, "timeout"), 1))
            results.append({"sandbox": translate.sandbox(copy, self.tokens.token(copy.id),
                                                         self.tokens.traffic_token(copy.id, copy.labels),
                                                         self.options.domain)})
        return JSONResponse(results, status_code=201)

    async def _metrics(self, request: Request, who: Principal) -> Response:
        info = await self.owned(request.path_params["sid"], who)
        stats = await self.api.stats(info.id)
        return JSONResponse([translate.metric(stats, info, time.time())])

    async def _network(self, request: Request, who: Principal) -> Response:
        body = await _json(request, required=True)
        info = await self.owned(request.path_params["sid"], who)
        await self.api.set_network(info.id, translate.network_update(body))
        return Response(status_code=204)
