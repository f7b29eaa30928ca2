"""The server binding: every operation of :class:`~dsec.api.protocol.NodeAPI` served over HTTP.

:func:`bind_routes` adds one FastAPI route per operation, built from its declaration (path, query and body
parameters with their documentation, the answer's status and media type), so the OpenAPI document is the
protocol's. :class:`FastPath` serves the operations declared ``fast`` (create, exec, destroy: what an RL loop
sends thousands of times) from the same declarations, without FastAPI's routing, dependency solving and
per-field validation. Each route parses its input, calls the one method of the implementation (the node's
engine, or the gateway) and serialises the answer; it must never hold logic about sandboxes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import IO, Annotated, Any, TypeVar
from urllib.parse import parse_qs

import pydantic
from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, TypeAdapter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.errors import DSecError, InvalidRequest, SandboxError

from .operations import JSON, OCTET, Operation, Slot, close_stream, operations_of
from .protocol import NodeAPI

__all__ = ["ERROR_RESPONSES", "FastPath", "bind_routes", "describe_errors"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_HTTP = "dsec_http_request"
_BODY = "dsec_body"
_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorPayload"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": desc, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for code, desc in [
        (400, "InvalidRequest"), (401, "Unauthorized"), (403, "Forbidden"), (404, "SandboxNotFound / ImageNotFound"),
        (408, "SandboxTimeout"), (409, "SandboxStateError / ReplayDivergence"), (429, "RateLimited / QuotaExceeded"),
        (501, "NotSupported"),
        (503, "BackendUnavailable / DaemonStopping / StoreUnavailable"),
    ]
}
"""The error answers every route may give (documented once for all of them)."""


# -- answers -----------------------------------------------------------------------------------------------

async def _lines(items: AsyncIterator[BaseModel], op: Operation[Any, Any],
                 upload: IO[bytes] | None) -> AsyncIterator[bytes]:
    """An NDJSON body. A stream whose items carry errors ends with an ``error`` item when it fails (a command's
    unexpected failure is a SandboxError, as on ``exec/result``); any other stream just ends."""
    item_type = op.answer_type
    try:
        async for item in items:
            yield item.model_dump_json().encode() + b"\n"
    except DSecError as exc:
        if "error" not in item_type.model_fields:
            raise
        yield item_type(type="error", error=exc.to_payload()["error"]).model_dump_json().encode() + b"\n"
    except Exception as exc:
        if not op.runs_command:
            raise
        log.exception("%s failed", op.name)
        err = SandboxError(f"exec failed: {type(exc).__name__}: {exc}")
        yield item_type(type="error", error=err.to_payload()["error"]).model_dump_json().encode() + b"\n"
    finally:
        # Reached on normal end and when the server cancels us after a client disconnect; closing the
        # implementation's stream is what kills the command (or cancels the build).
        await close_stream(items)
        if upload is not None:
            upload.close()


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


async def _command(work: Coroutine[Any, Any, T]) -> T:
    """An unexpected failure of a command becomes a SandboxError, as it does on the stream."""
    try:
        return await work
    except (DSecError, asyncio.CancelledError):
        raise
    except Exception as exc:
        log.exception("exec failed")
        raise SandboxError(f"exec failed: {type(exc).__name__}: {exc}") from exc


async def _spool(request: Request, slot: Slot, limit: int) -> IO[bytes]:
    """An uploaded body in a temporary file (in memory up to 64 MiB), rewound; InvalidRequest past ``limit``
    (the parameter's description, if any, says what to do about it)."""
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_IN_MEMORY)  # noqa: SIM115 (returned open)
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                hint = f": {slot.param.description}" if slot.param.description else ""
                raise InvalidRequest(f"the {slot.name.replace('_', ' ')} sent is larger than {limit} bytes{hint}")
            if size > _IN_MEMORY:
                await asyncio.to_thread(spool.write, chunk)
            else:
                spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


_IN_MEMORY = 64 * 1024**2


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


