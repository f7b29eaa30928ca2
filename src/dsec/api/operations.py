"""How each operation of the node API travels over HTTP, declared once, next to its signature.

``@operation(method, path, ...)`` on a method of :class:`~dsec.api.protocol.NodeAPI` turns it into an
:class:`Operation`. Its signature says where each argument goes:

- a ``{name}`` of the path: that path segment;
- a pydantic model: the JSON body;
- ``bytes``: the raw body (``application/octet-stream``);
- ``IO[bytes]``: a file streamed as the body, spooled to a file on the server (an upload: a build context);
- a field of the model given as ``body=``: that field of the JSON body (``fork(sandbox_id, count)`` sends
  ``ForkRequest(count=...)``);
- anything else, and any parameter with a :class:`Codec`: a query parameter, documented, bounded, renamed or
  encoded by a :class:`Param` in its ``Annotated`` metadata; one equal to its default is not sent.

Its return annotation says what comes back: a model or a list of models (JSON), ``bytes`` (a raw body of the
declared ``media_type``), ``None`` (204, no body) or an ``AsyncIterator`` of models (NDJSON, one per line).
A stream whose items have an ``error`` field ends with an ``error`` item when it fails; the client raises it.

The HTTP client (:mod:`dsec.api.client`) and the server binding (:mod:`dsec.api.binding`) both read these
declarations, so an operation's path and encodings are written nowhere else. Owns: the declaration, the
reading of signatures, and the encoding of a call and decoding of its answer on the client's side. Must
never do I/O.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import typing
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, cast, overload
from urllib.parse import quote, urlencode

import pydantic
from pydantic import BaseModel, TypeAdapter

from dsec.errors import ConnectionFailed, InvalidRequest, error_from_payload

__all__ = ["Codec", "Declared", "Operation", "Param", "Plan", "Slot", "close_stream", "operation", "operations_of"]

P = ParamSpec("P")
T = TypeVar("T")

Where = Literal["path", "query", "body", "body_field", "raw", "upload"]
Answer = Literal["json", "bytes", "empty", "stream"]
NDJSON = "application/x-ndjson"
OCTET = "application/octet-stream"
JSON = "application/json"


class Declared(Exception):
    """Raised by the body of every ``NodeAPI`` method, which never runs: the :class:`Operation` made of it
    answers attribute lookups. (Not ``NotImplementedError``: type checkers would then count the protocol's
    members as abstract in the classes that inherit them, the HTTP client and the gateway.)"""


@dataclass(frozen=True)
class Codec:
    """A query parameter whose text is not its value's own (:mod:`dsec.api.codecs`): ``wire`` is its type on the
    wire (what the server parses and documents), ``default`` its wire default, ``encode`` and ``decode`` the two
    directions. With a ``header``, part of the value travels in that header instead (what must never be in a
    URL, which proxies log): ``encode_header`` gives its value (None: not sent), and ``decode`` is given the
    header's value too."""

    wire: Any
    default: Any
    encode: Callable[[Any], str | list[str]]
    decode: Callable[..., Any]
    header: str | None = None
    header_description: str | None = None
    encode_header: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Param:
    """How a query parameter is documented and checked (``description``, ``ge``, ``le``), named on the wire
    (``alias``) and written (``codec``); on an upload, ``le`` is its largest size in bytes."""

    description: str | None = None
    ge: float | None = None
    le: float | None = None
    alias: str | None = None
    codec: Codec | None = None


@dataclass(frozen=True)
class Slot:
    """One parameter of an operation and where it travels."""

    name: str
    where: Where
    annotation: Any
    """Its Python type (``Annotated`` metadata removed)."""
    default: Any
    """Its default, or :data:`inspect.Parameter.empty` when required."""
    param: Param = field(default_factory=Param)

    @property
    def wire_name(self) -> str:
        return self.param.alias or self.name

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


@dataclass(frozen=True)
class _Route:
    method: str
    path: str
    status: int | None
    tags: tuple[str, ...]
    name: str | None
    body: type[BaseModel] | None
    media_type: str | Callable[[], str] | None
    description: str | None
    fast: bool
    runs_command: bool
    no_read_timeout: bool
    shared: bool


