"""Protected paths of a container sandbox: read-only bind mounts made inside its mount namespace.

A protected path is bind-mounted over itself with ``MS_RDONLY`` in the sandbox's own mount
namespace, so every write, ``rename``/``unlink`` of the mount point, ``FICLONE`` into it or extent
swap on it fails in the kernel (EROFS / EBUSY), whatever the sandbox's root tries. The sandbox
cannot undo the mount: its root has no ``CAP_SYS_ADMIN`` and the seccomp denylist refuses the whole
mount family.

The mounts are made by a short-lived child (``python -I -S``) that imports everything first, then
joins the sandbox's user and mount namespaces with ``setns`` and calls ``mount(2)`` through the
already loaded libc: after ``setns`` the child's root is the sandbox's, so it must never load or run
anything from there (which :mod:`subprocess` + ``nsenter mount`` would do: the image's own ``mount``).
This module never touches the daemon's own namespaces.
"""

from __future__ import annotations

import subprocess
import sys

from dsec.errors import InvalidRequest, SandboxError

__all__ = ["protect_paths"]

# The child: single-threaded (setns into a user namespace demands it), no imports after setns.
# A path is refused when any component is a symlink (realpath differs): a symlink the sandbox controls
# could later be pointed elsewhere, away from the read-only mount. Exit 3 names a bad path, 4 a failure.
_CHILD = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, paths = int(sys.argv[1]), sys.argv[2:]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)):
    fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, flag) != 0:
        sys.stderr.write(f"setns {ns}: {os.strerror(ctypes.get_errno())}"); sys.exit(4)
    os.close(fd)
os.chdir("/")
for path in paths:
    if not os.path.lexists(path):
        sys.stderr.write(f"protected path {path} does not exist in the sandbox"); sys.exit(3)
    if os.path.realpath(path) != path:
        sys.stderr.write(f"protected path {path} passes through a symbolic link"); sys.exit(3)
    b = path.encode()
    if libc.mount(b, b, None, MS_BIND | MS_REC, None) != 0 or libc.mount(
            None, b, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        sys.stderr.write(f"read-only bind mount of {path}: {os.strerror(ctypes.get_errno())}"); sys.exit(4)
"""


def protect_paths(init_pid: int, paths: list[str]) -> None:
    """Bind-mount each of ``paths`` read-only over itself in the namespaces of ``init_pid``.

    Raises :class:`InvalidRequest` for a path that is missing or passes through a symlink,
    :class:`SandboxError` when the kernel refuses.
    """
    if not paths:
        return
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, str(init_pid), *paths],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          check=False, timeout=30)
    message = proc.stderr.decode(errors="replace").strip()
    if proc.returncode == 3:
        raise InvalidRequest(message)
    if proc.returncode != 0:
        raise SandboxError(f"protecting paths failed: {message or f'exit status {proc.returncode}'}")