def _dump(op: Operation[Any, Any]) -> Callable[[Any], bytes]:
    """Serialise an operation's JSON answer (a model's own serializer: what ``model_dump_json`` runs)."""
    kind = op.answer_type
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        serialize: Callable[[Any], bytes] = kind.__pydantic_serializer__.to_json
        return serialize
    return TypeAdapter(kind).dump_json


# -- the routes --------------------------------------------------------------------------------------------

def bind_routes(app: FastAPI, api: NodeAPI, *, max_body: int) -> None:
    """One route per operation of ``api`` (``max_body``: the largest raw body a route reads)."""
    for op in operations_of(NodeAPI):
        _bind(app, api, op, max_body)


def _bind(app: FastAPI, api: NodeAPI, op: Operation[Any, Any], max_body: int) -> None:
    call: Callable[..., Any] = getattr(api, op.name)
    wire = {_wire_name(s): s for s in op.slots if s.where in ("path", "query")}
    headers = {_header_name(s): s for s in op.slots if s.param.codec is not None and s.param.codec.header}
    fields = [s.name for s in op.slots if s.where == "body_field"]
    raw = next((s.name for s in op.slots if s.where == "raw"), None)
    upload = next((s for s in op.slots if s.where == "upload"), None)
    respond = _responder(op)

    async def endpoint(**given: Any) -> Response:
        http: Request | None = given.pop(_HTTP, None)
        sent = {headers[name].name: given.pop(name) for name in headers}
        args: dict[str, Any] = {}
        for name, value in given.items():
            slot = wire.get(name)
            if slot is None:
                args[name] = value  # the model of the JSON body
            elif slot.param.codec is not None:
                codec = slot.param.codec
                args[slot.name] = codec.decode(value, sent[slot.name]) if codec.header else codec.decode(value)
            else:
                args[slot.name] = value
        if fields:
            model = args.pop(_BODY)
            args.update({name: getattr(model, name) for name in fields})
        if raw is not None:
            assert http is not None
            args[raw] = await _body(http, max_body)
        spooled = None
        if upload is not None:
            assert http is not None
            spooled = args[upload.name] = await _spool(http, upload, int(upload.param.le or max_body))
        if op.streams:
            try:
                items = call(**args)
            except BaseException:
                if spooled is not None:
                    spooled.close()
                raise
            return StreamingResponse(_lines(items, op, spooled), media_type=op.media_type)
        try:
            if op.runs_command:
                assert http is not None
                return respond(await _until_hangup(http.receive, _command(call(**args))))
            return respond(await call(**args))
        finally:
            if spooled is not None:
                spooled.close()

    endpoint.__name__ = op.route_name
    endpoint.__doc__ = op.doc
    endpoint.__signature__ = _signature(op)  # type: ignore[attr-defined]
    kind: dict[str, Any] = {"response_model": op.answer_type if op.answer == "json" else None}
    if op.answer in ("bytes", "stream"):
        kind["response_class"] = StreamingResponse if op.streams else Response
        kind["responses"] = {op.status: _documented_answer(op)}
    if raw is not None or upload is not None:
        kind["openapi_extra"] = {"requestBody": {"required": True, "content": {OCTET: {"schema": _BINARY}}}}
    app.add_api_route(op.path, endpoint, methods=[op.method], status_code=op.status, tags=list(op.tags),
                      name=op.route_name, description=op.doc, **kind)


_BINARY = {"type": "string", "format": "binary"}


def _wire_name(slot: Slot) -> str:
    return slot.wire_name if slot.where == "query" else slot.name


def _header_name(slot: Slot) -> str:
    """The endpoint's parameter for the header a codec uses (FastAPI reads ``x_name`` as ``x-name``)."""
    assert slot.param.codec is not None and slot.param.codec.header is not None
    return slot.param.codec.header.lower().replace("-", "_")


