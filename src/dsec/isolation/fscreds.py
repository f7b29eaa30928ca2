"""Acting as a sandbox user for file operations made from the host: per-thread filesystem credentials.

Owns :func:`acting_as`, which gives the *calling thread only* the filesystem uid, gid and supplementary
groups of a sandbox user (host ids: the sandbox's ids plus its uid shift) for the duration of a block, so
the kernel checks every open, create, unlink and rename against that user's permission bits and new files
are owned by it. Linux keeps these credentials per thread: ``setfsuid``/``setfsgid`` are per-thread system
calls, and so is ``setgroups`` when made as a raw system call (glibc's wrapper changes every thread of the
process); moving the filesystem uid away from 0 drops the filesystem capabilities (``CAP_DAC_OVERRIDE``,
``CAP_FOWNER``, ``CAP_CHOWN`` ...) from the thread's effective set, and moving it back restores them. It must
never leave a thread with another user's credentials: the block always ends by restoring root's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

__all__ = ["acting_as"]

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_SETGROUPS = 116
_SYS_SETFSUID = 122
_SYS_SETFSGID = 123


def _setgroups(groups: tuple[int, ...]) -> None:
    array = (ctypes.c_uint32 * max(len(groups), 1))(*groups)
    if _libc.syscall(_SYS_SETGROUPS, ctypes.c_size_t(len(groups)), array) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups: {os.strerror(err)}")


def _set_fs_ids(uid: int, gid: int) -> None:
    # Both calls answer the previous id and never fail visibly: read back to be sure the switch happened.
    _libc.syscall(_SYS_SETFSGID, ctypes.c_uint32(gid))
    _libc.syscall(_SYS_SETFSUID, ctypes.c_uint32(uid))
    if _libc.syscall(_SYS_SETFSUID, ctypes.c_uint32(0xFFFFFFFF)) != uid or \
            _libc.syscall(_SYS_SETFSGID, ctypes.c_uint32(0xFFFFFFFF)) != gid:
        raise PermissionError(f"cannot act as uid {uid} gid {gid} (the daemon must run as root)")


@contextlib.contextmanager
def acting_as(uid: int, gid: int, groups: tuple[int, ...] = ()) -> Iterator[None]:
    """Run the block with the host filesystem credentials ``uid``/``gid``/``groups`` in this thread only;
    root's are restored afterwards, whatever happens. uid 0 is a no-op (the daemon is root already)."""
    if uid == 0 and gid == 0 and not groups:
        yield
        return
    before = os.getgroups()
    try:
        _setgroups(groups)
        _set_fs_ids(uid, gid)
        yield
    finally:
        _set_fs_ids(0, 0)
        _setgroups(tuple(before))
