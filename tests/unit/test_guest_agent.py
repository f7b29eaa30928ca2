"""The guest agent's protocol end to end without a VM: the static ``dsec-agent`` runs on the host as pid 1 of its own
pid, mount, cgroup and uts namespaces, with a raw pty as its port, and the host's :class:`AgentClient` drives it.

What only a guest has (CONFINE, IDENTITY, SHUTDOWN, the commands' memory cgroup) is tested by the microvm and vm
backend tests; this covers the frames, channels, commands, terminals and file operations in seconds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import tty
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.errors import FileNotFound, InvalidRequest, IsADirectory, PermissionDenied
from dsec.guest.initramfs import ensure_agent
from dsec.guest.protocol import OUTPUT_WINDOW, STDIN_WINDOW, AgentClient, T, creds, parse_exit
from dsec.guest.surface import AgentPort

pytestmark = [pytest.mark.root]

ROOT = creds(0, 0, ())


@pytest.fixture
async def started(tmp_path: Path) -> AsyncIterator[tuple[AgentClient, int]]:
    """A connected client and the pid of the ``unshare`` above the agent."""
    binary = ensure_agent(tmp_path / "bin")  # (a copy of the node's build when there is one)
    master, slave = pty.openpty()
    tty.setraw(slave)
    # Its own pid namespace above all: the agent powers off "the guest" in some failures, which there only
    # ends the namespace. --kill-child: it goes with unshare if the test dies (the agent's setfsuid clears that
    # death signal, so it is also killed by its pid below).
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--cgroup", "--uts",
                             "--mount", str(binary), os.ttyname(slave)], stdin=subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    read_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                     os.fdopen(master, "rb", buffering=0))
    write_transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), os.fdopen(os.dup(master), "wb", buffering=0))
    client = AgentClient(reader, asyncio.StreamWriter(write_transport, protocol, None, loop))
    try:
        await client.wait_ready(30)
        yield client, proc.pid
    finally:
        await client.aclose()
        read_transport.close()
        with contextlib.suppress(OSError):
            for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
        try:
            proc.wait(timeout=10)  # unshare reaps the agent, then exits
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(slave)


@pytest.fixture
def agent(started: tuple[AgentClient, int]) -> AgentClient:
    return started[0]


def agent_peak_rss(unshare_pid: int) -> int:
    """The agent's peak resident memory (VmHWM), in bytes."""
    [pid] = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


async def run(agent: AgentClient, argv: list[str], stdin: bytes | None = None, cwd: str = "/"
              ) -> tuple[bytes, bytes, tuple[int, int | None, bool]]:
    channel = await agent.start_exec(argv, {"PATH": "/usr/bin:/bin"}, cwd)
    if stdin is not None:
        await agent.stdin(channel, stdin)
        await agent.send(T.STDIN, channel, b"")  # the end of its input
    return await outcome(agent, channel)


async def outcome(agent: AgentClient, channel: int) -> tuple[bytes, bytes, tuple[int, int | None, bool]]:
    """A started command's stdout, stderr and exit."""
    out, err = b"", b""
    while True:
        frame = await agent.next_frame(channel, 30)
        if frame.type == T.STDOUT:
            out += frame.payload
        elif frame.type == T.STDERR:
            err += frame.payload
        elif frame.type == T.EXIT:
            agent.close_channel(channel)
            return out, err, parse_exit(frame.payload)
        else:
            raise AssertionError(f"unexpected frame {frame}")


