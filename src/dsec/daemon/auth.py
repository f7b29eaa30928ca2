"""Tokens of the node's TCP API: who may call, which sandboxes they see, how fast.

Two scopes. An **admin** token (the daemon's ``--token``, or an ``admin`` entry of the token file)
sees and controls every sandbox. A **job** token sees only the sandboxes it created: the guard stamps
the reserved label ``dsec.job=<job>`` on every sandbox it creates, adds that label to every listing,
and answers 404 ``SandboxNotFound`` -- exactly what a missing sandbox gets -- for any other sandbox,
so a job cannot even learn that another job's sandbox exists. Routes outside ``/v1/sandboxes`` and
image reads (trajectory forks and logs, image pulls, metrics) need an admin token (403).

Per-token rate limits (``requests_per_s``, ``creates_per_s``) are token buckets holding one second of
burst; a refused request is 429 ``RateLimited`` with a ``Retry-After`` header. A batch of calls
(``sb.map``) takes one request per item, as a batch create takes one create per sandbox.

What a job token may do is decided per operation of the node API (:data:`JOB_POLICY`), and a request is
matched to its operation by the same declarations the server binds (:class:`~dsec.api.protocol.NodeAPI`):
no path is spelled here, and an operation added to the API without a decision is admin-only.

The token file (``DSEC_HOME/tokens.json``, 0600) stores each token's sha256, never the token; it is
re-read when it changes, so ``dsec token create`` takes effect on a running daemon. This module owns the
file and the guard; it never touches a sandbox (ownership is read through ``owner_of``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.api.operations import Operation, operations_of
from dsec.api.protocol import NodeAPI
from dsec.daemon.audit import caller
from dsec.daemon.fence import FENCE_HEADER, Fences
from dsec.errors import DSecError, Forbidden, InvalidRequest, RateLimited, SandboxNotFound, Unauthorized

__all__ = ["JOB_LABEL", "JOB_POLICY", "AuthGuard", "JobPolicy", "TokenEntry", "TokenFile", "job_policy", "open_path"]

JOB_LABEL = "dsec.job"
"""The label that records which job's token created a sandbox."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FENCE = FENCE_HEADER.lower().encode()

JobPolicy = Literal["create", "batch", "fork", "list", "destroy_many", "owner", "read", "admin"]
"""What the guard does with a job token's call of an operation: ``create``, ``batch`` and ``fork`` count
against its create limit (``create`` and ``batch`` also get the job's label; ``fork`` needs the sandbox to
be the job's); ``list`` is narrowed to the job's sandboxes, ``destroy_many`` to its ids; ``owner`` passes
only for the job's own sandbox (any other is answered as missing); ``read`` passes; ``admin`` is refused."""

JOB_POLICY: dict[str, JobPolicy] = {
    "create": "create",
    "create_many": "batch",
    "create_many_stream": "batch",
    "fork": "fork",
    "list": "list",
    "destroy_many": "destroy_many",
    "list_images": "read",
    "get_image": "read",
}
"""The operations whose job-token policy is not the default of :func:`job_policy`."""

_SANDBOX_PATH = NodeAPI.get.path  # /v1/sandboxes/{sandbox_id}: one sandbox, and its routes under it
_SANDBOX_PREFIX = _SANDBOX_PATH.partition("{")[0]
_SCOPED_DENIED = frozenset({"destroy", "fork"})  # change what a cluster gateway accounts for


def job_policy(op: Operation[Any, Any]) -> JobPolicy:
    """The policy for a job token's call of ``op``: :data:`JOB_POLICY`'s, else ``owner`` for a sandbox's own
    operation (its path under ``/v1/sandboxes/{sandbox_id}``), else ``admin``."""
    if op.name in JOB_POLICY:
        return JOB_POLICY[op.name]
    return "owner" if op.path == _SANDBOX_PATH or op.path.startswith(_SANDBOX_PATH + "/") else "admin"


