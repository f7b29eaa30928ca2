"""The node's image store: named root directories with their metadata, on local disk.

Layout under ``root``::

    <name>/rootfs        the image's root filesystem, ownership shifted by ``uid_shift``
    <name>/image.json    its :class:`~dsec.models.ImageInfo`
    .lock-<name>         flock taken by imports and removals of <name>
    .tmp-<name>-*        an import in progress (removed on failure, swept by the next import)

This module owns the on-disk layout, name validation, import of a directory (copy + uid shift +
atomic rename) and removal. It never mounts anything, never runs sandboxes and never modifies a
source directory: imports copy first and shift the copy.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dsec.backends.base import ImageRef
from dsec.errors import DSecError, ImageNotFound, InvalidRequest
from dsec.models import ImageConfig, ImageInfo

__all__ = ["DEFAULT_PATH", "ImageStore", "validate_name"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""``PATH`` given to images whose config does not set one."""

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_CAP_XATTR = "security.capability"
_UID_COUNT = 65536


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise :class:`InvalidRequest`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid image name {name!r}: use 1-128 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            name=str(name),
        )
    return name


class ImageStore:
    """Images kept as shifted root directories under ``root`` (see the module docstring)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    # ----------------------------------------------------------------- lookups
    def path(self, name: str) -> Path:
        """Directory of image ``name`` (whether or not it exists)."""
        return self.root / validate_name(name)

    def exists(self, name: str) -> bool:
        """True when image ``name`` is fully imported."""
        return (self.path(name) / "image.json").is_file()

    def get(self, name: str) -> ImageInfo:
        """Metadata of image ``name``; :class:`ImageNotFound` names the images that do exist."""
        meta = self.path(name) / "image.json"
        try:
            text = meta.read_text()
        except FileNotFoundError:
            raise self._not_found(name) from None
        return ImageInfo.model_validate_json(text)

    def resolve(self, name: str) -> ImageRef:
        """What a backend needs to start a sandbox from image ``name``."""
        info = self.get(name)
        return ImageRef(name=info.name, rootfs=self.path(name) / "rootfs", uid_shift=info.uid_shift,
                        config=info.config)

    def list(self) -> list[ImageInfo]:
        """Every fully imported image, sorted by name (in-progress imports are not listed)."""
        if not self.root.is_dir():
            return []
        found: list[ImageInfo] = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not _NAME_RE.fullmatch(entry.name):
                continue
            try:
                found.append(ImageInfo.model_validate_json((entry / "image.json").read_text()))
            except (OSError, ValueError):
                continue  # not an image directory (or one being removed)
        return found

    def names(self) -> builtins.list[str]:
        """Names of every fully imported image."""
        return [info.name for info in self.list()]

    def _not_found(self, name: str) -> ImageNotFound:
        names = self.names()
        have = f"available: {', '.join(names)}" if names else "the store is empty"
        return ImageNotFound(
            f"image {name!r} not found in {self.root} ({have}); build the base image with "
            "`dsec image build debian-python` or import a directory with `dsec image import NAME DIR`",
            image=name, available=names,
        )

    # ----------------------------------------------------------------- changes
    def import_dir(
        self,
        name: str,
        src: Path | str,
        uid_shift: int,
        source: str | None = None,
        config: ImageConfig | None = None,
        replace: bool = False,
        move: bool = False,
    ) -> ImageInfo:
        """Copy directory ``src`` into the store as image ``name``, shifting every uid/gid by ``uid_shift``.

        The copy keeps modes, setuid bits, xattrs, file capabilities, hard links, symlinks and
        special files. Source owners must lie in ``0..65535`` (what a user namespace maps); an
        already-shifted tree is refused rather than shifted twice. Nothing is left behind on failure.
        ``move=True`` renames ``src`` into the store instead of copying it (``src`` must be on the
        store's filesystem and is consumed, even on failure): for freshly built trees.
        """
        validate_name(name)
        src = Path(src)
        if uid_shift < 0:
            raise InvalidRequest(f"uid_shift must be >= 0, got {uid_shift}")
        if not src.is_dir():
            raise InvalidRequest(f"cannot import {src}: not a directory", path=str(src))
        config = (config or ImageConfig()).model_copy(deep=True)
        config.env.setdefault("PATH", DEFAULT_PATH)
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(name):
            self._sweep(name)
            target = self.root / name
            if target.exists() and not replace:
                raise InvalidRequest(f"image {name!r} already exists (remove it or pass replace=True)",
                                     image=name)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
            try:
                tmp.chmod(0o755)
                rootfs = tmp / "rootfs"
                if move:
                    os.rename(src, rootfs)
                else:
                    _copy_tree(src, rootfs)
                files, size = _shift_tree(rootfs, uid_shift)
                info = ImageInfo(
                    name=name, created_at=time.time(), size_bytes=size, files=files,
                    source=source or f"dir:{src.resolve()}", uid_shift=uid_shift, config=config,
                )
                _write_atomic(tmp / "image.json", info.model_dump_json(indent=2).encode())
                old = None
                if target.exists():
                    old = Path(tempfile.mkdtemp(prefix=f".trash-{name}-", dir=self.root))
                    os.rename(target, old / "image")
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _fsync_dir(self.root)
            return info

    def remove(self, name: str) -> None:
        """Delete image ``name`` (running sandboxes keep their own mounts or copies)."""
        validate_name(name)
        with self._locked(name):
            target = self.root / name
            if not (target / "image.json").is_file() and not target.is_dir():
                raise self._not_found(name)
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}-", dir=self.root))
            os.rename(target, trash / "image")
            shutil.rmtree(trash, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f".lock-{name}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _sweep(self, name: str) -> None:
        """Remove leftovers of an import or removal of ``name`` killed mid-way (caller holds the lock)."""
        for prefix in (f".tmp-{name}-", f".trash-{name}-"):
            for leftover in self.root.glob(f"{prefix}*"):
                # a same-prefixed longer name ("a" vs "a-b") has its own lock: only touch exact matches
                if leftover.name[len(prefix):].count("-") == 0:
                    shutil.rmtree(leftover, ignore_errors=True)


def _copy_tree(src: Path, dst: Path) -> None:
    """``cp -a`` keeps hard links, xattrs, special files and sparse files; reflinks when it can."""
    cp = shutil.which("cp") or "/bin/cp"
    proc = subprocess.run([cp, "-a", "--reflink=auto", "-T", "--", str(src), str(dst)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DSecError(f"copying {src} failed: {proc.stderr.strip()[:2000]}", path=str(src))


def _shift_tree(root: Path, shift: int) -> tuple[int, int]:
    """Add ``shift`` to the owner of every entry under ``root``; return (entries, bytes of file data).

    Each inode is shifted once even when hard-linked several times. ``chown`` clears setuid/setgid
    bits and file capabilities, so both are put back.
    """
    seen: set[int] = set()
    entries = 0
    size = 0
    root_dev = os.lstat(root).st_dev

    def shift_one(path: str) -> None:
        nonlocal size
        st = os.lstat(path)
        if st.st_dev != root_dev:
            raise DSecError(f"{path}: unexpected mount point inside an image copy")
        if st.st_ino in seen:
            return
        seen.add(st.st_ino)
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
        for owner in (st.st_uid, st.st_gid):
            if owner >= _UID_COUNT:
                raise InvalidRequest(
                    f"{path} is owned by uid/gid {owner}, outside 0..{_UID_COUNT - 1} (the ids a user "
                    "namespace maps): is the source already shifted? import an unshifted tree",
                    path=path, owner=owner,
                )
        if shift == 0:
            return
        is_link = stat.S_ISLNK(st.st_mode)
        caps = None if is_link else _get_caps(path)
        os.lchown(path, st.st_uid + shift, st.st_gid + shift)
        if not is_link:
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode))
            if caps is not None:
                os.setxattr(path, _CAP_XATTR, caps, follow_symlinks=False)

    shift_one(str(root))
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False,
                                                onerror=_raise):
        for entry in (*dirnames, *filenames):
            entries += 1
            shift_one(os.path.join(dirpath, entry))
    return entries, size


def _raise(err: OSError) -> None:
    raise err


def _get_caps(path: str) -> bytes | None:
    try:
        return os.getxattr(path, _CAP_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
