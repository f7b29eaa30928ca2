"""How the SDK talks HTTP to a DSec daemon: URL parsing, httpx client construction, error mapping.

This module owns the wire details (unix socket vs TCP, bearer token, timeouts) and the translation of
every failure into a :class:`dsec.DSecError`: a non-2xx answer becomes the error class the server named,
and any transport failure becomes :class:`dsec.ConnectionFailed`. It must never know about sandboxes or
retry anything on its own: a retried ``exec`` could run a command twice.
"""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlencode, urlsplit

import httpx

from dsec.errors import ConnectionFailed, DSecError, InvalidRequest, error_from_payload
from dsec.models import ImageBuildRequest

from .lean import LeanError, LeanPool

__all__ = ["CONTROL_TIMEOUT", "STREAM_TIMEOUT", "Transport", "build_request_parts", "parse_url", "read_chunks"]

# Creating sandboxes in bulk or moving large files can take minutes on a loaded node; a read that
# stalls longer than this means the daemon is wedged, not busy. A burst of thousands of calls from one
# client queues for the pool's connections (each bounded by its own read timeout): waiting there is
# the client's own backlog, not a failure, so the pool wait is long.
CONTROL_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=600.0)
# Exec output may be silent for as long as the command runs; the server enforces the exec timeout and
# closes the stream, so the client must not race it with a read timeout of its own.
STREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=300.0, pool=600.0)

_UNIX_BASE = "http://dsec"
_HINT = "is the daemon running? start it with `dsec up`"


@dataclass(frozen=True)
class Endpoint:
    """A parsed daemon URL: the httpx base URL and, for unix sockets, the socket path."""

    url: str
    base_url: str
    uds: str | None


def parse_url(url: str) -> Endpoint:
    """Accept ``unix:///abs/path.sock`` or ``http(s)://host:port``; anything else is InvalidRequest."""
    if url.startswith("unix://"):
        path = url[len("unix://") :]
        if not path.startswith("/"):
            raise InvalidRequest(f"a unix socket URL needs an absolute path (unix:///x.sock), got {url!r}")
        return Endpoint(url=url, base_url=_UNIX_BASE, uds=path)
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.netloc:
        return Endpoint(url=url, base_url=url.rstrip("/"), uds=None)
    raise InvalidRequest(f"daemon URL must be unix:///path.sock or http(s)://host:port, got {url!r}")


