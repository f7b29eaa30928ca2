"""envd's files: the Filesystem service (``spec/envd/filesystem/filesystem.proto``) and plain HTTP ``/files``.

Owns the translation of envd's file calls onto DSec's files API: ``GET /files`` (download), ``POST /files``
(multipart or octet-stream upload, gzip accepted), ``ListDir`` (with its depth) and ``Stat`` (an entry of
its parent's listing). Paths are resolved as envd does (relative ones below the sandbox's working
directory). The calls that need DSec's file operations and watches (MakeDir, Move, Remove, WatchDir and
the watchers) answer ``unimplemented`` naming what is missing. It must never touch a file by itself.
"""

from __future__ import annotations

import datetime
import gzip
import posixpath
import stat
import zlib
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.keys import EnvdTokens
from dsec.e2b.process import current_target, resolve_path
from dsec.e2b.wire import Code, ConnectError, RequestContext, filesystem_pb
from dsec.errors import DSecError, InvalidRequest, NotFound, NotSupported, Unauthorized
from dsec.models import FileEntry, SandboxInfo

__all__ = ["FilesystemService", "download", "upload"]

MAX_FILE_BYTES = 1024**3
_NO_OPS = "is not supported by this DSec version: it needs DSec's file operations and watches"
_KINDS = {"file": filesystem_pb.FileType.FILE, "dir": filesystem_pb.FileType.DIRECTORY,
          "symlink": filesystem_pb.FileType.SYMLINK}


def entry_info(entry: FileEntry) -> filesystem_pb.EntryInfo:
    """envd's ``EntryInfo`` of a DSec file entry (owner and group are not in DSec's listing yet)."""
    from protobuf.wkt import Timestamp

    kind = {"file": "-", "dir": "d", "symlink": "l"}.get(entry.type, "?")
    return filesystem_pb.EntryInfo(
        name=entry.name, type=_KINDS.get(entry.type, filesystem_pb.FileType.UNSPECIFIED), path=entry.path,
        size=entry.size, mode=stat.S_IMODE(entry.mode), permissions=kind + stat.filemode(entry.mode)[1:],
        modified_time=Timestamp.from_datetime(datetime.datetime.fromtimestamp(entry.mtime, datetime.UTC)))


class FilesystemService:
    """The Filesystem service of one node API (the sandbox comes from the app's current target)."""

    def __init__(self, api: NodeAPI) -> None:
        self.api = api

    async def _entries(self, path: str) -> list[FileEntry]:
        try:
            return await self.api.list_files(current_target.get().info.id, path)
        except DSecError as exc:
            raise _rpc_error(exc, path) from None

    async def stat(self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]
                   ) -> filesystem_pb.StatResponse:
        """One entry: found in its parent's listing."""
        path = posixpath.normpath(resolve_path(current_target.get().info, request.path))
        if path == "/":
            return filesystem_pb.StatResponse(entry=filesystem_pb.EntryInfo(
                name="/", path="/", type=filesystem_pb.FileType.DIRECTORY, mode=0o755, permissions="drwxr-xr-x"))
        parent, name = posixpath.split(path)
        for entry in await self._entries(parent):
            if entry.name == name:
                return filesystem_pb.StatResponse(entry=entry_info(entry))
        raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]
                       ) -> filesystem_pb.ListDirResponse:
        """A directory's entries, ``depth`` levels down (default 1)."""
        root = resolve_path(current_target.get().info, request.path)
        depth = request.depth or 1
        found: list[filesystem_pb.EntryInfo] = []
        level = [root]
        for _ in range(depth):
            below: list[str] = []
            for directory in level:
                for entry in await self._entries(directory):
                    found.append(entry_info(entry))
                    if entry.type == "dir":
                        below.append(entry.path)
            level = below
        return filesystem_pb.ListDirResponse(entries=found)

    async def _unsupported(self, what: str) -> None:
        raise ConnectError(Code.UNIMPLEMENTED, f"{what} {_NO_OPS}")

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]
                       ) -> filesystem_pb.MakeDirResponse:
        """Needs DSec's mkdir."""
        await self._unsupported("files.make_dir")
        raise AssertionError  # unreachable

    async def move(self, request: filesystem_pb.MoveRequest, ctx: RequestContext[Any, Any]
                   ) -> filesystem_pb.MoveResponse:
        """Needs DSec's rename."""
        await self._unsupported("files.rename")
        raise AssertionError

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]
                     ) -> filesystem_pb.RemoveResponse:
        """Needs DSec's remove."""
        await self._unsupported("files.remove")
        raise AssertionError

    def watch_dir(self, request: filesystem_pb.WatchDirRequest, ctx: RequestContext[Any, Any]
                  ) -> filesystem_pb.WatchDirResponse:
        """Needs DSec's watch."""
        raise ConnectError(Code.UNIMPLEMENTED, f"files.watch_dir {_NO_OPS}")

    async def create_watcher(self, request: filesystem_pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> filesystem_pb.CreateWatcherResponse:
        """Needs DSec's watch."""
        await self._unsupported("a directory watcher")
        raise AssertionError

    async def get_watcher_events(self, request: filesystem_pb.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> filesystem_pb.GetWatcherEventsResponse:
        """Needs DSec's watch."""
        await self._unsupported("a directory watcher")
        raise AssertionError

    async def remove_watcher(self, request: filesystem_pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> filesystem_pb.RemoveWatcherResponse:
        """Needs DSec's watch."""
        await self._unsupported("a directory watcher")
        raise AssertionError


def _rpc_error(exc: DSecError, path: str) -> ConnectError:
    if isinstance(exc, NotFound) and not isinstance(exc, translate.GONE):
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    return translate.connect_error(exc)


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
        _user(request)
        path = resolve_path(info, raw)
        try:
            data = await api.read_file(info.id, path)
        except NotFound as exc:
            if isinstance(exc, translate.GONE):
                raise
            return JSONResponse({"code": 404, "message": f"path '{path}' does not exist"}, status_code=404)
    except DSecError as exc:
        return envd_error(exc)
    name = posixpath.basename(path)
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'inline; filename="{name}"'})


def _user(request: Request) -> None:
    user = request.query_params.get("username")
    if user:
        raise NotSupported(f"username={user!r} is not supported by this DSec version: it needs DSec's users")


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


async def upload(request: Request, api: NodeAPI, tokens: EnvdTokens, info: SandboxInfo) -> Response:
    """``POST /files``: write each uploaded file (parents created); answers their ``EntryInfo``."""
    try:
        _authorize(request, tokens, info, request.query_params.get("path", ""), "write")
        _user(request)
        written: list[dict[str, str]] = []
        for raw, data in await _parts(request):
            path = resolve_path(info, raw)
            if any(w["path"] == path for w in written):
                raise InvalidRequest(f"you cannot upload multiple files to the same path '{path}' in one upload "
                                     "request")
            await api.write_file(info.id, path, data)
            written.append({"path": path, "name": posixpath.basename(path), "type": "file"})
    except DSecError as exc:
        return envd_error(exc)
    return JSONResponse(written)
