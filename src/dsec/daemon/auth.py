"""Tokens of the node's TCP API: who may call, which sandboxes they see, how fast.

Two scopes. An **admin** token (the daemon's ``--token``, or an ``admin`` entry of the token file)
sees and controls every sandbox. A **job** token sees only the sandboxes it created: the guard stamps
the reserved label ``dsec.job=<job>`` on every sandbox it creates, adds that label to every listing,
and answers 404 ``SandboxNotFound`` -- exactly what a missing sandbox gets -- for any other sandbox,
so a job cannot even learn that another job's sandbox exists. Routes outside ``/v1/sandboxes`` and
image reads (trajectory forks and logs, image pulls, metrics) need an admin token (403).

Per-token rate limits (``requests_per_s``, ``creates_per_s``) are token buckets holding one second of
burst; a refused request is 429 ``RateLimited`` with a ``Retry-After`` header.

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

from dsec.api.protocol import NodeAPI
from dsec.daemon.audit import caller
from dsec.daemon.fence import FENCE_HEADER, Fences
from dsec.errors import DSecError, Forbidden, InvalidRequest, RateLimited, SandboxNotFound, Unauthorized

__all__ = ["JOB_LABEL", "AuthGuard", "TokenEntry", "TokenFile", "open_path"]

JOB_LABEL = "dsec.job"
"""The label that records which job's token created a sandbox."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SANDBOX_ROUTE = re.compile(r"^/v1/sandboxes/([^/]+)(/.*)?$")
_DESTROY_MANY = NodeAPI.destroy_many.path
_FENCE = FENCE_HEADER.lower().encode()
_BATCH_STREAM = NodeAPI.create_many_stream.path


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
    prefix = f"/v1/sandboxes/{sandbox_id}"
    if path != prefix and not path.startswith(prefix + "/"):
        return False
    return not (method == "DELETE" and path == prefix) and path != prefix + "/fork"


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
            self._limit(entry, "requests", entry.requests_per_s if entry else None, 1)
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

    async def _count_creates(self, entry: TokenEntry, scope: Scope, receive: Receive) -> Receive:
        """An admin token from the file: only its create limit applies."""
        kind = _create_route(scope)
        if kind is None or entry.creates_per_s is None:
            return receive
        body, receive = await _read_body(receive)
        self._limit(entry, "creates", entry.creates_per_s, _create_count(kind, _json(body)))
        return receive

    async def _scope_to_job(self, job: str, entry: TokenEntry | None, scope: Scope, receive: Receive) -> Receive:
        path, method = scope["path"], scope["method"]
        kind = _create_route(scope)
        if kind is not None:
            body, replayed = await _read_body(receive)
            doc = _json(body)
            if kind == "fork":
                await self._check_owner(job, _SANDBOX_ROUTE.match(path).group(1))  # type: ignore[union-attr]
            self._limit(entry, "creates", entry.creates_per_s if entry else None, _create_count(kind, doc))
            if kind in ("create", "batch") and isinstance(doc, dict):
                spec = doc if kind == "create" else doc.get("spec")
                if isinstance(spec, dict):
                    trajectory = spec.get("trajectory")
                    if trajectory is not None and not str(trajectory).startswith(f"{job}/"):
                        raise Forbidden(f"a token of job {job!r} may only bind trajectories named '{job}/...', "
                                        f"got {trajectory!r}")
                    labels = spec.get("labels")
                    spec["labels"] = {**(labels if isinstance(labels, dict) else {}), JOB_LABEL: job}
                    body = json.dumps(doc).encode()
                    _set_length(scope, len(body))
                    return _replay(body, receive)
            return replayed
        if path == "/v1/sandboxes" and method == "GET":
            # Any job filter the caller sent is replaced by the token's own.
            pairs = [(k, v) for k, v in urllib.parse.parse_qsl(scope.get("query_string", b"").decode(errors="replace"),
                                                               keep_blank_values=True)
                     if not (k == "label" and v.split("=", 1)[0].strip() == JOB_LABEL)]
            scope["query_string"] = urllib.parse.urlencode([*pairs, ("label", f"{JOB_LABEL}={job}")]).encode()
            return receive
        if path == _DESTROY_MANY and method == "POST":
            # Narrowed to the token's job, as a create is labelled with it: other jobs' ids count as missing.
            body, replayed = await _read_body(receive)
            doc = _json(body)
            if not isinstance(doc, dict):
                return replayed
            body = json.dumps({**doc, "job": job}).encode()
            _set_length(scope, len(body))
            return _replay(body, receive)
        match = _SANDBOX_ROUTE.match(path)
        if match is not None:
            await self._check_owner(job, urllib.parse.unquote(match.group(1)))
            return receive
        if method == "GET" and (path == "/v1/images" or path.startswith("/v1/images/")):
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
    return path in ("/v1/health", "/", "/ui") or path.startswith("/ui/")


def _create_route(scope: Scope) -> str | None:
    if scope["method"] != "POST":
        return None
    path = scope["path"]
    if path == "/v1/sandboxes":
        return "create"
    if path in ("/v1/sandboxes/batch", _BATCH_STREAM):
        return "batch"
    match = _SANDBOX_ROUTE.match(path)
    if match is not None and match.group(2) == "/fork":
        return "fork"
    return None


def _create_count(kind: str, doc: Any) -> float:
    count = doc.get("count", 1) if isinstance(doc, dict) and kind != "create" else 1
    return float(count) if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1.0


def _json(body: bytes) -> Any:
    with contextlib.suppress(ValueError):
        return json.loads(body)
    return None  # the route's own validation answers 400


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a ``receive`` that hands it to the app again, then continues with the
    original (which reports the client's disconnect)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), _replay(b"".join(chunks), receive, message)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > 16 * 1024 * 1024:
            raise InvalidRequest("request body is over 16 MiB")
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