class Transport:
    """Builds httpx clients for one daemon and maps every failure to a DSecError."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.endpoint = parse_url(url)
        self.token = token

    @property
    def url(self) -> str:
        return self.endpoint.url

    def build_lean(self, max_connections: int = 100, keepalive_expiry: float = 4.0) -> LeanPool:
        """Keep-alive connections for :meth:`post_json` (by default at most 100 requests in flight, as httpx's
        default; idle ones dropped after 4 s, before uvicorn's 5 s keep-alive closes them)."""
        if self.endpoint.uds is not None:
            return LeanPool(uds=self.endpoint.uds, max_connections=max_connections,
                            keepalive_expiry=keepalive_expiry)
        parts = urlsplit(self.endpoint.base_url)
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        return LeanPool(host=parts.hostname or "", port=parts.port or (443 if tls else 80), tls=tls,
                        max_connections=max_connections, keepalive_expiry=keepalive_expiry)

    async def post_json(self, pool: LeanPool, path: str, body: bytes, *,
                        params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                        timeout: httpx.Timeout = CONTROL_TIMEOUT) -> bytes:
        """POST an already serialised JSON body on the lean connections and return the 2xx answer's body.

        The hot path of ``sb.exec`` (see :mod:`dsec._sdk.lean`): httpx's layers, and httpcore's under them,
        cost more client CPU per exec than the HTTP exchange itself. Errors are mapped exactly as
        :meth:`request` maps them."""
        parts = urlsplit(self.endpoint.base_url)
        target = parts.path.rstrip("/") + path + (f"?{urlencode(params)}" if params else "")
        head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", "User-Agent: dsec-sdk",
                "Content-Type: application/json", f"Content-Length: {len(body)}"]
        if headers:
            head += [f"{k}: {v}" for k, v in headers.items()]
        if self.token and not (headers and any(k.lower() == "authorization" for k in headers)):
            head.append(f"Authorization: Bearer {self.token}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        try:
            status, content = await pool.request(request, connect_timeout=timeout.connect, read_timeout=timeout.read)
        except LeanError as exc:
            if exc.kind == "connect":
                raise ConnectionFailed(f"cannot reach the DSec daemon at {self.url}: {exc}; {_HINT}") from exc
            if exc.kind == "timeout":
                raise ConnectionFailed(f"the DSec daemon at {self.url} did not answer in time: {exc}") from exc
            raise ConnectionFailed(f"connection to the DSec daemon at {self.url} was lost mid-call: {exc}") from exc
        if not 200 <= status < 300:
            try:
                payload: Any = json.loads(content)
            except (json.JSONDecodeError, UnicodeDecodeError):
                payload = content.decode(errors="replace")
            raise error_from_payload(payload, status)
        return content

    def build(self, limits: httpx.Limits | None = None) -> httpx.AsyncClient:
        """A new client bound to the calling event loop (httpx pools cannot cross loops)."""
        headers = {"User-Agent": "dsec-sdk"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        transport = httpx.AsyncHTTPTransport(uds=self.endpoint.uds) if self.endpoint.uds else None
        if limits is not None and transport is None:
            transport = httpx.AsyncHTTPTransport(limits=limits)
        return httpx.AsyncClient(
            base_url=self.endpoint.base_url, headers=headers, timeout=CONTROL_TIMEOUT, transport=transport
        )

    @contextmanager
    def mapped_errors(self) -> Iterator[None]:
        """Turn httpx transport failures raised inside the block into ConnectionFailed."""
        try:
            yield
        except httpx.ConnectError as exc:
            raise ConnectionFailed(f"cannot reach the DSec daemon at {self.url}: {exc}; {_HINT}") from exc
        except httpx.TimeoutException as exc:
            raise ConnectionFailed(f"the DSec daemon at {self.url} did not answer in time: {exc!r}") from exc
        except httpx.TransportError as exc:
            # ReadError, RemoteProtocolError...: the daemon died or dropped us mid-call.
            raise ConnectionFailed(
                f"connection to the DSec daemon at {self.url} was lost mid-call: {exc!r}"
            ) from exc

    async def request(
        self,
        client: httpx.AsyncClient,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        params: Any = None,
        timeout: httpx.Timeout | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request, read the whole answer, raise the server's error on non-2xx (``timeout``:
        the client's :data:`CONTROL_TIMEOUT` unless given)."""
        with self.mapped_errors():
            response = await client.request(method, path, json=json_body, content=content, params=params,
                                            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
                                            headers=headers)
        raise_for_status(response)
        return response

    @asynccontextmanager
    async def stream(
        self, client: httpx.AsyncClient, method: str, path: str, *, json_body: Any = None,
        headers: dict[str, str] | None = None, params: Any = None, content: AsyncIterator[bytes] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """Open a streamed response (no read timeout); closing it tells the server to stop. ``content``
        streams a request body (a build context)."""
        with self.mapped_errors():
            async with client.stream(method, path, json=json_body, timeout=STREAM_TIMEOUT, params=params,
                                     content=content, headers=headers) as response:
                if not response.is_success:
                    await response.aread()
                    raise_for_status(response)
                yield response


def raise_for_status(response: httpx.Response) -> None:
    """Re-raise the error a non-2xx answer carries (the server sends ``{"error": {...}}``)."""
    if response.is_success:
        return
    try:
        payload: Any = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        payload = response.text
    err: DSecError = error_from_payload(payload, response.status_code)
    raise err


def build_request_parts(request: ImageBuildRequest) -> tuple[dict[str, str], dict[str, str]]:
    """``POST /v1/images/build``'s query parameters and headers for ``request``: the model as JSON, and the
    registry credentials in ``X-Registry-Auth`` (base64url JSON), never in the URL."""
    public = request.model_copy(update={"username": None, "password": None})
    headers: dict[str, str] = {"Content-Type": "application/octet-stream"}  # a tar
    if request.username is not None:
        auth = json.dumps({"username": request.username, "password": request.password or ""})
        headers["X-Registry-Auth"] = base64.urlsafe_b64encode(auth.encode()).decode().rstrip("=")
    return {"request": public.model_dump_json(exclude_defaults=True)}, headers


async def read_chunks(stream: IO[bytes], size: int = 1024 * 1024) -> AsyncIterator[bytes]:
    """A file's bytes as a request body, read in a worker thread."""
    import asyncio

    while chunk := await asyncio.to_thread(stream.read, size):
        yield chunk
