"""A sandbox's disk quota: its writable files live on a tmpfs of its own, sized by ``spec.disk``.

The container backend mounts one under its overlay's upper layer, the function backend as its
workspace. Size and inodes are limited in the kernel (ENOSPC past either), the pages are charged
to the memory cgroup of whoever writes them (the sandbox), and the host's disks never see the
writes. Blocking: call from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from dsec.errors import SandboxError

__all__ = ["disk_full", "disk_inodes", "disk_options", "disk_used", "mount_disk", "umount"]

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_NOSUID = 2
_MS_NODEV = 4


def disk_used(path: Path) -> int:
    """Bytes the files below ``path`` take on disk (allocated blocks; files that vanish meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def disk_inodes(size: int) -> int:
    """Inodes of a sandbox disk of ``size`` bytes: one per 16 KiB, at least 16,384 (against inode bombs)."""
    return max(16384, size // 16384)


def disk_options(size: int, mode: int = 0o700, uid: int = 0) -> str:
    """The tmpfs options of a sandbox disk: ``size`` bytes, :func:`disk_inodes` inodes, its root directory
    of ``mode``, owned by host uid and gid ``uid``."""
    return f"size={size},nr_inodes={disk_inodes(size)},mode={mode:o},uid={uid},gid={uid}"


def mount_disk(target: Path, size: int, mode: int = 0o700, uid: int = 0) -> None:
    """Mount a tmpfs of :func:`disk_options` on ``target`` (nosuid, nodev)."""
    opts = disk_options(size, mode, uid)
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"tmpfs mount on {target} failed: {os.strerror(err)}")


def disk_full(path: str) -> bool:
    """Whether the sandbox disk mounted on ``path`` has no room (or no inode) left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    # "Full" a little before the last block: a write that fails with ENOSPC can leave a few blocks free.
    return st.f_bavail * st.f_frsize < 64 * 1024 or st.f_favail == 0


def umount(target: Path) -> None:
    """Detach the mount on ``target``; a no-op when nothing (or nothing any more) is mounted there."""
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            raise SandboxError(f"unmounting {target} failed: {os.strerror(err)}")
