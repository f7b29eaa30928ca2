"""The SDK's surface (process handles, terminals, shell sessions, file operations and watches, ports) against a
real daemon app (engine + FakeBackend over a unix socket), async and blocking."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from conftest import missing


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("home")) as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[dsec.Client]:
    async with dsec.Client(url=daemon.unix_url) as c:
        yield c


@pytest.fixture
async def sb(client: dsec.Client) -> AsyncIterator[dsec.AsyncSandbox]:
    async with await dsec.AsyncSandbox.create(image="tiny", client=client) as box:
        yield box


async def test_background_process_is_found_again_by_another_client(sb: dsec.AsyncSandbox, daemon: Daemon) -> None:
    proc = await sb.exec("echo ready; read x; echo got $x; exit 5", background=True)
    assert isinstance(proc, dsec.AsyncProcess) and proc.pid > 0
    async with dsec.Client(url=daemon.unix_url) as other:
        again = await (await dsec.AsyncSandbox.connect(sb.id, client=other)).processes.connect(proc.pid)
        assert [p.pid for p in await again._sandbox.processes.list()] == [proc.pid]
        await again.send_stdin("it\n")
        result = await again.result(timeout=20)
    assert (result.exit_code, result.stdout) == (5, b"ready\ngot it\n"), result
    chunks = [c async for c in proc.stdout()]
    assert b"".join(chunks) == b"ready\ngot it\n"
    with pytest.raises(dsec.ProcessNotFound):
        await sb.processes.connect(1 << 30)
    with pytest.raises(dsec.InvalidRequest, match="has ended"):
        await proc.send_stdin("late")


async def test_kill_and_close_stdin(sb: dsec.AsyncSandbox) -> None:
    cat = await sb.processes.start(["cat"], tag="cat")
    await cat.send_stdin(b"abc")
    await cat.close_stdin()
    assert (await cat.result(timeout=20)).stdout == b"abc"
    sleeper = await sb.exec(["sleep", "100"], background=True)
    await sleeper.kill(15)
    info = await sleeper.wait(timeout=20)
    assert (info.running, info.exit_code, info.signal) == (False, 143, 15), info


async def test_terminal(sb: dsec.AsyncSandbox) -> None:
    term = await sb.pty(cols=100, rows=30, command="stty size; read line; stty size; echo \"<$line>\"")
    seen = b""
    async for chunk in term.stdout():
        seen += chunk
        if b"30 100" in seen:
            break
    await term.resize(120, 40)
    await term.send_stdin("typed\n")
    out = (await term.result(timeout=20)).stdout
    assert b"40 120" in out and b"<typed>" in out, out


async def _screen_until(term: dsec.AsyncProcess, wanted: list[bytes], seen: bytes = b"") -> bytes:
    async with asyncio.timeout(20):
        async for chunk in term.stdout():
            seen += chunk
            if all(w in seen for w in wanted):
                return seen
    raise AssertionError(f"the terminal never showed {wanted}: {seen[-2000:]!r}")


async def test_a_terminal_runs_tmux_and_shows_its_screen(sb: dsec.AsyncSandbox) -> None:
    if shutil.which("tmux") is None:  # the fake backend's sandboxes run the host's programs
        missing("tmux is not installed (./scripts/setup installs it)")
    socket_path = f"/tmp/dsec-tmux-{sb.id}"  # the server forks away from the terminal: ended by name below
    tmux = ["tmux", "-f", "/dev/null", "-S", socket_path]
    term = await sb.pty(cols=100, rows=30, command=[*tmux, "new-session", "-s", "main"], env={"TERM": "xterm"})
    try:
        screen = await _screen_until(term, [b"[main]"])  # the status line: tmux drew its screen
        await term.send_stdin("echo $((6*7))-done\r")
        await _screen_until(term, [b"42-done"], screen)
        await term.resize(120, 40)
        await term.send_stdin("tmux display -p '#{window_width}x#{window_height}'\r")
        await _screen_until(term, [b"120x39"])  # the window: the terminal less tmux's status line
    finally:
        await sb.exec([*tmux, "kill-server"])
        Path(socket_path).unlink(missing_ok=True)  # a killed server leaves its socket
    assert (await term.wait(timeout=20)).running is False


async def test_shell_session(sb: dsec.AsyncSandbox) -> None:
    async with await sb.shell() as shell:
        await shell.run("cd /tmp; f() { echo f$1; }; export V=9")
        r = await shell.run("pwd; f 2; echo $V")
        assert r.stdout == b"/tmp\nf2\n9\n" and r.ok, r
        r = await shell.run("sleep 30", timeout=0.5)
        assert r.timed_out and not r.ok, r
        assert (await shell.run("echo $V")).stdout == b"9\n"


async def test_files_surface_and_structured_errors(sb: dsec.AsyncSandbox) -> None:
    files = sb.files
    made = await files.mkdir("a/b", parents=True)
    assert made.path == "/workspace/a/b" and made.permissions == "drwxr-xr-x"
    await files.write("a/f.txt", "hi")
    assert await files.exists("a/f.txt") and not await files.exists("a/none")
    stat = await files.stat("a/f.txt")
    assert (stat.size, stat.type, stat.mode) == (2, "file", 0o644), stat
    assert (await files.chmod("a/f.txt", 0o600)).mode == 0o600
    moved = await files.rename("a/f.txt", "g.txt")
    assert moved.path == "/workspace/g.txt" and await files.read("g.txt") == b"hi"
    with pytest.raises(FileNotFoundError) as missing:
        await files.read("a/f.txt")
    assert missing.value.errno == 2 and isinstance(missing.value, dsec.FileNotFound)
    with pytest.raises(IsADirectoryError):
        await files.read("a")
    with pytest.raises(FileExistsError):
        await files.mkdir("a")
    with pytest.raises(dsec.DirectoryNotEmpty):
        await files.remove("a")
    await files.remove("a", recursive=True)
    assert [e.name for e in await files.list()] == ["g.txt"]
    with pytest.raises(dsec.NotSupported, match="one host user"):  # the fake backend acts as one user only
        await files.read("g.txt", user="1000")
    with pytest.raises(dsec.InvalidRequest, match="user"):
        await files.read("g.txt", user="bad user")


async def test_watch_streams_events_in_order(sb: dsec.AsyncSandbox) -> None:
    seen: list[tuple[str, str]] = []
    async with await sb.files.watch("/workspace", recursive=True) as watch:  # recording from here on
        await sb.files.write("w.txt", "1")
        await sb.files.rename("w.txt", "v.txt")
        await sb.files.remove("v.txt")

        async def read() -> None:
            async for event in watch:
                seen.append((event.type, event.path.rsplit("/", 1)[-1]))
                if event.type == "delete":
                    return

        await asyncio.wait_for(read(), 20)
        assert seen[0] == ("create", "w.txt") and ("move", "w.txt") in seen and seen[-1] == ("delete", "v.txt"), seen
        again = [e.type async for e in watch.events(since=0, follow=False)]  # read again from the start
        assert again[0] == "create" and again[-1] == "delete", again
        assert [e.type async for e in watch.events(follow=False)] == []  # nothing new since the last read


async def test_expose_get_url_and_tcp(sb: dsec.AsyncSandbox) -> None:
    # The kernel picks the server's port (one picked here and let go could be taken meanwhile, by the exposure's
    # own listener among others: the fake backend's sandboxes share the host's loopback); the server says it.
    server = await sb.exec(["python3", "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"], background=True)
    said = b""
    async for chunk in server.stdout():
        said += chunk
        if found := re.search(rb"port (\d+)", said):
            break
    assert found, said
    port = int(found[1])
    url = await sb.get_url(port)
    async with httpx.AsyncClient() as http:
        r = await http.get(url + "/", headers=(await sb.ports())[0].headers)
        assert r.status_code == 200 and "Directory listing" in r.text, r.text
        assert (await http.get(url + "/")).status_code == 401
    sock = await sb.connect_port(port)
    try:
        await asyncio.to_thread(sock.sendall, b"GET / HTTP/1.0\r\n\r\n")
        head = await asyncio.to_thread(sock.recv, 100)
        assert head.startswith(b"HTTP/1.0 200"), head
    finally:
        sock.close()
    await sb.unexpose(port)
    assert await sb.ports() == []
    await server.kill()


def test_the_blocking_api(daemon: Daemon) -> None:
    with dsec.Client(url=daemon.unix_url) as client, dsec.Sandbox.create(image="tiny", client=client) as box:
        proc = box.exec("echo sync", background=True)
        assert isinstance(proc, dsec.Process) and proc.result(timeout=20).stdout == b"sync\n"
        assert [p.pid for p in box.processes.list()] == [proc.pid]
        with box.shell() as shell:
            assert shell.run("echo $((1+2))").stdout == b"3\n"
        box.files.mkdir("x")
        assert box.files.stat("x").type == "dir"
        with box.files.watch("x") as watch:
            assert isinstance(watch, dsec.Watch)
            box.files.write("x/y", "1")  # before the first read: recorded all the same
            assert next(iter(watch)).type == "create"
