"""envd's plain HTTP ``/files``: download (``GET``) and upload (``POST``) of a sandbox's files.

Owns the translation of ``/files`` onto DSec's files API: the access token or a signed URL, ``username``
(the user the file is read or written as), paths resolved as envd does (relative ones below the sandbox's
working directory), multipart or octet-stream uploads (gzip accepted), what envd does after an upload (the
file given to its user; its ``X-Metadata-*`` headers as the file's ``user.e2b.`` extended attributes) and
envd's HTTP errors. It must never touch a file by itself.
"""

from __future__ import annotations

import contextlib
import gzip
import posixpath
import re
import zlib
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.keys import EnvdTokens
from dsec.e2b.process import resolve_path
from dsec.errors import DSecError, FileNotFound, InvalidRequest, PermissionDenied, Unauthorized
from dsec.models import SandboxInfo
from dsec.models.surface import FileStat, XattrRequest

__all__ = ["download", "upload"]

MAX_FILE_BYTES = 1024**3
_METADATA = "x-metadata-"
METADATA_XATTR = "user.e2b."
"""envd keeps a file's metadata as extended attributes under this prefix."""
_MAX_METADATA_BYTES = 4096
"""envd's cap on a file's metadata (keys with the prefix, and values)."""
_MAX_METADATA_KEY = 255 - len(METADATA_XATTR)
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


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


def _metadata(request: Request) -> dict[str, str]:
    """envd's ``X-Metadata-<key>`` headers: keys lowercased, the first value of a repeated one, printable
    ASCII only, within envd's sizes (InvalidRequest, before anything is written, otherwise)."""
    found: dict[str, str] = {}
    for raw_name, raw_value in request.headers.raw:
        name = raw_name.decode("latin-1").lower()
        if not name.startswith(_METADATA):
            continue
        key, value = name[len(_METADATA):], raw_value.decode("latin-1")
        if not key or not _PRINTABLE.fullmatch(key) or not _PRINTABLE.fullmatch(value):
            raise InvalidRequest(f"invalid metadata header {raw_name.decode('latin-1')!r}: keys and values must be "
                                 "printable US-ASCII")
        if len(key) > _MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata key {key!r} is longer than {_MAX_METADATA_KEY} bytes")
        found.setdefault(key, value)
    if sum(len(METADATA_XATTR) + len(k) + len(v) for k, v in found.items()) > _MAX_METADATA_BYTES:
        raise InvalidRequest(f"the file's metadata is larger than {_MAX_METADATA_BYTES} bytes")
    return found


async def _settle(api: NodeAPI, sandbox_id: str, path: str, user: str | None, metadata: dict[str, str]
                  ) -> FileStat:
    """What envd does after writing an upload: give the file to its user, and replace its metadata.

    envd writes as root and chowns the file to its user (watchers see a CHMOD after the create and the write).
    DSec's write as root does the same; a file written by another user is that user's already, and the chown
    of it to its owner is that event. The metadata replaces the file's ``user.e2b.`` attributes: keys not in
    this upload are removed."""
    found = await api.stat_file(sandbox_id, path, user=user)
    if found.uid != 0:
        with contextlib.suppress(PermissionDenied):  # not the writer's file (written through group rights)
            found = await api.chown_file(sandbox_id, path, f"{found.uid}:{found.gid}", user=user)
    wanted = {METADATA_XATTR + k: v for k, v in metadata.items()}
    stale = [name for name in found.xattrs or {} if name.startswith(METADATA_XATTR) and name not in wanted]
    if wanted or stale:
        found = await api.set_xattrs(sandbox_id, XattrRequest(path=path, set=wanted, remove=stale), user=user)
    return found


def file_metadata(found: FileStat) -> dict[str, str]:
    """envd's metadata of a file: its ``user.e2b.`` attributes, without the prefix."""
    return {k[len(METADATA_XATTR):]: v for k, v in (found.xattrs or {}).items() if k.startswith(METADATA_XATTR)}


async def upload(request: Request, api: NodeAPI, tokens: EnvdTokens, info: SandboxInfo) -> Response:
    """``POST /files``: write each uploaded file (parents created); answers their ``EntryInfo``."""
    try:
        _authorize(request, tokens, info, request.query_params.get("path", ""), "write")
        user = _user(request)
        metadata = _metadata(request)
        written: list[dict[str, Any]] = []
        for raw, data in await _parts(request):
            path = resolve_path(info, raw)
            if any(w["path"] == path for w in written):
                raise InvalidRequest(f"you cannot upload multiple files to the same path '{path}' in one upload "
                                     "request")
            await api.write_file(info.id, path, data, user=user)
            found = await _settle(api, info.id, path, user, metadata)
            entry: dict[str, Any] = {"path": path, "name": posixpath.basename(path), "type": "file"}
            if stored := file_metadata(found):
                entry["metadata"] = stored
            written.append(entry)
    except DSecError as exc:
        return envd_error(exc)
    return JSONResponse(written)
