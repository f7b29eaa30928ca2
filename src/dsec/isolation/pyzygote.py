"""The Python zygote of a function sandbox: every ``sb.call`` is forked from an interpreter of the image that
has already imported cloudpickle and the call loader, so no call starts a Python of its own.

The zygote's launcher (``zygote_py.c``) starts it inside the sandbox as ``python3 -I /.dsec/pyzygote.py
WORKDIR TMP_BYTES CPUS UID GID[,GROUP...]`` in pid, ipc and uts namespaces of its own (it sees and can signal nothing of
the host's), a copy of the sandbox's mount namespace, its user and network namespaces and its zygote cgroup,
under the zygote's own seccomp filter, with fd 3 the control socket to the daemon, fd 4 a socket to the
launcher and fd 5 every call's seccomp program. It keeps the capabilities of the sandbox's root, which its
calls' namespaces need; its bounding set keeps only CAP_SYS_ADMIN, which it passes (ambient) to each call's
init, and its securebits are locked as ``zygote.c`` locks them, once for all calls.

Each call is made ready one ahead, as in ``zygote.c``, with a single copy of the interpreter: the zygote gives
its next child a new pid namespace and spawns ``dsec-callinit`` there (``callinit.c``: a vfork and an exec),
which makes the call's mount, ipc and uts namespaces, mounts its ``/proc`` and ``/tmp``, drops its capability
and waits as the namespace's pid 1, reaping orphans; then it forks the call process into that pid namespace
(pid 2), which waits for the init to be ready, joins its namespaces, becomes the image's user, drops every
capability, sets no_new_privs, restricts itself with Landlock and the seccomp program and waits for its
request. A request (NUL-separated ``CPU_S FSIZE NOFILE TMP_BYTES CWD MAX_RESULT CLIENT_PYTHON ENVC ENV...``
with the call's four pipes and the ``cgroup.procs`` files of its own cgroup) goes to the call process,
which moves its init and itself into the call's cgroup (in the call, so that no call's migration, which can
wait for an RCU grace period, holds up the zygote), takes its pipes, rlimits and working directory, reports
``start`` with what it has waited for a CPU so far, and runs the loader (:mod:`loader`): the pickled call on
stdin, the reply on stdout, its prints on stderr. A request whose ``CLIENT_PYTHON`` is ``program`` carries
``ARGC ARGV...`` after the environment and runs that Python program instead (``loader.run_program``), with the
call's pipes as its standard streams. When it exits the zygote reports ``usage``, ``tmpfull``
and ``exit`` on the status pipe as ``zygote.c`` does, kills the init (ending the pid namespace and whatever
the call left) and closes the pipe once both are reaped. It reports ``pid HOSTPID`` of the init when it
dispatched (the launcher translates the number, asked when the call is made ahead and read at its dispatch:
killing the init kills the call). ``drain`` makes it stop
taking calls and exit when the last one ended (the daemon starts a new zygote after a mount change); end
of file kills every call at once.

This file is copied into every function sandbox's ``/.dsec``. It must import nothing but the standard
library, cloudpickle and the loader, and never unpickle or run anything of the caller's: only the calls
it forks do, once confined. Only x86-64 is supported (syscall numbers).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import os
import resource
import select
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from typing import NoReturn

CTL_FD, LAUNCHER_FD, SECCOMP_FD = 3, 4, 5
MAX_MESSAGE = (2 << 20) + (64 << 10)  # exec_client.MAX_MESSAGE
MAX_CGROUP_FDS = 4
INIT = "/.dsec/dsec-callinit"
PROGRAM = "program"
"""``CLIENT_PYTHON`` of a request that runs a program (``ARGC ARGV...`` follow the environment), not a call."""

SYS_CAPGET, SYS_CAPSET = 125, 126
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID = 0x20000, 0x04000000, 0x08000000, 0x20000000
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 4, 22, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 28, 38, 47
PR_CAP_AMBIENT_RAISE, PR_CAP_AMBIENT_CLEAR_ALL = 2, 4
SECCOMP_MODE_FILTER = 2
# NOROOT, NO_SETUID_FIXUP (each locked) and KEEP_CAPS_LOCKED, as zygote.c sets them
SECUREBITS = 0b101111
CAP_SYS_ADMIN, CAP_LAST = 21, 63
# Landlock (linux/landlock.h): writes only beneath the workspace, /tmp and /dev; no TCP; scoped signals and
# abstract unix sockets, each as the kernel's ABI allows (zygote_setup.c: prepare_landlock)
LL_WRITE_FILE, LL_REMOVE_DIR, LL_REMOVE_FILE, LL_MAKE_CHAR, LL_MAKE_DIR = 1 << 1, 1 << 4, 1 << 5, 1 << 6, 1 << 7
LL_MAKE_REG, LL_MAKE_SOCK, LL_MAKE_FIFO, LL_MAKE_BLOCK, LL_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
LL_REFER, LL_TRUNCATE = 1 << 13, 1 << 14
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1, 2


class _Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The C library's fork without its at-fork handlers (glibc >= 2.34, musl >= 1.2.3), or None.
_Fork = getattr(_libc, "_Fork", None)
if _Fork is not None:
    _Fork.restype, _Fork.argtypes = ctypes.c_int, []


class Failed(Exception):
    """A step that failed: ``what`` and its errno (None: ``what`` says it all)."""

    def __init__(self, what: str, err: int | None) -> None:
        super().__init__(what if err is None else f"{what}: {os.strerror(err)}")


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise Failed(what, ctypes.get_errno())
    return ret


def _addr(obj: ctypes.Structure | ctypes.Array[_CapData]) -> ctypes.c_void_p:
    return ctypes.c_void_p(ctypes.addressof(obj))


def _syscall(nr: int, *args: int | ctypes.c_void_p | None) -> int:
    return int(_libc.syscall(ctypes.c_long(nr), *[a if isinstance(a, ctypes.c_void_p) else ctypes.c_long(a or 0)
                                                  for a in args]))


def _prctl(option: int, arg: int = 0, arg3: ctypes.c_void_p | int = 0) -> int:
    third = arg3 if isinstance(arg3, ctypes.c_void_p) else ctypes.c_ulong(arg3)
    return int(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), third, ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _setns(fd: int, nstype: int, what: str) -> None:
    _check(int(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype))), what)


class Confinement:
    """What every call applies to itself before the caller's code runs (``zygote.c``: the same steps)."""

    def __init__(self, workdir: str, uid: int, gids: list[int], seccomp: bytes) -> None:
        self.uid, self.gid, self.groups = uid, gids[0], gids[1:]
        abi = _syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
        if abi < 1:
            raise Failed("landlock", ctypes.get_errno() if abi < 0 else 95)
        self.write = (LL_WRITE_FILE | LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_CHAR | LL_MAKE_DIR | LL_MAKE_REG
                      | LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_BLOCK | LL_MAKE_SYM
                      | (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0))
        self.dev = LL_WRITE_FILE | (LL_TRUNCATE if abi >= 3 else 0)
        self.ruleset = _Ruleset(self.write, LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if abi >= 4 else 0,
                                LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL if abi >= 6 else 0)
        self.ruleset_size = 8 if abi < 4 else 16 if abi < 6 else 24
        self.workdir_fd = os.open(workdir, os.O_PATH | os.O_CLOEXEC)
        self.dev_fd = os.open("/dev", os.O_PATH | os.O_CLOEXEC)
        os.close(_check(_syscall(SYS_LANDLOCK_CREATE_RULESET, _addr(self.ruleset), self.ruleset_size, 0),
                        "landlock ruleset"))
        if len(seccomp) % 8:
            raise Failed("seccomp program size", 22)
        self.filter = ctypes.create_string_buffer(seccomp, len(seccomp))
        self.fprog = _Fprog(len(seccomp) // 8, ctypes.cast(self.filter, ctypes.c_void_p))
        # Built once here rather than in every call: what a call allocates lands on pages it must copy.
        self.no_caps = (_CapHeader(0x20080522, 0), (_CapData * 2)())
        self.rules = (_PathBeneath(self.write, self.workdir_fd), _PathBeneath(self.dev, self.dev_fd),
                      _PathBeneath(self.write, -1))

    def apply(self) -> None:
        """Drop the last bounding and the ambient capability, become the image's user, drop every capability,
        no_new_privs, Landlock, seccomp (in the call, before the caller's code)."""
        _check(_prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN), "drop bounding capability")
        _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clear ambient capabilities")
        if self.uid or self.gid or self.groups:
            try:
                os.setgroups(self.groups)
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
            except OSError as e:
                raise Failed("become the image's user", e.errno or 1) from None
        header, data = self.no_caps
        _check(_syscall(SYS_CAPSET, _addr(header), _addr(data)), "drop capabilities")
        _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "set no_new_privs")
        fd = _check(_syscall(SYS_LANDLOCK_CREATE_RULESET, _addr(self.ruleset), self.ruleset_size, 0), "landlock")
        tmp = os.open("/tmp", os.O_PATH | os.O_CLOEXEC)  # the call's own /tmp, mounted by its init
        self.rules[2].parent_fd = tmp
        for rule in self.rules:
            _check(_syscall(SYS_LANDLOCK_ADD_RULE, fd, 1, _addr(rule), 0), "landlock")
        _check(_syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0), "landlock")
        for each in (fd, tmp, self.workdir_fd, self.dev_fd):
            os.close(each)
        if self.fprog.len:
            _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, _addr(self.fprog)), "load seccomp program")


