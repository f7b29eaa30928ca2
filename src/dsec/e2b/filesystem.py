"""envd's Filesystem service (``spec/envd/filesystem/filesystem.proto``) over DSec's file operations and watches.

Owns the translation of envd's file calls onto the node API, as the user the call names: ``Stat``,
``ListDir`` (with its depth), ``MakeDir`` (``mkdir -p``; an existing directory is ``already_exists``),
``Move``, ``Remove`` (recursive; a missing path is fine, as ``os.RemoveAll``), ``WatchDir`` (a stream) and
the polled watchers (``CreateWatcher``/``GetWatcherEvents``/``RemoveWatcher``) onto a DSec watch, whose
events become envd's (create, write, remove, rename, chmod; names relative to the watched directory; with
``include_entry``, the entry's info). ``Stat`` of a symlink describes what it resolves to, as envd's.
Paths are resolved as envd does (relative ones below the sandbox's working directory). It keeps, per
polled watcher, only the number of the next event to hand out; it must never touch a file by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import posixpath
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.files import file_metadata
from dsec.e2b.process import current_target, keepalive_interval, resolve_path, user_of, with_keepalive
from dsec.e2b.wire import Code, ConnectError, Oneof, RequestContext, filesystem_pb
from dsec.errors import DSecError, FileExists, FileNotFound, NotADirectory
from dsec.models import FileEntry
from dsec.models.surface import FileEvent, FileStat, MkdirRequest, RenameRequest, WatchRequest

__all__ = ["FilesystemService", "entry_info"]

_KINDS = {"file": filesystem_pb.FileType.FILE, "dir": filesystem_pb.FileType.DIRECTORY,
          "symlink": filesystem_pb.FileType.SYMLINK}
_EVENTS = {"create": filesystem_pb.EventType.CREATE, "modify": filesystem_pb.EventType.WRITE,
           "delete": filesystem_pb.EventType.REMOVE, "move": filesystem_pb.EventType.RENAME,
           "chmod": filesystem_pb.EventType.CHMOD}
_SETTLE_S = 0.2
"""A polled watcher waits this long for more events after the last one: a write's events come as a burst, which a
loaded daemon may read in parts."""
_POLL_WAIT_S = 0.25
"""How long a poll that found nothing yet waits for a first event (inotify reports a moment after the call)."""
_MAX_WATCHERS = 1024
_MAX_HOPS = 40
"""Symlinks followed at most, as Linux's path resolution (ELOOP past it)."""
_STAT_AT_ONCE = 16
"""Entries of a listing described at once (a listing has no owners: each entry is a stat)."""


def _timestamp(mtime: float) -> Any:
    from protobuf.wkt import Timestamp

    return Timestamp.from_datetime(datetime.datetime.fromtimestamp(mtime, datetime.UTC))


def _permissions(kind: str, mode: int) -> str:
    return {"file": "-", "dir": "d", "symlink": "l"}.get(kind, "?") + stat.filemode(mode)[1:]


def entry_info(entry: FileEntry | FileStat) -> filesystem_pb.EntryInfo:
    """envd's ``EntryInfo`` of a DSec listing entry or stat (a listing has no owner, group or metadata)."""
    info = filesystem_pb.EntryInfo(
        name=entry.name, type=_KINDS.get(entry.type, filesystem_pb.FileType.UNSPECIFIED), path=entry.path,
        size=entry.size, mode=stat.S_IMODE(entry.mode), permissions=_permissions(entry.type, entry.mode),
        modified_time=_timestamp(entry.mtime))
    if isinstance(entry, FileStat):
        info.owner = entry.owner or str(entry.uid)
        info.group = entry.group or str(entry.gid)
        if entry.symlink_target is not None:
            info.symlink_target = entry.symlink_target
        info.metadata.update(file_metadata(entry))
    return info


def rpc_error(exc: DSecError, path: str) -> ConnectError:
    """The Connect error of a file call (envd's wording for a missing path)."""
    if isinstance(exc, FileNotFound):
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    return translate.connect_error(exc)


def _watch_event(event: FileEvent, root: str) -> list[filesystem_pb.FilesystemEvent]:
    """envd's events for one DSec event: a move in the tree is a rename of the old name and a create of the new."""
    def named(path: str, kind: filesystem_pb.EventType) -> filesystem_pb.FilesystemEvent:
        return filesystem_pb.FilesystemEvent(name=posixpath.relpath(path, root), type=kind)

    out = [named(event.path, _EVENTS[event.type])]
    if event.type == "move" and event.dest is not None:
        out.append(named(event.dest, filesystem_pb.EventType.CREATE))
    return out


@dataclass
class _Cursor:
    """A polled watcher between polls."""

    root: str
    next: int
    """The number of the next event to hand out."""
    include_entry: bool
    user: str | None