class _Routes:
    """The node API's operations by method and path, matched as the server matches them (a literal path before
    a templated one: ``/v1/sandboxes/batch`` is create_many, not a sandbox named ``batch``)."""

    def __init__(self, ops: tuple[Operation[Any, Any], ...]) -> None:
        self.exact: dict[tuple[str, str], Operation[Any, Any]] = {}
        self.templated: list[tuple[str, re.Pattern[str], Operation[Any, Any]]] = []
        for op in ops:
            if "{" in op.path:
                pattern = re.compile(re.sub(r"{(\w+)}", r"(?P<\1>[^/]+)", op.path))
                self.templated.append((op.method, pattern, op))
            else:
                self.exact[(op.method, op.path)] = op

    def match(self, method: str, path: str) -> tuple[Operation[Any, Any], dict[str, str]] | None:
        """The operation ``method path`` calls and its path parameters (unquoted); None if none does."""
        op = self.exact.get((method, path))
        if op is not None:
            return op, {}
        for op_method, pattern, op in self.templated:
            found = pattern.fullmatch(path)
            if found is not None and op_method == method:
                return op, {k: urllib.parse.unquote(v) for k, v in found.groupdict().items()}
        return None


_ROUTES = _Routes(operations_of(NodeAPI))
_CALL_BATCH_TAIL = NodeAPI.call_many.path.rpartition("}")[2]
"""``/call/batch``: only a path ending so is matched against the API to count a call batch's items."""
_unknown = set(JOB_POLICY) - {op.name for op in operations_of(NodeAPI)}
if _unknown:  # a renamed or removed operation must not leave a policy that no longer applies
    raise RuntimeError(f"JOB_POLICY names operations the node API does not have: {sorted(_unknown)}")


def _sandbox_of(path: str) -> str | None:
    """The sandbox id a path under ``/v1/sandboxes/<id>`` addresses (quoted, as sent), else None."""
    if not path.startswith(_SANDBOX_PREFIX):
        return None
    sandbox_id = path[len(_SANDBOX_PREFIX):].partition("/")[0]
    return sandbox_id or None


@dataclass(frozen=True)
class TokenEntry:
    """One token of the token file (the token itself is never stored, only its sha256)."""

    name: str
    sha256: str
    scope: Literal["admin", "job"] = "job"
    job: str | None = None
    requests_per_s: float | None = None
    creates_per_s: float | None = None


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenFile:
    """The node's token file: create, list, remove; lookups re-read it when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._by_digest: dict[str, TokenEntry] = {}

    def entries(self) -> list[TokenEntry]:
        """Every token entry (empty when the file does not exist)."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"token file {self.path} is unreadable: {exc}") from None
        try:
            return [TokenEntry(**item) for item in raw.get("tokens", [])]
        except (TypeError, AttributeError) as exc:
            raise InvalidRequest(f"token file {self.path} has a malformed entry: {exc}") from None

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry of ``token``, or None."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._by_digest = {e.sha256: e for e in self.entries()} if stamp else {}
            self._stamp = stamp
        return self._by_digest.get(_digest(token))

    def create(self, name: str, *, job: str | None = None, admin: bool = False, requests_per_s: float | None = None,
               creates_per_s: float | None = None, e2b_format: bool = False) -> str:
        """Add a token and return it (shown once: only its sha256 is kept). ``e2b_format``: shaped as an E2B API
        key (``e2b_`` + 40 hex digits), which the e2b SDK checks its ``E2B_API_KEY`` against."""
        if not _NAME.match(name):
            raise InvalidRequest(f"token name must be 1-128 of [A-Za-z0-9._-], got {name!r}")
        if admin == (job is not None):
            raise InvalidRequest("a token is either --admin or for one --job")
        if job is not None and not _NAME.match(job):
            raise InvalidRequest(f"job name must be 1-128 of [A-Za-z0-9._-], got {job!r}")
        for rate in (requests_per_s, creates_per_s):
            if rate is not None and not (rate > 0 and math.isfinite(rate)):
                raise InvalidRequest(f"rate limits must be positive numbers, got {rate!r}")
        entries = self.entries()
        if any(e.name == name for e in entries):
            raise InvalidRequest(f"a token named {name!r} already exists (remove it first)")
        token = "e2b_" + secrets.token_hex(20) if e2b_format else "dsec_" + secrets.token_urlsafe(32)
        entries.append(TokenEntry(name=name, sha256=_digest(token), scope="admin" if admin else "job", job=job,
                                  requests_per_s=requests_per_s, creates_per_s=creates_per_s))
        self._write(entries)
        return token

    def remove(self, name: str) -> None:
        """Revoke the token called ``name``."""
        entries = self.entries()
        kept = [e for e in entries if e.name != name]
        if len(kept) == len(entries):
            raise InvalidRequest(f"no token named {name!r} in {self.path}")
        self._write(kept)

    def _write(self, entries: list[TokenEntry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"tokens": [asdict(e) for e in entries]}, f, indent=1)
        os.replace(tmp, self.path)


