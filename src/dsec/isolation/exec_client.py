"""Daemon side of the exec helper: start it, hand it a command, stream what the command does.

:class:`ExecHelper` owns the helper process (:mod:`dsec.isolation.nsexec`) and the
socketpair to it. :func:`stream_exec` turns one spawned command into ``ExecEvent``s with
the limits every backend promises: wall-clock timeout, captured-output cap, kill on
close, and a verdict naming the limit that ended the command.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import BackendUnavailable, InvalidRequest, SandboxError
from dsec.isolation import nsexec
from dsec.models import ExecEvent, ExecRequest, ExecResult, LimitHit

__all__ = ["ExecHelper", "Spawned", "stream_exec"]

_CHUNK = 64 * 1024
# After the command exits, output still buffered in the pipes is read for this long; a
# background job that keeps the pipe open does not hold the call hostage.
_DRAIN_AFTER_EXIT_S = 0.2


@dataclass
class Spawned:
    """Our ends of a command's pipes."""

    stdin: int
    stdout: int
    stderr: int
    status: int
    pid: int | None = None
    closed: bool = field(default=False)

    def kill(self) -> None:
        """SIGKILL the command's process group (it is a session leader)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.stdin, self.stdout, self.stderr, self.status):
                with contextlib.suppress(OSError):
                    os.close(fd)


class ExecHelper:
    """One helper process per daemon; :meth:`spawn` is cheap (one message + one fork there)."""

    def __init__(self, seccomp_bpf: bytes, nsenter: Path) -> None:
        self._bpf = seccomp_bpf
        self._nsenter = nsenter
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                # Isolated mode, no site: the helper forks per command, so it must stay small (~8 MB).
                [sys.executable, "-I", "-S", nsexec.__file__, str(theirs.fileno()), str(self._nsenter)],
                stdin=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            raise BackendUnavailable(f"cannot start the exec helper: {e}") from e
        finally:
            theirs.close()
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._bpf)
        self._proc.stdin.close()
        self._sock = ours

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def spawn(self, request: dict[str, Any]) -> Spawned:
        """Ask the helper to run ``request`` (see :mod:`dsec.isolation.nsexec`); returns our pipe ends."""
        if self._proc is None or self._proc.poll() is not None:
            # The helper died (or was never started): one restart, then give up loudly.
            self.close()
            self.start()
        assert self._sock is not None
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(4)]
        stdin_r, stdin_w = pipes[0]
        theirs = [stdin_r, pipes[1][1], pipes[2][1], pipes[3][1]]
        ours = Spawned(stdin=stdin_w, stdout=pipes[1][0], stderr=pipes[2][0], status=pipes[3][0])
        try:
            self._sock.sendmsg([json.dumps(request).encode()],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs).tobytes())])
        except OSError as e:
            ours.close()
            raise SandboxError(f"exec helper unreachable: {e}") from e
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in (ours.stdin, ours.stdout, ours.stderr, ours.status):
            os.set_blocking(fd, False)
        return ours


class _Reader:
    """Non-blocking reads of several fds on the running loop, pushed into one queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[str, bytes]]) -> None:
        self.loop = loop
        self.queue = queue
        self.open: set[int] = set()

    def add(self, fd: int, name: str) -> None:
        self.open.add(fd)
        self.loop.add_reader(fd, self._ready, fd, name)

    def _ready(self, fd: int, name: str) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.remove(fd)
        self.queue.put_nowait((name, data))

    def remove(self, fd: int) -> None:
        if fd in self.open:
            self.open.discard(fd)
            self.loop.remove_reader(fd)

    def close(self) -> None:
        for fd in list(self.open):
            self.remove(fd)