class FilesystemService:
    """The Filesystem service of one node API (the sandbox comes from the app's current target)."""

    def __init__(self, api: NodeAPI) -> None:
        self.api = api
        self._cursors: dict[tuple[str, str], _Cursor] = {}
        """What each polled watcher needs between polls, by (sandbox, watch)."""

    @staticmethod
    def _where(path: str) -> tuple[str, str]:
        info = current_target.get().info
        return info.id, posixpath.normpath(resolve_path(info, path))

    async def stat(self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]
                   ) -> filesystem_pb.StatResponse:
        """One entry (a symlink itself, with its target)."""
        sandbox_id, path = self._where(request.path)
        try:
            return filesystem_pb.StatResponse(entry=await self._entry(sandbox_id, path, user_of(ctx)))
        except DSecError as exc:
            raise rpc_error(exc, path) from None

    async def _entry(self, sandbox_id: str, path: str, user: str | None) -> filesystem_pb.EntryInfo:
        """envd's entry of a path: a symlink is described by what it resolves to, with that absolute target."""
        found = await self.api.stat_file(sandbox_id, path, user=user)
        if found.type != "symlink":
            return entry_info(found)
        target, hops = found, 0
        resolved = path
        while target.type == "symlink" and target.symlink_target is not None and hops < _MAX_HOPS:
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(resolved), target.symlink_target))
            try:
                target = await self.api.stat_file(sandbox_id, resolved, user=user)
            except FileNotFound:
                return entry_info(found)  # dangling: the link itself
            hops += 1
        info = entry_info(target.model_copy(update={"name": found.name, "path": found.path}))
        info.symlink_target = resolved
        return info

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]
                       ) -> filesystem_pb.ListDirResponse:
        """A directory's entries, ``depth`` levels down (default 1), in envd's walk order (by name, each
        directory followed by what is below it), each with its owner and group."""
        sandbox_id, root = self._where(request.path)
        found: list[filesystem_pb.EntryInfo] = []
        await self._walk(sandbox_id, root, request.depth or 1, user_of(ctx), found)
        return filesystem_pb.ListDirResponse(entries=found)

    async def _walk(self, sandbox_id: str, directory: str, depth: int, user: str | None,
                    found: list[filesystem_pb.EntryInfo]) -> None:
        try:
            entries = sorted(await self.api.list_files(sandbox_id, directory, user=user), key=lambda e: e.name)
        except DSecError as exc:
            raise rpc_error(exc, directory) from None
        limit = asyncio.Semaphore(_STAT_AT_ONCE)

        async def described(entry: FileEntry) -> filesystem_pb.EntryInfo:
            async with limit:
                try:
                    return await self._entry(sandbox_id, entry.path, user)
                except DSecError:  # gone or unreadable since the listing: what the listing said
                    return entry_info(entry)

        for entry, info in zip(entries, await asyncio.gather(*map(described, entries)), strict=True):
            found.append(info)
            if entry.type == "dir" and depth > 1:
                await self._walk(sandbox_id, entry.path, depth - 1, user, found)

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]
                       ) -> filesystem_pb.MakeDirResponse:
        """``mkdir -p``, but an existing directory is ``already_exists`` (the SDK answers False)."""
        sandbox_id, path = self._where(request.path)
        user = user_of(ctx)
        try:
            try:
                made = await self.api.make_dir(sandbox_id, MkdirRequest(path=path), user=user)
            except FileNotFound:  # a missing parent: make them all
                made = await self.api.make_dir(sandbox_id, MkdirRequest(path=path, parents=True), user=user)
        except FileExists:
            raise ConnectError(Code.ALREADY_EXISTS, f"directory '{path}' already exists") from None
        except DSecError as exc:
            raise rpc_error(exc, path) from None
        return filesystem_pb.MakeDirResponse(entry=entry_info(made))

    async def move(self, request: filesystem_pb.MoveRequest, ctx: RequestContext[Any, Any]
                   ) -> filesystem_pb.MoveResponse:
        """Rename (replacing an existing destination, as ``mv``)."""
        sandbox_id, source = self._where(request.source)
        destination = self._where(request.destination)[1]
        try:
            moved = await self.api.rename_file(sandbox_id, RenameRequest(source=source, destination=destination),
                                               user=user_of(ctx))
        except DSecError as exc:
            raise rpc_error(exc, source) from None
        return filesystem_pb.MoveResponse(entry=entry_info(moved))

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]
                     ) -> filesystem_pb.RemoveResponse:
        """Remove a path and all below it; a missing one is fine."""
        sandbox_id, path = self._where(request.path)
        try:
            await self.api.remove_file(sandbox_id, path, recursive=True, user=user_of(ctx))
        except FileNotFound:
            pass
        except DSecError as exc:
            raise rpc_error(exc, path) from None
        return filesystem_pb.RemoveResponse()

    # -- watches ------------------------------------------------------------------------------------------

    async def _watch(self, path: str, recursive: bool, ctx: RequestContext[Any, Any]) -> tuple[str, str, str]:
        """Start a DSec watch: ``(sandbox, watch id, watched path)``."""
        sandbox_id, path = self._where(path)
        try:
            watch = await self.api.watch_files(sandbox_id, WatchRequest(path=path, recursive=recursive),
                                               user=user_of(ctx))
        except NotADirectory:
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory") from None
        except DSecError as exc:
            raise rpc_error(exc, path) from None
        return sandbox_id, watch.id, watch.path

    async def watch_dir(self, request: filesystem_pb.WatchDirRequest, ctx: RequestContext[Any, Any]
                        ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        """A directory's events as they come, until the client hangs up (then the watch is stopped)."""
        sandbox_id, watch_id, root = await self._watch(request.path, request.recursive, ctx)
        try:
            start: Oneof[Literal["start"], filesystem_pb.WatchDirResponse.StartEvent] = Oneof(
                "start", filesystem_pb.WatchDirResponse.StartEvent())
            yield filesystem_pb.WatchDirResponse(event=start)
            events = self.api.watch_events(sandbox_id, watch_id, follow=True)
            async for event in with_keepalive(events, keepalive_interval(ctx)):
                if event is None:
                    keepalive: Oneof[Literal["keepalive"], filesystem_pb.WatchDirResponse.KeepAlive] = Oneof(
                        "keepalive", filesystem_pb.WatchDirResponse.KeepAlive())
                    yield filesystem_pb.WatchDirResponse(event=keepalive)
                    continue
                for one in await self._described(sandbox_id, _watch_event(event, root), root, request.include_entry,
                                                 user_of(ctx)):
                    changed: Oneof[Literal["filesystem"], filesystem_pb.FilesystemEvent] = Oneof("filesystem", one)
                    yield filesystem_pb.WatchDirResponse(event=changed)
        except DSecError as exc:
            raise rpc_error(exc, root) from None
        finally:
            with contextlib.suppress(DSecError):
                await self.api.unwatch(sandbox_id, watch_id)

    async def _described(self, sandbox_id: str, events: list[filesystem_pb.FilesystemEvent], root: str,
                          include: bool, user: str | None) -> list[filesystem_pb.FilesystemEvent]:
        """``include_entry``: each event with the entry's info where the path still exists (best effort, as envd)."""
        if include:
            for event in events:
                if event.type not in (filesystem_pb.EventType.REMOVE, filesystem_pb.EventType.RENAME):
                    with contextlib.suppress(DSecError):
                        event.entry = await self._entry(sandbox_id, posixpath.join(root, event.name), user)
        return events

    async def create_watcher(self, request: filesystem_pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> filesystem_pb.CreateWatcherResponse:
        """Start a watch read by polling (``GetWatcherEvents``)."""
        sandbox_id, watch_id, root = await self._watch(request.path, request.recursive, ctx)
        if len(self._cursors) >= _MAX_WATCHERS:
            self._cursors.pop(next(iter(self._cursors)))  # the oldest: DSec stops it once nobody reads it
        self._cursors[(sandbox_id, watch_id)] = _Cursor(root, 0, request.include_entry, user_of(ctx))
        return filesystem_pb.CreateWatcherResponse(watcher_id=watch_id)

    async def get_watcher_events(self, request: filesystem_pb.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> filesystem_pb.GetWatcherEventsResponse:
        """The events since the last poll (waiting a moment for a burst to finish)."""
        sandbox_id = current_target.get().info.id
        key = (sandbox_id, request.watcher_id)
        if key not in self._cursors:
            raise ConnectError(Code.NOT_FOUND, f"watcher '{request.watcher_id}' not found")
        cursor = self._cursors[key]
        root, since = cursor.root, cursor.next
        found: list[FileEvent] = []
        try:
            wait = _POLL_WAIT_S
            while True:
                batch = await self._poll(sandbox_id, request.watcher_id, since + len(found), wait)
                if not batch:
                    break
                found.extend(batch)
                wait = _SETTLE_S
        except DSecError as exc:
            self._cursors.pop(key, None)
            raise rpc_error(exc, root) from None
        if found:
            cursor.next = found[-1].number + 1
        events = [e for f in found for e in _watch_event(f, root)]
        return filesystem_pb.GetWatcherEventsResponse(
            events=await self._described(sandbox_id, events, root, cursor.include_entry, cursor.user))

    async def _poll(self, sandbox_id: str, watch_id: str, since: int, wait: float) -> list[FileEvent]:
        """The events from ``since`` on, waiting up to ``wait`` seconds for a first one."""
        found: list[FileEvent] = []
        events = self.api.watch_events(sandbox_id, watch_id, since=since, follow=True)
        try:
            async with asyncio.timeout(wait):
                async for event in events:
                    found.append(event)
                    break
        except TimeoutError:
            return found
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        async for event in self.api.watch_events(sandbox_id, watch_id, since=found[-1].number + 1, follow=False):
            found.append(event)
        return found

    async def remove_watcher(self, request: filesystem_pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> filesystem_pb.RemoveWatcherResponse:
        """Stop a polled watch."""
        sandbox_id = current_target.get().info.id
        self._cursors.pop((sandbox_id, request.watcher_id), None)
        try:
            await self.api.unwatch(sandbox_id, request.watcher_id)
        except DSecError as exc:
            raise rpc_error(exc, request.watcher_id) from None
        return filesystem_pb.RemoveWatcherResponse()
