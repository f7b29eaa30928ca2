"""Sandbox mounts that never enter the host's mount namespace.

Every new mount namespace starts as a copy of its creator's mount table, and crun reads that table
on every create: with a container sandbox's overlay and disk tmpfs mounted on the host, each create
got slower with every live sandbox (``unshare -m`` took 11 ms at no sandbox and 220 ms at 10,000).
So the container backend builds a sandbox's mounts detached, with the kernel's mount API
(``fsopen``/``fsmount``, ``open_tree``, ``move_mount``, ``mount_setattr``; Linux 6.7 or later for
overlayfs' ``lowerdir+``), attaches them in a private mount namespace of the node's own, the *mount
holder*, and hands a clone of the sandbox's root to the runtime shim, which attaches it in a private
namespace of its own before it runs crun (see ``rtshim.c``).

The holder is a sleeping ``dsec-rtshim --hold`` process (comm ``dsec-mntns``), one per DSEC_HOME,
in its own session: it outlives a daemon crash, and the restarted daemon adopts it (pid and start
time in ``$DSEC_HOME/container/mntns.pid``). The daemon works in its namespace from a few dedicated
threads (each unshares its filesystem context and ``setns``-es there; several, because an unmount
waits for an RCU grace period and concurrent teardowns must not queue behind one another), and reads
the mounts through the first one's ``/proc/<pid>/task/<tid>/root``: the upper layer for snapshots, the
disk tmpfs for usage, the uncovered overlay for hidden paths.

Blocking: call from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from dsec.errors import BackendUnavailable, SandboxError
from dsec.isolation.disk import disk_options
from dsec.isolation.procs import start_time

__all__ = ["MountHolder", "attach", "clone_tree", "overlay_mount", "sysfs_mount", "tmpfs_mount"]

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYSFS_SETTLE_S = 10.0
"""How long a new sysfs may list the devices of its (ended) network namespace before the backend starts anyway."""
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_MOUNT_SETATTR = (
    428, 429, 430, 431, 432, 442)  # x86_64 and aarch64 share these (the new syscalls are numbered alike)
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_O_CLOEXEC = 0o2000000
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOUNT_ATTR_RDONLY = 1
_MOUNT_ATTR_NOSUID = 2
_MOUNT_ATTR_NODEV = 4
_MOUNT_ATTR_NOEXEC = 8
_MOVE_MOUNT_F_EMPTY_PATH = 4
_CLONE_FS = 0x200
_CLONE_NEWNS = 0x20000
_CLONE_NEWNET = 0x40000000
_MNT_DETACH = 2
T = TypeVar("T")
THREADS = 4
"""Worker threads in the holder's namespace."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _call(what: str, nr: int, *args: object) -> int:
    ret = int(_libc.syscall(nr, *args))
    if ret < 0:
        err = ctypes.get_errno()
        raise SandboxError(f"{what} failed: {os.strerror(err)}")
    return ret


def _fs_mount(fstype: str, options: list[tuple[str, str]], attrs: int, where: str) -> int:
    """A detached mount of a new ``fstype`` with ``options`` (key, value) and mount ``attrs``: its fd."""
    ctx = _call(f"fsopen {fstype} ({where})", _SYS_FSOPEN, fstype.encode(), 1)  # FSOPEN_CLOEXEC
    try:
        for key, value in [("source", fstype), *options]:  # source: how mountinfo names it
            _call(f"{fstype} option {key}={value} ({where})", _SYS_FSCONFIG, ctx, _FSCONFIG_SET_STRING,
                  key.encode(), value.encode(), 0)
        _call(f"{fstype} mount ({where})", _SYS_FSCONFIG, ctx, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _call(f"fsmount {fstype} ({where})", _SYS_FSMOUNT, ctx, 1, attrs)  # FSMOUNT_CLOEXEC
    finally:
        os.close(ctx)


def tmpfs_mount(size: int, mode: int = 0o700, uid: int = 0, where: str = "disk") -> int:
    """A detached tmpfs with :func:`dsec.isolation.disk.disk_options` (nosuid, nodev): its mount fd."""
    options = [kv.partition("=") for kv in disk_options(size, mode, uid).split(",")]
    return _fs_mount("tmpfs", [(k, v) for k, _, v in options], _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, where)


def overlay_mount(lowers: list[str], upper: str, work: str, where: str = "root", setuid: bool = False) -> int:
    """A detached overlayfs (nodev, nosuid unless ``setuid``; ``xino=on``) over ``lowers`` (top first): its mount fd.

    Each lower is passed on its own (``lowerdir+``), so no option string limits the number of layers.
    Paths are resolved by the calling thread: lowers must be mounted in its mount namespace (or detached).
    """
    if any(len(p.encode()) > 255 for p in (*lowers, upper, work)):
        raise SandboxError(f"overlay for {where}: a layer path is longer than the kernel's 255-byte option limit")
    options = [("lowerdir+", p) for p in lowers] + [("upperdir", upper), ("workdir", work), ("xino", "on")]
    return _fs_mount("overlay", options, (0 if setuid else _MOUNT_ATTR_NOSUID) | _MOUNT_ATTR_NODEV, where)


def sysfs_mount() -> int:
    """A detached sysfs (read-only, nosuid, nodev, noexec) of a new network namespace: its mount fd.

    sysfs shows the network devices of the namespace it is mounted from. That namespace dies with the thread
    that made it (the mount holds no live reference to it), so this sysfs lists no network device at all,
    none of the host's or of any sandbox's, and one of it can be shared by every sandbox of the node (a
    superblock per sandbox is what each would otherwise cost, see oci.runtime_config). It returns once the
    namespace's loopback is gone from the listing (a kernel worker removes it after the thread ends).
    """
    made: list[int] = []
    failed: list[BaseException] = []

    def run() -> None:  # its own thread: the new network namespace is this thread's alone, and dies with it
        try:
            if _libc.unshare(_CLONE_NEWNET) != 0:
                raise SandboxError(f"unshare(CLONE_NEWNET) for the node's sysfs: {os.strerror(ctypes.get_errno())}")
            made.append(_fs_mount("sysfs", [], _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
                                  | _MOUNT_ATTR_NOEXEC, "the node's sysfs"))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="dsec-sysfs")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    # The namespace is torn down by a kernel worker after the thread ends (1-2 ms here when quiet, longer under
    # load): until then its loopback device is still listed. Sandboxes are started only once it is gone.
    devices = f"/proc/self/fd/{made[0]}/class/net"
    deadline = time.monotonic() + _SYSFS_SETTLE_S
    try:
        while (left := os.listdir(devices)) and time.monotonic() < deadline:
            time.sleep(0.002)
    except BaseException:
        os.close(made[0])
        raise
    if left:
        log.warning("the node's sysfs still lists %s of its dead network namespace after %g s", left,
                    _SYSFS_SETTLE_S)
    return made[0]


