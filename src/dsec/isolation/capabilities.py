"""Capabilities kept by sandboxed root, and the calls that drop the rest.

Sandbox root lives in a user namespace, so these capabilities only ever apply to
objects owned by that namespace; we still keep only what ordinary package installs
and build tools need (Docker's default set minus ``MKNOD`` and ``NET_RAW``). The same
list feeds runc's config for the container init and :func:`drop_to` in the exec helper.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["CAP_NUMBERS", "DEFAULT_CAPS", "drop_bounding", "drop_to", "set_caps", "set_no_new_privs"]

CAP_NUMBERS: dict[str, int] = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
    "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_LINUX_IMMUTABLE": 9,
    "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11, "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13,
    "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17,
    "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23, "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25,
    "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27, "CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29,
    "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31, "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35, "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37,
    "CAP_PERFMON": 38, "CAP_BPF": 39, "CAP_CHECKPOINT_RESTORE": 40,
}

DEFAULT_CAPS: tuple[str, ...] = (
    "CAP_CHOWN",  # apt, tar and pip chown files they unpack
    "CAP_DAC_OVERRIDE",  # root in the sandbox expects to write root-owned files mode 0644
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",  # signal any process of the sandbox (only those: separate pid namespace)
    "CAP_SETGID",  # su, sudo, apt's _apt user drop
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",  # servers on ports < 1024 inside the sandbox's own network namespace
    "CAP_SYS_CHROOT",  # debootstrap-style tools and some package scripts chroot
    "CAP_AUDIT_WRITE",
)

_libc = ctypes.CDLL(None, use_errno=True)
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_CAPSET = 126
_CAP_LAST = 40


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def drop_bounding(keep: tuple[str, ...]) -> None:
    """Drop every capability not in ``keep`` from the bounding set (it limits what any later execve,
    setuid binary included, can gain). Joining a user namespace resets it to full: call after setns."""
    wanted = {CAP_NUMBERS[name] for name in keep}
    for cap in range(_CAP_LAST + 1):
        if cap not in wanted:
            ret = _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
            # EINVAL: the running kernel does not know this capability, nothing to drop.
            if ret != 0 and ctypes.get_errno() != 22:
                _check(ret, f"PR_CAPBSET_DROP {cap}")


def set_caps(keep: tuple[str, ...]) -> None:
    """Make ``keep`` the effective and permitted sets; empty inheritable and ambient sets."""
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    mask = sum(1 << CAP_NUMBERS[name] for name in keep)
    header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = word
        data[i].permitted = word
        # Inheritable stays empty: execve of a file with inheritable file caps gains nothing.
        data[i].inheritable = 0
    _check(_libc.syscall(_SYS_CAPSET, ctypes.byref(header), data), "capset")


def drop_to(keep: tuple[str, ...] = DEFAULT_CAPS) -> None:
    """Reduce this process's bounding, ambient, effective, permitted and inheritable sets to ``keep``."""
    drop_bounding(keep)
    set_caps(keep)


def set_no_new_privs() -> None:
    """setuid binaries and file capabilities can no longer raise privileges after this."""
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