class _Bucket:
    """A token bucket of ``rate`` per second holding one second (at least one unit) of burst."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.level = self.capacity
        self.stamp = time.monotonic()

    def take(self, cost: float) -> float:
        """Take ``cost`` units; 0.0 when granted, else the seconds to wait. A cost above the burst
        waits for a full bucket and leaves it in debt, so a big batch is admitted, then paid for."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(cost, self.capacity)
        if self.level >= need:
            self.level -= cost
            return 0.0
        return (need - self.level) / self.rate


_SCOPED = "sb1."


def scoped_token(token: str, sandbox_id: str) -> str:
    """A credential derived from the node's admin ``token`` that opens only ``sandbox_id``'s data routes.

    The cluster gateway hands it to the SDK so exec and file traffic goes straight to the node without
    giving a job the node's own token (which opens every sandbox on it)."""
    mac = hmac.new(token.encode(), sandbox_id.encode(), hashlib.sha256).hexdigest()
    return f"{_SCOPED}{sandbox_id}.{mac}"


def _scoped_ok(admin_token: str, given: bytes, method: str, path: str) -> bool:
    """Whether ``given`` is a scoped token of ``admin_token`` for the sandbox that ``path`` addresses. It
    opens ``/v1/sandboxes/<its id>`` and the routes under it, except destroy and fork, which change what the
    gateway accounts for and so go through it."""
    text = given.decode("latin-1")
    if not text.startswith("Bearer " + _SCOPED):
        return False
    sandbox_id = text[len("Bearer " + _SCOPED):].rpartition(".")[0]
    if not sandbox_id or not secrets.compare_digest(text[len("Bearer "):], scoped_token(admin_token, sandbox_id)):
        return False
    if _sandbox_of(path) != sandbox_id:
        return False
    route = _ROUTES.match(method, path)
    return route is None or route[0].name not in _SCOPED_DENIED


@dataclass(frozen=True)
class _Principal:
    name: str
    job: str | None  # None: admin


OwnerOf = Callable[[str], Awaitable[dict[str, str] | None]]