async def test_commands_run_with_their_output_stdin_and_status(agent: AgentClient, tmp_path: Path) -> None:
    await agent.ping()
    out, err, (code, signo, _) = await run(agent, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (out, err, code, signo) == (b"out\n", b"err\n", 3, None)
    out, _, (code, _, _) = await run(agent, ["cat"], stdin=b"x" * 300_000)  # more than a pty's buffer
    assert (len(out), code) == (300_000, 0)
    out, _, _ = await run(agent, ["pwd"], cwd=str(tmp_path))
    assert out == f"{tmp_path}\n".encode()
    _, err, (code, _, _) = await run(agent, ["/nonexistent"])
    assert code == 127 and b"cannot run /nonexistent" in err


async def test_stdin_streams_through_a_window_of_credit(started: tuple[AgentClient, int]) -> None:
    """Any amount of stdin streams through with bounded memory: the agent credits what the command took and the
    host keeps to its window, so a reader that starts late (which an agent buffering 8 MiB refused with ENOBUFS)
    or never reads holds the writer instead of failing or hanging it."""
    agent, unshare_pid = started
    assert agent.credits  # announced in READY (and in PING's reply)
    agent.features = 0
    await agent.ping()
    pass
    out, err, (code, _, _) = await run(agent, ["wc", "-c"], stdin=b"x" * (64 << 20))
    assert (out.strip(), err, code) == (b"67108864", b"", 0)
    out, err, (code, _, _) = await run(agent, ["sh", "-c", "sleep 2; wc -c"], stdin=b"y" * (24 << 20))
    assert (out.strip(), err, code) == (b"25165824", b"", 0)
    # the agent held at most the window besides its frame buffer (2 MiB) and itself: its 8 MiB limit was never near
    assert agent_peak_rss(unshare_pid) < STDIN_WINDOW + (4 << 20)
    out, _, (code, _, _) = await run(agent, ["head", "-c", "5"], stdin=b"0123456789" * (1 << 20))
    assert (out, code) == (b"01234", 0)  # it stopped reading: the rest is dropped and credited
    out, _, (code, _, _) = await run(agent, ["true"], stdin=b"z" * (16 << 20))
    assert (out, code) == (b"", 0)  # it never read: its exit ends the window
    # the end of its stdin comes after what a write still waiting for credit sends
    channel = await agent.start_exec(["sh", "-c", "sleep 1; wc -c"], {"PATH": "/usr/bin:/bin"}, "/")
    writing = asyncio.create_task(agent.stdin(channel, b"w" * (8 << 20)))
    await asyncio.sleep(0.1)
    await agent.end_stdin(channel)
    assert await writing
    out, _, (code, _, _) = await outcome(agent, channel)
    assert (out.strip(), code) == (b"8388608", 0)


async def test_output_waits_for_the_hosts_credit(started: tuple[AgentClient, int]) -> None:
    """A command writing far more than the window to a consumer that does not read: the host queues at most the
    window (the agent stops reading the pipe), other channels keep working meanwhile, and reading it all gives
    every byte in order, then the exit; one that exits with its window full still has all of its output sent."""
    agent, unshare_pid = started
    assert agent.output_credits
    count = 8_000_000  # 63 MB of `seq`
    channel = await agent.start_exec(["seq", "1", str(count)], {"PATH": "/usr/bin:/bin"}, "/")
    await asyncio.sleep(1.5)
    assert agent.queued(channel) == OUTPUT_WINDOW  # stalled at the window
    out, _, (code, _, _) = await run(agent, ["echo", "meanwhile"])  # the port is not blocked for the others
    assert (out, code) == (b"meanwhile\n", 0)
    await agent.ping()
    got, held = bytearray(), 0
    while (frame := await agent.next_frame(channel, 30)).type == T.STDOUT:
        got += frame.payload
        held = max(held, agent.queued(channel))
    assert frame.type == T.EXIT and parse_exit(frame.payload)[0] == 0
    agent.close_channel(channel)
    assert held <= OUTPUT_WINDOW
    assert got == "".join(f"{i}\n" for i in range(1, count + 1)).encode()
    assert agent_peak_rss(unshare_pid) < 8 << 20  # the agent buffered nothing either
    # exits with its window full and the rest in the pipe (1 MiB + 64 KiB fit): the drain waits for credit
    channel = await agent.start_exec(["sh", "-c", "head -c 1100000 /dev/zero; exit 7"], {"PATH": "/usr/bin:/bin"}, "/")
    await asyncio.sleep(1.5)
    out, _, (code, _, _) = await outcome(agent, channel)
    assert (len(out), code) == (1_100_000, 7)
    # given up before its end (and not killed): released, so the agent sends the rest (dropped here) and the
    # command ends instead of waiting on its pipe for credit that never comes
    channel = await agent.start_exec(["head", "-c", str(8 << 20), "/dev/zero"], {"PATH": "/usr/bin:/bin"}, "/")
    await asyncio.sleep(1)
    assert agent.queued(channel) == OUTPUT_WINDOW
    agent.close_channel(channel)
    for _ in range(100):
        out, _, _ = await run(agent, ["sh", "-c", "pgrep -x head || true"])
        if not out:
            break
        await asyncio.sleep(0.1)
    assert out == b""


async def test_a_connection_to_a_fast_server_waits_for_the_hosts_credit(agent: AgentClient) -> None:
    """A server sending far more than the window to a host that does not read: held at the window, all of it
    delivered in order once read."""
    size = 16 << 20
    data = os.urandom(1 << 20) * 16
    with socket.create_server(("127.0.0.1", 0)) as server:
        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(data)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            port = await AgentPort.open(agent, server.getsockname()[1])
            await asyncio.sleep(1.5)
            assert agent.queued(port._channel) == OUTPUT_WINDOW
            await agent.ping()
            got = bytearray()
            while chunk := await port.read(1 << 16):
                got += chunk
                assert agent.queued(port._channel) <= OUTPUT_WINDOW
            await port.aclose()
        finally:
            thread.join(30)
    assert len(got) == size and got == data


async def test_a_signal_ends_a_command(agent: AgentClient) -> None:
    channel = await agent.start_exec(["sleep", "30"], {"PATH": "/usr/bin:/bin"}, "/")
    await asyncio.sleep(0.2)
    await agent.signal(channel, 9)
    frame = await agent.next_frame(channel, 30)
    assert frame.type == T.EXIT and parse_exit(frame.payload)[:2] == (137, 9)


async def test_a_terminal_command_reports_its_pid_and_size(agent: AgentClient) -> None:
    channel = await agent.start_ext(["sh", "-c", "tty; stty size"], {"PATH": "/usr/bin:/bin"}, "/", ROOT, 4 | 16,
                                    (100, 30))
    started = await agent.next_frame(channel, 30)
    assert started.type == T.STARTED and struct.unpack(">I", started.payload)[0] > 1
    out = b""
    while (frame := await agent.next_frame(channel, 30)).type == T.STDOUT:
        out += frame.payload
    assert frame.type == T.EXIT and parse_exit(frame.payload)[0] == 0
    assert out.startswith(b"/dev/pts/") and out.endswith(b"\r\n30 100\r\n"), out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may reach and write in (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="dsec-agent-test-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


async def test_files_round_trip_as_root_and_as_a_user(agent: AgentClient, shared: Path) -> None:
    tmp_path = shared
    target = f"{tmp_path}/a/b/f"
    await agent.write(target, b"data", 0o640)  # parents made
    assert await agent.read(target, 100) == b"data"
    assert os.stat(target).st_mode & 0o7777 == 0o640
    assert [(e.name, e.type, e.size) for e in await agent.list(f"{tmp_path}/a/b")] == [("f", "file", 4)]
    await agent.mkdir(f"{tmp_path}/m/n")
    assert Path(tmp_path, "m", "n").is_dir()
    with pytest.raises(IsADirectory):
        await agent.read(f"{tmp_path}/a", 100)
    with pytest.raises(FileNotFound):
        await agent.read(f"{tmp_path}/missing", 100)
    with pytest.raises(InvalidRequest):
        await agent.read("relative", 100)
    user = creds(4242, 4242, ())
    await agent.write_as(user, f"{tmp_path}/u/mine", b"first", None)  # its parent made, as the user
    await agent.write_as(user, f"{tmp_path}/u/mine", b"u2", None)  # in place
    st = os.stat(f"{tmp_path}/u/mine")
    assert (st.st_uid, st.st_gid, Path(tmp_path, "u", "mine").read_bytes()) == (4242, 4242, b"u2")
    assert os.stat(f"{tmp_path}/u").st_uid == 4242
    with pytest.raises(PermissionDenied):
        await agent.write_as(user, f"{tmp_path}/a/b/f", b"not yours", None)


async def test_a_connection_reaches_a_loopback_port(agent: AgentClient) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        channel = agent.open_channel()
        await agent.send(T.CONNECT, channel, port.to_bytes(2, "big"))
        conn, _ = await asyncio.to_thread(server.accept)
        with conn:
            assert (await agent.next_frame(channel, 30)).type == T.STARTED
            await agent.stdin(channel, b"ping")
            assert await asyncio.to_thread(conn.recv, 4) == b"ping"
            conn.sendall(b"pong")
            frame = await agent.next_frame(channel, 30)
            assert (frame.type, frame.payload) == (T.DATA, b"pong")
        assert (await agent.next_frame(channel, 30)).type == T.END  # the server closed


async def test_a_connection_to_a_slow_server_loses_nothing(agent: AgentClient) -> None:
    """Bytes for a guest port flow within the same window: a server that reads late gets every one."""
    size = 24 << 20
    got: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                time.sleep(1.5)
                total = 0
                while chunk := conn.recv(1 << 20):
                    total += len(chunk)
                got.append(total)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            port = await AgentPort.open(agent, server.getsockname()[1])
            await port.write(b"p" * size)
            await port.write_eof()
            assert await port.read(1) == b""  # the server closed once it had read everything
            await port.aclose()
        finally:
            thread.join(30)
    assert got == [size]


async def test_junk_and_unknown_requests_leave_the_agent_serving(agent: AgentClient) -> None:
    channel = agent.open_channel()
    await agent.send(0x7F, channel)
    frame = await agent.next_frame(channel, 30)
    assert frame.type == T.ERROR and b"unknown request" in frame.payload
    await agent.send(T.EXEC, channel, b"short")
    frame = await agent.next_frame(channel, 30)
    assert frame.type == T.ERROR and b"malformed exec" in frame.payload
    await agent.ping()
