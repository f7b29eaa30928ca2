"""The per-loop epoll of command pipes: callbacks per fd, handed over without re-registering, removed before
close, one failing callback not starving the others, on the default loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Callable

import pytest
import uvloop

from dsec.isolation import pipewatch
from dsec.isolation.pipewatch import pipe_watch


async def _exercise() -> None:
    loop = asyncio.get_running_loop()
    watch = pipe_watch()
    assert pipe_watch(loop) is watch
    (r1, w1), (r2, w2) = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC), os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    got: list[tuple[str, bytes]] = []
    both = loop.create_future()

    def reader(name: str, fd: int) -> None:
        data = os.read(fd, 100)
        got.append((name, data))
        if len(got) == 2 and not both.done():
            both.set_result(None)

    def broken() -> None:
        raise RuntimeError("boom")

    errors: list[object] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context.get("exception")))
    watch.add(r1, broken)
    watch.replace(r1, lambda: reader("one", r1))  # handed over: the same registration, another callback
    watch.add(r2, lambda: reader("two", r2))
    os.write(w1, b"a")
    os.write(w2, b"b")
    await asyncio.wait_for(both, 5)
    assert sorted(got) == [("one", b"a"), ("two", b"b")]

    # A failing callback is reported and the other fd is still served.
    watch.replace(r1, broken)
    os.write(w1, b"x")
    os.write(w2, b"c")
    for _ in range(100):
        if ("two", b"c") in got and errors:
            break
        await asyncio.sleep(0.01)
    assert ("two", b"c") in got and isinstance(errors[0], RuntimeError)

    # Removed, then closed: the number can come back for another pipe, which is watched afresh.
    watch.remove(r1)
    watch.remove(r1)  # twice is nothing
    for fd in (r1, w1):
        os.close(fd)
    r3, w3 = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    hung_up = loop.create_future()
    watch.add(r3, lambda: hung_up.done() or hung_up.set_result(os.read(r3, 10)))
    os.close(w3)  # end of file is readiness too
    assert await asyncio.wait_for(hung_up, 5) == b""
    for fd in (r3, r2, w2):
        watch.remove(fd)
        os.close(fd)


@pytest.mark.parametrize("make_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_pipe_watch(make_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    loop = make_loop()
    try:
        loop.run_until_complete(_exercise())
    finally:
        loop.close()


def _epoll_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # (the listing's own fd, closed by now)
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
    return count


@pytest.mark.parametrize("make_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_closed_loop_leaves_no_watch_behind(make_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """Every loop that ran a command once kept its watch, its epoll fd and itself (the watch held its loop, the
    loop's entry held the watch): a test run leaked an fd per test, and a daemon one per loop it ever ran."""
    gc.collect()
    before, watches = _epoll_fds(), len(pipewatch._watches)
    loop = make_loop()
    loop.run_until_complete(_exercise())
    assert len(pipewatch._watches) == watches + 1
    loop.close()
    del loop
    gc.collect()
    assert len(pipewatch._watches) == watches
    assert _epoll_fds() == before