def confine_zygote() -> None:
    """Once, in the zygote: a bounding set of CAP_SYS_ADMIN alone (ambient, for the calls' inits), locked
    securebits, and not dumpable."""
    for cap in range(CAP_LAST + 1):
        if cap != CAP_SYS_ADMIN and _prctl(PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() != 22:
            raise Failed("drop bounding capability", ctypes.get_errno())
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(_syscall(SYS_CAPGET, _addr(header), _addr(data)), "read capabilities")
    data[0].inheritable = 1 << CAP_SYS_ADMIN
    data[1].inheritable = 0
    _check(_syscall(SYS_CAPSET, _addr(header), _addr(data)), "set inheritable capabilities")
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_SYS_ADMIN), "raise the ambient capability")
    _check(_prctl(PR_SET_SECUREBITS, SECUREBITS), "set securebits")
    _check(_prctl(PR_SET_DUMPABLE, 0), "set non-dumpable")


def _fork() -> int:
    """Fork a call. ``os.fork`` runs CPython's after-fork work in the child (``PyOS_AfterFork_Child``: the runtime's
    locks, every registered at-fork handler in Python), which writes to ~180 pages the child shares with the
    zygote; ~75 of them the call would not have touched otherwise: a copy-on-write fault each (~5 us on a VM).
    The zygote is one thread that forks holding no lock (the GIL is released around the foreign call), so the
    child needs none of that: the C library's own ``_Fork`` (its pid and thread bookkeeping, no handlers) and a
    fresh seed for ``random`` if something imported it (what its handler does) suffice. ``os.fork`` where the C
    library has no ``_Fork``."""
    if _Fork is None:
        return os.fork()
    pid = int(_Fork())
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if pid == 0 and "random" in sys.modules:
        sys.modules["random"].seed()
    return pid


