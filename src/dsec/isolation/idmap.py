"""An unshifted view of a uid-shifted tree, through an idmapped mount (Linux >= 5.12).

The image store keeps images with ownership shifted by ``uid_shift`` (host uid 100000 is the
image's root) so that containers can use them from a user namespace. A VM guest has its own kernel
and wants the image's real owners back. ``unshifted_view`` mounts the tree idmapped, so that a
file owned by ``shift + k`` on disk appears owned by ``k``, for as long as the context lasts; tools
such as ``mkfs.erofs`` then read the original ownership without copying anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dsec.errors import NotSupported

__all__ = ["unshifted_view"]

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD = -100
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_RECURSIVE, _AT_EMPTY_PATH = 1, 0o2000000, 0x8000, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
_MNT_DETACH = 2


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise NotSupported(f"idmapped mount: {what} failed: {os.strerror(err)}")
    return result


@contextlib.contextmanager
def _userns(shift: int, count: int) -> Iterator[int]:
    """An fd of a user namespace mapping ``shift..shift+count`` (inside) to ``0..count`` (host)."""
    holder = subprocess.Popen(["unshare", "--user", "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        ours = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/user") == ours:  # `unshare` has not unshared yet
            if holder.poll() is not None or time.monotonic() > deadline:
                raise NotSupported("idmapped mount: could not create a user namespace")
            time.sleep(0.001)
        # Written by root from the parent namespace (the holder never gets any capability over it).
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{holder.pid}/{name}").write_text(f"{shift} 0 {count}")
        fd = os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdin is not None:
            holder.stdin.close()


@contextlib.contextmanager
def unshifted_view(root: Path, shift: int, workdir: Path, count: int = 65536) -> Iterator[Path]:
    """``root`` mounted on a new directory in ``workdir`` so that owner ``shift + k`` reads as ``k``;
    unmounted when the context ends.

    Raises :class:`NotSupported` when the kernel or the filesystem cannot idmap.
    """
    with _userns(shift, count) as userns:
        tree = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(root).encode(),
                                    _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE), "open_tree")
        try:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns)
            _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr),
                                 ctypes.sizeof(attr)), "mount_setattr")
            target = Path(tempfile.mkdtemp(prefix=".idmap-", dir=workdir))
            try:
                _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, str(target).encode(),
                                     _MOVE_MOUNT_F_EMPTY_PATH), "move_mount")
                try:
                    yield target
                finally:
                    _libc.umount2(str(target).encode(), _MNT_DETACH)
            finally:
                with contextlib.suppress(OSError):
                    target.rmdir()
        finally:
            os.close(tree)
