"""``AsyncSandbox.files``: a sandbox's files, through the node API.

Owns the files calls of a sandbox handle: read, write, list, stat, exists, mkdir, remove, rename, chmod, chown,
watch, upload and download. Paths are absolute or relative to the sandbox's working directory; ``user=``
says whose permissions are checked (default: the sandbox's user). Calls that change state (and reads) are
numbered and answered from the log on a trajectory handle, through the sandbox's ``_logged_call``. It never
spells a route and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import posixpath
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pydantic

from dsec.api.operations import close_stream
from dsec.errors import InvalidRequest, NotFound
from dsec.models import FileEntry
from dsec.models.surface import (
    FileEvent,
    FileStat,
    MkdirRequest,
    RenameRequest,
    WatchInfo,
    WatchRequest,
    XattrRequest,
    check_user,
)

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

__all__ = ["AsyncFiles", "AsyncWatch"]


def _args(**fields: Any) -> dict[str, Any]:
    """A call's identity arguments as the daemon logs them (``user`` only when given)."""
    if fields.get("user") is None:
        fields.pop("user", None)
    return fields


class AsyncFiles:
    """Files of one sandbox: raw bytes in and out, paths resolved inside the sandbox by the daemon."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _path(self, path: str) -> str:
        """``path`` as the daemon resolves it: relative ones against the sandbox's working directory."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidRequest(f"path must be a non-empty string without NUL bytes, got {path!r}", path=path)
        workdir = self._sandbox._info.spec.workdir or "/workspace"
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(workdir, path))

    @staticmethod
    def _user(user: str | None) -> str | None:
        try:
            return check_user(user)
        except pydantic.ValidationError as exc:  # (parse_user raises InvalidRequest itself)
            raise InvalidRequest(str(exc)) from None

    async def write(self, path: str, data: bytes | str, mode: int | None = None, user: str | None = None) -> None:
        """Create or replace ``path`` (parents created) as ``user``; ``str`` data is written as UTF-8."""
        body = data.encode() if isinstance(data, str) else bytes(data)
        sb, path, user = self._sandbox, self._path(path), self._user(user)
        await sb._logged_call("write", _args(path=path, mode=mode, data=body, user=user),
                              lambda seq: sb._api.write_file(sb.id, path, body, mode, seq, user))

    async def read(self, path: str, user: str | None = None) -> bytes:
        """The whole content of the regular file ``path``, read as ``user``."""
        sb, path, user = self._sandbox, self._path(path), self._user(user)
        return bytes(await sb._logged_call("read", _args(path=path, user=user),
                                           lambda seq: sb._api.read_file(sb.id, path, seq, user=user)))

    async def list(self, path: str | None = None, user: str | None = None) -> builtins.list[FileEntry]:
        """Entries of directory ``path`` (default: the sandbox's workdir); symlinks are not followed."""
        sb, user = self._sandbox, self._user(user)
        where = self._path(path if path is not None else sb._info.spec.workdir or "/workspace")
        return builtins.list(await sb._logged_call("list", _args(path=where, user=user),
                                                   lambda seq: sb._api.list_files(sb.id, where, seq, user)))

    async def stat(self, path: str, user: str | None = None) -> FileStat:
        """What ``lstat`` says of ``path``: type, size, mode, owner and group (ids and names), mtime, and a
        symlink's target. :class:`dsec.FileNotFound` (a ``FileNotFoundError``) when there is nothing."""
        sb, path, user = self._sandbox, self._path(path), self._user(user)
        found: FileStat = await sb._logged_call("stat", {"path": path, "user": user},
                                                lambda seq: sb._api.stat_file(sb.id, path, user, seq))
        return found

    async def exists(self, path: str, user: str | None = None) -> bool:
        """Whether ``path`` names anything (a dangling symlink does)."""
        try:
            await self.stat(path, user)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    async def mkdir(self, path: str, parents: bool = False, mode: int = 0o755, user: str | None = None
                    ) -> FileStat:
        """Create directory ``path`` with exactly ``mode``; ``parents``: its missing parents too, and an
        existing directory is fine (``mkdir -p``). :class:`dsec.FileExists` otherwise."""
        sb, user = self._sandbox, self._user(user)
        try:
            request = MkdirRequest(path=self._path(path), parents=parents, mode=mode)
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid mkdir: {exc.errors()[0]['msg']}") from None
        made: FileStat = await sb._logged_call(
            "mkdir", {"path": request.path, "parents": parents, "mode": mode, "user": user},
            lambda seq: sb._api.make_dir(sb.id, request, user, seq))
        return made

    async def remove(self, path: str, recursive: bool = False, user: str | None = None) -> None:
        """Remove a file, a symlink (not its target) or an empty directory; ``recursive``: a directory with
        everything below it. :class:`dsec.DirectoryNotEmpty` for a non-empty one without it."""
        sb, path, user = self._sandbox, self._path(path), self._user(user)
        await sb._logged_call("remove", {"path": path, "recursive": recursive, "user": user},
                              lambda seq: sb._api.remove_file(sb.id, path, recursive, user, seq))

    async def rename(self, source: str, destination: str, overwrite: bool = True, user: str | None = None
                     ) -> FileStat:
        """Move ``source`` to ``destination`` (as ``mv``: replacing what is there unless ``overwrite=False``,
        then :class:`dsec.FileExists`)."""
        sb, user = self._sandbox, self._user(user)
        request = RenameRequest(source=self._path(source), destination=self._path(destination), overwrite=overwrite)
        moved: FileStat = await sb._logged_call(
            "rename", {"source": request.source, "destination": request.destination, "overwrite": overwrite,
                       "user": user},
            lambda seq: sb._api.rename_file(sb.id, request, user, seq))
        return moved

    async def chmod(self, path: str, mode: int, user: str | None = None) -> FileStat:
        """Set ``path``'s permission bits (``0o755``); a symlink's target's."""
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"file mode must be between 0 and 0o7777, got {mode:o}")
        sb, path, user = self._sandbox, self._path(path), self._user(user)
        changed: FileStat = await sb._logged_call("chmod", {"path": path, "mode": mode, "user": user},
                                                  lambda seq: sb._api.chmod_file(sb.id, path, mode, user, seq))
        return changed

    async def chown(self, path: str, owner: str, user: str | None = None) -> FileStat:
        """Give ``path`` (a symlink's target) to ``owner`` (``user``, ``uid``, ``user:group``, ``uid:gid`` of the
        sandbox); only root may give files away."""
        sb, path, user, owner = self._sandbox, self._path(path), self._user(user), self._user(owner) or ""
        changed: FileStat = await sb._logged_call("chown", {"path": path, "owner": owner, "user": user},
                                                  lambda seq: sb._api.chown_file(sb.id, path, owner, user, seq))
        return changed

    async def set_xattrs(self, path: str, values: dict[str, str] | None = None, remove: Sequence[str] = (),
                         user: str | None = None) -> FileStat:
        """Set (``values``) and remove extended attributes of ``path`` (a symlink's target), by full name in the
        ``user.`` namespace (``user.origin``); ``stat(path).xattrs`` reads them. Container and function
        backends; others raise :class:`dsec.NotSupported`."""
        sb, user = self._sandbox, self._user(user)
        try:
            request = XattrRequest(path=self._path(path), set=values or {}, remove=list(remove))
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid extended attributes: {exc.errors()[0]['msg']}") from None
        changed: FileStat = await sb._logged_call(
            "xattrs", {"path": request.path, "set": request.set, "remove": request.remove, "user": user},
            lambda seq: sb._api.set_xattrs(sb.id, request, user, seq))
        return changed

    async def watch(self, path: str | None = None, recursive: bool = False, user: str | None = None
                    ) -> AsyncWatch:
        """Start watching directory ``path`` (default: the workdir): changes are recorded from now on, and
        iterating the watch gives them as they happen: ``create``, ``modify``, ``delete``, ``move`` (``dest``:
        where it went) and ``chmod`` events. ``recursive``: every directory below it too, including ones
        created later. Close it when done (``async with`` does). An observation: never logged on a trajectory."""
        sb, user = self._sandbox, self._user(user)
        try:
            request = WatchRequest(path=self._path(path or sb._info.spec.workdir or "/workspace"), recursive=recursive)
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid watch: {exc.errors()[0]['msg']}") from None
        return AsyncWatch(sb, await sb._api.watch_files(sb.id, request, user))

    async def upload(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a local file, or a directory tree, to ``remote`` (permission bits kept)."""
        source = Path(local)
        if source.is_dir():
            for root, _dirs, names in os.walk(source):
                for name in sorted(names):
                    item = Path(root) / name
                    rel = item.relative_to(source).as_posix()
                    await self._upload_file(item, f"{remote.rstrip('/')}/{rel}")
        elif source.is_file():
            await self._upload_file(source, remote)
        else:
            raise InvalidRequest(f"nothing to upload at {str(source)!r} (not a file or directory)")

    async def _upload_file(self, local: Path, remote: str) -> None:
        data, mode = await asyncio.to_thread(lambda: (local.read_bytes(), local.stat().st_mode & 0o7777))
        await self.write(remote, data, mode=mode)

    async def download(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy a sandbox file, or a directory tree, to ``local`` (parents created)."""
        target = Path(local)
        if (await self.stat(remote)).type != "dir":
            data = await self.read(remote)
            await asyncio.to_thread(_write_local, target, data)
            return
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        for entry in await self.list(remote):
            if entry.type in ("file", "dir"):
                await self.download(entry.path, target / entry.name)


def _write_local(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


class AsyncWatch:
    """A started watch of a sandbox directory (``files.watch``): the node records its events from the start,
    numbered, so nothing is missed between starting it and reading it; any client may read them (``events``)."""

    def __init__(self, sandbox: AsyncSandbox, info: WatchInfo) -> None:
        self._sandbox = sandbox
        self._info = info
        self._next = 0

    def __repr__(self) -> str:
        return f"<AsyncWatch {self._info.id} of {self._info.path}>"

    @property
    def id(self) -> str:
        """The watch's id on the node."""
        return self._info.id

    @property
    def path(self) -> str:
        """The watched directory."""
        return self._info.path

    async def events(self, since: int | None = None, follow: bool = True) -> AsyncGenerator[FileEvent, None]:
        """Its events from number ``since`` (default: the first not yet read through this handle) and, with
        ``follow``, as they happen, until the watch is closed or the loop is left."""
        sb = self._sandbox
        stream = sb._api.watch_events(sb.id, self.id, self._next if since is None else since, follow)
        try:
            async for event in stream:
                self._next = max(self._next, event.number + 1)
                yield event
        finally:
            await close_stream(stream)

    def __aiter__(self) -> AsyncGenerator[FileEvent, None]:
        return self.events()

    async def close(self) -> None:
        """Stop the watch (its event stream ends)."""
        with contextlib.suppress(NotFound):
            await self._sandbox._api.unwatch(self._sandbox.id, self.id)

    async def __aenter__(self) -> AsyncWatch:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
