"""The fake backend's processes: host subprocesses (on a host terminal when asked) as a
:class:`~dsec.backends.surface.ProcessIO`, so the SDK, the daemon and the conformance kit can drive process
handles, terminals and shell sessions without any isolation. Tests only: nothing here confines anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import termios

from dsec.backends.surface import ProcessIO, ProcessSink, ProcessSpec, Stream
from dsec.isolation.process_io import raw_mode, set_size

__all__ = ["FakeProcess"]

_CHUNK = 64 * 1024


class FakeProcess(ProcessIO):
    """One host process in its own session; output read on the event loop."""

    def __init__(self, spec: ProcessSpec, cwd: str, env: dict[str, str], sink: ProcessSink) -> None:
        self._loop = asyncio.get_running_loop()
        self._sink = sink
        self._master: int | None = None
        slave = None
        if spec.pty is not None:
            self._master, slave = os.openpty()
            set_size(self._master, *spec.pty)
            if spec.pty_stdin:
                raw_mode(slave)
        pty_io = spec.pty is not None and not spec.pty_stdin
        self.streams: tuple[Stream, ...] = ("pty",) if pty_io else ("stdout", "stderr")

        def controlling_terminal() -> None:
            if slave is not None:
                fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self._proc = subprocess.Popen(
            spec.argv, cwd=cwd, env=env, start_new_session=True, preexec_fn=controlling_terminal,
            stdin=slave if slave is not None else subprocess.PIPE,
            stdout=slave if pty_io else subprocess.PIPE, stderr=slave if pty_io else subprocess.PIPE)
        if slave is not None:
            os.close(slave)
        self.pid = self._proc.pid
        self._input = self._master if self._master is not None else self._proc.stdin.fileno()  # type: ignore[union-attr]
        os.set_blocking(self._input, False)
        self._reading: dict[int, Stream] = {}
        if pty_io and self._master is not None:
            self._reading[self._master] = "pty"
        else:
            assert self._proc.stdout is not None and self._proc.stderr is not None
            self._reading = {self._proc.stdout.fileno(): "stdout", self._proc.stderr.fileno(): "stderr"}
        for fd in self._reading:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._ready, fd)
        self._waiter = self._loop.create_task(self._wait(spec.timeout))

    def _ready(self, fd: int) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._sink.output(self._reading[fd], data)
            return
        self._loop.remove_reader(fd)
        del self._reading[fd]

    async def _wait(self, timeout: float | None) -> None:
        try:
            code = await asyncio.wait_for(asyncio.to_thread(self._proc.wait), timeout)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            code = await asyncio.to_thread(self._proc.wait)
        for _ in range(20):  # what it wrote before it ended
            if not self._reading:
                break
            await asyncio.sleep(0.01)
        for fd in list(self._reading):
            self._loop.remove_reader(fd)
        self._reading.clear()
        self._close_input()
        self._sink.exited(128 - code if code < 0 else code, -code if code < 0 else None)

    async def write(self, data: bytes) -> None:
        if self._input < 0 or self._proc.returncode is not None:
            raise OSError(errno.EPIPE, "standard input is closed")
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._input, view):]
            except BlockingIOError:
                await asyncio.sleep(0.01)

    async def close_stdin(self) -> None:
        if self._input == self._master and self._master is not None:
            with contextlib.suppress(OSError):
                os.write(self._master, b"\x04")
            return
        self._close_input()

    def _close_input(self) -> None:
        if self._input >= 0 and self._input != self._master and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # (its file object owns the fd: closed once, here)
        self._input = -1

    def signal(self, signo: int, group: bool = True) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                (os.killpg if group else os.kill)(self.pid, signo)

    async def signal_foreground(self, signo: int, include_self: bool = True) -> None:
        if self._master is None:
            if include_self:
                self.signal(signo)
            return
        with contextlib.suppress(OSError):
            group = os.tcgetpgrp(self._master)
            if group > 0 and (include_self or group != self.pid):
                os.killpg(group, signo)

    async def resize(self, cols: int, rows: int) -> None:
        if self._master is None:
            raise OSError(errno.ENOTTY, "no terminal")
        set_size(self._master, cols, rows)

    async def aclose(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(asyncio.CancelledError):
            await self._waiter
        if self._master is not None:
            with contextlib.suppress(OSError):
                os.close(self._master)
            self._master = None
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()
