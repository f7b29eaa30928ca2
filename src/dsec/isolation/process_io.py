"""Processes that outlive their request, on the pipes the exec helper or a zygote hands back; terminals.

Owns :class:`PipeProcess` (a :class:`~dsec.backends.surface.ProcessIO` over a :class:`Spawned`: output read
as it comes and reported to the sink, input written without blocking the loop, signals through the host
pid, the exit from the status pipe) and the terminals such processes run in: :func:`sandbox_pty` opens one
in a sandbox's own devpts (``/dev/pts/ptmx`` resolved inside its root), :func:`host_pty` on the host's (a
function sandbox's calls have no devpts of their own). Nothing here decides how long a process is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import stat
import struct
import termios
from collections.abc import Awaitable, Callable

from dsec.backends.surface import ProcessIO, ProcessSink, ProcessSpec, Stream
from dsec.errors import InvalidRequest, SandboxError
from dsec.isolation.exec_client import Spawned

__all__ = ["PipeProcess", "host_pty", "ns_pid", "raw_mode", "sandbox_pty", "set_size", "spawn_process"]

_CHUNK = 64 * 1024
_DRAIN_AFTER_EXIT_S = 0.2
_TIOCSPTLCK = 0x40045431
_TIOCGPTPEER = 0x5441
_PTMX = (5, 2)
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set the window size of the terminal ``fd`` belongs to (SIGWINCH goes to its foreground group)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def raw_mode(fd: int) -> None:
    """No echo, no line editing, no signals from typed characters, no output processing: every byte written to
    the terminal reaches the program as it is (a shell session's commands), and interrupts are sent as signals."""
    attrs = termios.tcgetattr(fd)
    attrs[0] &= ~(termios.IGNBRK | termios.BRKINT | termios.PARMRK | termios.ISTRIP | termios.INLCR
                  | termios.IGNCR | termios.ICRNL | termios.IXON)
    attrs[1] &= ~termios.OPOST
    attrs[3] &= ~(termios.ECHO | termios.ECHONL | termios.ICANON | termios.ISIG | termios.IEXTEN)
    attrs[2] = (attrs[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
    attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, attrs)


def _pair(master: int, owner: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    try:
        fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        os.close(master)
        raise
    try:
        os.fchown(slave, *owner)  # what grantpt does: the terminal is its user's
        os.fchmod(slave, 0o620)
        set_size(master, *size)
    except OSError:
        os.close(master)
        os.close(slave)
        raise
    os.set_blocking(master, False)
    return master, slave


def sandbox_pty(root: str, owner: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    """``(master, slave)`` of a new terminal in the devpts of the sandbox whose root is the host path ``root``
    (``/proc/<init>/root``); the slave belongs to host ids ``owner``. Blocking."""
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW, 0, 0x10 | 0x02 | 0x04)
        master = int(_libc.syscall(_SYS_OPENAT2, rootfd, b"dev/pts/ptmx", ctypes.byref(how), ctypes.sizeof(how)))
        if master < 0:
            err = ctypes.get_errno()
            raise SandboxError(f"the sandbox has no terminal multiplexer (/dev/pts/ptmx): {os.strerror(err)}")
    finally:
        os.close(rootfd)
    st = os.fstat(master)
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != _PTMX:
        os.close(master)
        raise SandboxError("the sandbox's /dev/pts/ptmx is not a terminal multiplexer")
    return _pair(master, owner, size)


def host_pty(owner: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    """``(master, slave)`` of a new terminal of the host's devpts (for sandboxes without one of their own)."""
    master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    return _pair(master, owner, size)


Stdio = tuple[int | None, int | None, int | None]
"""What a spawned process gets as stdin, stdout and stderr (None: a pipe of the spawner's)."""


async def spawn_process(spawn: Callable[[Stdio], Awaitable[Spawned]], spec: ProcessSpec, sink: ProcessSink,
                        terminal: tuple[int, int] | None, **options: Callable[[int], int]) -> PipeProcess:
    """The :class:`PipeProcess` of what ``spawn`` starts for ``spec``: on ``terminal`` (``(master, slave)``, raw
    when only stdin is the terminal) or on pipes. The slave is closed once spawned, the master with the process
    (at once when spawning fails). Not yet started: the caller waits for it (:meth:`PipeProcess.wait_started`)."""
    master, slave = terminal if terminal is not None else (None, None)
    if slave is not None and spec.pty_stdin:
        raw_mode(slave)
    stdio: Stdio = (slave, None, None) if spec.pty_stdin else (slave, slave, slave)
    try:
        spawned = await spawn(stdio)
    except BaseException:
        if master is not None:
            os.close(master)
        raise
    finally:
        if slave is not None:
            os.close(slave)
    return PipeProcess(spawned, sink, master, pty_io=spec.pty is not None and not spec.pty_stdin,
                       timeout=spec.timeout, **options)


def ns_pid(host_pid: int) -> int:
    """The pid a host process has in its own (innermost) pid namespace."""
    with open(f"/proc/{host_pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return int(line.split()[-1])
    raise SandboxError(f"process {host_pid} has no pid namespace entry")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class PipeProcess(ProcessIO):
    """A process started by the exec helper or a zygote, read on the event loop.

    ``master`` is its terminal's master side (output stream ``pty``, input written there) when ``pty_io``;
    with a master but not ``pty_io`` (a shell session) only its stdin is the terminal."""

    def __init__(self, spawned: Spawned, sink: ProcessSink, master: int | None = None, pty_io: bool = False,
                 timeout: float | None = None, pid_of: Callable[[int], int] = ns_pid) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawned = spawned
        self._sink = sink
        self._master = master
        self._pid_of = pid_of
        self.streams: tuple[Stream, ...] = ("pty",) if pty_io else ("stdout", "stderr")
        self._reading: dict[int, Stream] = {}
        self._input: int = master if master is not None else spawned.stdin
        if pty_io and master is not None:
            self._reading[master] = "pty"
        else:
            self._reading.update({spawned.stdout: "stdout", spawned.stderr: "stderr"})
        self._status = b""
        self.host_pid: int | None = None
        self.pid = 0
        self._wstatus: int | None = None
        self._ended = False
        self._started: asyncio.Future[None] = self._loop.create_future()
        self._write_lock = asyncio.Lock()
        self._drain: asyncio.TimerHandle | None = None
        self._timer = self._loop.call_later(timeout, self._timed_out) if timeout else None
        self._loop.add_reader(spawned.status, self._on_status)
        for fd in self._reading:
            self._loop.add_reader(fd, self._on_output, fd)

    async def wait_started(self, within: float = 30.0) -> None:
        """Until the helper reported the pid (raises what kept it from starting)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._started), within)
        except TimeoutError:
            await self.aclose()
            raise SandboxError(f"the process did not start within {within:g} s") from None

    # -- reading -----------------------------------------------------------------------------------------

    def _on_status(self) -> None:
        fd = self._spawned.status
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._status += data
        while b"\n" in self._status:
            line, self._status = self._status.split(b"\n", 1)
            kind, _, value = line.decode(errors="replace").partition(" ")
            if kind == "pid" and self.host_pid is None:
                self.host_pid = int(value)
                with contextlib.suppress(OSError, SandboxError, ValueError):
                    self.pid = self._pid_of(self.host_pid)
                self.pid = self.pid or self.host_pid
                if not self._started.done():
                    self._started.set_result(None)
            elif kind == "exit" and self._wstatus is None:
                self._wstatus = int(value)
            elif kind == "error":
                self._report_error(value)
        if not data:
            self._loop.remove_reader(fd)
        if self._wstatus is not None and not self._reading:  # its output already ended: nothing to drain
            self._finish()
            return
        if (self._wstatus is not None or not data) and self._drain is None:
            self._drain = self._loop.call_later(_DRAIN_AFTER_EXIT_S, self._finish)

    def _report_error(self, what: str) -> None:
        if not self._started.done() and self.host_pid is None:
            error = InvalidRequest(what) if what.startswith("working directory") else SandboxError(
                f"could not start the process: {what}")
            self._started.set_exception(error)
            self._started.exception()
            return
        self._sink.output(self.streams[-1], f"dsec: {what}\n".encode())

    def _on_output(self, fd: int) -> None:
        stream = self._reading.get(fd)
        if stream is None:
            return
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: the terminal's last slave side closed
            data = b""
        if data:
            self._sink.output(stream, data)
            return
        self._loop.remove_reader(fd)
        del self._reading[fd]
        if not self._reading and self._wstatus is not None:
            self._finish()

    def _finish(self) -> None:
        if self._ended:
            return
        self._ended = True
        for fd in list(self._reading):
            self._loop.remove_reader(fd)
        self._reading.clear()
        if self._timer is not None:
            self._timer.cancel()
        if not self._started.done():
            self._started.set_exception(SandboxError("the process helper went away before starting it"))
            self._started.exception()
            self._release()
            return
        wstatus = self._wstatus
        if wstatus is None:
            code, sig = 255, None
            self._sink.output(self.streams[-1], b"dsec: the process's exit status was lost (its helper went "
                                                b"away)\n")
        elif os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            code = 128 + sig
        else:
            code, sig = os.waitstatus_to_exitcode(wstatus), None
        self._release()
        self._sink.exited(code, sig)

    def _timed_out(self) -> None:
        self._timer = None
        self.signal(signal.SIGKILL)

    # -- acting ------------------------------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        async with self._write_lock:
            fd = self._input
            if fd < 0 or self._ended:
                raise OSError(errno.EPIPE, "standard input is closed")
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    ready: asyncio.Future[None] = self._loop.create_future()
                    self._loop.add_writer(fd, _resolve, ready)
                    try:
                        await ready
                    finally:
                        self._loop.remove_writer(fd)
                    if self._input < 0:
                        raise OSError(errno.EPIPE, "standard input is closed") from None

    async def close_stdin(self) -> None:
        async with self._write_lock:
            if self._input < 0:
                return
            if self._input == self._master:
                with contextlib.suppress(OSError):
                    os.write(self._input, b"\x04")
                return
            os.close(self._input)
            self._input = self._spawned.stdin = -1

    def signal(self, signo: int, group: bool = True) -> None:
        if self.host_pid is None or self._ended:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.host_pid, signo)
            else:
                os.kill(self.host_pid, signo)

    async def signal_foreground(self, signo: int, include_self: bool = True) -> None:
        if self._master is None or self._ended or self.host_pid is None:
            if include_self:
                self.signal(signo)
            return
        with contextlib.suppress(OSError):
            group = os.tcgetpgrp(self._master)  # a host pid: the daemon is in the host's pid namespace
            if group > 0 and (include_self or group != self.host_pid):
                os.killpg(group, signo)

    async def resize(self, cols: int, rows: int) -> None:
        if self._master is None:
            raise InvalidRequest("this process has no terminal to resize")
        if not self._ended:
            set_size(self._master, cols, rows)

    async def aclose(self) -> None:
        if not self._ended:
            self.signal(signal.SIGKILL)
            self._ended = True
        for fd in list(self._reading):
            self._loop.remove_reader(fd)
        self._reading.clear()
        if self._timer is not None:
            self._timer.cancel()
        if self._drain is not None:
            self._drain.cancel()
        self._release()

    def _release(self) -> None:
        if not self._spawned.closed:  # once closed, its fd number may already be another connection's
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._spawned.status)
        self._input = -1
        self._spawned.close()
        if self._master is not None:
            with contextlib.suppress(OSError):
                os.close(self._master)
            self._master = None