def clone_tree(path: str, readonly: bool = False, noexec: bool = False) -> int:
    """A detached recursive clone of the mount tree at ``path`` (resolved in the caller's mount namespace):
    its fd. With ``readonly`` it is read-only, with ``noexec`` no-exec, with either nosuid and nodev too,
    throughout."""
    fd = _call(f"cloning the mounts at {path}", _SYS_OPEN_TREE, _AT_FDCWD, path.encode(),
               _OPEN_TREE_CLONE | _AT_RECURSIVE | _O_CLOEXEC)
    flags = (_MOUNT_ATTR_RDONLY if readonly else 0) | (_MOUNT_ATTR_NOEXEC if noexec else 0)
    if flags:
        attr = _MountAttr(flags | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, 0)
        try:
            _call(f"setting the flags of the clone of {path}", _SYS_MOUNT_SETATTR, fd, b"",
                  _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        except BaseException:
            os.close(fd)
            raise
    return fd


def attach(fd: int, target: str, dir_fd: int = _AT_FDCWD) -> None:
    """Attach the detached mount ``fd`` on ``target`` (relative to ``dir_fd``, which may itself be a
    detached mount: the tree then grows while still detached)."""
    _call(f"attaching a mount on {target}", _SYS_MOVE_MOUNT, fd, b"", dir_fd, target.encode(),
          _MOVE_MOUNT_F_EMPTY_PATH)


def running_holder(pidfile: Path, tag: str | None = None) -> int:
    """The pid of the mount holder ``pidfile`` names if it still runs (and holds ``tag``, when given), else 0.
    The pid's start time must match the file's: a pid reused since is not the holder."""
    with contextlib.suppress(OSError, ValueError):
        pid_s, started = pidfile.read_text().split()
        pid = int(pid_s)
        if (start_time(pid) == started
                and Path(f"/proc/{pid}/comm").read_text().strip() == "dsec-mntns"
                and (tag is None or tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes())):
            return pid
    return 0


class MountHolder:
    """The node's private mount namespace for sandbox mounts (see the module docstring)."""

    def __init__(self, shim: Path, pidfile: Path, tag: str) -> None:
        self.shim, self.pidfile, self.tag = shim, pidfile, tag
        self.pid = 0
        self._child = 0  # the holder's pid when this process started it (and must reap it)
        self._started: str | None = None  # its start time (a pid reused since is not it)
        self._thread: ThreadPoolExecutor | None = None
        self._tid = 0
        self._join_error: Exception | None = None

    def start(self) -> None:
        """Adopt the running holder of this home, or start one; then join its namespace from the workers."""
        self.pid = self._adopt() or self._spawn()
        self._started = start_time(self.pid)
        pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="dsec-mntns", initializer=self._join)
        try:
            self._tid = pool.submit(threading.get_native_id).result()  # the first worker: it lives until close
        except BaseException as exc:
            pool.shutdown()
            # A failed initializer only breaks the pool; its own error says what went wrong.
            raise (self._join_error or exc) from None
        self._thread = pool

    def _adopt(self) -> int:
        return running_holder(self.pidfile, self.tag)

    def _spawn(self) -> int:
        # posix_spawn, not subprocess: the holder is meant to outlive this process's handle on it. Its own
        # session: a signal to the daemon's process group (a terminal's ^C) must not reach it.
        null = [(os.POSIX_SPAWN_OPEN, fd, "/dev/null", os.O_RDWR, 0) for fd in (0, 1, 2)]
        pid = os.posix_spawn(str(self.shim), [str(self.shim), "--hold", self.tag], {}, file_actions=null,
                             setsid=True)
        own = os.readlink(f"/proc/{os.getpid()}/ns/mnt")
        for _ in range(1000):  # ~2 s: the holder unshares within a millisecond
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise BackendUnavailable(f"the mount holder ({self.shim} --hold) could not make its private mount "
                                         f"namespace: exit status {os.waitstatus_to_exitcode(status)}")
            with contextlib.suppress(OSError):
                if (os.readlink(f"/proc/{pid}/ns/mnt") != own
                        and Path(f"/proc/{pid}/comm").read_text().strip() == "dsec-mntns"):
                    break
            time.sleep(0.002)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise BackendUnavailable("the mount holder did not set up its mount namespace within 2 s")
        self._child = pid
        tmp = self.pidfile.with_name(self.pidfile.name + ".tmp")
        tmp.write_text(f"{pid} {start_time(pid)}\n")
        os.replace(tmp, self.pidfile)
        return pid

    def _join(self) -> None:
        try:
            if _libc.unshare(_CLONE_FS) != 0:
                raise BackendUnavailable(f"unshare(CLONE_FS): {os.strerror(ctypes.get_errno())}")
            fd = os.open(f"/proc/{self.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, _CLONE_NEWNS) != 0:
                    raise BackendUnavailable(f"joining the mount holder's namespace (pid {self.pid}): "
                                             f"{os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        except Exception as exc:
            self._join_error = exc if isinstance(exc, BackendUnavailable) else BackendUnavailable(
                f"joining the mount holder's namespace (pid {self.pid}): {exc}")
            raise

    def alive(self) -> bool:
        """Whether the holder process still runs (non-blocking: one read of its stat)."""
        if not self.pid:
            return False
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] != "Z" and start_time(self.pid) == self._started
        return False

    def respawn(self) -> int:
        """A new holder after this one died (killed): born from a worker thread, which is still in the dead
        holder's namespace, so the new one's private namespace is a copy of it with every sandbox's mounts in
        it; the workers move there and the old namespace goes with them. Returns the new holder's pid."""
        if self._thread is None:
            raise BackendUnavailable("the mount holder is not started")
        old, dead, ours = self._thread, self.pid, self._child == self.pid
        pid = old.submit(self._spawn).result()
        if ours:  # reaped: it was this process's child
            with contextlib.suppress(ChildProcessError):
                os.waitpid(dead, os.WNOHANG)
        self.pid, self._started = pid, start_time(pid)
        pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="dsec-mntns", initializer=self._join)
        try:
            self._tid = pool.submit(threading.get_native_id).result()
        except BaseException as exc:
            pool.shutdown()
            raise (self._join_error or exc) from None
        self._thread = pool
        old.shutdown()
        log.info("mount holder %d died; holder %d took its mounts over", dead, pid, extra={"component": "mount-holder"})
        return pid

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` in the holder's mount namespace (on one of its worker threads) and wait."""
        if self._thread is None:
            raise BackendUnavailable("the mount holder is not started")
        return self._thread.submit(fn, *args).result()

    def view(self, path: str) -> str:
        """``path`` as the holder's namespace sees it, from any thread of this process."""
        if not self._tid:
            raise BackendUnavailable("the mount holder is not started")
        return f"/proc/{os.getpid()}/task/{self._tid}/root{path}"

    def umount(self, *targets: str) -> None:
        """Detach whatever is mounted on each of ``targets`` in the holder's namespace (a no-op where nothing is)."""
        def run() -> None:
            for target in targets:
                if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
                    err = ctypes.get_errno()
                    if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
                        raise SandboxError(f"unmounting {target} failed: {os.strerror(err)}")
        self.run(run)

    def stop_left_behind(self) -> bool:
        """End this home's holder that a dead daemon left (no sandbox of the home is left); True if one ran."""
        pid = self._adopt()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pidfile.unlink(missing_ok=True)
        return bool(pid)

    def close(self, stop: bool) -> None:
        """Leave the namespace; with ``stop`` (no sandbox of this home is left) end the holder too."""
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
            self._tid = 0
        if stop and self.pid:
            with contextlib.suppress(ProcessLookupError):
                if self._child == self.pid or self._adopt() == self.pid:
                    os.kill(self.pid, signal.SIGKILL)
            if self._child == self.pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
            self.pidfile.unlink(missing_ok=True)
        self._child = 0
        self.pid = 0
