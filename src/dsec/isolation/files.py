"""File operations on a sandbox's filesystem from the host, confined to the sandbox root.

Every path is resolved with ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` against
a directory fd of the sandbox root (``/proc/<init>/root`` for a container): ``..`` and
symlinks, absolute or relative, are resolved *as if* the root were ``/``, so neither
``../../etc/shadow`` nor a symlink planted by the agent can reach a host file. Files the
host creates are chowned to the sandbox's root user. Blocking: call from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import stat
from collections.abc import Iterator

from dsec.errors import InvalidRequest, NotFound, SandboxError
from dsec.models import FileEntry

__all__ = ["SandboxFS"]

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _normalise(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute and free of NUL bytes, got {path!r}", path=path)
    return posixpath.normpath(path)


class SandboxFS:
    """Confined file access below ``root`` (a host path), as user ``uid``/``gid`` for new files.

    Only the sandbox's root filesystem (its overlay) is served: every target is first resolved with
    ``O_PATH`` (no side effect), checked to live on the same device as the root, and only then reopened
    for reading or writing. The daemon acts as host root, so without that check a path such as
    ``/proc/kallsyms`` or ``/proc/1/oom_score_adj`` would reach the sandbox's procfs and sysfs with the
    host's privileges; those are left to commands run inside the sandbox. ``also_serve`` names host
    paths whose filesystems are served too (a function sandbox's workspace, bound over a read-only root)."""

    def __init__(self, root: str, uid: int, gid: int, also_serve: tuple[str, ...] = ()) -> None:
        self.root = root
        self.uid = uid
        self.gid = gid
        self.also_serve = also_serve

    @contextlib.contextmanager
    def _rootfd(self) -> Iterator[tuple[int, frozenset[int]]]:
        try:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxError(f"sandbox root is gone ({self.root}): {e.strerror}") from None
        try:
            devices = {os.fstat(fd).st_dev}
            for path in self.also_serve:
                with contextlib.suppress(OSError):
                    devices.add(os.stat(path).st_dev)
            yield fd, frozenset(devices)
        finally:
            os.close(fd)

    def _open(self, rootfd: int, path: str, flags: int, mode: int = 0) -> int:
        how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = int(_libc.syscall(_SYS_OPENAT2, rootfd, path.lstrip("/").encode() or b".", ctypes.byref(how),
                               ctypes.sizeof(how)))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return fd

    def _resolve(self, root: tuple[int, frozenset[int]], path: str, directory: bool = False) -> int:
        """An ``O_PATH`` fd of ``path`` on the sandbox's root filesystem (raises for anything else)."""
        fd = self._open(root[0], path, os.O_PATH | (os.O_DIRECTORY if directory else 0))
        if os.fstat(fd).st_dev not in root[1]:
            os.close(fd)
            raise InvalidRequest(f"{path} is not on the sandbox's filesystem: the files API serves the root "
                                 f"filesystem, not /proc, /sys or /dev (read those with exec)", path=path)
        return fd

    @staticmethod
    def _reopen(pathfd: int, flags: int) -> int:
        return os.open(f"/proc/self/fd/{pathfd}", flags | os.O_CLOEXEC)

    def _error(self, e: OSError, path: str) -> Exception:
        if e.errno == errno.ENOENT:
            return NotFound(f"no such file or directory in the sandbox: {path}", path=path)
        if e.errno == errno.EISDIR:
            return InvalidRequest(f"is a directory: {path}", path=path)
        if e.errno == errno.ENOTDIR:
            return InvalidRequest(f"not a directory: {path}", path=path)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return SandboxError(f"sandbox disk is full writing {path}", path=path)
        return SandboxError(f"{path}: {e.strerror}", path=path)

    def read(self, path: str, max_bytes: int) -> bytes:
        """Contents of a regular file; larger than ``max_bytes`` is an error naming both sizes."""
        path = _normalise(path)
        with self._rootfd() as root:
            try:
                pathfd = self._resolve(root, path)
            except OSError as e:
                raise self._error(e, path) from None
            try:
                st = os.fstat(pathfd)
                if stat.S_ISDIR(st.st_mode):
                    raise InvalidRequest(f"is a directory: {path} (use files.list)", path=path)
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidRequest(f"not a regular file: {path}", path=path)
                if st.st_size > max_bytes:
                    raise InvalidRequest(f"{path} is {st.st_size} bytes, over the read limit of {max_bytes}",
                                         path=path, size=st.st_size, limit=max_bytes)
                fd = self._reopen(pathfd, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as e:
                raise self._error(e, path) from None
            finally:
                os.close(pathfd)
            try:
                chunks = []
                total = 0
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                    if total > max_bytes:
                        raise InvalidRequest(f"{path} grew past the read limit of {max_bytes} bytes", path=path)
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)

    def _mkdirs(self, root: tuple[int, frozenset[int]], directory: str) -> None:
        parts = [p for p in directory.split("/") if p]
        current = ""
        for part in parts:
            current += "/" + part
            try:
                os.close(self._resolve(root, current, directory=True))
                continue
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            parent = self._resolve(root, posixpath.dirname(current), directory=True)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=parent)
                    os.chown(part, self.uid, self.gid, dir_fd=parent, follow_symlinks=False)
            finally:
                os.close(parent)

    def makedirs(self, path: str) -> None:
        """Create a directory and its missing parents, owned by the sandbox's root user."""
        path = _normalise(path)
        with self._rootfd() as root:
            try:
                self._mkdirs(root, path)
            except OSError as e:
                raise self._error(e, path) from None

    def write(self, path: str, data: bytes, mode: int | None) -> None:
        """Create or replace a file; missing parent directories are created."""
        path = _normalise(path)
        if path == "/":
            raise InvalidRequest("cannot write to '/'", path=path)
        with self._rootfd() as root:
            try:
                self._mkdirs(root, posixpath.dirname(path))
                parent = self._resolve(root, posixpath.dirname(path), directory=True)
                try:
                    # One name under a checked directory, O_EXCL|O_NOFOLLOW: never through a planted link.
                    fd = os.open(posixpath.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o644, dir_fd=parent)
                    os.fchown(fd, self.uid, self.gid)
                except FileExistsError:
                    pathfd = self._resolve(root, path)
                    try:
                        if not stat.S_ISREG(os.fstat(pathfd).st_mode):
                            raise InvalidRequest(f"not a regular file: {path}", path=path) from None
                        fd = self._reopen(pathfd, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
                    finally:
                        os.close(pathfd)
                finally:
                    os.close(parent)
            except OSError as e:
                raise self._error(e, path) from None
            try:
                if mode is not None:
                    os.fchmod(fd, mode & 0o7777)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as e:
                raise self._error(e, path) from None
            finally:
                os.close(fd)

    def list(self, path: str) -> list[FileEntry]:
        """Entries of a directory, symlinks not followed, sorted by name."""
        path = _normalise(path)
        with self._rootfd() as root:
            try:
                pathfd = self._resolve(root, path, directory=True)
                try:
                    fd = self._reopen(pathfd, os.O_RDONLY | os.O_DIRECTORY)
                finally:
                    os.close(pathfd)
            except OSError as e:
                raise self._error(e, path) from None
            try:
                entries = []
                for name in sorted(os.listdir(fd)):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while listing
                    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
                    entries.append(FileEntry(name=name, path=posixpath.join(path, name), type=kind,
                                             size=st.st_size, mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime))
                return entries
            finally:
                os.close(fd)
