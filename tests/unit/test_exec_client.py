"""The daemon's side of an exec (``dsec.isolation.exec_client``) against a stand-in helper: real pipes and a real
process playing the command, the status lines written by the test (what ``dsec-nsexec`` or the zygote sends)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from dsec.backends.base import collect_exec
from dsec.errors import SandboxError
from dsec.isolation.exec_client import Spawned, send_with_pipes, stream_exec
from dsec.models import ExecRequest


class _Helper:
    """Our ends of one command's pipes (``spawned``) and the helper's ends (``status`` to report on)."""

    def __init__(self) -> None:
        ends = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
        for r, w in ends:
            os.set_blocking(r, False)
            os.set_blocking(w, False)
        stdin, stdout, stderr, status = ends
        self.spawned = Spawned(stdin=stdin[1], stdout=stdout[0], stderr=stderr[0], status=status[0])
        self.theirs = [stdin[0], stdout[1], stderr[1]]
        self.status = status[1]

    def report(self, line: str) -> None:
        os.write(self.status, line.encode() + b"\n")

    def hang_up(self) -> None:
        """The helper's ends close (it exited, or the command's status was reported and closed)."""
        for fd in [*self.theirs, self.status]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.theirs, self.status = [], -1


@pytest.fixture
def helper() -> Iterator[_Helper]:
    h = _Helper()
    yield h
    h.hang_up()


@pytest.fixture
def command() -> Iterator[subprocess.Popen[bytes]]:
    """The command: a session leader, as the helper starts it."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


async def test_a_call_closed_before_the_pid_line_is_read_still_kills_its_command(
        helper: _Helper, command: subprocess.Popen[bytes]) -> None:
    """The client hangs up between the helper starting the command and the daemon reading its pid: the "pid"
    line comes after the call is gone, and the command must still be killed (it ran on, with no timeout)."""
    call = asyncio.create_task(collect_exec(stream_exec(helper.spawned, ExecRequest(command=["sleep", "300"]))))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    helper.report(f"pid {command.pid}")
    for _ in range(200):
        if command.poll() is not None:
            break
        await asyncio.sleep(0.01)
    assert command.poll() == -9, "the command outlived its call"


async def test_a_function_call_closed_before_its_pid_hands_its_pipe_over_once_killed(
        helper: _Helper, command: subprocess.Popen[bytes]) -> None:
    """With ``status_to`` (a function call's slot waits for its pipe's end of file), the pipe has one reader at a
    time: the pid line is read, the command killed, then the pipe handed over (two readers could lose the line)."""
    handed: list[tuple[int, bool]] = []
    stream = stream_exec(helper.spawned, ExecRequest(command=["sleep", "300"]),
                         status_to=lambda fd, at_eof: handed.append((fd, at_eof)))
    call = asyncio.create_task(collect_exec(stream))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert handed == []  # not yet: the pid is still to be read
    helper.report(f"pid {command.pid}")
    for _ in range(200):
        if command.poll() is not None and handed:
            break
        await asyncio.sleep(0.01)
    assert command.poll() == -9, "the command outlived its call"
    assert len(handed) == 1 and handed[0][1] is False
    os.close(handed[0][0])


async def test_a_call_closed_before_anything_started_lets_go_of_the_pipe(helper: _Helper) -> None:
    """No command was started (the helper reports an error, or just hangs up): nothing is killed, and the
    daemon's end of the status pipe is closed at the helper's EOF."""
    status = helper.spawned.status
    call = asyncio.create_task(collect_exec(stream_exec(helper.spawned, ExecRequest(command=["true"]))))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    os.fstat(status)  # still ours: a "pid" line may come
    helper.hang_up()
    for _ in range(200):
        try:
            os.fstat(status)
        except OSError:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(OSError):
        os.fstat(status)


async def test_a_call_that_ends_normally_needs_no_watch_on_its_pipe(helper: _Helper) -> None:
    """The common path: pid, output, exit: the result, and every pipe of ours closed at the end."""
    call = asyncio.create_task(collect_exec(stream_exec(helper.spawned, ExecRequest(command=["echo", "hi"]))))
    helper.report("pid 12345")
    os.write(helper.theirs[1], b"hi\n")
    helper.report("exit 0")
    helper.hang_up()
    result = await asyncio.wait_for(call, 10)
    assert result.exit_code == 0 and result.stdout == b"hi\n", result
    for fd in (helper.spawned.stdout, helper.spawned.stderr, helper.spawned.status):
        with pytest.raises(OSError):
            os.fstat(fd)


async def test_a_peer_that_takes_no_request_holds_only_that_call() -> None:
    """A zygote that does not read (its sandbox starved of CPU) fills its socket's queue: the next request
    waits for room without blocking the event loop (every other sandbox's calls), then fails naming it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with pytest.raises(BlockingIOError):
            while True:  # fill the queue, as requests nobody reads do
                ours.send(b"x" * 1024, socket.MSG_DONTWAIT)
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.create_task(heartbeat())
        fds_before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(SandboxError, match=r"took no request for 0\.5 s"):
            await send_with_pipes(ours, b"request", "the sandbox's zygote", within=0.5)
        beat.cancel()
        assert ticks >= 20, f"the event loop was blocked: {ticks} ticks in 0.5 s"
        assert len(os.listdir("/proc/self/fd")) == fds_before, "the request's pipes leaked"
        # Several calls wait for the same socket (the node's exec helper is shared); as the peer reads, each one
        # gets through (one writer callback per fd: a second waiter replaced the first, which then timed out).
        waiting = [asyncio.create_task(send_with_pipes(ours, b"request", "the exec helper", within=10))
                   for _ in range(3)]
        await asyncio.sleep(0.2)
        theirs.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                theirs.recv(2048)
        for spawned in await asyncio.wait_for(asyncio.gather(*waiting), 10):
            spawned.close()
        # A socket closed by a destroy (in a worker thread) while a call waits fails that call at once.
        with pytest.raises(BlockingIOError):
            while True:
                ours.send(b"x" * 1024, socket.MSG_DONTWAIT)
        stuck = asyncio.create_task(send_with_pipes(ours, b"request", "the sandbox's zygote", within=10))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(ours.close)
        with pytest.raises(SandboxError, match="unreachable"):
            await asyncio.wait_for(stuck, 2)
    finally:
        ours.close()
        theirs.close()


async def test_an_exit_read_after_the_timeout_fired_is_not_a_timeout(
        helper: _Helper, command: subprocess.Popen[bytes]) -> None:
    """The command exits 0 just as its timeout fires: the timer's kill comes too late and the "exit 0" line is
    read after it. It was not killed, so the result names no limit (it said limit="time" with exit code 0)."""
    call = asyncio.create_task(collect_exec(stream_exec(helper.spawned,
                                                        ExecRequest(command=["true"], timeout=0.05))))
    helper.report(f"pid {command.pid}")
    await asyncio.sleep(0.3)  # the timer has fired
    helper.report("exit 0")
    helper.hang_up()
    result = await asyncio.wait_for(call, 10)
    assert result.exit_code == 0 and result.limit is None, result


async def test_a_late_pid_with_its_exit_kills_nothing(helper: _Helper, command: subprocess.Popen[bytes]) -> None:
    """The pid line comes after the call was closed, with the exit line right behind it: the command was reaped
    already, and its number may be another process's now. Nothing is killed."""
    call = asyncio.create_task(collect_exec(stream_exec(helper.spawned, ExecRequest(command=["true"]))))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    helper.report(f"pid {command.pid}\nexit 0")
    await asyncio.sleep(0.3)
    assert command.poll() is None, "a process was killed for a command that had exited"
