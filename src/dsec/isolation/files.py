"""File operations on a sandbox's filesystem from the host, confined to the sandbox root.

Every path is resolved with ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` against a directory
fd of the sandbox root (``/proc/<init>/root`` for a container): ``..`` and symlinks, absolute or
relative, are resolved *as if* the root were ``/``, so neither ``../../etc/shadow`` nor a symlink planted
by the agent can reach a host file. Nothing here passes a path the kernel would resolve from the host's
root: names are used only relative to a directory fd, never followed when they may be symlinks, and
inodes are changed through ``/proc/self/fd`` of an fd that was resolved in the root.

An operation acts either as the sandbox's root (the daemon's own credentials; files it creates are
chowned to the sandbox's root user) or as one sandbox user (:func:`~dsec.isolation.fscreds.acting_as`:
the kernel checks that user's permission bits and new files are that user's). Errors are the sandbox's
errno, as :func:`dsec.errors.file_error` classes. Blocking: call from a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from dsec.accounts import Identity
from dsec.errors import DSecError, InvalidRequest, SandboxError, file_error
from dsec.isolation.fscreds import acting_as
from dsec.models import FileEntry
from dsec.models.surface import FileKind, FileStat, check_xattr_names

__all__ = ["Actor", "SandboxFS", "file_kind", "make_workdir", "normalise"]

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
_SYS_RENAMEAT2 = 316
_RENAME_NOREPLACE = 1
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


_OVERLAYFS_MAGIC = 0x794C7630


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _fs_type(fd: int) -> int:
    """``f_type`` of the filesystem ``fd`` is on (the first field of struct statfs)."""
    buf = ctypes.create_string_buffer(128)
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value


@dataclass(frozen=True)
class _Root:
    """A sandbox root opened for one operation: its fd, the devices served, and whether it is an overlay."""

    fd: int
    devices: frozenset[int]
    overlay: bool


@dataclass(frozen=True)
class Actor:
    """A sandbox user as the host sees it: host uid and gid (sandbox ids plus the uid shift) and groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def normalise(path: str) -> str:
    """``path`` made absolute-normal; an InvalidRequest for anything else than an absolute path without NUL."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute and free of NUL bytes, got {path!r}", path=path)
    return posixpath.normpath(path)


def file_kind(mode: int) -> FileKind:
    """The listing kind of an ``st_mode``."""
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "symlink" if stat.S_ISLNK(mode) else "other")


def _split(path: str) -> tuple[str, str]:
    parent, name = posixpath.split(path)
    if not name:
        raise InvalidRequest(f"{path!r} names the sandbox's root directory, which this operation cannot take",
                             path=path)
    return parent, name


def _user_xattrs(fd: int) -> dict[str, str] | None:
    """The ``user.`` extended attributes of an ``O_PATH`` fd's inode; None where they cannot be read (the
    caller may not read the file)."""
    inode = f"/proc/self/fd/{fd}"
    try:
        names = [n for n in os.listxattr(inode) if n.startswith("user.")]
        return {n: os.getxattr(inode, n).decode(errors="replace") for n in names}
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.ENODATA):  # a filesystem without them; one removed meanwhile
            return {}
        return None


@contextlib.contextmanager
def _absent_ok() -> Iterator[None]:
    """Removing an attribute that is not there is no error."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENODATA:
            raise