def _signature(op: Operation[Any, Any]) -> inspect.Signature:
    """What FastAPI reads of the route: its path, query and body parameters."""
    params = []
    kw = inspect.Parameter.KEYWORD_ONLY
    for slot in op.slots:
        if slot.where == "path":  # a string, or a number (a pid, a port) that FastAPI checks as one
            params.append(inspect.Parameter(slot.name, kw, annotation=int if slot.annotation is int else str))
        elif slot.where == "query":
            meta, codec = slot.param, slot.param.codec
            annotation = codec.wire if codec is not None else slot.annotation
            if meta.description is not None or meta.ge is not None or meta.le is not None:
                annotation = Annotated[annotation, Query(description=meta.description, ge=meta.ge, le=meta.le)]
            default = slot.default if slot.required or codec is None else codec.default
            params.append(inspect.Parameter(slot.wire_name, kw, annotation=annotation, default=default))
            if codec is not None and codec.header is not None:
                params.append(inspect.Parameter(_header_name(slot), kw, default=None, annotation=Annotated[
                    str | None, Header(description=codec.header_description)]))
        elif slot.where == "body":
            params.append(inspect.Parameter(slot.name, kw, annotation=slot.annotation))
    if op.body_model is not None:
        params.append(inspect.Parameter(_BODY, kw, annotation=op.body_model))
    if op.runs_command or any(s.where in ("raw", "upload") for s in op.slots):
        params.append(inspect.Parameter(_HTTP, kw, annotation=Request))
    return inspect.Signature(params)


def _responder(op: Operation[Any, Any]) -> Callable[[Any], Response]:
    status = op.status
    if op.answer == "empty":
        return lambda _: Response(status_code=status)
    if op.answer == "bytes":
        media = op.media_type
        return lambda value: Response(content=value, status_code=status, media_type=media)
    dump = _dump(op)
    return lambda value: Response(content=dump(value), status_code=status, media_type=JSON)


def _documented_answer(op: Operation[Any, Any]) -> dict[str, Any]:
    """The OpenAPI entry of a raw or streamed answer (a JSON one is FastAPI's, from the response model)."""
    media = op.media_type.split(";")[0].strip()
    if op.streams:
        content: dict[str, Any] = {"schema": {"$ref": f"#/components/schemas/{op.answer_type.__name__}"}}
    else:
        content = {"schema": _BINARY} if media == OCTET else {}
    return {"description": op.answer_description or "", "content": {media: content}}


def describe_errors(app: FastAPI) -> None:
    """Put the error payload and the streams' item models into the OpenAPI components; drop FastAPI's 422
    (validation errors are answered as 400 InvalidRequest)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
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
        for op in operations_of(NodeAPI):
            if op.streams:
                item = op.answer_type.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in item.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas.setdefault(op.answer_type.__name__, item)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# -- the fast path -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Fast:
    """One fast operation, worked out from its declaration."""

    op: Operation[Any, Any]
    call: Callable[..., Any]
    exact: str | None
    pattern: re.Pattern[str] | None
    body: Slot | None
    query: tuple[Slot, ...]
    dump: Callable[[Any], bytes] | None
    status: int

    @classmethod
    def of(cls, op: Operation[Any, Any], api: NodeAPI) -> _Fast:
        slots = op.slots
        if any(s.where in ("raw", "body_field") or (s.where == "query" and not _plain_int(s)) for s in slots) \
                or op.streams or op.answer == "bytes":
            raise TypeError(f"{op.name} cannot be served by the fast path: only JSON or no bodies, integer "
                            "queries, and a JSON or empty answer")
        exact = op.path if "{" not in op.path else None
        pattern = None if exact is not None else re.compile(re.sub(r"{(\w+)}", r"(?P<\1>[^/]+)", op.path))
        return cls(op, getattr(api, op.name), exact, pattern, next((s for s in slots if s.where == "body"), None),
                   tuple(s for s in slots if s.where == "query"), _dump(op) if op.answer == "json" else None,
                   op.status)

    def parse(self, scope: Scope, body: bytes) -> dict[str, Any] | None:
        """The call's arguments from the query and body, or None when FastAPI should answer (and word the 400)."""
        args: dict[str, Any] = {}
        if scope["query_string"]:
            if not self.query:
                return None
            query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            for slot in self.query:
                values = query.pop(slot.wire_name, [])
                if len(values) > 1 or (values and not (values[0].isascii() and values[0].isdigit())):
                    return None
                if values:
                    args[slot.name] = int(values[0])
            if query:
                return None
        if self.body is not None:
            content_type = dict(scope["headers"]).get(b"content-type", b"")
            if content_type.split(b";")[0].strip().lower() != b"application/json":
                return None
            try:
                args[self.body.name] = self.body.annotation.model_validate_json(body)
            except pydantic.ValidationError:
                return None
        return args


