"""The HTTP API of a node: a thin shim over :class:`~dsec.daemon.engine.Engine`.

Owns routing, parsing, serialisation, error payloads and the bearer-token check. Every route parses
its input, calls one engine method and serialises the answer; a route that grows an ``if`` about
sandboxes is a bug -- that logic belongs in the engine, where in-process tests exercise it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypeVar
from urllib.parse import parse_qs

import pydantic
from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.daemon import builds
from dsec.daemon.audit import AuditQuery
from dsec.daemon.auth import AuthGuard, TokenFile
from dsec.daemon.engine import MAX_FILE_BYTES, Engine, dsec_version
from dsec.daemon.metrics import CONTENT_TYPE
from dsec.errors import DaemonStopping, DSecError, InvalidRequest, SandboxError
from dsec.models import (
    AuditEntry,
    AuditOutcome,
    BatchCreateRequest,
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkRequest,
    ImageBuildEvent,
    ImageInfo,
    ImagePullRequest,
    KeyboardRequest,
    LifecycleEvent,
    LoggedCall,
    MouseRequest,
    NetworkRequest,
    NodeInfo,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
    TrajectoryForkRequest,
    parse_pairs,
)

if TYPE_CHECKING:
    from dsec.cluster.gateway import GatewayEngine

__all__ = ["AnswerCutOffCalls", "create_app"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NDJSON = "application/x-ndjson"
OCTET = "application/octet-stream"
_SEQ = Query(ge=0, description="Call number on a trajectory-bound sandbox (the SDK sends it; default: next)")
Seq = Annotated[int | None, _SEQ]
_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorPayload"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": desc, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for code, desc in [
        (400, "InvalidRequest"), (401, "Unauthorized"), (403, "Forbidden"), (404, "SandboxNotFound / ImageNotFound"),
        (408, "SandboxTimeout"), (409, "SandboxStateError / ReplayDivergence"), (429, "RateLimited / QuotaExceeded"),
        (501, "NotSupported"),
        (503, "BackendUnavailable / DaemonStopping / StoreUnavailable"),
    ]
}


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


async def _ndjson(events: AsyncIterator[ExecEvent]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event.model_dump_json().encode() + b"\n"
    except DSecError as exc:
        yield ExecEvent(type="error", error=exc.to_payload()["error"]).model_dump_json().encode() + b"\n"
    except Exception as exc:
        log.exception("exec stream failed")
        err = SandboxError(f"exec failed: {type(exc).__name__}: {exc}")
        yield ExecEvent(type="error", error=err.to_payload()["error"]).model_dump_json().encode() + b"\n"
    finally:
        # Reached on normal end and when the server cancels us after a client disconnect; closing
        # the engine's stream is what kills the command.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _event_lines(events: AsyncIterator[LifecycleEvent]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event.model_dump_json().encode() + b"\n"
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _until_hangup(receive: Callable[[], Awaitable[Message]], work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first (a cancelled exec kills its command, as
    closing a stream does). The body must have been read: what ``receive`` answers next is the hang-up."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if watcher.done() and current is not None and not current.cancelling():
            # Nobody reads this answer; it keeps the hang-up out of the server's error log.
            raise SandboxError("the client hung up before the command ended; it was killed") from None
        raise
    finally:
        watcher.cancel()


async def _exec_result(work: Coroutine[Any, Any, ExecResult]) -> ExecResult:
    """An unexpected failure of a one-response exec becomes a SandboxError, as it does on the stream."""
    try:
        return await work
    except (DSecError, asyncio.CancelledError):
        raise
    except Exception as exc:
        log.exception("exec failed")
        raise SandboxError(f"exec failed: {type(exc).__name__}: {exc}") from exc


_EXEC_RESULT_PATH = re.compile(r"/v1/sandboxes/([^/]+)/exec/result")
_SANDBOX_PATH = re.compile(r"/v1/sandboxes/([^/]+)")


class FastPath:
    """The three hottest calls served without FastAPI's routing, dependency solving and per-field validation:
    ``POST /v1/sandboxes/{id}/exec/result`` (what ``sb.exec`` sends) and ``POST /v1/sandboxes`` (what
    ``Sandbox.create`` sends), each one ``model_validate_json`` and one engine call, and ``DELETE
    /v1/sandboxes/{id}`` (``sb.close``: one engine call, 204); on the gateway the same class serves the
    gateway engine, so a create pays for one lean request cycle there too.

    It answers exactly what the declared routes answer (they stay, document the API and serve whatever
    this class hands back): a body that is not valid, a query other than one ``seq`` (exec) or any query
    (create), or a content type other than JSON go on to FastAPI with their body replayed, so their 400s
    are FastAPI's. Behind a bearer-token guard it sits inside the guard like every route; without one (the
    node's unix socket) the app takes it before its middleware stack (see ``_NodeAPI``).
    """

    def __init__(self, app: ASGIApp, engine: Engine | GatewayEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "DELETE" and not scope["query_string"]:
            deleted = _SANDBOX_PATH.fullmatch(scope["path"])
            if deleted is not None:
                await self._destroy(deleted.group(1), send)
                return
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        match = None if path == "/v1/sandboxes" else _EXEC_RESULT_PATH.fullmatch(path)
        if match is None and path != "/v1/sandboxes":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived: nothing to run
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        parsed = self._parse(scope, body, exec_request=match is not None)
        if parsed is None:
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, send)
            return
        request, seq = parsed
        status = 200
        try:
            if match is not None:
                assert isinstance(request, ExecRequest)
                result: pydantic.BaseModel = await _until_hangup(
                    receive, _exec_result(self.engine.exec(match.group(1), request, seq)))
            else:
                assert isinstance(request, SandboxSpec)
                result, status = await self.engine.create(request), 201
            payload = result.model_dump_json().encode()
        except DSecError as err:
            status, payload = err.status_code, json.dumps(err.to_payload(), ensure_ascii=False,
                                                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _destroy(self, sandbox_id: str, send: Send) -> None:
        """``DELETE /v1/sandboxes/{id}`` as the route answers it: 204 without a body, or the error payload.
        (The engine shields the teardown from a client that hangs up, as it does behind the route.)"""
        try:
            await self.engine.destroy(sandbox_id)
        except DSecError as err:
            payload = json.dumps(err.to_payload(), ensure_ascii=False, separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": err.status_code,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def _parse(scope: Scope, body: bytes, *, exec_request: bool
               ) -> tuple[ExecRequest | SandboxSpec, int | None] | None:
        """The request and its ``seq``, or None when FastAPI should answer (and word the 400)."""
        content_type = dict(scope["headers"]).get(b"content-type", b"")
        if content_type.split(b";")[0].strip().lower() != b"application/json":
            return None
        seq: int | None = None
        if scope["query_string"]:
            if not exec_request:
                return None
            query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            values = query.pop("seq", [])
            if query or len(values) != 1 or not (values[0].isascii() and values[0].isdigit()):
                return None
            seq = int(values[0])
        try:
            if exec_request:
                return ExecRequest.model_validate_json(body), seq
            return SandboxSpec.model_validate_json(body), None
        except pydantic.ValidationError:
            return None


def _mode(mode: str | None) -> int | None:
    if mode is None or mode == "":
        return None
    try:
        return int(mode, 8)
    except ValueError:
        raise InvalidRequest(f"mode must be an octal string such as '644' or '0755', got {mode!r}") from None


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise InvalidRequest(f"file body of {declared} bytes is over the {limit}-byte limit")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise InvalidRequest(f"file body is over the {limit}-byte limit")
    return bytes(data)


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
    """The FastAPI app, with ``sb.exec``'s requests taken before its middleware stack when no token guards
    the app (the node's unix socket): ServerErrorMiddleware, FastAPI's telemetry and body-limit layers and
    Starlette's wrap every ``send`` of an answer in a frame of their own, a visible share of the daemon's
    CPU per exec. Behind a token guard the fast path stays inside it, where every route is."""

    exec_fast_path: FastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.exec_fast_path is not None and scope["type"] == "http":
            await self.exec_fast_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def full_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every request the fast path does not serve."""
        await super().__call__(scope, receive, send)


def create_app(engine: Engine | GatewayEngine, token: str | None = None, *, max_body: int = MAX_FILE_BYTES,
               tokens: TokenFile | None = None, guarded_outside: bool = False) -> FastAPI:
    """The node's FastAPI app over ``engine`` (a node's, or the cluster gateway's, which has the same
    methods); with ``token`` (admin) or ``tokens`` (the token file), every route but ``GET /v1/health``
    needs a token (see :mod:`dsec.daemon.auth` for scopes, rate limits and the sandbox-scoped tokens of
    cluster mode). ``guarded_outside``: the caller adds its own guard middleware (the gateway's job
    guard), so the fast path must sit inside the middleware stack too, never in front of it."""
    app = _NodeAPI(
        title="DSec node API",
        version=dsec_version(),
        description=(
            "Sandboxes of one DSec node. Errors are `{\"error\": {\"type\", \"message\", \"detail\"}}`. "
            "On TCP every route except `GET /v1/health` needs `Authorization: Bearer <token>`."
        ),
        responses=_ERRORS,
    )

    @app.exception_handler(DSecError)
    async def _dsec_error(_request: Request, exc: DSecError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(InvalidRequest(_validation_message(exc)))

    @app.get("/v1/health", tags=["node"])
    async def health() -> NodeInfo:
        """Identity, version and backend availability (no token needed)."""
        return await engine.health()

    @app.get("/v1/statistics", tags=["node"])
    async def statistics() -> NodeStatistics:
        """Warm pools (ready, target, hits, misses) and the create admission queue."""
        return engine.statistics()

    @app.post("/v1/pools", tags=["node"])
    async def declare_pool(config: PoolConfig) -> PoolStatistics:
        """Declare a warm pool, or change the bounds of the pool of that shape."""
        return await engine.declare_pool(config)

    @app.post("/v1/sandboxes", status_code=201, tags=["sandboxes"])
    async def create(spec: SandboxSpec) -> SandboxInfo:
        """Create a sandbox."""
        return await engine.create(spec)

    @app.post("/v1/sandboxes/batch", status_code=201, tags=["sandboxes"])
    async def create_many(request: BatchCreateRequest) -> list[SandboxInfo]:
        """Create many sandboxes from one spec; all or nothing."""
        return await engine.create_many(request)

    @app.get("/v1/sandboxes", tags=["sandboxes"])
    async def list_sandboxes(
        label: Annotated[list[str], Query(description="`key=value`; repeat to require several")] = [],  # noqa: B006
        backend: str | None = None,
        state: str | None = None,
    ) -> list[SandboxInfo]:
        """Sandboxes matching every label filter."""
        return await engine.list(parse_pairs(label, "label filter"), backend=backend, state=state)

    @app.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get(sandbox_id: str) -> SandboxInfo:
        """One sandbox."""
        return await engine.get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def destroy(sandbox_id: str) -> Response:
        """Destroy a sandbox (idempotent)."""
        await engine.destroy(sandbox_id)
        return Response(status_code=204)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/exec",
        tags=["commands"],
        response_class=StreamingResponse,
        responses={200: {
            "description": "One JSON `ExecEvent` per line: output chunks, then one `exit` or `error`.",
            "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/ExecEvent"}}},
        }},
    )
    async def exec_(sandbox_id: str, request: ExecRequest, seq: Seq = None) -> StreamingResponse:
        """Run a command, streaming its output; hanging up kills it (not on a trajectory: it is logged)."""
        return StreamingResponse(_ndjson(engine.exec_stream(sandbox_id, request, seq)), media_type=NDJSON)

    @app.post("/v1/sandboxes/{sandbox_id}/exec/result", tags=["commands"], response_model=ExecResult)
    async def exec_result(sandbox_id: str, body: ExecRequest, request: Request, seq: Seq = None) -> Response:
        """Run a command to completion and answer its result in one response: the cheap round trip for short
        commands (what ``sb.exec`` uses); hanging up kills it (not on a trajectory: it is logged)."""
        result = await _until_hangup(request.receive, _exec_result(engine.exec(sandbox_id, body, seq)))
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/sandboxes/{sandbox_id}/call", tags=["commands"])
    async def call(sandbox_id: str, request: CallRequest) -> CallResult:
        """Run a pickled Python callable (function backend); the reply is decoded by the client."""
        return await engine.call(sandbox_id, request)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files",
        tags=["files"],
        response_class=Response,
        responses={200: {"description": "The file's bytes", "content": {OCTET: {"schema": {
            "type": "string", "format": "binary"}}}}},
    )
    async def read_file(sandbox_id: str, path: str, seq: Seq = None) -> Response:
        """Read a file."""
        return Response(await engine.read_file(sandbox_id, path, max_body, seq), media_type=OCTET)

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files",
        status_code=204,
        tags=["files"],
        openapi_extra={"requestBody": {"required": True, "content": {OCTET: {"schema": {
            "type": "string", "format": "binary"}}}}},
    )
    async def write_file(
        sandbox_id: str,
        path: str,
        request: Request,
        mode: Annotated[str | None, Query(description="octal permission bits, e.g. `644`")] = None,
        seq: Seq = None,
    ) -> Response:
        """Create or replace a file (parents created)."""
        await engine.write_file(sandbox_id, path, await _body(request, max_body), _mode(mode), seq)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", tags=["files"])
    async def list_files(sandbox_id: str, path: str, seq: Seq = None) -> list[FileEntry]:
        """List a directory."""
        return await engine.list_files(sandbox_id, path, seq)

    @app.get("/v1/sandboxes/{sandbox_id}/stats", tags=["sandboxes"])
    async def stats(sandbox_id: str) -> SandboxStats:
        """Resource usage now."""
        return await engine.stats(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", tags=["sandboxes"])
    async def pause(sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Freeze every process of the sandbox; `release_memory`: also save it to disk and release its RAM."""
        return await engine.pause(sandbox_id, release_memory)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", tags=["sandboxes"])
    async def resume(sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox."""
        return await engine.resume(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/timeout", tags=["sandboxes"])
    async def set_timeout(sandbox_id: str, request: TimeoutRequest) -> SandboxInfo:
        """Destroy the sandbox `timeout` seconds from now instead of at its current deadline."""
        return await engine.set_timeout(sandbox_id, request.timeout)

    @app.get("/v1/sandboxes/{sandbox_id}/screenshot", tags=["computer use"],
             responses={200: {"content": {"image/png": {}}, "description": "the display as PNG"}},
             response_class=Response)
    async def screenshot(sandbox_id: str, seq: Seq = None) -> Response:
        """The sandbox's display as a PNG (``vm`` backend; others answer 501 NotSupported)."""
        return Response(content=await engine.screenshot(sandbox_id, seq), media_type="image/png")

    @app.post("/v1/sandboxes/{sandbox_id}/mouse", status_code=204, tags=["computer use"])
    async def mouse(sandbox_id: str, request: MouseRequest, seq: Seq = None) -> Response:
        """Move the pointer to a pixel of the display and click, press, release or scroll there."""
        await engine.mouse(sandbox_id, request, seq)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/keyboard", status_code=204, tags=["computer use"])
    async def keyboard(sandbox_id: str, request: KeyboardRequest, seq: Seq = None) -> Response:
        """Type text (US layout) or press key combos on the display."""
        await engine.keyboard(sandbox_id, request, seq)
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/network", tags=["sandboxes"])
    async def set_network(sandbox_id: str, request: NetworkRequest) -> SandboxInfo:
        """Replace the sandbox's network policy (enforced outside the sandbox, effective at once)."""
        return await engine.set_network(sandbox_id, request.network)

    @app.post("/v1/sandboxes/{sandbox_id}/reveal", tags=["sandboxes"])
    async def reveal(sandbox_id: str, seq: Seq = None) -> SandboxInfo:
        """Make the sandbox's hidden paths visible, read-only (for grading; a logged call on a trajectory)."""
        return await engine.reveal(sandbox_id, seq)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", tags=["sandboxes"])
    async def snapshot(sandbox_id: str, seq: Seq = None) -> SnapshotRef:
        """Save the sandbox's writable state (a checkpoint of its trajectory, if bound to one)."""
        return await engine.snapshot(sandbox_id, seq)

    @app.post("/v1/sandboxes/{sandbox_id}/lease", tags=["trajectories"])
    async def renew_lease(sandbox_id: str) -> SandboxInfo:
        """Renew the lease of a trajectory-bound sandbox (the SDK's heartbeat while its client is idle)."""
        return await engine.renew_lease(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, tags=["sandboxes"])
    async def fork(sandbox_id: str, request: ForkRequest) -> list[SandboxInfo]:
        """Make independent copies of a live sandbox's state; all or nothing."""
        return await engine.fork(sandbox_id, request.count)

    @app.post("/v1/trajectories/fork", status_code=201, tags=["trajectories"])
    async def branch_trajectory(request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch a trajectory at a call: a new trajectory sharing the calls before it, on a rebuilt sandbox."""
        return await engine.branch_trajectory(request)

    @app.get("/v1/trajectories/log", tags=["trajectories"])
    async def trajectory_log(
        name: str,
        start: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[LoggedCall]:
        """Logged calls of a trajectory from `start` (the SDK fast-forwards through them)."""
        return await engine.trajectory_log(name, start, limit)

    @app.get("/v1/images", tags=["images"])
    async def list_images() -> list[ImageInfo]:
        """Images in the node's store."""
        return await engine.list_images()

    @app.post("/v1/images/pull", tags=["images"])
    async def pull_image(request: ImagePullRequest) -> ImageInfo:
        """Pull an image from an OCI registry into the node's store (returns when it is ready)."""
        return await engine.pull_image(request)

    @app.post(
        "/v1/images/build",
        tags=["images"],
        response_class=StreamingResponse,
        openapi_extra={"requestBody": {"required": True, "content": {OCTET: {"schema": {
            "type": "string", "format": "binary"}}}}},
        responses={200: {
            "description": "One JSON `ImageBuildEvent` per line: the builder's output, then one `done` or `error`.",
            "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/ImageBuildEvent"}}},
        }},
    )
    async def build_image(
        http: Request,
        request: Annotated[str, Query(description="the `ImageBuildRequest` as JSON (no password)")],
        x_registry_auth: Annotated[str | None, Header(description="base64url JSON username/password")] = None,
    ) -> StreamingResponse:
        """Build an image from a Dockerfile; the body is the build context as a tar. Hanging up cancels it."""
        parsed = builds.parse_request(request, x_registry_auth)
        context = await builds.spool_context(http.stream())
        return StreamingResponse(builds.event_lines(engine.build_image(parsed, context), context),
                                 media_type=NDJSON)

    @app.get("/v1/images/{name}", tags=["images"])
    async def get_image(name: str) -> ImageInfo:
        """One image."""
        return await engine.get_image(name)

    @app.get("/v1/overview", tags=["node"])
    async def overview() -> NodeOverview:
        """Counters, load, failures by reason, image cache, pools and audit trail in one answer (the dashboard
        polls it; rates are differences between two polls)."""
        return await engine.overview()

    @app.get("/v1/audit", tags=["audit"])
    async def audit(
        sandbox_id: str | None = None,
        who: Annotated[str | None, Query(description="token name (`local` on the unix socket)")] = None,
        job: str | None = None,
        outcome: AuditOutcome | None = None,
        since: Annotated[float | None, Query(description="Unix seconds")] = None,
        until: Annotated[float | None, Query(description="Unix seconds")] = None,
        before: Annotated[int | None, Query(ge=1, description="only entries with a smaller `id` (paging)")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[AuditEntry]:
        """Commands run in this node's sandboxes, newest first, matching every filter given."""
        return await engine.audit_log(AuditQuery(sandbox_id=sandbox_id, who=who, job=job, outcome=outcome,
                                                 since=since, until=until, before=before, limit=limit))

    @app.get("/v1/sandboxes/{sandbox_id}/logs", tags=["audit"])
    async def sandbox_logs(
        sandbox_id: str,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        before: Annotated[int | None, Query(ge=1)] = None,
    ) -> list[AuditEntry]:
        """A sandbox's command history with the head of each command's output, newest first (kept outside the
        sandbox; still there after it is destroyed)."""
        return await engine.sandbox_logs(sandbox_id, limit, before)

    @app.get(
        "/v1/events",
        tags=["node"],
        response_class=StreamingResponse,
        responses={200: {
            "description": "One JSON `LifecycleEvent` per line, as they happen; the stream does not end.",
            "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/LifecycleEvent"}}},
        }},
    )
    async def events(
        since: Annotated[int | None, Query(ge=0, description="first replay the kept events after this `seq`")] = None,
    ) -> StreamingResponse:
        """Stream sandbox lifecycle events (created, destroyed, expired, paused, resumed, create_failed)."""
        return StreamingResponse(_event_lines(engine.subscribe(since)), media_type=NDJSON)

    @app.get(
        "/metrics",
        tags=["node"],
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        """Prometheus metrics of this node."""
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    from dsec.daemon.ui import mount_ui

    mount_ui(app)
    _add_error_schema(app)
    if token is not None or tokens is not None or guarded_outside:
        app.add_middleware(FastPath, engine=engine)  # added first: the token guard wraps it
        if token is not None or tokens is not None:
            app.add_middleware(AuthGuard, admin_token=token, tokens=tokens, owner_of=engine.owner_labels)
    else:  # nothing guards the app (the node's unix socket): the fast path goes in front of the whole stack
        app.exec_fast_path = FastPath(app.full_stack, engine)
    return app


def _add_error_schema(app: FastAPI) -> None:
    """Put the error payload and ExecEvent (used by the NDJSON stream) into the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        # Validation errors are answered as 400 InvalidRequest, never FastAPI's 422: drop its entries.
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorPayload"] = {
            "title": "ErrorPayload",
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["type", "message", "detail"],
                "properties": {
                    "type": {"type": "string", "description": "DSecError subclass name"},
                    "message": {"type": "string"},
                    "detail": {"type": "object"},
                },
            }},
        }
        event = ExecEvent.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in event.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas.setdefault("ExecEvent", event)
        lifecycle = LifecycleEvent.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.setdefault("LifecycleEvent", lifecycle)
        build_event = ImageBuildEvent.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in build_event.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas.setdefault("ImageBuildEvent", build_event)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the node API (what ``scripts/gen-openapi`` writes to ``docs/openapi.json``)."""
    import tempfile
    from pathlib import Path

    from dsec.config import Settings
    from dsec.daemon.engine import _NoImages

    with tempfile.TemporaryDirectory() as home:
        # Routes never touch the engine while the document is built; it only has to exist.
        engine = Engine(Settings(home=Path(home), node="openapi"), {}, _NoImages("documentation only"))
        return create_app(engine).openapi()