class AuthGuard:
    """Bearer-token check, job scoping and rate limits as pure ASGI middleware.

    Not BaseHTTPMiddleware: it wraps streamed responses and breaks client-disconnect handling.
    """

    def __init__(self, app: ASGIApp, *, admin_token: str | None, tokens: TokenFile | None,
                 owner_of: OwnerOf) -> None:
        self.app = app
        self.admin_token = admin_token
        self.admin = f"Bearer {admin_token}".encode() if admin_token else None
        self.tokens = tokens
        self.owner_of = owner_of
        self.fences = Fences()
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def _principal(self, header: bytes) -> tuple[_Principal, TokenEntry | None] | None:
        if self.admin is not None and secrets.compare_digest(header, self.admin):
            return _Principal("admin", None), None
        if self.tokens is None or not header.startswith(b"Bearer "):
            return None
        entry = self.tokens.lookup(header[7:].decode(errors="replace"))
        if entry is None:
            return None
        return _Principal(entry.name, entry.job if entry.scope == "job" else None), entry

    def _limit(self, entry: TokenEntry | None, kind: str, rate: float | None, cost: float) -> None:
        if entry is None or rate is None or cost <= 0:
            return
        bucket = self._buckets.get((entry.sha256, kind))
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[(entry.sha256, kind)] = _Bucket(rate)
        wait = bucket.take(cost)
        if wait > 0:
            raise RateLimited(f"token {entry.name!r} is over its limit of {rate:g} {kind}/s; retry in {wait:.2f} s",
                              retry_after=round(wait, 3), limit=kind)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and open_path(scope["path"])
                                       and _FENCE not in dict(scope["headers"])):  # (a fenced health is checked)
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        if self.admin_token and _scoped_ok(self.admin_token, header, scope["method"], scope["path"]):
            caller.set("sandbox-token")  # the audit trail's "who"; per request (each runs in its own task)
            await self.app(scope, receive, send)
            return
        try:
            found = self._principal(header)
            if found is None:
                raise Unauthorized("missing or wrong token: send 'Authorization: Bearer <token>' (DSEC_TOKEN)")
            who, entry = found
            caller.set(entry.name if entry is not None else "admin")
            receive = await self._count_requests(entry, scope, receive)
            fence = dict(scope["headers"]).get(_FENCE)
            if fence is not None:
                self.fences.admit(fence, admin=who.job is None)
            if who.job is not None:
                receive = await self._scope_to_job(who.job, entry, scope, receive)
            elif entry is not None:
                receive = await self._count_creates(entry, scope, receive)
        except DSecError as err:
            headers = {"Retry-After": str(max(1, math.ceil(err.retry_after)))} if isinstance(err, RateLimited) else {}
            await JSONResponse(err.to_payload(), status_code=err.status_code, headers=headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _count_requests(self, entry: TokenEntry | None, scope: Scope, receive: Receive) -> Receive:
        """Take the request from the token's request limit: one, or for a batch of calls (``sb.map``) one per
        item it carries, each being a call of its own (items the node sends back unrun, to be sent again, count
        again)."""
        if entry is None or entry.requests_per_s is None:
            return receive
        cost = 1.0
        if scope["method"] == "POST" and scope["path"].endswith(_CALL_BATCH_TAIL):
            route = _ROUTES.match(scope["method"], scope["path"])
            if route is not None and route[0].name == NodeAPI.call_many.name:
                # No cap of the guard's own here: the route takes a batch of any size (the app reads it whole too).
                body, receive = await _read_body(receive, limit=None)
                cost = _item_count(_json(body))
        self._limit(entry, "requests", entry.requests_per_s, cost)
        return receive

    async def _count_creates(self, entry: TokenEntry, scope: Scope, receive: Receive) -> Receive:
        """An admin token from the file: only its create limit applies."""
        route = _ROUTES.match(scope["method"], scope["path"])
        kind = job_policy(route[0]) if route is not None else None
        if kind not in ("create", "batch", "fork") or entry.creates_per_s is None:
            return receive
        body, receive = await _read_body(receive)
        self._limit(entry, "creates", entry.creates_per_s, _create_count(kind, _json(body)))
        return receive

    async def _scope_to_job(self, job: str, entry: TokenEntry | None, scope: Scope, receive: Receive) -> Receive:
        path, method = scope["path"], scope["method"]
        route = _ROUTES.match(method, path)
        if route is None:  # no such operation: the app answers 404 or 405, to the sandbox's owner only
            sandbox_id = _sandbox_of(path)
            if sandbox_id is None:
                raise Forbidden(f"{method} {path} needs an admin token (this token is scoped to job {job!r})")
            await self._check_owner(job, urllib.parse.unquote(sandbox_id))
            return receive
        op, params = route
        kind = job_policy(op)
        if kind in ("create", "batch", "fork"):
            body, replayed = await _read_body(receive)
            doc = _json(body)
            if kind == "fork":
                await self._check_owner(job, params["sandbox_id"])
            self._limit(entry, "creates", entry.creates_per_s if entry else None, _create_count(kind, doc))
            if kind != "fork" and isinstance(doc, dict):
                return _labelled(job, kind, doc, scope, receive) or replayed
            return replayed
        if kind == "list":
            # Any job filter the caller sent is replaced by the token's own.
            pairs = [(k, v) for k, v in urllib.parse.parse_qsl(scope.get("query_string", b"").decode(errors="replace"),
                                                               keep_blank_values=True)
                     if not (k == "label" and v.split("=", 1)[0].strip() == JOB_LABEL)]
            scope["query_string"] = urllib.parse.urlencode([*pairs, ("label", f"{JOB_LABEL}={job}")]).encode()
            return receive
        if kind == "destroy_many":
            # Narrowed to the token's job, as a create is labelled with it: other jobs' ids count as missing.
            body, replayed = await _read_body(receive)
            doc = _json(body)
            if not isinstance(doc, dict):
                return replayed
            body = json.dumps({**doc, "job": job}).encode()
            _set_length(scope, len(body))
            return _replay(body, receive)
        if kind == "owner":
            await self._check_owner(job, params["sandbox_id"])
            return receive
        if kind == "read":
            return receive
        raise Forbidden(f"{method} {path} needs an admin token (this token is scoped to job {job!r})")

    async def _check_owner(self, job: str, sandbox_id: str) -> None:
        labels = await self.owner_of(sandbox_id)
        if labels is None or labels.get(JOB_LABEL) != job:
            # The same answer as for a sandbox that does not exist: no probing for other jobs' ids.
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)


