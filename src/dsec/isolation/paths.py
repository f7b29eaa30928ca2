"""Protected and hidden paths of a sandbox: mounts made inside its mount namespace.

A protected path is bind-mounted over itself with ``MS_RDONLY`` in the sandbox's own mount
namespace, so every write, ``rename``/``unlink`` of the mount point, ``FICLONE`` into it or extent
swap on it fails in the kernel (EROFS / EBUSY), whatever the sandbox's root tries. The sandbox
cannot undo the mount: its root has no ``CAP_SYS_ADMIN`` and the seccomp denylist refuses the whole
mount family.

The mounts are made by a short-lived child (``python -I -S``) that imports everything first, then
joins the sandbox's user and mount namespaces with ``setns`` and calls ``mount(2)`` through the
already loaded libc: after ``setns`` the child's root is the sandbox's, so it must never load or run
anything from there (which :mod:`subprocess` + ``nsenter mount`` would do: the image's own ``mount``).
Every directory above a protected or hidden path is bound over itself (read-write) first: a mount moves
with a renamed ancestor, so without that the sandbox could rename ``/workspace`` away with the cover of a
hidden ``/workspace/tests`` inside it and make a plain ``/workspace/tests`` where the grader writes; a
mount point cannot be renamed or removed (EBUSY). A rename across such a directory's edge gets EXDEV.
A hidden directory is covered by an empty read-only tmpfs in the same way (the sandbox sees an empty,
unwritable directory); its real content stays on the sandbox's overlay, where the daemon's host-side
view (without the cover) reads and writes it. Revealing removes the cover and protects the path.
A function sandbox's zygote builds its mount namespace as host root before it enters its user
namespace, so that namespace belongs to the host's user namespace: the child joins only the mount
namespace there (``user_ns=False``) and stays host root, which only ever mounts over the given paths.
This module never touches the daemon's own namespaces.
"""

from __future__ import annotations

import subprocess
import sys

from dsec.errors import InvalidRequest, SandboxError

__all__ = ["cover_paths", "protect_paths", "reveal_paths"]

# The child: single-threaded (setns into a user namespace demands it), no imports after setns. It becomes
# the namespace's root (host uid 0 has no mapping there). A path is refused when any component is a symlink
# (realpath differs): a symlink the sandbox controls could later be pointed elsewhere, away from the mount.
# argv: PID NAMESPACES (user,mnt | mnt) (protect|cover|uncover) PATH... Exit 3 names a bad path, 4 a failure.
_CHILD = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, namespaces, op, paths = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
def bail(code, msg):
    sys.stderr.write(msg); sys.exit(code)
# Both opened first, as host root: once in the user namespace, opening /proc/PID/ns/mnt is a ptrace check
# against the init, refused while it is still the runtime's non-dumpable child just before its execve.
fds = [(os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY), ns, flag)
       for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)) if ns in namespaces]
for fd, ns, flag in fds:
    if libc.setns(fd, flag) != 0:
        bail(4, f"setns {ns}: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
os.setgroups([]); os.setresgid(0, 0, 0); os.setresuid(0, 0, 0)
os.chdir("/")
pinned = set()
for path in paths:
    b = path.encode()
    if op == "cover":
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as e:
            bail(3, f"hidden path {path} cannot be created: {e.strerror}")
    elif op == "uncover" and libc.umount2(b, 0) != 0:
        bail(4, f"uncovering {path}: {os.strerror(ctypes.get_errno())}")
    if not os.path.lexists(path):
        bail(3, f"path {path} does not exist in the sandbox")
    if os.path.realpath(path) != path:
        bail(3, f"path {path} passes through a symbolic link")
    if op in ("protect", "cover"):
        parts = path.split("/")
        for i in range(2, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in pinned and libc.mount(parent.encode(), parent.encode(), None, MS_BIND | MS_REC,
                                                   None) != 0:
                bail(4, f"bind mount over {parent}: {os.strerror(ctypes.get_errno())}")
            pinned.add(parent)
    if op == "cover":
        if libc.mount(b"tmpfs", b, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=0755") != 0:
            bail(4, f"covering {path}: {os.strerror(ctypes.get_errno())}")
        continue
    if libc.mount(b, b, None, MS_BIND | MS_REC, None) != 0 or libc.mount(
            None, b, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        bail(4, f"read-only bind mount of {path}: {os.strerror(ctypes.get_errno())}")
"""


def _run(init_pid: int, op: str, paths: list[str], user_ns: bool) -> None:
    if not paths:
        return
    namespaces = "user,mnt" if user_ns else "mnt"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, str(init_pid), namespaces, op, *paths],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          check=False, timeout=30)
    message = proc.stderr.decode(errors="replace").strip()
    if proc.returncode == 3:
        raise InvalidRequest(message)
    if proc.returncode != 0:
        raise SandboxError(f"{op} failed: {message or f'exit status {proc.returncode}'}")


def protect_paths(init_pid: int, paths: list[str], user_ns: bool = True) -> None:
    """Bind-mount each of ``paths`` read-only over itself in the namespaces of ``init_pid`` (its mount
    namespace only, as host root, when not ``user_ns``).

    Raises :class:`InvalidRequest` for a path that is missing or passes through a symlink,
    :class:`SandboxError` when the kernel refuses.
    """
    _run(init_pid, "protect", paths, user_ns)


def cover_paths(init_pid: int, paths: list[str], user_ns: bool = True) -> None:
    """Hide each directory of ``paths`` (created if missing) under an empty read-only tmpfs."""
    _run(init_pid, "cover", paths, user_ns)


def reveal_paths(init_pid: int, paths: list[str], user_ns: bool = True) -> None:
    """Remove the covers of :func:`cover_paths` and leave each path read-only (protected)."""
    _run(init_pid, "uncover", paths, user_ns)