class Operation(Generic[P, T]):
    """One operation of the node API: its signature and docstring (from the ``NodeAPI`` method) and its route.

    On a class that inherits it (the HTTP client, the gateway) an instance's attribute is the operation bound
    to that instance's ``perform`` (``perform_stream`` for a streamed answer), so those classes implement
    every operation at once and override only the ones they answer differently."""

    def __init__(self, fn: Callable[Concatenate[Any, P], T], route: _Route) -> None:
        self.fn = fn
        self.name: str = fn.__name__
        self.doc: str = inspect.cleandoc(fn.__doc__ or "")
        self.method = route.method
        self.path = route.path
        self.tags = route.tags
        self.route_name = route.name or self.name
        """The server's name for the route (FastAPI makes the OpenAPI operation id of it)."""
        self.body_model = route.body
        self._media_type = route.media_type
        self.answer_description = route.description
        self.fast = route.fast
        """Also served by the server's fast path (the calls an RL loop makes thousands of times)."""
        self.runs_command = route.runs_command
        """Hanging up kills the command; an unexpected failure is a SandboxError (the stream: an error event)."""
        self.no_read_timeout = route.no_read_timeout
        """The call may take as long as it needs (a create waiting for room, a command): no read timeout."""
        self.shared = route.shared
        """Answered from what every node shares (the image store, the trajectory log): any node may answer it."""
        self._status = route.status
        self._hook: str | None = None
        functools.update_wrapper(cast(Any, self), fn)  # name, docstring and signature for tools (help, IDEs)

    def __repr__(self) -> str:
        return f"<operation {self.name}: {self.method} {self.path}>"

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Operation[P, T]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any] | None = None) -> Callable[P, T]: ...
    def __get__(self, obj: object | None, owner: type[Any] | None = None) -> Any:
        if obj is None:
            return self
        hook = self._hook
        if hook is None:
            hook = self._hook = "perform_stream" if self.streams else "perform"
        bound = functools.partial(getattr(obj, hook), self)
        # Kept on the instance: the next lookup finds it there (this is not a data descriptor) with no call.
        with contextlib.suppress(TypeError):  # an instance without a __dict__ binds on each lookup
            vars(obj)[self.name] = bound
        return bound

    # -- the signature, read once -------------------------------------------------------------------------

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        """Every parameter, in the signature's order."""
        hints = typing.get_type_hints(self.fn, include_extras=True)
        segments = set(re.findall(r"{(\w+)}", self.path))
        body_fields = set(self.body_model.model_fields) if self.body_model is not None else set()
        slots = []
        for name, parameter in list(inspect.signature(self.fn).parameters.items())[1:]:
            annotation, param = _unwrap(hints[name])
            where: Where
            if name in segments:
                where = "path"
            elif param.codec is not None:
                where = "query"
            elif name in body_fields:
                where = "body_field"
            elif annotation is bytes:
                where = "raw"
            elif annotation == IO[bytes]:
                where = "upload"
            elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
                where = "body"
            else:
                where = "query"
            slots.append(Slot(name, where, annotation, parameter.default, param))
        missing = segments - {s.name for s in slots if s.where == "path"}
        if missing:
            raise TypeError(f"{self.name}: path {self.path} names {sorted(missing)}, not parameters")
        return tuple(slots)

    @functools.cached_property
    def answer(self) -> Answer:
        """What comes back: JSON, raw bytes, nothing, or an NDJSON stream."""
        returned = self._returned
        if returned is None or returned is type(None):
            return "empty"
        if returned is bytes:
            return "bytes"
        if typing.get_origin(returned) is AsyncIterator:
            return "stream"
        return "json"

    @functools.cached_property
    def _returned(self) -> Any:
        return typing.get_type_hints(self.fn)["return"]  # an async def's own return type, not its coroutine's

    @functools.cached_property
    def answer_type(self) -> Any:
        """The JSON answer's type, or a stream's item model."""
        if self.answer == "stream":
            return typing.get_args(self._returned)[0]
        return self._returned

    @property
    def status(self) -> int:
        """The success status: as declared, else 204 for an empty answer and 200 for any other."""
        return self._status or (204 if self.answer == "empty" else 200)

    @functools.cached_property
    def media_type(self) -> str:
        """The content type of a raw or streamed answer (JSON otherwise)."""
        declared = self._media_type
        if declared is None:
            return NDJSON if self.answer == "stream" else OCTET if self.answer == "bytes" else JSON
        return declared if isinstance(declared, str) else declared()

    @property
    def streams(self) -> bool:
        return self.answer == "stream"

    @functools.cached_property
    def sandbox_scoped(self) -> bool:
        """Addressed to one sandbox (its id in the path): the gateway sends it to the sandbox's node."""
        return "{sandbox_id}" in self.path

    # -- the client's side ---------------------------------------------------------------------------------

    @functools.cached_property
    def plan(self) -> Plan:
        """How the client encodes a call of this operation and decodes its answer."""
        return Plan.of(self)

    def encode(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Request:
        """A call as a request: its target (path and query), body, body content type and headers."""
        return self.plan.encode(args, kwargs)

    def arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A call's arguments by name (defaults left out)."""
        return self.plan.bind(args, kwargs)


Request = tuple[str, "bytes | IO[bytes] | None", str, "dict[str, str] | None"]
"""A call as the client sends it: target (path and query), body (an upload is a file), its content type, and
headers beyond the usual (None: none)."""
_Query = tuple[str, str, Any, bool, "Codec | None"]
"""A query parameter as the encoder reads it: name, wire name, default, required, codec."""


@dataclass
class Plan:
    """An operation's client-side encoding, worked out once (the exec path runs it per call)."""

    name: str
    empty: bool
    """The answer has no body."""
    names: tuple[str, ...]
    arity: int
    head: str
    """The path up to its first parameter."""
    segments: tuple[tuple[str, str], ...]
    """Each path parameter and the literal path after it."""
    query: tuple[_Query, ...]
    headers: tuple[tuple[str, str, Callable[[Any], str | None]], ...]
    """Each parameter with part of it in a header: name, header, how to write it."""
    body: Slot | None
    body_fields: tuple[str, ...]
    body_model: type[BaseModel] | None
    content_type: str
    validate: Callable[[bytes], Any] | None
    label: str

    @classmethod
    def of(cls, op: Operation[Any, Any]) -> Plan:
        slots = op.slots
        head, *rest = re.split(r"{(\w+)}", op.path)
        body = next((s for s in slots if s.where in ("body", "raw", "upload")), None)
        validate: Callable[[bytes], Any] | None = None
        label = ""
        if op.answer in ("json", "stream"):
            kind = op.answer_type
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                validate, label = kind.model_validate_json, _article(kind.__name__)
            else:
                validate, label = TypeAdapter(kind).validate_json, f"a {_describe(kind)}"
        return cls(
            name=op.name, empty=op.answer == "empty",
            names=tuple(s.name for s in slots), arity=len(slots), head=head,
            segments=tuple(zip(rest[0::2], rest[1::2], strict=True)),
            query=tuple((s.name, s.wire_name, s.default, s.required, s.param.codec) for s in slots
                        if s.where == "query"),
            headers=tuple((s.name, s.param.codec.header, s.param.codec.encode_header) for s in slots
                          if s.param.codec is not None and s.param.codec.header and s.param.codec.encode_header),
            body=body, body_fields=tuple(s.name for s in slots if s.where == "body_field"), body_model=op.body_model,
            content_type=OCTET if body is not None and body.where in ("raw", "upload") else JSON, validate=validate,
            label=label,
        )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.names):
            raise TypeError(f"takes {len(self.names)} arguments, {len(args)} given")
        values = dict(zip(self.names, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.names or name in values:
                raise TypeError(f"unexpected or repeated argument {name!r}")
            values[name] = value
        return values

    def encode(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Request:
        """A call as a request: its target (path and query), body, body content type and headers."""
        if kwargs or len(args) > self.arity:
            values = self.bind(args, kwargs)
        else:
            values = dict(zip(self.names, args, strict=False))
        target = self.head
        for name, literal in self.segments:
            value = values.get(name)
            if value.__class__ is not str or _plain_segment(value) is None:
                value = _segment(name, value)
            target += value + literal
        if self.query:
            query: list[tuple[str, str]] = []
            for name, wire_name, default, required, codec in self.query:
                value = values.get(name, default)
                if value is None or value is inspect.Parameter.empty or (not required and value == default):
                    continue
                text = codec.encode(value) if codec is not None else _text(value)
                if isinstance(text, list):
                    query += [(wire_name, item) for item in text]
                else:
                    query.append((wire_name, text))
            if query:
                target += "?" + urlencode(query)
        headers: dict[str, str] | None = None
        for name, header, write in self.headers:
            written = write(values[name]) if values.get(name) is not None else None
            if written is not None:
                headers = {**(headers or {}), header: written}
        body = self.body
        if body is None:
            return target, self._fields(values), self.content_type, headers
        value = values.get(body.name)
        if value is None:
            raise TypeError(f"missing argument {body.name!r}")
        if body.where == "upload":
            return target, value, self.content_type, headers
        return target, bytes(value) if body.where == "raw" else value.model_dump_json().encode(), self.content_type, \
            headers

    def decode(self, content: bytes) -> Any:
        """The answer of a unary call (its status was a success)."""
        validate = self.validate
        if validate is None:
            return None if self.empty else content
        try:
            return validate(content)
        except pydantic.ValidationError as exc:
            raise ConnectionFailed(f"the daemon's answer to {self.name} is not {self.label} (daemon stopped "
                                   f"mid-call, or not a DSec daemon?): {exc.errors()[0]['msg']}") from None

    def decode_item(self, line: bytes) -> Any:
        """One line of a streamed answer; an error event (the server's failure mid-stream) is raised."""
        validate = self.validate
        assert validate is not None
        item = validate(line)
        if getattr(item, "type", None) == "error":
            raise error_from_payload({"error": getattr(item, "error", None) or {}}, 500)
        return item

    def _fields(self, values: dict[str, Any]) -> bytes | None:
        """The body made of the ``body=`` model's fields, if the operation has one."""
        if self.body_model is not None:
            try:
                model = self.body_model(**{name: values[name] for name in self.body_fields if name in values})
            except pydantic.ValidationError as exc:
                raise InvalidRequest(f"invalid {self.body_model.__name__}: " + "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
            return bytes(model.model_dump_json(), "utf-8")
        return None


_plain_segment = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]*").fullmatch
"""A path segment that needs no quoting (and is not ``.`` or ``..``): every sandbox id."""


def _segment(name: str, value: Any) -> str:
    """One path segment, quoted; an argument that would route elsewhere on the server is refused."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # a pid, a port
        return str(value)
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise InvalidRequest(f"not a {name.replace('_', ' ')}: {value!r}")
    return quote(value, safe="")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _article(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _describe(kind: Any) -> str:
    args = typing.get_args(kind)
    if typing.get_origin(kind) is list and args and isinstance(args[0], type):
        return f"list of {args[0].__name__}"
    return str(kind)


def _unwrap(hint: Any) -> tuple[Any, Param]:
    """A parameter's type and its :class:`Param` (an empty one when it has none)."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        return base, next((e for e in extras if isinstance(e, Param)), Param())
    return hint, Param()


def operation(
    method: str,
    path: str,
    *,
    tags: Sequence[str] = (),
    status: int | None = None,
    name: str | None = None,
    body: type[BaseModel] | None = None,
    media_type: str | Callable[[], str] | None = None,
    description: str | None = None,
    fast: bool = False,
    runs_command: bool = False,
    no_read_timeout: bool = False,
    shared: bool = False,
) -> Callable[[Callable[Concatenate[Any, P], T]], Operation[P, T]]:
    """Declare a ``NodeAPI`` method an operation served at ``method path``.

    ``status``: the success status (default 200, or 204 for no answer); ``name``: the route's name when it is
    not the method's (it makes the OpenAPI operation id); ``body``: the model whose fields are parameters of
    the method; ``media_type`` (or a function that names it when first needed) and ``description``: a raw or
    streamed answer's content type and its documentation; ``fast``: also served by the server's fast path;
    ``runs_command``: hanging up kills the command, and a failure is a SandboxError (on a stream: an error
    event the client raises); ``no_read_timeout``: the call may wait as long as it needs; ``shared``:
    answered from stores every node shares (a cluster gateway asks any node)."""
    route = _Route(method, path, status, tuple(tags), name, body, media_type, description, fast, runs_command,
                   no_read_timeout, shared)

    def declare(fn: Callable[Concatenate[Any, P], T]) -> Operation[P, T]:
        return Operation(fn, route)

    return declare


async def close_stream(stream: AsyncIterator[Any]) -> None:
    """Close a streamed answer early (an async generator: the HTTP stream ends, and an exec's command dies)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def operations_of(api: type[Any]) -> tuple[Operation[Any, Any], ...]:
    """The operations a protocol class declares, in declaration order."""
    return tuple(value for value in vars(api).values() if isinstance(value, Operation))