class SandboxFS:
    """Confined file access below ``root`` (a host path). ``uid``/``gid``: the host ids of the sandbox's root
    user (owner of what is created as root); ``actor``: the sandbox user to act as (None: root).

    Only the sandbox's root filesystem (its overlay) is served: every target is first resolved with
    ``O_PATH`` (no side effect), checked to live on the same device as the root, and only then reopened
    for reading or writing. The daemon acts as host root, so without that check a path such as
    ``/proc/kallsyms`` or ``/proc/1/oom_score_adj`` would reach the sandbox's procfs and sysfs with the
    host's privileges; those are left to commands run inside the sandbox. ``also_serve`` names host
    paths whose filesystems are served too (a function sandbox's workspace, bound over a read-only root)."""

    def __init__(self, root: str, uid: int, gid: int, also_serve: tuple[str, ...] = (),
                 actor: Actor | None = None) -> None:
        self.root = root
        self.uid = uid
        self.gid = gid
        self.also_serve = also_serve
        self.actor = actor

    # -- plumbing ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, path: str, what: str) -> Iterator[_Root]:
        """The root fd and served devices, with the actor's credentials; OSErrors become file errors."""
        try:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxError(f"sandbox root is gone ({self.root}): {e.strerror}") from None
        try:
            devices = {os.fstat(fd).st_dev}
            for served in self.also_serve:
                with contextlib.suppress(OSError):
                    devices.add(os.stat(served).st_dev)
            actor = self.actor
            with acting_as(actor.uid, actor.gid, actor.groups) if actor is not None else contextlib.nullcontext():
                try:
                    yield _Root(fd, frozenset(devices), _fs_type(fd) == _OVERLAYFS_MAGIC)
                except OSError as e:
                    raise self._error(e, path, what) from None
        finally:
            os.close(fd)

    @staticmethod
    def _error(e: OSError, path: str, what: str) -> DSecError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return SandboxError(f"sandbox disk is full: {what} {path}", path=path, errno=e.errno)
        return file_error(e.errno or errno.EIO, path, what)

    def _open(self, rootfd: int, path: str, flags: int, mode: int = 0) -> int:
        how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = int(_libc.syscall(_SYS_OPENAT2, rootfd, path.lstrip("/").encode() or b".", ctypes.byref(how),
                               ctypes.sizeof(how)))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return fd

    def _resolve(self, root: _Root, path: str, directory: bool = False,
                 follow: bool = True) -> int:
        """An ``O_PATH`` fd of ``path`` on the sandbox's root filesystem (raises for anything else)."""
        flags = os.O_PATH | (os.O_DIRECTORY if directory else 0) | (0 if follow else os.O_NOFOLLOW)
        fd = self._open(root.fd, path, flags)
        # An overlay root reports, for a file of a lower layer on another filesystem, a device of its own for
        # that layer: anything of the overlay is the sandbox's root filesystem.
        if os.fstat(fd).st_dev not in root.devices and not (root.overlay and _fs_type(fd) == _OVERLAYFS_MAGIC):
            os.close(fd)
            raise InvalidRequest(f"{path} is not on the sandbox's filesystem: the files API serves the root "
                                 f"filesystem, not /proc, /sys or /dev (read those with exec)", path=path)
        return fd

    @staticmethod
    def _reopen(pathfd: int, flags: int) -> int:
        return os.open(f"/proc/self/fd/{pathfd}", flags | os.O_CLOEXEC)

    def _own(self, name: str, parent: int) -> None:
        """Give what root just created to the sandbox's root user (a user's creations are already its own)."""
        if self.actor is None:
            os.chown(name, self.uid, self.gid, dir_fd=parent, follow_symlinks=False)

    # -- reading -------------------------------------------------------------------------------------

    def read(self, path: str, max_bytes: int) -> bytes:
        """Contents of a regular file; larger than ``max_bytes`` is an error naming both sizes."""
        path = normalise(path)
        with self._session(path, "read") as root:
            pathfd = self._resolve(root, path)
            try:
                st = os.fstat(pathfd)
                if stat.S_ISDIR(st.st_mode):
                    raise file_error(errno.EISDIR, path, "read", hint="use files.list")
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidRequest(f"not a regular file: {path}", path=path)
                if st.st_size > max_bytes:
                    raise InvalidRequest(f"{path} is {st.st_size} bytes, over the read limit of {max_bytes}",
                                         path=path, size=st.st_size, limit=max_bytes)
                fd = self._reopen(pathfd, os.O_RDONLY | os.O_NONBLOCK)
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

    def list(self, path: str) -> list[FileEntry]:
        """Entries of a directory, symlinks not followed, sorted by name."""
        path = normalise(path)
        with self._session(path, "list") as root:
            pathfd = self._resolve(root, path, directory=True)
            try:
                fd = self._reopen(pathfd, os.O_RDONLY | os.O_DIRECTORY)
            finally:
                os.close(pathfd)
            try:
                entries = []
                for name in sorted(os.listdir(fd)):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while listing
                    entries.append(FileEntry(name=name, path=posixpath.join(path, name), type=file_kind(st.st_mode),
                                             size=st.st_size, mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime))
                return entries
            finally:
                os.close(fd)

    def stat(self, path: str) -> FileStat:
        """What ``lstat`` says of ``path`` (intermediate symlinks resolved in the root, the last one not)."""
        path = normalise(path)
        with self._session(path, "stat") as root:
            fd = self._open(root.fd, path, os.O_PATH | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
                xattrs = {} if stat.S_ISLNK(st.st_mode) else _user_xattrs(fd)  # links cannot carry user.*
            finally:
                os.close(fd)
        return FileStat(name=posixpath.basename(path) or "/", path=path, type=file_kind(st.st_mode),
                        size=st.st_size, mode=stat.S_IMODE(st.st_mode), uid=self._inside(st.st_uid, self.uid),
                        gid=self._inside(st.st_gid, self.gid), mtime=st.st_mtime, symlink_target=target,
                        xattrs=xattrs)

    @staticmethod
    def _inside(host_id: int, shift: int) -> int:
        """A host id as the sandbox sees it (65534, the kernel's overflow id, for one its namespace does not map)."""
        inside = host_id - shift
        return inside if 0 <= inside <= 65535 else 65534

    # -- writing -------------------------------------------------------------------------------------

    def _mkdirs(self, root: _Root, directory: str, mode: int = 0o755) -> None:
        current = ""
        for part in (p for p in directory.split("/") if p):
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
                    os.mkdir(part, mode, dir_fd=parent)
                    self._own(part, parent)
            finally:
                os.close(parent)

    def makedirs(self, path: str) -> None:
        """Create a directory and its missing parents."""
        path = normalise(path)
        with self._session(path, "mkdir") as root:
            self._mkdirs(root, path)

    def mkdir(self, path: str, parents: bool = False, mode: int = 0o755) -> FileStat:
        """Create one directory with exactly ``mode``; ``parents``: also its missing parents, and an existing
        directory is fine (``mkdir -p``)."""
        path = normalise(path)
        parent_path, name = _split(path)
        with self._session(path, "mkdir") as root:
            if parents:
                self._mkdirs(root, parent_path)
            parent = self._resolve(root, parent_path, directory=True)
            try:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    if not parents:
                        raise
                    os.close(self._resolve(root, path, directory=True))  # ENOTDIR unless a directory
                else:
                    self._own(name, parent)
                    made = self._resolve(root, path, directory=True)
                    try:
                        os.chmod(f"/proc/self/fd/{made}", mode)
                    finally:
                        os.close(made)
            finally:
                os.close(parent)
        return self.stat(path)

    def write(self, path: str, data: bytes, mode: int | None) -> None:
        """Create or replace a file; missing parent directories are created."""
        path = normalise(path)
        parent_path, name = _split(path)
        with self._session(path, "write") as root:
            self._mkdirs(root, parent_path)
            parent = self._resolve(root, parent_path, directory=True)
            try:
                # One name under a checked directory, O_EXCL|O_NOFOLLOW: never through a planted link.
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=parent)
                if self.actor is None:
                    os.fchown(fd, self.uid, self.gid)
            except FileExistsError:
                pathfd = self._resolve(root, path)
                try:
                    kind = os.fstat(pathfd).st_mode
                    if stat.S_ISDIR(kind):
                        raise file_error(errno.EISDIR, path, "write") from None
                    if not stat.S_ISREG(kind):
                        raise InvalidRequest(f"not a regular file: {path}", path=path) from None
                    fd = self._reopen(pathfd, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
                finally:
                    os.close(pathfd)
            finally:
                os.close(parent)
            try:
                if mode is not None:
                    os.fchmod(fd, mode & 0o7777)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, a symlink (not what it points to) or an empty directory; ``recursive``: a directory
        with everything below it, never crossing into another filesystem mounted below it."""
        path = normalise(path)
        parent_path, name = _split(path)
        with self._session(path, "remove") as root:
            parent = self._resolve(root, parent_path, directory=True)
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=parent)
                elif recursive:
                    self._remove_tree(parent, name, root, path)
                else:
                    os.rmdir(name, dir_fd=parent)
            finally:
                os.close(parent)

    def _remove_tree(self, parent: int, name: str, root: _Root, path: str) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            if os.fstat(fd).st_dev not in root.devices and not (root.overlay and _fs_type(fd) == _OVERLAYFS_MAGIC):
                raise InvalidRequest(f"{path} is another filesystem mounted in the sandbox (/proc, /dev, a "
                                     f"protected path): not removed", path=path)
            for entry in os.scandir(fd):
                child = posixpath.join(path, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    self._remove_tree(fd, entry.name, root, child)
                else:
                    os.unlink(entry.name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent)

    def rename(self, source: str, destination: str, overwrite: bool = True) -> FileStat:
        """Move ``source`` to ``destination`` (``overwrite``: replace what is there, as ``mv`` does)."""
        source, destination = normalise(source), normalise(destination)
        (src_dir, src_name), (dst_dir, dst_name) = _split(source), _split(destination)
        with self._session(source, "rename") as root:
            src_parent = self._resolve(root, src_dir, directory=True)
            try:
                dst_parent = self._resolve(root, dst_dir, directory=True)
                try:
                    flags = 0 if overwrite else _RENAME_NOREPLACE
                    if _libc.syscall(_SYS_RENAMEAT2, src_parent, src_name.encode(), dst_parent, dst_name.encode(),
                                     flags) != 0:
                        err = ctypes.get_errno()
                        # Which path the errno is about: the destination for "exists", else the source.
                        raise OSError(err, os.strerror(err), destination if err == errno.EEXIST else source)
                finally:
                    os.close(dst_parent)
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise file_error(errno.EEXIST, destination, "rename") from None
                if e.errno == errno.EXDEV:
                    raise InvalidRequest(f"cannot rename {source} to {destination}: they are on different "
                                         "filesystems of the sandbox (copy it instead)", path=source) from None
                raise
            finally:
                os.close(src_parent)
        return self.stat(destination)

    def chmod(self, path: str, mode: int) -> FileStat:
        """Set the permission bits of ``path`` (a symlink's target)."""
        path = normalise(path)
        with self._session(path, "chmod") as root:
            fd = self._resolve(root, path)
            try:
                os.chmod(f"/proc/self/fd/{fd}", mode & 0o7777)  # the inode fd resolved in the root, not a path
            finally:
                os.close(fd)
        return self.stat(path)

    def set_xattrs(self, path: str, values: dict[str, str], remove: builtins.list[str]) -> FileStat:
        """Set and remove ``user.`` extended attributes of ``path`` (a symlink's target); removing an absent one
        is fine. Other namespaces are refused here too: the daemon acts as host root, which may set them."""
        path = normalise(path)
        try:
            check_xattr_names([*values, *remove])
        except ValueError as exc:
            raise InvalidRequest(str(exc), path=path) from None
        with self._session(path, "set extended attributes of") as root:
            fd = self._resolve(root, path)
            try:
                inode = f"/proc/self/fd/{fd}"  # the inode resolved in the root, not a path
                for name in remove:
                    with _absent_ok():
                        os.removexattr(inode, name)
                for name, value in values.items():
                    os.setxattr(inode, name, value.encode())
            finally:
                os.close(fd)
        return self.stat(path)

    def chown(self, path: str, uid: int, gid: int) -> FileStat:
        """Give ``path`` (a symlink's target) to sandbox ``uid``/``gid``."""
        path = normalise(path)
        with self._session(path, "chown") as root:
            fd = self._resolve(root, path)
            try:
                os.chown(f"/proc/self/fd/{fd}", uid + self.uid, gid + self.gid)
            finally:
                os.close(fd)
        return self.stat(path)

    def open_dir(self, path: str) -> int:
        """An ``O_PATH`` fd of directory ``path`` on the sandbox's filesystem (for a watch); the caller closes it."""
        path = normalise(path)
        with self._session(path, "watch") as root:
            fd = self._resolve(root, path, directory=True)
            try:
                os.close(self._reopen(fd, os.O_RDONLY | os.O_DIRECTORY))  # the user may read it
            except BaseException:
                os.close(fd)
                raise
            return fd

    def names(self, path: str) -> builtins.list[tuple[str, bool]]:
        """``(name, is_dir)`` of a directory's entries (symlinks are not directories here)."""
        return [(entry.name, entry.type == "dir") for entry in self.list(path)]

    def exists(self, path: str) -> bool:
        """Whether ``path`` names anything (a dangling symlink does)."""
        try:
            self.stat(path)
        except DSecError as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise
        return True


def make_workdir(fs: SandboxFS, workdir: str, user: Identity) -> None:
    """Create the sandbox's working directory if the image lacks it, as its default user's when that is not
    root (the user works there: ``SandboxSpec.user``, an image's ``User``)."""
    fresh = not fs.exists(workdir)
    fs.makedirs(workdir)
    if fresh and not user.is_root:
        fs.chown(workdir, user.uid, user.gid)
