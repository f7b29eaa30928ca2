"""Daemon side of a function sandbox's zygotes (``zygote.c``, ``pyzygote.py``): start them, hand them calls,
stop them.

:class:`Zygote` owns one ``dsec-zygote`` process and the socketpair to it. Starting it is
the expensive part (~10 ms: overlay, binds, pivot_root, Landlock ruleset, user namespace);
each call afterwards is one message there, handed to a clone the zygote made ahead of it. The status pipe of a call
speaks the exec helper's protocol (``pid``, ``exit``, ``error`` lines, plus ``usage`` and ``tmpfull``), so
:func:`dsec.isolation.exec_client.stream_exec` drives it unchanged. :meth:`Zygote.start_python` has the
zygote's launcher start a :class:`PyZygote` (the image's Python with cloudpickle and the call loader
imported), which serves ``sb.call`` the same way.

This module starts processes and writes uid maps and cgroup membership; it never decides
limits or paths (the backend does) and never reads what a call prints.
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import InvalidRequest, SandboxError
from dsec.isolation.affinity import hex_mask, sandbox_cpus
from dsec.isolation.exec_client import MAX_MESSAGE, Spawned, send_with_pipes
from dsec.isolation.procs import reap

__all__ = ["MAX_REQUEST", "PyZygote", "Zygote", "ZygoteConfig"]

_MFD_CLOEXEC = 1
_START_TIMEOUT_S = 30.0
# The image's interpreter importing cloudpickle: ~0.2 s of CPU, but a sandbox's CPU class yields to everything
# else on the node (cpu.idle), so under load it has taken over 30 s.
_PYTHON_START_TIMEOUT_S = 180.0
# How long a zygote told to stop (its socket closed) has to kill and reap its calls before it is killed.
_EXIT_GRACE_S = 2.0
MAX_REQUEST = MAX_MESSAGE
"""Largest request of one call (``MAX_MSG`` in ``zygote.h``): a command at the kernel's exec limit."""


@dataclass(frozen=True)
class ZygoteConfig:
    """Everything a zygote is built from."""

    binary: Path
    newroot: Path
    """Empty directory the sandbox root is mounted on (in the zygote's own mount namespace)."""
    lowerdirs: tuple[Path, ...]
    """Read-only layers, top first: the scaffold of mount points, then the image root."""
    workspace: Path
    """Host directory bound writable on ``workdir``."""
    workdir: str
    support: Path
    """Host directory bound read-only on ``/.dsec`` (the call loader and cloudpickle)."""
    tmpfs_bytes: int
    """Size of each call's fresh ``/tmp``."""
    seccomp_bpf: bytes
    uid_shift: int
    uid_count: int
    cgroup_procs: tuple[str, ...]
    """``cgroup.procs`` files the zygote is moved into (each call then moves to a cgroup of its own)."""
    zygote_bpf: bytes = b""
    """The Python zygote's seccomp program (empty: it runs unfiltered)."""
    cpus: str = field(default_factory=lambda: hex_mask(sandbox_cpus()))
    """Hexadecimal mask of the CPUs each command gets, ``-`` to keep the zygote's (see :mod:`.affinity`)."""

    def argv(self) -> list[str]:
        for path in (*self.lowerdirs, self.newroot, self.workspace, self.support):
            text = str(path)
            # overlayfs splits lowerdir on ':' and options on ','; the C side uses fixed 4 KiB buffers.
            if any(c in text for c in ":,\\\n") or len(text) > 1024:
                raise SandboxError(f"path unusable for the sandbox root (no ':', ',', '\\\\', <= 1 KiB): {text!r}")
        return [str(self.binary), str(self.newroot), ":".join(str(p) for p in self.lowerdirs),
                str(self.workspace), self.workdir, str(self.support), str(self.tmpfs_bytes), self.cpus]