def open_path(path: str) -> bool:
    """Paths served without a token: health, and the dashboard's static files (they hold no data; the page
    asks for a token and sends it with every API call), and ``/``, which redirects a browser there."""
    return path in (NodeAPI.health.path, "/", "/ui") or path.startswith("/ui/")


def _labelled(job: str, kind: JobPolicy, doc: dict[str, Any], scope: Scope, receive: Receive) -> Receive | None:
    """The body of a job's create (``doc``: a spec) or batch (``doc["spec"]``) with the job's label added, as
    a ``receive`` to hand the app; None if there is no spec to label (the route's validation answers 400)."""
    spec = doc if kind == "create" else doc.get("spec")
    if not isinstance(spec, dict):
        return None
    trajectory = spec.get("trajectory")
    if trajectory is not None and not str(trajectory).startswith(f"{job}/"):
        raise Forbidden(f"a token of job {job!r} may only bind trajectories named '{job}/...', got {trajectory!r}")
    labels = spec.get("labels")
    spec["labels"] = {**(labels if isinstance(labels, dict) else {}), JOB_LABEL: job}
    body = json.dumps(doc).encode()
    _set_length(scope, len(body))
    return _replay(body, receive)


def _create_count(kind: str, doc: Any) -> float:
    count = doc.get("count", 1) if isinstance(doc, dict) and kind != "create" else 1
    return float(count) if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1.0


_BODY_LIMIT = 16 * 1024 * 1024
"""The largest create request the guard reads to count its sandboxes."""


def _item_count(doc: Any) -> float:
    items = doc.get("items") if isinstance(doc, dict) else None
    return float(len(items)) if isinstance(items, list) and items else 1.0  # malformed: validation answers 400


def _json(body: bytes) -> Any:
    with contextlib.suppress(ValueError):
        return json.loads(body)
    return None  # the route's own validation answers 400


async def _read_body(receive: Receive, limit: int | None = _BODY_LIMIT) -> tuple[bytes, Receive]:
    """The whole request body (refused past ``limit`` bytes), and a ``receive`` that hands it to the app again,
    then continues with the original (which reports the client's disconnect)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), _replay(b"".join(chunks), receive, message)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            raise InvalidRequest(f"request body is over {limit >> 20} MiB")
        if not message.get("more_body", False):
            break
    return b"".join(chunks), _replay(b"".join(chunks), receive)


def _replay(body: bytes, receive: Receive, pending: Message | None = None) -> Receive:
    queue: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if pending is not None:
        queue.append(pending)

    async def replayed() -> Message:
        return queue.pop(0) if queue else await receive()

    return replayed


def _set_length(scope: Scope, length: int) -> None:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    scope["headers"] = [*headers, (b"content-length", str(length).encode())]
