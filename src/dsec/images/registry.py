"""Pulling images from an OCI registry over the distribution API (``/v2/``), with httpx.

Owns image references (``[host[:port]/]repo[:tag][@sha256:...]``), the auth challenge dance
(anonymous, HTTP basic, and bearer tokens from the realm a ``WWW-Authenticate`` header names),
retries of transient failures (connection errors, 429, 5xx) with backoff, manifest and index
fetching (a multi-arch index resolves to linux/amd64), and blob downloads verified against their
digests. Errors name what failed: an unknown repository or tag is :class:`ImageNotFound`, refused
credentials :class:`Unauthorized`, a digest mismatch :class:`InvalidRequest`. It also pushes blobs and
manifests (tests and tooling fill a registry with it). Flattening is :mod:`dsec.images.oci_import`'s job.
"""

from __future__ import annotations

import base64
import hashlib
import re
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from dsec.errors import DSecError, ImageNotFound, InvalidRequest, Unauthorized
from dsec.images.image_store import ImageStore, validate_name
from dsec.images.layers import FlattenStats
from dsec.images.oci_import import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    ImageSource,
    Layer,
    Progress,
    _load_json,
    _mismatch,
    check_digest,
    import_image,
    parse_manifest,
    pick_manifest,
)
from dsec.models import ImageInfo

__all__ = ["Reference", "RegistryAuth", "RegistryClient", "RegistrySource", "default_name", "parse_reference", "pull"]

DOCKER_HUB = "registry-1.docker.io"
_ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_RETRY_STATUS = {429, 500, 502, 503, 504}
_CHUNK = 1 << 20
_MAX_MANIFEST = 4 << 20


@dataclass(frozen=True)
class Reference:
    """A parsed image reference."""

    registry: str
    """``host[:port]``."""
    repository: str
    """``library/debian``, ``team/app``..."""
    tag: str | None
    """Tag, when given (``latest`` when neither a tag nor a digest is)."""
    digest: str | None
    """Pinned manifest digest, when given."""

    @property
    def ref(self) -> str:
        """What to put after ``/manifests/``: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")


def parse_reference(text: str) -> Reference:
    """Parse ``[host[:port]/]repo[:tag][@digest]`` the way docker does (no host: Docker Hub)."""
    rest, _, digest = text.partition("@")
    if digest:
        check_digest(digest, f"image reference {text!r}")
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    tag: str | None = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.fullmatch(tag):
            raise InvalidRequest(f"image reference {text!r}: invalid tag {tag!r}")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _REPO_RE.fullmatch(path):
        raise InvalidRequest(f"image reference {text!r}: invalid repository name {path!r} (lowercase letters, "
                             "digits and separators)")
    if tag is None and not digest:
        tag = "latest"
    return Reference(registry=registry, repository=path, tag=tag, digest=digest or None)


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}


class RegistryAuth(httpx.Auth):
    """Answers a registry's 401 challenge: basic credentials, or a bearer token fetched from the realm."""

    requires_response_body = True

    def __init__(self, username: str | None = None, password: str | None = None) -> None:
        self._basic = ("Basic " + base64.b64encode(f"{username}:{password or ''}".encode()).decode()
                       if username else None)
        self._header: str | None = None

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self._header is not None:
            request.headers["Authorization"] = self._header
        response = yield request
        if response.status_code != 401:
            return
        scheme, params = _challenge(response.headers.get("WWW-Authenticate", ""))
        if scheme == "basic" and self._basic is not None:
            self._header = self._basic
        elif scheme == "bearer" and "realm" in params:
            query: dict[str, str] = {k: params[k] for k in ("service", "scope") if k in params}
            token_request = httpx.Request("GET", params["realm"], params=query)
            if self._basic is not None:
                token_request.headers["Authorization"] = self._basic
            token_response = yield token_request
            if token_response.status_code != 200:
                raise Unauthorized(f"the registry's token service {params['realm']} refused "
                                   f"{'the credentials' if self._basic else 'anonymous access'} "
                                   f"(HTTP {token_response.status_code}): give --username/--password",
                                   realm=params["realm"])
            try:
                body = token_response.json()
                token = body.get("token") or body.get("access_token")
            except ValueError:
                token = None
            if not isinstance(token, str) or not token:
                raise DSecError(f"the registry's token service {params['realm']} answered without a token")
            self._header = f"Bearer {token}"
        else:
            return  # no way to answer: the caller turns the 401 into an error
        request.headers["Authorization"] = self._header
        yield request


def _registry_errors(response: httpx.Response) -> str:
    try:
        errors = response.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except (ValueError, AttributeError):
        return response.text[:200]


