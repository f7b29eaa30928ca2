"""envd's plain HTTP ``/files``: download (``GET``) and upload (``POST``) of a sandbox's files.

Owns the translation of ``/files`` onto DSec's files API: the access token or a signed URL, ``username``
(the user the file is read or written as), paths resolved as envd does (relative ones below the sandbox's
working directory), multipart or octet-stream uploads (gzip accepted) and envd's HTTP errors. It must
never touch a file by itself.
"""

from __future__ import annotations

import contextlib
import gzip
import posixpath
import zlib

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.keys import EnvdTokens
from dsec.e2b.process import resolve_path
from dsec.errors import DSecError, FileNotFound, InvalidRequest, NotSupported, PermissionDenied, Unauthorized
from dsec.models import SandboxInfo

__all__ = ["download", "upload"]

MAX_FILE_BYTES = 1024**3
_METADATA = "x-metadata-"


def envd_error(exc: DSecError) -> JSONResponse:
    """envd's HTTP error body for a DSec error."""
    status, body = translate.envd_status(exc)
    return JSONResponse(body, status_code=status)


def _authorize(request: Request, tokens: EnvdTokens, info: SandboxInfo, path: str, operation: str) -> None:
    """``/files`` takes the envd access token, or an unexpired signature of this path and operation."""
    given = request.headers.get("x-access-token")
    if given is not None:
        if not tokens.check(info.id, given):
            raise Unauthorized("access token present in header but does not match")
        return
    query = request.query_params
    tokens.check_signature(info.id, path, operation, query.get("username"), query.get("signature"),
                           query.get("signature_expiration"))


async def download(request: Request, api: NodeAPI, tokens: EnvdTokens, info: SandboxInfo) -> Response:
    """``GET /files?path=``: a file's bytes."""
    try:
        raw = request.query_params.get("path", "")
        _authorize(request, tokens, info, raw, "read")
        path = resolve_path(info, raw)
        try:
            data = await api.read_file(info.id, path, user=_user(request))
        except FileNotFound:
            return JSONResponse({"code": 404, "message": f"path '{path}' does not exist"}, status_code=404)
    except DSecError as exc:
        return envd_error(exc)
    name = posixpath.basename(path)
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'inline; filename="{name}"'})


def _user(request: Request) -> str | None:
    """The user ``/files`` acts as (``username``; none: the sandbox's)."""
    return request.query_params.get("username") or None


def _decode(data: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return data
    if encoding != "gzip":
        raise InvalidRequest(f"unsupported Content-Encoding {encoding!r} (identity or gzip)")
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise InvalidRequest(f"the gzip body does not decompress: {exc}") from None


async def _parts(request: Request) -> list[tuple[str, bytes]]:
    """``(path, bytes)`` of each upload, from a multipart form or an octet-stream body."""
    content_type = request.headers.get("content-type", "")
    query_path = request.query_params.get("path")
    if content_type.startswith("application/octet-stream"):
        if not query_path:
            raise InvalidRequest("path query parameter is required for raw body upload")
        return [(query_path, _decode(await request.body(), request.headers.get("content-encoding")))]
    if not content_type.startswith("multipart/"):
        raise InvalidRequest(f"unsupported content type: {content_type}, expected multipart/form-data or "
                             "application/octet-stream")
    parts: list[tuple[str, bytes]] = []
    async with request.form(max_part_size=MAX_FILE_BYTES) as form:
        for name, value in form.multi_items():
            if name != "file" or not isinstance(value, UploadFile):
                continue
            path = query_path or value.filename
            if not path:
                raise InvalidRequest("a multipart file part needs a filename (its path) or the path query parameter")
            parts.append((path, await value.read()))
    return parts


async def _give_to_owner(api: NodeAPI, sandbox_id: str, path: str, user: str | None) -> None:
    """envd writes an upload as root and then gives the file to its user (a chown, which watchers see as a
    CHMOD after the create and the write). DSec's write as root does the same; a file written by another user
    is that user's already, and the chown of it to its owner is that event."""
    found = await api.stat_file(sandbox_id, path, user=user)
    if found.uid != 0:
        with contextlib.suppress(PermissionDenied):  # not the writer's file (written through group rights)
            await api.chown_file(sandbox_id, path, f"{found.uid}:{found.gid}", user=user)


async def upload(request: Request, api: NodeAPI, tokens: EnvdTokens, info: SandboxInfo) -> Response:
    """``POST /files``: write each uploaded file (parents created); answers their ``EntryInfo``."""
    try:
        _authorize(request, tokens, info, request.query_params.get("path", ""), "write")
        user = _user(request)
        if any(name.lower().startswith(_METADATA) for name in request.headers):
            raise NotSupported("file metadata (X-Metadata-* headers, envd's xattrs) is not supported by DSec: "
                               "write the file without metadata")
        written: list[dict[str, str]] = []
        for raw, data in await _parts(request):
            path = resolve_path(info, raw)
            if any(w["path"] == path for w in written):
                raise InvalidRequest(f"you cannot upload multiple files to the same path '{path}' in one upload "
                                     "request")
            await api.write_file(info.id, path, data, user=user)
            await _give_to_owner(api, info.id, path, user)
            written.append({"path": path, "name": posixpath.basename(path), "type": "file"})
    except DSecError as exc:
        return envd_error(exc)
    return JSONResponse(written)