def _plain_int(slot: Slot) -> bool:
    """A query parameter the fast path parses itself: an optional non-negative integer."""
    return slot.param.codec is None and slot.annotation in (int, int | None) and slot.param.le is None and (
        slot.param.ge is None or slot.param.ge <= 0)


class FastPath:
    """The operations declared ``fast``, served without FastAPI's routing, dependency solving and per-field
    validation: each one ``model_validate_json`` of its body and one call. On the gateway the same class serves
    the gateway, so a create pays for one lean request cycle there too.

    It answers exactly what the declared routes answer (they stay, document the API and serve whatever this
    class hands back): a body that is not valid, a query it does not know, or a content type other than JSON
    go on to FastAPI with their body replayed, so their 400s are FastAPI's. Behind a bearer-token guard it sits
    inside the guard like every route; without one (the node's unix socket) the app takes it before its
    middleware stack."""

    def __init__(self, app: ASGIApp, api: NodeAPI) -> None:
        self.app = app
        routes: dict[str, list[_Fast]] = {}
        for op in operations_of(NodeAPI):
            if op.fast:
                routes.setdefault(op.method, []).append(_Fast.of(op, api))
        self._routes = {method: tuple(fast) for method, fast in routes.items()}

    def match(self, method: str, path: str) -> tuple[_Fast, dict[str, Any]] | None:
        """The fast operation serving ``method path`` and its path arguments, or None."""
        for fast in self._routes.get(method, ()):
            if fast.exact is not None:
                if path == fast.exact:
                    return fast, {}
                continue
            assert fast.pattern is not None
            found = fast.pattern.fullmatch(path)
            if found is not None:
                return fast, found.groupdict()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            matched = self.match(scope["method"], scope["path"])
            if matched is not None:
                await self._serve(*matched, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, fast: _Fast, args: dict[str, Any], scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        if fast.body is not None:
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] != "http.request":  # gone before its body arrived: nothing to run
                    return
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
        if fast.op.runs_command:
            parsed = fast.parse(scope, body)
            answer = None if parsed is None else await self._answer(
                fast, _until_hangup(receive, _command(fast.call(**args, **parsed))))
        else:
            answer = await self.answer(fast, args, scope, body)
        if answer is None:
            await self.app(scope, _replay(body, receive) if fast.body is not None else receive, send)
            return
        status, payload = answer
        if payload or status != 204:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
        else:
            await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": payload})

    async def answer(self, fast: _Fast, args: dict[str, Any], scope: Scope, body: bytes
                     ) -> tuple[int, bytes] | None:
        """The status and JSON body answering a fast operation that runs no command (``args``: its path
        arguments; ``body``: the request's whole body), or None when the app should answer (and word the 400)."""
        parsed = fast.parse(scope, body)
        if parsed is None:
            return None
        return await self._answer(fast, fast.call(**args, **parsed))

    @staticmethod
    async def _answer(fast: _Fast, call: Awaitable[Any]) -> tuple[int, bytes]:
        try:
            result = await call
            return fast.status, fast.dump(result) if fast.dump is not None else b""
        except DSecError as err:
            return err.status_code, json.dumps(err.to_payload(), ensure_ascii=False, separators=(",", ":")).encode()


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that first hands back the body already read."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