def _transport_problem(exc: httpx.TransportError, client: RegistryClient) -> str:
    """What failed, said plainly: the host name, the connection, TLS (where plain HTTP is the likely fix) or time."""
    causes: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(causes) < 8:
        causes.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(c) for c in causes)
    host = client.registry.rsplit(":", 1)[0] if not client.registry.endswith("]") else client.registry
    if any(isinstance(c, socket.gaierror) for c in causes) or "Name or service not known" in text \
            or "name resolution" in text:
        return (f"the host name {host!r} does not resolve ({exc}); check the reference's registry part (a registry "
                "on this machine is 127.0.0.1:PORT)")
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {client.http.timeout.connect or 'the'} s ({type(exc).__name__})"
    if any(isinstance(c, ssl.SSLError) for c in causes) and not client.insecure:
        return f"the TLS handshake failed ({exc}): a plain HTTP registry needs --insecure"
    if any(isinstance(c, ConnectionRefusedError) for c in causes) or "refused" in text:
        return f"nothing accepts connections there ({exc}): is the registry running, on that port?"
    return str(exc) or type(exc).__name__


class RegistryClient:
    """One registry (``host[:port]``); ``insecure=True`` speaks plain HTTP (a registry on loopback)."""

    def __init__(self, registry: str, insecure: bool = False, username: str | None = None,
                 password: str | None = None, timeout: float = 60.0, retries: int = 3,
                 transport: httpx.BaseTransport | None = None, backoff: float = 0.5) -> None:
        self.registry = registry
        self.insecure = insecure
        self.retries = retries
        self.backoff = backoff
        scheme = "http" if insecure else "https"
        self.http = httpx.Client(base_url=f"{scheme}://{registry}", auth=RegistryAuth(username, password),
                                 follow_redirects=True, timeout=timeout, transport=transport)

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
        """One request, retried on connection errors, 429 and 5xx; errors named after ``what``."""
        for attempt in range(self.retries):
            try:
                response = self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                if attempt + 1 < self.retries:
                    time.sleep(self.backoff * 2**attempt)
                    continue
                raise DSecError(f"cannot reach registry {self.registry} for {what}: {_transport_problem(exc, self)}",
                                registry=self.registry) from None
            if response.status_code in _RETRY_STATUS and attempt + 1 < self.retries:
                time.sleep(self.backoff * 2**attempt)
                continue
            return self._check(response, what)
        raise AssertionError("unreachable")

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        code = response.status_code
        if code < 400:
            return response
        response.read()
        detail = _registry_errors(response)
        if code == 401:
            raise Unauthorized(f"registry {self.registry} refused {what} (HTTP 401: {detail}): wrong or missing "
                               "credentials (--username/--password)", registry=self.registry)
        if code == 403:
            raise Unauthorized(f"registry {self.registry} denied {what} (HTTP 403: {detail})", registry=self.registry)
        if code == 404:
            raise ImageNotFound(f"{what}: not found in registry {self.registry} ({detail or 'HTTP 404'})",
                                registry=self.registry)
        raise DSecError(f"registry {self.registry} failed {what}: HTTP {code}: {detail}", registry=self.registry)

    # ------------------------------------------------------------------ pull
    def manifest(self, repository: str, ref: str) -> tuple[bytes, str]:
        """The raw manifest (or index) ``ref`` of ``repository`` and its media type; verified if ``ref`` is a digest."""
        what = f"manifest {repository}:{ref}" if not ref.startswith("sha256:") else f"manifest {repository}@{ref}"
        response = self._send("GET", f"/v2/{repository}/manifests/{ref}", what, headers={"Accept": _ACCEPT})
        data = response.content
        if len(data) > _MAX_MANIFEST:
            raise InvalidRequest(f"{what}: larger than {_MAX_MANIFEST} bytes")
        if ref.startswith("sha256:"):
            got = "sha256:" + hashlib.sha256(data).hexdigest()
            if got != ref:
                raise _mismatch(what, ref, got)
        return data, response.headers.get("Content-Type", "").split(";")[0].strip()

    def blob_bytes(self, repository: str, digest: str, what: str) -> bytes:
        """A small blob (a config), verified against ``digest``."""
        data = self._send("GET", f"/v2/{repository}/blobs/{check_digest(digest, what)}", what).content
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest:
            raise _mismatch(what, digest, got)
        return data

    def download(self, repository: str, digest: str, out: IO[bytes], what: str,
                 advance: Callable[[int], None] = lambda n: None) -> int:
        """Stream blob ``digest`` into ``out`` (rewound and retried on a broken connection); verified."""
        url = f"/v2/{repository}/blobs/{check_digest(digest, what)}"
        for attempt in range(self.retries):
            out.seek(0)
            out.truncate()
            sha, size = hashlib.sha256(), 0
            try:
                with self.http.stream("GET", url) as response:
                    self._check(response, what)
                    for chunk in response.iter_bytes(_CHUNK):
                        sha.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        advance(len(chunk))
            except httpx.TransportError as exc:
                if attempt + 1 < self.retries:
                    time.sleep(self.backoff * 2**attempt)
                    continue
                raise DSecError(f"downloading {what} from {self.registry} failed: {exc}") from None
            got = "sha256:" + sha.hexdigest()
            if got != digest:
                raise _mismatch(what, digest, got)
            out.flush()
            out.seek(0)
            return size
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ push
    def push_blob(self, repository: str, data: bytes) -> str:
        """Upload ``data`` as a blob (monolithic upload) unless the registry has it; return its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        what = f"blob {digest} of {repository}"
        try:
            self._send("HEAD", f"/v2/{repository}/blobs/{digest}", what)
            return digest
        except ImageNotFound:
            pass
        start = self._send("POST", f"/v2/{repository}/blobs/uploads/", f"upload to {repository}")
        location = start.headers["Location"]
        # the upload URL carries its own query (``_state``): add the digest to it, do not replace it
        url = httpx.URL(location).copy_merge_params({"digest": digest})
        self._send("PUT", str(url), what, content=data,
                   headers={"Content-Type": "application/octet-stream"})
        return digest

    def push_manifest(self, repository: str, ref: str, data: bytes, media_type: str) -> str:
        """Upload a manifest (or index) under tag ``ref``; return its digest."""
        self._send("PUT", f"/v2/{repository}/manifests/{ref}", f"manifest {repository}:{ref}", content=data,
                   headers={"Content-Type": media_type})
        return "sha256:" + hashlib.sha256(data).hexdigest()


class _Cancelled(Exception):
    """Raised inside a download thread when the import it serves was abandoned."""


class RegistrySource(ImageSource):
    """An image in a registry. Its layers download (verified) into anonymous files under ``spool``, up to
    ``parallel`` at once and as soon as the manifest is read, while earlier layers are being flattened."""

    def __init__(self, client: RegistryClient, ref: Reference, spool: Path, progress: Progress | None = None,
                 parallel: int = 3) -> None:
        self.client = client
        self.ref = ref
        self.spool = spool
        self.progress = progress
        self.description = f"registry:{ref}"
        self._pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="dsec-pull")
        self._pending: list[tuple[Layer, Future[IO[bytes]]]] = []
        self._closing = False

    def load(self) -> tuple[dict[str, Any], list[Layer]]:
        repo, where = self.ref.repository, str(self.ref)
        data, media = self.client.manifest(repo, self.ref.ref)
        for _ in range(4):
            doc = _load_json(data, f"{where}: manifest")
            if doc.get("mediaType", media) in INDEX_TYPES or media in INDEX_TYPES:
                desc = pick_manifest(doc, where)
                data, media = self.client.manifest(repo, check_digest(desc.get("digest"), f"{where}: index entry"))
                continue
            config, layers = parse_manifest(doc, where, lambda d, w: self.client.blob_bytes(repo, d, w))
            self._pending = [(layer, self._pool.submit(self._download, layer)) for layer in layers]
            return config, layers
        raise InvalidRequest(f"{where}: indexes nested too deeply")

    def _download(self, layer: Layer) -> IO[bytes]:
        assert layer.digest is not None
        out = tempfile.TemporaryFile(dir=self.spool)  # noqa: SIM115 (handed to open_layer's caller)
        try:
            shown = (self.progress.task(f"download {layer.digest[7:19]}", layer.size)
                     if self.progress is not None else (lambda n: None))

            def advance(n: int) -> None:
                if self._closing:
                    raise _Cancelled
                shown(n)

            self.client.download(self.ref.repository, layer.digest, out, f"layer {layer.digest}", advance)
        except BaseException:
            out.close()
            raise
        return out

    def open_layer(self, layer: Layer) -> IO[bytes]:
        index = next(i for i, (pending, _) in enumerate(self._pending) if pending is layer)
        _, future = self._pending.pop(index)
        return future.result()

    def close(self) -> None:
        """Abandon downloads still running, drop the files nobody took, close the connections."""
        self._closing = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for _, future in self._pending:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()
        self._pending = []
        self.client.close()


def default_name(ref: Reference) -> str:
    """The store name a pull of ``ref`` gets without ``--name``: ``debian`` or ``debian-bookworm``."""
    name = ref.repository.rsplit("/", 1)[-1]
    if ref.tag and ref.tag != "latest":
        name += f"-{ref.tag.lower()}"
    return re.sub(r"[^a-z0-9._-]", "-", name)[:128]


def pull(store: ImageStore, reference: str, uid_shift: int, name: str | None = None, insecure: bool = False,
         username: str | None = None, password: str | None = None, replace: bool = False,
         progress: Progress | None = None) -> tuple[ImageInfo, FlattenStats]:
    """Pull ``reference`` from its registry into ``store`` as ``name`` (default: :func:`default_name`)."""
    ref = parse_reference(reference)
    name = validate_name(name or default_name(ref))
    store.root.mkdir(parents=True, exist_ok=True)
    client = RegistryClient(ref.registry, insecure=insecure, username=username, password=password)
    source = RegistrySource(client, ref, spool=store.root, progress=progress)
    return import_image(store, name, source, uid_shift=uid_shift, replace=replace, progress=progress)
