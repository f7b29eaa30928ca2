"""The exec helper ("zygote"): starts each command inside a running sandbox.

What runc's ``nsexec`` does for ``runc exec``, without paying runc's ~20-45 ms per call:
one small host process per node, started by the daemon and connected to it by a
socketpair. For each command it points its children at the sandbox's pid namespace,
``posix_spawn``s (vfork, no page-table copy) the static ``dsec-nsenter`` binary
(``nsenter.c``) there with the command's pipes, and points its children home again.
``dsec-nsenter`` moves into the sandbox's cgroups, joins its user, mount, network, ipc,
uts and cgroup namespaces, becomes the sandbox's root user, drops to the sandbox's
capabilities, sets no_new_privs and rlimits, loads the same seccomp program as the
sandbox's init and execs the command. The helper reports the command's host pid and,
when its pidfd says it exited, its wait status on a status pipe, so the daemon can
stream, time and kill it.

Nothing of this runs inside the sandbox before the command itself: the helper's socket
lives in the host's mount namespace only, so sandboxed code cannot reach it. This module
imports nothing of dsec and nothing heavy: it is the whole program of the helper process.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

__all__ = ["MAX_MESSAGE", "main"]

MAX_MESSAGE = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_PIDFD_OPEN = 434
_SYS_SETNS = 308
_PR_SET_PDEATHSIG = 1
_CLONE_NEWPID = 0x20000000
_MFD_CLOEXEC = 1
_MFD_ALLOW_SEALING = 2
_HIGH_FD = 100  # sources are parked above the fds the spawned binary expects (0-5)
# How long a helper whose daemon hung up waits for its commands to exit (killed ones take milliseconds).
_REAP_GRACE_S = 2.0


def _sys(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _report(fd: int, line: str) -> bool:
    """Tell the daemon; False when it no longer listens (the command then runs on, the sandbox owns it)."""
    try:
        os.write(fd, line.encode() + b"\n")
    except OSError:
        return False
    return True


def _park(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD)


class Helper:
    """State of the helper process: the nsenter binary, the seccomp program, its own pid namespace."""

    def __init__(self, nsenter: str, bpf: bytes, cpus: str = "-") -> None:
        self.nsenter = nsenter
        self.cpus = cpus
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.bpf_fd = -1
        if bpf:
            self.bpf_fd = os.memfd_create("dsec-seccomp", _MFD_CLOEXEC | _MFD_ALLOW_SEALING)
            os.write(self.bpf_fd, bpf)
            fcntl.fcntl(self.bpf_fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)

    def spawn(self, req: dict[str, Any], fds: list[int]) -> tuple[int, int] | None:
        """Start one command; returns (pid, pidfd) to watch, or None after reporting an error.

        ``setns(CLONE_NEWPID)`` only changes where *children* are born, and a process may always go
        back to its own namespace: so the helper points its children at the sandbox, spawns, and
        points them home again."""
        status = fds[3]
        parked: list[int] = []
        target = -1
        pid = 0
        try:
            target = _sys(_libc.syscall(_SYS_PIDFD_OPEN, req["init_pid"], 0), f"open sandbox init {req['init_pid']}")
            sources = [*fds, target] + ([self.bpf_fd] if self.bpf_fd >= 0 else [])
            parked = [_park(fd) for fd in sources]
            actions = [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(parked)]
            flags = int(req.get("landlock", True)) | int(req.get("pristine", False)) << 1  # see nsenter.c
            argv = [self.nsenter, str(req["uid"]), str(req["gid"]), f"{req['capmask']:x}", str(req["nofile"]),
                    str(flags), self.cpus, req["cwd"], *req["cgroup_procs"], "--", *req["argv"]]
            _sys(_libc.syscall(_SYS_SETNS, target, _CLONE_NEWPID), "join sandbox pid namespace")
            try:
                pid = os.posix_spawn(self.nsenter, argv, req["env"], file_actions=actions, setsid=True,
                                     setsigdef=(signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT))
            finally:
                _sys(_libc.syscall(_SYS_SETNS, self.own_pidns, _CLONE_NEWPID), "return to own pid namespace")
            watch = _sys(_libc.syscall(_SYS_PIDFD_OPEN, pid, 0), "watch command")
        except (OSError, ValueError, TypeError, KeyError) as e:
            if pid:  # started, but it cannot be watched (no pidfd: EMFILE): the daemon never learns its pid
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            # One bad request must never take the helper (and every other sandbox's commands) down.
            _report(status, f"error {type(e).__name__}: {e}")
            return None
        finally:
            for fd in [*parked, target]:
                if fd >= 0:
                    os.close(fd)
        if not _report(status, f"pid {pid}"):
            # The daemon hung up before it learnt the pid (a client cancelled within a millisecond):
            # nobody could ever kill this command, so we do. It is still reaped through its pidfd.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        return pid, watch

    def serve(self, sock: socket.socket) -> None:
        fd_size = array.array("i").itemsize
        # One receive buffer for the helper's life: recvmsg(MAX_MESSAGE) allocated (mmap) and shrank (mremap,
        # munmap with its TLB shootdown) a fresh 1 MiB buffer per command.
        buffer = bytearray(MAX_MESSAGE)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is not None:
                    _reap(sel, key)
                    continue
                try:
                    size, ancdata, flags, _ = sock.recvmsg_into([buffer], socket.CMSG_SPACE(4 * fd_size))
                except InterruptedError:
                    continue
                data = bytes(memoryview(buffer)[:size])
                if not data:
                    sel.unregister(sock)
                    _reap_dying(sel)
                    return
                fds: list[int] = []
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        whole = len(payload) - len(payload) % fd_size
                        fds.extend(struct.unpack(f"{whole // fd_size}i", payload[:whole]))
                for fd in fds:
                    os.set_inheritable(fd, False)
                if len(fds) != 4:
                    for fd in fds:
                        os.close(fd)
                    continue
                try:
                    if flags & socket.MSG_TRUNC:
                        raise ValueError(f"the request is larger than {MAX_MESSAGE} bytes")
                    request = json.loads(data)
                except ValueError as e:
                    # The daemon refuses such requests before sending; a helper that died on one would take
                    # every running command's status reports with it.
                    _report(fds[3], f"error request: {e}")
                    for fd in fds:
                        os.close(fd)
                    continue
                spawned = self.spawn(request, fds)
                for fd in fds[:3]:
                    os.close(fd)
                if spawned is None:
                    os.close(fds[3])
                else:
                    sel.register(spawned[1], selectors.EVENT_READ, (spawned[0], fds[3]))


def _reap(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
    """A command exited (its pidfd is readable): reap it, report, forget it."""
    pid, status = key.data
    sel.unregister(key.fd)
    os.close(key.fd)
    try:
        _, wstatus = os.waitpid(pid, 0)
    except ChildProcessError:
        wstatus = 0
    _report(status, f"exit {wstatus}")
    os.close(status)


def _reap_dying(sel: selectors.BaseSelector) -> None:
    """The daemon closed its end: it is stopping, and has just killed the commands of the calls it cut off.
    Reap them before exiting: a child left unreaped becomes a zombie of whatever inherits it (the daemon,
    then the host's init, which may collect it late), and a zombie shows in the sandbox's process list as
    if its command still ran. Commands still running after the grace are left running, re-parented to the
    daemon (subreaper)."""
    end = time.monotonic() + _REAP_GRACE_S
    while sel.get_map() and (left := end - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            _reap(sel, key)


def main() -> None:
    """Entry point: ``python -I -S nsexec.py SOCKET_FD NSENTER_PATH [CPUS]`` (seccomp BPF on stdin; CPUS: the
    hexadecimal mask commands get, see :mod:`dsec.isolation.affinity`)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Commands are our children and we reap them ourselves (pidfd + waitpid).
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)
    bpf = sys.stdin.buffer.read()
    # Our stdin (the program's pipe, at EOF now) must not stay open where a new fd could reuse 0.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0, inheritable=False)
    os.close(null)
    Helper(sys.argv[2], bpf, *sys.argv[3:4]).serve(sock)


if __name__ == "__main__":
    main()