class Zygote:
    """One ``dsec-zygote`` process. :meth:`start` blocks (call it in a thread); :meth:`spawn` does not."""

    def __init__(self, config: ZygoteConfig) -> None:
        self.config = config
        self.pid: int | None = None
        self._sock: socket.socket | None = None

    def start(self) -> int:
        """Start the zygote, map its user namespace, move it into the cgroups; returns its pid."""
        cfg = self.config
        argv = cfg.argv()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bpf = os.memfd_create("dsec-seccomp", _MFD_CLOEXEC)
        zbpf = os.memfd_create("dsec-seccomp-zygote", _MFD_CLOEXEC)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(bpf, cfg.seccomp_bpf)
            os.write(zbpf, cfg.zygote_bpf)
            actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), 0), (os.POSIX_SPAWN_DUP2, null, 1),
                       (os.POSIX_SPAWN_DUP2, null, 2)]
            if cfg.seccomp_bpf:
                actions.append((os.POSIX_SPAWN_DUP2, bpf, 3))
            if cfg.zygote_bpf:
                actions.append((os.POSIX_SPAWN_DUP2, zbpf, 4))
            self.pid = os.posix_spawn(str(cfg.binary), argv, {}, file_actions=actions,
                                      setsigdef=(signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM))
        finally:
            theirs.close()
            os.close(bpf)
            os.close(zbpf)
            os.close(null)
        self._sock = ours
        try:
            ours.settimeout(_START_TIMEOUT_S)
            self._expect(b"userns")
            pid = self.pid
            # The zygote is host root until now: only we can map its namespace and place it in its cgroups.
            Path(f"/proc/{pid}/uid_map").write_text(f"0 {cfg.uid_shift} {cfg.uid_count}\n")
            Path(f"/proc/{pid}/gid_map").write_text(f"0 {cfg.uid_shift} {cfg.uid_count}\n")
            for procs in cfg.cgroup_procs:
                Path(procs).write_text(str(pid))
            ours.send(b"go")
            self._expect(b"ready")
            ours.settimeout(None)
        except BaseException:
            self.close()
            raise
        return pid

    def _expect(self, word: bytes) -> None:
        assert self._sock is not None
        try:
            msg = self._sock.recv(4096)
        except (TimeoutError, OSError) as e:
            raise SandboxError(f"function sandbox zygote did not start: {e}") from e
        if msg != word:
            text = msg.decode(errors="replace").removeprefix("error ") or "it exited"
            raise SandboxError(f"function sandbox zygote failed to start: {text}")

    def alive(self) -> bool:
        return self.pid is not None and self._sock is not None

    async def spawn(self, fields: list[str], cgroup_fds: Sequence[int] = (),
                    stdio: tuple[int | None, int | None, int | None] = (None, None, None)) -> Spawned:
        """Send one call (see ``zygote.c``) with the cgroup.procs files of its own cgroup; returns our ends of
        its pipes (``stdio``: see ``send_with_pipes``)."""
        if self._sock is None:
            raise SandboxError("the sandbox's zygote is gone (destroyed)")
        return await _send_call(self._sock, fields, cgroup_fds, "the sandbox's zygote", stdio)

    def start_python(self, argv: list[str], timeout: float = _PYTHON_START_TIMEOUT_S) -> PyZygote:
        """Have the zygote's launcher start a Python zygote running ``argv`` (blocks until it is ready; call it in
        a thread). :class:`InvalidRequest` when the image cannot run it (no such interpreter), SandboxError
        when it failed otherwise."""
        if self._sock is None:
            raise SandboxError("the sandbox's zygote is gone (destroyed)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            message = b"\0".join([b"python", *(a.encode() for a in argv)])
            self._sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno()]))])
            theirs.close()
            ours.settimeout(timeout)
            try:
                answer = ours.recv(4096)
            except (TimeoutError, OSError) as e:
                raise SandboxError(f"the sandbox's Python zygote did not start: {e}") from e
            text = answer.decode(errors="replace")
            if text.startswith("ready "):
                ours.settimeout(None)
                return PyZygote(ours, version=text.split()[1])
            reason = text.removeprefix("error ") or "it exited"
            if reason.startswith("cannot execute"):
                raise InvalidRequest(f"{reason}: the sandbox's image has no {argv[0]!r}", python=argv[0])
            raise SandboxError(f"the sandbox's Python zygote failed to start: {reason}")
        except BaseException:
            ours.close()
            theirs.close()
            raise

    def refresh(self) -> None:
        """Make the next call see the zygote's mount namespace as it is now (after the daemon mounted over a
        protected or hidden path there): the zygote replaces the call it cloned ahead of time."""
        if self._sock is None:
            raise SandboxError("the sandbox's zygote is gone (destroyed)")
        self._sock.send(b"refresh")

    def close(self) -> None:
        """Stop the zygote and reap it, and every call with it.

        Closing its socket tells the zygote to kill its calls (and the one it cloned ahead) and reap them;
        only one that does not manage within ``_EXIT_GRACE_S`` is killed. Its children are then the daemon's
        (a child subreaper: the calls' PDEATHSIG kills them, and the kernel hands them to us), reaped here:
        each left a zombie of the daemon for good before (one per destroyed sandbox at least)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        pid, self.pid = self.pid, None
        if pid is None or reap(pid, _EXIT_GRACE_S):
            return
        children = _children(pid)
        children += [g for c in children for g in _children(c)]  # the launcher's Python zygotes come to us too
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        adopted = reap(pid, 5.0)  # reaped: its children are ours already (or gone)
        for child in children:
            reap(child, 2.0, pending=not adopted)


class PyZygote:
    """One Python zygote (``pyzygote.py``) of a sandbox: :meth:`spawn` sends it a call."""

    def __init__(self, sock: socket.socket, version: str) -> None:
        self._sock: socket.socket | None = sock
        self.version = version
        """The image interpreter's ``major.minor``."""

    def alive(self) -> bool:
        """False once it was closed or drained, or its socket says it went away."""
        if self._sock is None:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def spawn(self, fields: list[str], cgroup_fds: Sequence[int] = ()) -> Spawned:
        """Send one call (see ``pyzygote.py``); returns our ends of its pipes."""
        if self._sock is None:
            raise SandboxError("the sandbox's Python zygote is gone")
        return await _send_call(self._sock, fields, cgroup_fds, "the sandbox's Python zygote")

    def drain(self) -> None:
        """Take no more calls; it exits when the running ones have ended (their view of the sandbox's mounts
        stays as it was). Our end is closed: it is done with."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(b"drain")
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Stop it now: it kills its calls (their pid namespace ends with it) and its launcher reaps it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def _send_call(sock: socket.socket, fields: list[str], cgroup_fds: Sequence[int], peer: str,
                     stdio: tuple[int | None, int | None, int | None] = (None, None, None)) -> Spawned:
    message = b"\0".join(f.encode() for f in fields)
    if len(message) > MAX_REQUEST:
        raise InvalidRequest(f"command and environment take {len(message)} bytes, over the function backend's "
                             f"limit of {MAX_REQUEST}: pass large inputs as stdin or through a file")
    return await send_with_pipes(sock, message, peer, extra_fds=cgroup_fds, stdio=stdio)


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (one thread: the zygote's)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
