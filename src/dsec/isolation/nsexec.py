"""The exec helper ("zygote"): joins a running sandbox and executes one command in it.

What runc's ``nsexec`` does for ``runc exec``, without paying runc's ~45 ms per call:
one small host process per node, started by the daemon and connected to it by a
socketpair, forks once per command, straight into the sandbox's pid namespace. The
child moves itself into the sandbox's cgroups, joins its user, mount, network, ipc,
uts and cgroup namespaces, becomes the sandbox's root user, drops to the same
capabilities, no_new_privs, rlimits and seccomp filter as the sandbox's init, and
execs. The helper reports the command's host pid and, later, its wait status on a
status pipe, so the daemon can stream, time and kill it.

Nothing of this runs inside the sandbox before the command itself: the helper's
socket lives in the host's mount namespace only, so sandboxed code cannot reach it.
This module imports nothing heavy: it is the whole program of the helper process.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import resource
import selectors
import signal
import socket
import struct
import sys
from typing import Any

if __package__:
    from dsec.isolation.capabilities import drop_bounding, set_caps, set_no_new_privs
else:
    # Run as a plain script (``python -I -S nsexec.py``): importing the dsec package would pull the
    # SDK and pydantic into a process that forks for every command. Load the one sibling we need.
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_dsec_caps", os.path.join(os.path.dirname(__file__),
                                                                             "capabilities.py"))
    assert _spec is not None and _spec.loader is not None
    _caps = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_caps)
    drop_bounding, set_caps, set_no_new_privs = _caps.drop_bounding, _caps.set_caps, _caps.set_no_new_privs

__all__ = ["MAX_MESSAGE", "NS_FLAGS", "main"]

_HELPER_PID = 0

MAX_MESSAGE = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_PIDFD_OPEN = 434
_SYS_SETNS = 308
_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
NS_FLAGS = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP
_RLIMITS = {
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
    "fsize": resource.RLIMIT_FSIZE,
    "stack": resource.RLIMIT_STACK,
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
}


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _sys(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _load_seccomp(bpf: bytes) -> None:
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p).value)
    _sys(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "load seccomp filter")


def _report(fd: int, line: str) -> None:
    # OSError: the daemon went away; the command runs on, the sandbox owns it.
    with contextlib.suppress(OSError):
        os.write(fd, line.encode() + b"\n")


def _become_command(req: dict[str, Any], pidfd: int, fds: list[int], bpf: bytes) -> None:
    """In B: enter the sandbox fully and exec. Never returns; errors go to the status pipe."""
    stdin, stdout, stderr, status = fds
    try:
        for procs in req["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")
        _sys(_libc.syscall(_SYS_SETNS, pidfd, NS_FLAGS), "join sandbox namespaces")
        os.close(pidfd)
        os.setgroups([])
        os.setresgid(req["gid"], req["gid"], req["gid"])
        os.setresuid(req["uid"], req["uid"], req["uid"])
        os.umask(0o022)
        try:
            os.chdir(req["cwd"])
        except OSError as e:
            raise OSError(e.errno, f"working directory {req['cwd']!r}: {e.strerror}") from None
        for name, (soft, hard) in req.get("rlimits", {}).items():
            resource.setrlimit(_RLIMITS[name], (soft, hard))
        os.setsid()
        for target, fd in enumerate((stdin, stdout, stderr)):
            os.dup2(fd, target)
        os.set_inheritable(status, False)
        os.closerange(3, status)
        os.closerange(status + 1, 65536)
        # Ignored signals survive execve: give the command default dispositions.
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        # Joining the user namespace reset the bounding set to full: cut it again, here.
        drop_bounding(tuple(req["caps"]))
        set_caps(tuple(req["caps"]))
        set_no_new_privs()
        if bpf:
            _load_seccomp(bpf)
        os.execvpe(req["argv"][0], req["argv"], req["env"])
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        _report(status, f"error {msg}")
        os._exit(127)


def _spawn(req: dict[str, Any], fds: list[int], bpf: bytes, own_pidns: int) -> tuple[int, int] | None:
    """Fork the command straight into the sandbox's pid namespace; returns (pid, pidfd) to watch.

    ``setns(CLONE_NEWPID)`` only changes where *children* are born, and a process may always go back
    to its own namespace: so the helper points its children at the sandbox, forks, and points them
    home again. One fork per command, and no watcher process per running command."""
    status = fds[3]
    try:
        target = _sys(_libc.syscall(_SYS_PIDFD_OPEN, req["init_pid"], 0), f"open sandbox init {req['init_pid']}")
    except OSError as e:
        _report(status, f"error {e}")
        return None
    try:
        _sys(_libc.syscall(_SYS_SETNS, target, _CLONE_NEWPID), "join sandbox pid namespace")
        try:
            pid = os.fork()
        finally:
            if os.getpid() == _HELPER_PID:
                _sys(_libc.syscall(_SYS_SETNS, own_pidns, _CLONE_NEWPID), "return to own pid namespace")
        if pid == 0:
            _become_command(req, target, fds, bpf)
        watch = _sys(_libc.syscall(_SYS_PIDFD_OPEN, pid, 0), "watch command")
    except OSError as e:
        _report(status, f"error {e}")
        return None
    finally:
        os.close(target)
    _report(status, f"pid {pid}")
    return pid, watch


def _serve(sock: socket.socket, bpf: bytes) -> None:
    fd_size = array.array("i").itemsize
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if key.data is not None:
                # A command exited (its pidfd is readable): reap it, report, forget it.
                pid, status = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                try:
                    _, wstatus = os.waitpid(pid, 0)
                except ChildProcessError:
                    wstatus = 0
                _report(status, f"exit {wstatus}")
                os.close(status)
                continue
            try:
                data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4 * fd_size))
            except InterruptedError:
                continue
            if not data:
                return  # the daemon closed its end; running commands are re-parented to their sandbox's init
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    whole = len(payload) - len(payload) % fd_size
                    fds.extend(struct.unpack(f"{whole // fd_size}i", payload[:whole]))
            if len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                continue
            spawned = _spawn(json.loads(data), fds, bpf, own_pidns)
            for fd in fds[:3]:
                os.close(fd)
            if spawned is None:
                os.close(fds[3])
            else:
                sel.register(spawned[1], selectors.EVENT_READ, (spawned[0], fds[3]))


def main() -> None:
    """Entry point of the helper process: ``python -I -S nsexec.py FD`` (seccomp BPF on stdin)."""
    global _HELPER_PID
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _HELPER_PID = os.getpid()
    # Commands are our children and we reap them ourselves (pidfd + waitpid).
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bpf = sys.stdin.buffer.read()
    _serve(sock, bpf)


if __name__ == "__main__":
    main()