# --------------------------------------------------------------------------------------- one call


@dataclass
class Ready:
    """The next call, made ahead: its init in a new pid namespace, and the call process already confined there,
    waiting on ``sock`` for its request."""

    init: int
    pidfd: int
    host: int = 0
    """The init's pid on the host (the launcher's answer, read when the call is dispatched), which the daemon
    kills the call by."""
    call: int = 0
    sock: socket.socket | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        if self.sock is not None:
            self.sock.close()


@dataclass
class Running:
    """A dispatched call: its init, the call process, and the status pipe, closed once both are reaped."""

    init: int
    status: int
    call_done: bool = False
    init_done: bool = False


@dataclass
class Request:
    """One call's request, parsed (see the module docstring)."""

    cpu: int
    fsize: int
    nofile: int
    cwd: str
    limit: int
    client: str
    env: dict[str, str]
    argv: list[str]
    """A program's ``[python, script, arg...]`` (``client`` is :data:`PROGRAM`); empty for ``sb.call``."""

    @classmethod
    def parse(cls, msg: bytes) -> Request:
        fields = msg.split(b"\0")
        envc = int(fields[7])
        env = dict(f.decode(errors="surrogateescape").partition("=")[::2] for f in fields[8:8 + envc])
        client = fields[6].decode()
        argv: list[str] = []
        if client == PROGRAM:
            argc = int(fields[8 + envc])
            argv = [f.decode(errors="surrogateescape") for f in fields[9 + envc:9 + envc + argc]]
            if argc < 2 or len(argv) != argc:
                raise ValueError("program: argv")
        return cls(cpu=int(fields[0]), fsize=int(fields[1]), nofile=int(fields[2]), cwd=fields[4].decode(),
                   limit=int(fields[5]), client=client, env=env, argv=argv)


