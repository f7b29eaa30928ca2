"""The node API conformance checks of the sandbox surface: file operations and watches, process handles and
terminals, shell sessions, exposed ports (part of :data:`dsec.testing.node_api.NODE_CHECKS`).

Same rules as :mod:`dsec.testing.node_api`: only the protocol, the same checks on the engine, a daemon and a
gateway, nothing left behind. The backend behind ``image`` runs commands as root (the fake backend does),
so users are the backend conformance kit's to check (:mod:`dsec.testing.conformance_surface`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator

import httpx

from dsec.api.protocol import NodeAPI
from dsec.errors import DirectoryNotEmpty, FileNotFound, NotFound, ProcessNotFound
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models_surface import (
    ExposeRequest,
    MkdirRequest,
    ProcessRequest,
    PtySize,
    RenameRequest,
    ShellRequest,
    ShellRunRequest,
    WatchRequest,
)

__all__ = ["SURFACE_NODE_CHECKS"]

_WAIT = 20.0


@contextlib.asynccontextmanager
async def _sandbox(api: NodeAPI, image: str) -> AsyncIterator[SandboxInfo]:
    info = await api.create(SandboxSpec(image=image))
    try:
        yield info
    finally:
        await api.destroy(info.id)


async def check_file_operations(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        made = await api.make_dir(sb.id, MkdirRequest(path="d/e", parents=True, mode=0o750))
        assert (made.path, made.type, made.mode) == ("/workspace/d/e", "dir", 0o750), made
        await api.write_file(sb.id, "d/f", b"xyz")  # relative to the workdir
        stat = await api.stat_file(sb.id, "/workspace/d/f")
        assert (stat.name, stat.size, stat.type, stat.uid) == ("f", 3, "file", 0), stat
        moved = await api.rename_file(sb.id, RenameRequest(source="d/f", destination="g"))
        assert moved.path == "/workspace/g", moved
        assert (await api.chmod_file(sb.id, "g", 0o600)).mode == 0o600
        assert (await api.chown_file(sb.id, "g", "0:0")).uid == 0
        with _raises(FileNotFound, "nope"):
            await api.stat_file(sb.id, "nope")
        with _raises(DirectoryNotEmpty):
            await api.remove_file(sb.id, "d")
        await api.remove_file(sb.id, "d", recursive=True)
        assert [e.name for e in await api.list_files(sb.id, "/workspace")] == ["g"]


async def check_file_watch(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        watch = await api.watch_files(sb.id, WatchRequest(path="/workspace", recursive=True))
        assert [w.id for w in await api.list_watches(sb.id)] == [watch.id]
        await api.write_file(sb.id, "seen", b"1")
        deadline = time.monotonic() + _WAIT
        seen: list[tuple[int, str, str]] = []
        while not any(kind == "create" for _, kind, _ in seen) and time.monotonic() < deadline:
            seen = [(e.number, e.type, e.path) async for e in api.watch_events(sb.id, watch.id, follow=False)]
            await asyncio.sleep(0.05)
        assert seen and seen[0][1:] == ("create", "/workspace/seen"), seen
        later = [e.number async for e in api.watch_events(sb.id, watch.id, since=seen[-1][0] + 1, follow=False)]
        assert all(n > seen[-1][0] for n in later), later
        await api.unwatch(sb.id, watch.id)
        with _raises(ProcessNotFound):
            await api.unwatch(sb.id, watch.id)


async def check_processes(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        cat = await api.start_process(sb.id, ProcessRequest(command=["cat"], tag="echo"))
        assert cat.running and cat.tag == "echo" and cat.stdin_open, cat
        await api.send_stdin(sb.id, cat.pid, b"round trip")
        await api.close_stdin(sb.id, cat.pid)
        done = await api.wait_process(sb.id, cat.pid, timeout=_WAIT)
        assert (done.running, done.exit_code) == (False, 0), done
        events = [e async for e in api.process_output(sb.id, cat.pid)]
        assert b"".join(e.data or b"" for e in events if e.type == "stdout") == b"round trip", events
        assert events[-1].type == "exit" and events[-1].exit_code == 0, events
        tail = [e async for e in api.process_output(sb.id, cat.pid, stdout=6)]
        assert b"".join(e.data or b"" for e in tail if e.type == "stdout") == b"trip", tail
        sleeper = await api.start_process(sb.id, ProcessRequest(command=["sleep", "100"]))
        assert {p.pid for p in await api.list_processes(sb.id)} == {cat.pid, sleeper.pid}
        await api.signal_process(sb.id, sleeper.pid, 9)
        killed = await api.wait_process(sb.id, sleeper.pid, timeout=_WAIT)
        assert (killed.exit_code, killed.signal) == (137, 9), killed
        assert (await api.get_process(sb.id, sleeper.pid)).running is False
        with _raises(ProcessNotFound):
            await api.get_process(sb.id, 1 << 30)
        term = await api.start_process(sb.id, ProcessRequest(command="read x; stty size",
                                                             pty=PtySize(cols=90, rows=30)))
        await api.resize_process(sb.id, term.pid, PtySize(cols=100, rows=40))
        await api.send_stdin(sb.id, term.pid, b"\n")
        assert (await api.wait_process(sb.id, term.pid, timeout=_WAIT)).exit_code == 0
        out = b"".join([e.data or b"" async for e in api.process_output(sb.id, term.pid) if e.type == "pty"])
        assert b"40 100" in out, out


async def check_shell_sessions(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        shell = await api.start_shell(sb.id, ShellRequest())
        assert [s.id for s in await api.list_shells(sb.id)] == [shell.id]
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="cd /tmp && export X=7"))
        assert r.exit_code == 0, r
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="pwd; echo $X; echo e >&2; (exit 3)"))
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"/tmp\n7\n", b"e\n"), r
        await api.close_shell(sb.id, shell.id)
        assert await api.list_shells(sb.id) == []


async def check_ports(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        with socket.socket() as probe:  # a port nothing listens on, in the sandbox too
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        exposed = await api.expose_port(sb.id, ExposeRequest(port=port))
        assert exposed.protocol == "http" and exposed.url and exposed.token, exposed
        assert await api.list_ports(sb.id) == [exposed] and await api.get_port(sb.id, port) == exposed
        async with httpx.AsyncClient() as client:
            refused = await client.get(exposed.url)
            assert refused.status_code == 401, refused.text
            gone = await client.get(exposed.url, headers=exposed.headers)
            assert gone.status_code == 502 and f"port {port}" in gone.text, gone.text
        await api.unexpose_port(sb.id, port)
        with _raises(NotFound):
            await api.get_port(sb.id, port)


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except kind as exc:
        assert match is None or match in str(exc), f"{kind.__name__} says {exc!s}, not {match!r}"
        return
    raise AssertionError(f"no {kind.__name__} was raised")


SURFACE_NODE_CHECKS = (check_file_operations, check_file_watch, check_processes, check_shell_sessions, check_ports)
"""The surface's checks, in the order of their operations in :class:`NodeAPI`."""
