"""Landlock: which ABI the running kernel offers.

The function backend's Landlock ruleset (writes only beneath the workspace, ``/tmp`` and
``/dev``; no TCP bind or connect from ABI 4; signals and abstract unix sockets scoped to
the call from ABI 6) is built once per sandbox by ``zygote_setup.c`` and applied to each call
there, in C, between the fork and the exec. This module only asks the kernel what it
supports, for ``available()`` and ``dsec doctor``; it never restricts the calling process.
"""

from __future__ import annotations

import ctypes

__all__ = ["landlock_abi"]

_SYS_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_CREATE_RULESET_VERSION = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def landlock_abi() -> int:
    """The Landlock ABI version (``>= 1``), or ``0`` when Landlock is absent or disabled."""
    ret = _libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                        ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(ret), 0)