def call_process(sock: socket.socket, pidfd: int, told: int, confinement: Confinement, cpus: set[int] | None
                 ) -> NoReturn:
    """The call process (pid 2 of its namespace), forked ahead of its request: it confines itself, waits for the
    request, then runs the loader. A set-up that failed is reported once the request brings a status pipe."""
    code = 127
    try:
        code = _call(sock, pidfd, told, confinement, cpus)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _call(sock: socket.socket, pidfd: int, told: int, confinement: Confinement, cpus: set[int] | None) -> int:
    failure: str | None = None
    try:
        said = os.read(told, 600)  # the init's namespaces and mounts are ready
        os.close(told)
        if said != b"ok":
            raise Failed(said.decode(errors="replace").removeprefix("error ") or "the call's init exited", None)
        _confine(sock, pidfd, confinement, cpus)
    except Failed as e:
        failure = str(e)
    except OSError as e:
        failure = f"prepare the call: {os.strerror(e.errno or 5)}"
    msg, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 4 + MAX_CGROUP_FDS)
    if not msg and not fds:
        return 0  # the zygote is going away, or drained
    if len(fds) < 4 or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return 127
    sock.close()
    status = fds[3]
    try:
        _move(fds[4:])
    except OSError as e:
        _report_error(status, f"move the call into its cgroup: {os.strerror(e.errno or 5)}")
        return 127
    if failure is not None:
        _report_error(status, failure)
        return 127
    try:
        request = Request.parse(msg)
    except (ValueError, IndexError):
        _report_error(status, "request: malformed")
        return 127
    return _serve(request, fds)


def _move(cgroups: list[int]) -> None:
    """The init (pid 1 here) and this process into the call's own cgroup, through ``cgroup.procs`` files the
    daemon opened (a write through them is the opener's, whatever this process has become since)."""
    own = str(os.getpid()).encode()
    try:
        for fd in cgroups:
            os.write(fd, b"1")
            os.write(fd, own)
    finally:
        for fd in cgroups:
            os.close(fd)