async def _feed_stdin(fd: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(fd, ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(fd)
    except (BrokenPipeError, OSError):
        pass  # the command closed its stdin early; that is its business
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _decode_status(wstatus: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        return 128 + sig, sig
    return os.waitstatus_to_exitcode(wstatus), None


def _raise_or_shell_status(error: str, request: ExecRequest, captured: dict[str, bytearray]) -> None:
    """A command that cannot be found or executed ends as it would in a shell (127/126, the reason on
    stderr); a bad working directory is the caller's mistake; anything else is the sandbox's failure."""
    if error.startswith("working directory"):
        raise InvalidRequest(error, cwd=request.cwd)
    if error.startswith("cannot execute"):
        captured["stderr"] += f"dsec: {error}\n".encode()
        return
    raise SandboxError(f"could not start {request.argv()[0]!r} in the sandbox: {error}", argv=request.argv())


async def stream_exec(
    spawned: Spawned,
    request: ExecRequest,
    verdict: Callable[[int, int | None], LimitHit | None] | None = None,
) -> AsyncIterator[ExecEvent]:
    """Stream a spawned command to its end. ``verdict(exit_code, signal)`` names a cgroup limit hit."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    reader = _Reader(loop, queue)
    captured = {"stdout": bytearray(), "stderr": bytearray()}
    status_buf = b""
    wstatus: int | None = None
    limit: LimitHit | None = None
    truncated = False
    setup_error: str | None = None
    start = time.monotonic()
    deadline = start + request.timeout if request.timeout else None
    exited_at: float | None = None
    stdin_task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    armed_for: float | None = None
    try:
        # The status pipe first: the helper reports the command's pid before it can print anything.
        reader.add(spawned.status, "status")
        reader.add(spawned.stdout, "stdout")
        reader.add(spawned.stderr, "stderr")
        if request.stdin:
            stdin_task = asyncio.create_task(_feed_stdin(spawned.stdin, request.stdin))
        else:
            os.close(spawned.stdin)
        spawned.stdin = -1
        while True:
            if exited_at is not None and not ({spawned.stdout, spawned.stderr} & reader.open):
                break
            waits = [t for t in (deadline, exited_at and exited_at + _DRAIN_AFTER_EXIT_S) if t]
            wake = min(waits) if waits else None
            if wake != armed_for:
                # One timer re-armed only when the wake-up time changes: asyncio.wait_for would
                # create a task per event, a visible share of a 1 ms exec.
                if timer is not None:
                    timer.cancel()
                timer = None if wake is None else loop.call_later(
                    max(0.0, wake - time.monotonic()), queue.put_nowait, ("timer", b""))
                armed_for = wake
            name, data = await queue.get()
            if name == "timer":
                armed_for = None
                timer = None
                if exited_at is not None and time.monotonic() >= exited_at + _DRAIN_AFTER_EXIT_S:
                    break  # drained long enough; background writers keep the pipe, not us
                if deadline is not None and time.monotonic() >= deadline:
                    limit = "time"
                    spawned.kill()
                    deadline = None
                continue
            if name == "status":
                status_buf += data
                while b"\n" in status_buf:
                    line, status_buf = status_buf.split(b"\n", 1)
                    kind, _, value = line.decode(errors="replace").partition(" ")
                    if kind == "pid":
                        spawned.pid = int(value)
                        if limit is not None:
                            spawned.kill()
                    elif kind == "exit":
                        wstatus = int(value)
                        exited_at = time.monotonic()
                    elif kind == "error":
                        setup_error = value
                if not data and wstatus is None:
                    exited_at = exited_at or time.monotonic()
                continue
            if not data:
                continue
            room = request.max_output - len(captured[name])
            if len(data) > room:
                data = data[: max(room, 0)]
                truncated = True
                if limit is None:
                    limit = "output"
                spawned.kill()
            if data:
                captured[name] += data
                yield ExecEvent(type=name, data=bytes(data))
        if setup_error is not None:
            _raise_or_shell_status(setup_error, request, captured)
        if wstatus is None:
            # The helper went away without a verdict: any exit code we made up would be a lie.
            what = "before starting" if spawned.pid is None else "while running"
            raise SandboxError(f"the exec helper died {what} {request.argv()[0]!r}; its exit status is lost")
        exit_code, sig = _decode_status(wstatus)
        if limit is None and verdict is not None:
            limit = verdict(exit_code, sig)
        result = ExecResult(
            exit_code=exit_code,
            stdout=bytes(captured["stdout"]),
            stderr=bytes(captured["stderr"]),
            duration_s=round(time.monotonic() - start, 6),
            truncated=truncated,
            signal=sig,
            limit=limit,
        )
        yield ExecEvent(type="exit", result=result)
    finally:
        if wstatus is None:
            spawned.kill()  # closed early (client gone, caller cancelled): the command must not run on
        reader.close()
        if timer is not None:
            timer.cancel()
        if stdin_task is not None and not stdin_task.done():
            stdin_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stdin_task
        spawned.close()
