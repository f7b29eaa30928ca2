"""Applying OCI/docker layer tars onto a root directory: the flattening rules of the OCI image spec.

Owns the per-entry rules: whiteouts (``.wh.NAME``) and opaque directories (``.wh..wh..opq``), hard links
(within a layer and to files of earlier layers), symlinks, ownership, modes with setuid/setgid bits, file
times, and extended attributes carried as PAX ``SCHILY.xattr.*`` records. Device nodes and fifos are
skipped: a sandbox runs in a user namespace, where the kernel refuses to open device nodes of a mounted
image anyway, and every sandbox gets its own ``/dev`` from the runtime.

Every path is resolved by the kernel with ``openat2(RESOLVE_IN_ROOT)``: ``..``, absolute symlinks and
symlinked parents all resolve *inside* the root, as if it were a chroot, so a hostile layer cannot write
outside it; entry names with ``..`` components are refused outright. This module never reads archives or
registries (``dsec.images.oci_import`` does) and never writes anywhere but under the root it was given.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import BackendUnavailable, DSecError, InvalidRequest

__all__ = ["FlattenStats", "Flattener", "open_in_root", "split_entry_name"]

_SYS_OPENAT2 = 437  # x86_64 and aarch64 (the generic syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_MAX_ID = 65535  # the ids a sandbox's user namespace maps
_COPY_CHUNK = 1 << 20
_MAX_HOPS = 40  # symlinks followed when creating parents (the kernel's own limit)
# errors an entry can cause by itself (a name clash, a path through a file, a link loop...): bad input
_BAD_ENTRY_ERRNOS = {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENOENT, errno.EXDEV,
                     errno.EINVAL, errno.ENAMETOOLONG, errno.ENOTEMPTY, errno.EMLINK, errno.EPERM}
# xattrs worth keeping in an image: user data and file capabilities. trusted.* (overlayfs keeps its
# own state there: a layer must never forge it) and security.* labels of the builder's host are dropped.
_KEPT_XATTRS = ("user.",)
_KEPT_XATTR_NAMES = ("security.capability",)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """``openat2(root_fd, path, flags, RESOLVE_IN_ROOT)``: ``path`` resolved as if ``root_fd`` were ``/``."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root_fd), ctypes.c_char_p(path.encode()),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            raise BackendUnavailable("importing images needs the openat2 system call (Linux 5.6 or later)")
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def split_entry_name(name: str, layer: str) -> list[str]:
    """The components of a tar entry name relative to the image root (``[]`` for the root itself).

    A leading ``/`` or ``./`` is dropped (some tools write them); ``..`` components, empty names and
    NUL bytes are refused with :class:`InvalidRequest`, so a hostile entry fails loudly.
    """
    if "\0" in name:
        raise InvalidRequest(f"layer {layer}: entry name {name!r} contains a NUL byte", layer=layer)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"layer {layer}: entry {name!r} has a '..' component (a path escaping the image "
                             "root): refusing the archive", layer=layer, entry=name)
    return parts


@dataclass
class FlattenStats:
    """What flattening did, for the import report."""

    entries: int = 0
    """Tar entries applied (whiteouts included)."""
    whiteouts: int = 0
    """Files and directories removed by ``.wh.`` entries and opaque markers."""
    skipped_devices: int = 0
    """Device nodes and fifos not created (see the module docstring)."""
    skipped_xattrs: set[str] = field(default_factory=set)
    """Names of xattrs not kept (builder-host security labels, ``trusted.*``)."""