def _report_error(status: int, text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(status, f"error {text}\n".encode())


def _join(pidfd: int) -> None:
    """Join the init's mount, ipc and uts namespaces. On a loaded node this has failed with EPERM in about one call
    in a thousand, the init alive and ready: tried again for up to 0.5 s before it is reported."""
    for attempt in range(50):
        try:
            _setns(pidfd, CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS, "join the call's namespaces")
            return
        except Failed:
            if attempt == 49:
                raise
            import time

            time.sleep(0.01)


def _confine(sock: socket.socket, pidfd: int, confinement: Confinement, cpus: set[int] | None) -> None:
    """Everything that does not depend on the request: the init's namespaces, a session, no fd of the zygote's,
    the OOM killer's first choice, the image's user, no capability, no_new_privs, Landlock, seccomp."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _join(pidfd)
    os.setsid()
    keep = sorted({sock.fileno(), confinement.workdir_fd, confinement.dev_fd})
    low = 3
    for fd in keep:  # the zygote's other fds (other calls' pipes, its sockets) are not this call's
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)
    with contextlib.suppress(OSError):  # the OOM killer's first choice, as in zygote.c (best effort)
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"500")  # not open(): the io stack's objects are pages every call would copy
        finally:
            os.close(fd)
    os.umask(0o022)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.sched_getscheduler(0) == os.SCHED_BATCH:  # the zygote's class ends here, as in zygote.c
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if cpus:
        os.sched_setaffinity(0, cpus)
    confinement.apply()


def _serve(request: Request, fds: list[int]) -> int:
    """The request: its pipes, rlimits and working directory, then the loader; the exit code."""
    status = fds[3]
    try:
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        if not _set_up(request, status):
            return 127
    except OSError as e:  # before the caller's code: a failure of the sandbox
        _report_error(status, f"start call: {e}")
        return 127
    os.close(status)  # the caller's code must not be able to write status lines
    os.environ.clear()
    os.environ.update(request.env)
    import loader

    if request.client == PROGRAM:
        return int(loader.run_program(request.argv))
    sys.argv = ["-c"]
    return int(loader.serve(request.limit, request.client))


def _set_up(request: Request, status: int) -> bool:
    resource.setrlimit(resource.RLIMIT_NOFILE, (request.nofile, request.nofile))
    if request.fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (request.fsize, request.fsize))
    if request.cpu:  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.setrlimit(resource.RLIMIT_CPU, (request.cpu, request.cpu + 1))
    try:
        os.chdir(request.cwd)
    except OSError as e:
        _report_error(status, f"working directory '{request.cwd}': {os.strerror(e.errno or 2)}")
        return False
    # What it waited for until now (a CPU, on a busy node) is the sandbox's time, not the caller's: the daemon's
    # clock for the call's timeout starts here.
    with open("/proc/self/schedstat", "rb") as f:
        delay = f.read().split()[1].decode()
    os.write(status, f"start {delay}\n".encode())
    return True


# ------------------------------------------------------------------------------------------ the zygote


class Zygote:
    """The dispatch loop: one call's init spawned ahead, the running calls, drain and end of file."""

    def __init__(self, ctl: socket.socket, launcher: socket.socket, tmp_bytes: str, confinement: Confinement,
                 cpus: set[int] | None) -> None:
        self.ctl, self.launcher, self.tmp_bytes = ctl, launcher, tmp_bytes
        self.confinement, self.cpus = confinement, cpus
        self.ready: Ready | None = None
        self.asked: collections.deque[Ready] = collections.deque()
        """Calls whose init's host pid the launcher has yet to answer, in the order asked."""
        self.by_call: dict[int, Running] = {}
        self.by_init: dict[int, Running] = {}
        self.draining = False
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def prepare(self, tmp_bytes: str) -> Ready:
        """The next call: its init, spawned into a new pid namespace made for our next child, and the call process
        forked there, which confines itself and waits for its request."""
        told, tell = os.pipe2(os.O_CLOEXEC)
        try:
            _check(int(_libc.unshare(ctypes.c_int(CLONE_NEWPID))), "new pid namespace")
            try:
                init = os.posix_spawn(INIT, [INIT, f"mode=1777,size={tmp_bytes}"], {}, setsid=True,
                                      file_actions=[(os.POSIX_SPAWN_DUP2, tell, 3),
                                                    (os.POSIX_SPAWN_DUP2, SECCOMP_FD, 4)])
            finally:
                _setns(self.own_pidns, CLONE_NEWPID, "return to the zygote's pid namespace")
        finally:
            os.close(tell)
        ready: Ready | None = None
        try:
            ready = Ready(init=init, pidfd=os.pidfd_open(init))
            self._ask_host_pid(ready)  # answered while the call is forked
            self._fork_ahead(ready, told)  # the call waits for its init's "ok"; the zygote never does
            return ready
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)  # reaped as an unknown child
            if ready is not None:
                if ready.call:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(ready.call, signal.SIGKILL)
                ready.close()
            raise
        finally:
            os.close(told)

    def _fork_ahead(self, ready: Ready, told: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _setns(ready.pidfd, CLONE_NEWPID, "enter the call's pid namespace")
        child = -1
        try:
            child = _fork()
            if child == 0:
                ours.close()
                call_process(theirs, ready.pidfd, told, self.confinement, self.cpus)
        finally:
            if child != 0:
                theirs.close()
                _setns(self.own_pidns, CLONE_NEWPID, "return to the zygote's pid namespace")
        ready.call, ready.sock = child, ours

    def _ask_host_pid(self, ready: Ready) -> None:
        """Ask the launcher for the host's number of ``ready``'s init (which the daemon kills a call by)."""
        creds = struct.pack("iII", ready.init, os.getuid(), os.getgid())
        self.launcher.sendmsg([b"?"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        self.asked.append(ready)

    def _host_pid(self, ready: Ready) -> int:
        """``ready``'s init's host pid: the launcher answers in the order it was asked (an answer for a call
        given up since is read and dropped)."""
        while not ready.host:
            if not self.asked:
                raise Failed("learn the call's host pid", 3)
            asked = self.asked.popleft()
            asked.host = max(int(self.launcher.recv(32) or b"0"), -1)
            if asked.host <= 0:
                asked.host = -1
        if ready.host < 0:
            raise Failed("learn the call's host pid", 3)
        return ready.host

    def prepare_ahead(self) -> None:
        if self.ready is None and not self.draining:
            try:
                self.ready = self.prepare(self.tmp_bytes)
            except (Failed, OSError):
                self.ready = None  # the next request tries again, and reports why if it fails then

    def dispatch(self, msg: bytes, fds: list[int]) -> None:
        pipes, cgroups = fds[:4], fds[4:]
        status = pipes[3]
        ready: Ready | None = None
        try:
            fields = msg.split(b"\0", 4)
            tmp = fields[3].decode() if len(fields) > 4 else ""
            if not tmp.isdigit():
                raise Failed("request", 22)
            if tmp == self.tmp_bytes:
                self.prepare_ahead()
                ready, self.ready = self.ready, None
            if ready is None:  # another size of /tmp, or preparing ahead failed: a call of its own, now
                ready = self.prepare(tmp)
            host = self._host_pid(ready)
            assert ready.sock is not None
            # The call moves its init and itself into its cgroup before anything of the request runs: the
            # zygote, one process for every call, never waits on a cgroup migration.
            socket.send_fds(ready.sock, [msg], [*pipes[:4], *cgroups])
            running = Running(init=ready.init, status=status)
            self.by_call[ready.call] = running
            self.by_init[ready.init] = running
            try:
                os.write(status, f"pid {host}\n".encode())
            except OSError:
                os.kill(ready.init, signal.SIGKILL)  # the daemon hung up before it learnt the pid
        except (Failed, OSError, ValueError, IndexError) as e:
            if ready is not None:
                for pid in (ready.init, ready.call):
                    with contextlib.suppress(ProcessLookupError):
                        if pid:
                            os.kill(pid, signal.SIGKILL)  # reaped as unknown children
            text = str(e) if isinstance(e, Failed) else f"start call: {e}"
            _report_error(status, text)
            os.close(status)
        finally:
            if ready is not None:
                ready.close()
            for fd in (*pipes[:3], *cgroups):
                os.close(fd)
        self.prepare_ahead()  # the next call's, while this one runs

    def reap(self) -> None:
        while True:
            try:
                pid, wstatus, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.ready is not None and pid in (self.ready.init, self.ready.call):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.ready.init, signal.SIGKILL)  # the next request prepares another call
                self.ready.close()
                self.ready = None
            elif pid in self.by_call:
                self._call_ended(self.by_call.pop(pid), wstatus, usage)
            elif pid in self.by_init:
                running = self.by_init.pop(pid)
                running.init_done = True
                if running.call_done:
                    os.close(running.status)

    def _call_ended(self, running: Running, wstatus: int, usage: resource.struct_rusage) -> None:
        running.call_done = True
        full = 0
        if not running.init_done:
            try:
                st = os.statvfs(f"/proc/{running.init}/root/tmp")
                full = int(st.f_bavail * st.f_frsize < 64 * 1024 or st.f_favail == 0)
            except OSError:
                pass
        cpu_us = int((usage.ru_utime + usage.ru_stime) * 1e6)
        with contextlib.suppress(OSError):
            os.write(running.status, f"usage {cpu_us} {usage.ru_maxrss}\ntmpfull {full}\nexit {wstatus}\n".encode())
        if running.init_done:
            os.close(running.status)
        else:  # its pid namespace ends with it; the status pipe is closed once it is reaped
            with contextlib.suppress(ProcessLookupError):
                os.kill(running.init, signal.SIGKILL)

    def drain(self) -> None:
        self.draining = True
        if self.ready is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.ready.init, signal.SIGKILL)  # its pid namespace, the call made ahead with it
            self.ready.close()
            self.ready = None

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        poller = select.poll()
        poller.register(self.ctl.fileno(), select.POLLIN)
        poller.register(self.wakeup_r, select.POLLIN)
        self.prepare_ahead()
        while not (self.draining and not self.by_call and not self.by_init):
            for fd, _ in poller.poll():
                if fd == self.wakeup_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wakeup_r, 512):
                            pass
                    self.reap()
                    continue
                # close-on-exec: no init spawned later may hold a call's pipes (their end of file is a verdict)
                msg, fds, flags, _ = socket.recv_fds(self.ctl, MAX_MESSAGE, 4 + MAX_CGROUP_FDS,
                                                     socket.MSG_CMSG_CLOEXEC)
                if not msg and not fds:
                    return  # the daemon closed the socket (destroy, or it died): every call goes with us
                if msg == b"drain" and not fds:
                    self.drain()
                elif len(fds) >= 4 and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    self.dispatch(msg, fds)
                else:
                    for each in fds:
                        os.close(each)

    def stop(self) -> None:
        for pid in [*self.by_init, *([self.ready.init] if self.ready else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return


def _cpus(hex_mask: str) -> set[int] | None:
    if hex_mask == "-":
        return None
    value = int(hex_mask, 16)
    return {bit for bit in range(value.bit_length()) if value >> bit & 1}


def main() -> None:
    ctl = socket.socket(fileno=CTL_FD)
    try:
        workdir, tmp_bytes, cpus, uid, gid = sys.argv[1:6]
        if os.uname().machine != "x86_64":
            raise Failed(f"the Python zygote supports x86-64 only, not {os.uname().machine}", 95)
        program = os.pread(SECCOMP_FD, 1 << 20, 0)
        for fd in (CTL_FD, LAUNCHER_FD, SECCOMP_FD):
            os.set_inheritable(fd, False)
        confinement = Confinement(workdir, int(uid), [int(g) for g in gid.split(",")], program)
        confine_zygote()
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cloudpickle  # noqa: F401  (imported once here: every call is forked with it)
        import loader  # noqa: F401
        if os.sched_getscheduler(0) == os.SCHED_OTHER:  # as zygote.c: spawning ahead never preempts a call
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        zygote = Zygote(ctl, socket.socket(fileno=LAUNCHER_FD), tmp_bytes, confinement, _cpus(cpus))
    except (Failed, OSError, ValueError, ImportError) as e:
        ctl.send(f"error start the Python zygote: {e}".encode())
        sys.exit(1)
    # What the zygote holds is never collected again: no call's garbage collection walks (and so copies)
    # the interpreter's pages it shares with the zygote.
    gc.collect()
    gc.freeze()
    ctl.send(f"ready {sys.version_info[0]}.{sys.version_info[1]}".encode())
    try:
        zygote.serve()
    finally:
        zygote.stop()


if __name__ == "__main__":
    main()
