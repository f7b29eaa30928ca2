"""The file operations and watches of backends whose sandbox roots the host reaches directly (container,
function, the test fake), written once for all.

Owns :class:`HostFiles`: each operation asks the backend for its view of a path (a
:class:`~dsec.isolation.files.SandboxFS` acting as the right user, and the path in it) and runs the blocking
part in a worker thread; and :class:`HostFileOps`, the :class:`~dsec.backends.base.Backend` methods that hand
each request to the backend's :class:`HostFiles`. Which root a path is served from (the sandbox's own, or the
host's view beneath a hidden path) stays the backend's decision; this module never touches a backend's private
state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from dsec.accounts import Identity
from dsec.backends.base import Backend
from dsec.errors import InvalidRequest
from dsec.isolation.files import Actor, SandboxFS
from dsec.isolation.inotify import DirectoryWatch
from dsec.models import SandboxRecord
from dsec.models.surface import FileEvent, FileStat

__all__ = ["HostFileOps", "HostFiles", "View", "actor_of"]

View = Callable[[SandboxRecord, str, Identity | None], tuple[SandboxFS, str]]
"""The backend's view of a sandbox path for a user: the filesystem to act on and the path in it."""


def actor_of(user: Identity, shift: int) -> Actor | None:
    """The host credentials a sandbox user's file operations run with (None for root: the daemon's own)."""
    if user.is_root:
        return None
    return Actor(user.uid + shift, user.gid + shift, tuple(g + shift for g in user.groups))


class HostFiles:
    """stat, mkdir, remove, rename, chmod, chown, extended attributes and watch over a backend's :data:`View`."""

    def __init__(self, view: View) -> None:
        self._view = view

    async def stat(self, record: SandboxRecord, path: str, user: Identity | None) -> FileStat:
        fs, inner = self._view(record, path, user)
        found = await asyncio.to_thread(fs.stat, inner)
        return found.model_copy(update={"path": path}) if inner != path else found

    async def mkdir(self, record: SandboxRecord, path: str, parents: bool, mode: int, user: Identity | None
                    ) -> FileStat:
        fs, inner = self._view(record, path, user)
        made = await asyncio.to_thread(fs.mkdir, inner, parents, mode)
        return made.model_copy(update={"path": path}) if inner != path else made

    async def remove(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None) -> None:
        fs, inner = self._view(record, path, user)
        await asyncio.to_thread(fs.remove, inner, recursive)

    async def rename(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                     user: Identity | None) -> FileStat:
        fs, inner_source = self._view(record, source, user)
        other, inner_dest = self._view(record, destination, user)
        if other.root != fs.root:
            raise InvalidRequest(f"cannot rename {source} to {destination}: one of them is beneath a hidden path "
                                 "and the other is not", path=source)
        moved = await asyncio.to_thread(fs.rename, inner_source, inner_dest, overwrite)
        return moved.model_copy(update={"path": destination, "name": destination.rsplit("/", 1)[-1]})

    async def chmod(self, record: SandboxRecord, path: str, mode: int, user: Identity | None) -> FileStat:
        fs, inner = self._view(record, path, user)
        changed = await asyncio.to_thread(fs.chmod, inner, mode)
        return changed.model_copy(update={"path": path}) if inner != path else changed

    async def set_xattrs(self, record: SandboxRecord, path: str, values: dict[str, str], remove: list[str],
                         user: Identity | None) -> FileStat:
        fs, inner = self._view(record, path, user)
        changed = await asyncio.to_thread(fs.set_xattrs, inner, values, remove)
        return changed.model_copy(update={"path": path}) if inner != path else changed

    async def chown(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None) -> FileStat:
        fs, inner = self._view(record, path, user)
        changed = await asyncio.to_thread(fs.chown, inner, owner.uid, owner.gid)
        return changed.model_copy(update={"path": path}) if inner != path else changed

    async def watch(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None
                    ) -> AsyncIterator[FileEvent]:
        fs, inner = self._view(record, path, user)
        watch = DirectoryWatch(inner, recursive, fs.open_dir, fs.names)
        await watch.start()
        return self._events(watch, path, inner)

    @staticmethod
    async def _events(watch: DirectoryWatch, path: str, inner: str) -> AsyncIterator[FileEvent]:
        try:
            async for event in watch.events():
                if inner != path:  # served through the host's view of a hidden path: name sandbox paths
                    event = event.model_copy(update={
                        "path": path + event.path[len(inner):],
                        "dest": None if event.dest is None else path + event.dest[len(inner):]})
                yield event
        finally:
            watch.close()


class HostFileOps(Backend):
    """A backend whose files API is its :attr:`files` (stat, mkdir, remove, rename, chmod, chown, extended
    attributes, watch); reading, writing and listing stay the backend's own."""

    files: HostFiles

    async def stat_file(self, record: SandboxRecord, path: str, user: Identity | None = None) -> FileStat:
        return await self.files.stat(record, path, user)

    async def make_dir(self, record: SandboxRecord, path: str, parents: bool, mode: int,
                       user: Identity | None = None) -> FileStat:
        return await self.files.mkdir(record, path, parents, mode, user)

    async def remove_file(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> None:
        await self.files.remove(record, path, recursive, user)

    async def rename_file(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                          user: Identity | None = None) -> FileStat:
        return await self.files.rename(record, source, destination, overwrite, user)

    async def chmod_file(self, record: SandboxRecord, path: str, mode: int, user: Identity | None = None
                         ) -> FileStat:
        return await self.files.chmod(record, path, mode, user)

    async def set_xattrs(self, record: SandboxRecord, path: str, values: dict[str, str], remove: list[str],
                         user: Identity | None = None) -> FileStat:
        return await self.files.set_xattrs(record, path, values, remove, user)

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        return await self.files.chown(record, path, owner, user)

    async def watch_files(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> AsyncIterator[FileEvent]:
        return await self.files.watch(record, path, recursive, user)