class Flattener:
    """Applies layers, bottom first, onto ``root`` (an empty directory the caller owns)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stats = FlattenStats()
        self._root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._layer_paths: set[str] = set()

    def close(self) -> None:
        """Release the root's file descriptor."""
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __enter__(self) -> Flattener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def apply(self, tar: tarfile.TarFile, layer: str) -> None:
        """Apply one layer's entries (a tar opened in stream or random-access mode)."""
        self._layer_paths = set()
        for member in tar:
            try:
                self._entry(tar, member, layer)
            except OSError as exc:
                if exc.errno not in _BAD_ENTRY_ERRNOS:  # the host's problem (disk full, I/O error), not the image's
                    raise DSecError(f"layer {layer}: writing {member.name!r} into {self.root} failed: "
                                    f"{exc.strerror or exc}", layer=layer) from exc
                raise InvalidRequest(f"layer {layer}: cannot apply entry {member.name!r}: {exc.strerror or exc}",
                                     layer=layer, entry=member.name) from exc
            except ValueError as exc:  # embedded NUL in a link name and the like
                if isinstance(exc, InvalidRequest):
                    raise
                raise InvalidRequest(f"layer {layer}: bad entry {member.name!r}: {exc}", layer=layer) from exc
            self.stats.entries += 1

    # ------------------------------------------------------------------ one entry
    def _entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo, layer: str) -> None:
        parts = split_entry_name(member.name, layer)
        if not parts:
            return  # the root itself: keep the store's root directory as it is
        base, parent = parts[-1], parts[:-1]
        if base.startswith(_WHITEOUT):
            self._whiteout(parent, base, layer)
            return
        for owner in (member.uid, member.gid):
            if not 0 <= owner <= _MAX_ID:
                raise InvalidRequest(f"layer {layer}: {member.name!r} is owned by uid/gid {owner}, outside "
                                     f"0..{_MAX_ID} (the ids a sandbox's user namespace maps)", layer=layer)
        path = "/".join(parts)
        for i in range(1, len(parts) + 1):
            self._layer_paths.add("/".join(parts[:i]))
        with self._dir(parent, layer, create=True) as pfd:
            assert pfd is not None
            if member.isdir():
                self._mkdir(pfd, base, member)
            elif member.isreg():
                self._remove(pfd, base)
                self._write_file(tar, pfd, base, member)
            elif member.issym():
                self._remove(pfd, base)
                os.symlink(member.linkname, base, dir_fd=pfd)
                os.chown(base, member.uid, member.gid, dir_fd=pfd, follow_symlinks=False)
                os.utime(base, (member.mtime, member.mtime), dir_fd=pfd, follow_symlinks=False)
            elif member.islnk():
                self._hardlink(pfd, base, path, member.linkname, layer)
            else:  # character and block devices, fifos, anything else
                self._remove(pfd, base)
                self.stats.skipped_devices += 1

    def _whiteout(self, parent: list[str], base: str, layer: str) -> None:
        """Hide lower-layer content. Entries of *this* layer are never hidden by its own whiteouts (OCI image
        spec), whatever their order in the tar: what this layer wrote under a hidden path is kept."""
        prefix = "/".join(parent)
        if base == _OPAQUE:
            hidden, target = prefix, "."
        else:
            target = base[len(_WHITEOUT):]
            if target in ("", ".", "..") or target.startswith(_WHITEOUT):
                raise InvalidRequest(f"layer {layer}: invalid whiteout entry {base!r}", layer=layer)
            hidden = f"{prefix}/{target}".lstrip("/")
        with self._dir(parent, layer, create=False) as pfd:
            if pfd is None:
                return  # hides something that does not exist: nothing to do
            if base != _OPAQUE and hidden not in self._layer_paths:
                if self._remove(pfd, target):
                    self.stats.whiteouts += 1
                return
            try:
                dfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except (FileNotFoundError, NotADirectoryError):
                return  # this layer's own non-directory, or an opaque marker in a missing directory
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # a symlink written by this layer: nothing lower to hide
                    raise
                return
            try:
                self._prune(dfd, hidden)
            finally:
                os.close(dfd)

    def _prune(self, dfd: int, path: str) -> None:
        """Remove everything under directory ``dfd`` (at ``path``) that this layer did not write."""
        for child in os.listdir(dfd):
            child_path = f"{path}/{child}".lstrip("/")
            if child_path not in self._layer_paths:
                self._remove(dfd, child)
                self.stats.whiteouts += 1
                continue
            try:
                sub = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:
                continue  # this layer's file or symlink
            try:
                self._prune(sub, child_path)
            finally:
                os.close(sub)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _dir(self, parts: list[str], layer: str, create: bool) -> Iterator[int | None]:
        """An ``O_PATH`` fd of directory ``parts`` resolved in the root; missing ones are made (0755, root)."""
        path = "/".join(parts) or "."
        try:
            fd = open_in_root(self._root_fd, path, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                yield None
                return
            fd = self._make_dirs(parts)
        except NotADirectoryError:
            raise InvalidRequest(f"layer {layer}: {path!r} is not a directory in the image but an entry "
                                 "is placed under it", layer=layer) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _make_dirs(self, parts: list[str], hops: int = 0) -> int:
        """Create the missing directories of ``parts``, each step resolved in the root; return the last one.

        A dangling symlink on the way is followed (its target made, inside the root), as docker and
        containerd do for layers that write under a link whose target a later entry creates.
        """
        for i in range(1, len(parts) + 1):
            try:
                os.close(open_in_root(self._root_fd, "/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            parent = open_in_root(self._root_fd, "/".join(parts[:i - 1]) or ".", os.O_PATH | os.O_DIRECTORY)
            try:
                try:
                    st: os.stat_result | None = os.lstat(parts[i - 1], dir_fd=parent)
                except FileNotFoundError:
                    st = None
                if st is None:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=parent)
                    continue
                if not stat.S_ISLNK(st.st_mode) or hops >= _MAX_HOPS:
                    raise OSError(errno.ELOOP if hops >= _MAX_HOPS else errno.EEXIST,
                                  "cannot create a directory here", "/".join(parts[:i]))
                link = os.readlink(parts[i - 1], dir_fd=parent)
            finally:
                os.close(parent)
            # Lexical resolution is enough here: every open above and below is still RESOLVE_IN_ROOT.
            target: list[str] = [] if link.startswith("/") else parts[:i - 1]
            for comp in link.split("/"):
                if comp == "..":
                    if target:
                        target.pop()
                elif comp not in ("", "."):
                    target.append(comp)
            return self._make_dirs(target + parts[i:], hops + 1)
        return open_in_root(self._root_fd, "/".join(parts) or ".", os.O_PATH | os.O_DIRECTORY)

    def _remove(self, pfd: int, name: str) -> bool:
        """Remove ``name`` under ``pfd`` (a whole tree for a directory); False if it did not exist."""
        try:
            st = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=pfd)  # fd-based: never follows a symlink out of the tree
        else:
            os.unlink(name, dir_fd=pfd)
        return True

    def _mkdir(self, pfd: int, name: str, member: tarfile.TarInfo) -> None:
        try:
            st: os.stat_result | None = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=pfd)
            st = None
        if st is None:
            os.mkdir(name, 0o700, dir_fd=pfd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            self._metadata(fd, member)
        finally:
            os.close(fd)

    def _write_file(self, tar: tarfile.TarFile, pfd: int, name: str, member: tarfile.TarInfo) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=pfd)
        try:
            data = tar.extractfile(member)
            if data is not None:
                with data, open(fd, "wb", closefd=False) as out:
                    shutil.copyfileobj(data, out, _COPY_CHUNK)
            self._metadata(fd, member)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)

    def _hardlink(self, pfd: int, base: str, path: str, linkname: str, layer: str) -> None:
        target = split_entry_name(linkname, layer)
        if not target:
            raise InvalidRequest(f"layer {layer}: hard link {path!r} points at the image root", layer=layer)
        if "/".join(target) == path:
            return  # a link to itself: the file is already there
        with self._dir(target[:-1], layer, create=False) as tfd:
            try:
                if tfd is None:
                    raise FileNotFoundError
                st = os.lstat(target[-1], dir_fd=tfd)
            except FileNotFoundError:
                raise InvalidRequest(f"layer {layer}: hard link {path!r} points at {linkname!r}, which is not "
                                     "in this or an earlier layer", layer=layer) from None
            if stat.S_ISDIR(st.st_mode):
                raise InvalidRequest(f"layer {layer}: hard link {path!r} points at directory {linkname!r}",
                                     layer=layer)
            self._remove(pfd, base)
            os.link(target[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)

    def _metadata(self, fd: int, member: tarfile.TarInfo) -> None:
        """Owner, then mode (chown clears setuid/setgid), then xattrs (chown clears file capabilities)."""
        os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)
        for key, value in member.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            attr = key[len("SCHILY.xattr."):]
            if not (attr.startswith(_KEPT_XATTRS) or attr in _KEPT_XATTR_NAMES):
                self.stats.skipped_xattrs.add(attr)
                continue
            try:
                os.setxattr(fd, attr, value.encode("utf-8", "surrogateescape"))
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.stats.skipped_xattrs.add(attr)
