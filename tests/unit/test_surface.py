"""The engine's sandbox surface over the fake backend: process handles and their buffers, shell sessions,
file operations and watches, exposed ports (auth, HTTP, WebSocket, raw TCP), relative paths, and the
trajectory log of the calls that change state."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.daemon.processes import OutputBuffer
from dsec.errors import (
    DirectoryNotEmpty,
    FileExists,
    InvalidRequest,
    NotFound,
    NotSupported,
    ProcessNotFound,
    SandboxNotFound,
)
from dsec.models import SandboxSpec
from dsec.models.surface import ProcessRequest, PtySize, ShellRequest, ShellRunRequest
from dsec.testing.fake import FakeBackend, FakeImages

SPEC = SandboxSpec(image="base")


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    eng = Engine(Settings(home=tmp_path / "home"), {"container": FakeBackend(root=tmp_path / "fake")}, FakeImages())
    await eng.start()
    try:
        yield eng
    finally:
        for info in await eng.list():
            await eng.destroy(info.id)
        await eng.aclose()


async def _collect(engine: Engine, sid: str, pid: int, offsets: dict[str, int] | None = None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    async for event in engine.surface.process_output(sid, pid, offsets):
        if event.type in ("stdout", "stderr", "pty"):
            out[event.type] = out.get(event.type, b"") + (event.data or b"")
        elif event.type == "dropped":
            out[f"dropped-{event.stream}"] = str(event.dropped).encode()
        elif event.type == "exit":
            out["exit"] = str(event.exit_code).encode()
    return out


def test_output_buffer_keeps_the_tail_and_counts_what_it_dropped() -> None:
    buf = OutputBuffer(limit=10)
    for chunk in (b"0123", b"4567", b"89ab", b"cd"):
        buf.append(chunk)
    assert (buf.start, buf.end) == (4, 14)
    assert buf.read(0) == (4, 4, b"456789abcd")
    assert buf.read(9) == (0, 9, b"9abcd")
    assert buf.read(14) == (0, 14, b"")


async def test_background_process_with_input_output_and_reconnect(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    proc = await surface.start_process(info.id, ProcessRequest(
        command="echo up; read line; echo got:$line; echo oops >&2; exit 4", tag="job"))
    assert proc.running and proc.stdin_open and proc.tag == "job" and proc.pid > 0
    await surface.send_stdin(info.id, proc.pid, b"hello\n")
    done = await surface.wait_process(info.id, proc.pid, timeout=20)
    assert (done.running, done.exit_code) == (False, 4), done
    # another client (or the same, later) reads everything again, or from an offset
    out = await _collect(engine, info.id, proc.pid)
    assert out == {"stdout": b"up\ngot:hello\n", "stderr": b"oops\n", "exit": b"4"}, out
    tail = await _collect(engine, info.id, proc.pid, {"stdout": 3, "stderr": 5})
    assert tail == {"stdout": b"got:hello\n", "exit": b"4"}, tail
    assert [p.pid for p in surface.list_processes(info.id)] == [proc.pid]
    with pytest.raises(InvalidRequest, match="has ended"):
        await surface.send_stdin(info.id, proc.pid, b"late")
    with pytest.raises(ProcessNotFound):
        surface.process(info.id, 999999)


async def test_a_late_reader_is_told_how_much_was_dropped(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec.daemon.processes.BUFFER_BYTES", 1000)
    info = await engine.create(SPEC)
    proc = await engine.surface.start_process(info.id, ProcessRequest(command="head -c 5000 /dev/zero"))
    await engine.surface.wait_process(info.id, proc.pid, timeout=20)
    out = await _collect(engine, info.id, proc.pid)
    assert out["dropped-stdout"] == b"4000" and out["stdout"] == bytes(1000), out.keys()
    assert engine.surface.process(info.id, proc.pid).dropped_bytes["stdout"] == 4000


async def test_signal_close_stdin_and_the_sandbox_going(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    cat = await surface.start_process(info.id, ProcessRequest(command=["cat"]))
    await surface.send_stdin(info.id, cat.pid, b"abc")
    await surface.close_stdin(info.id, cat.pid)
    assert (await surface.wait_process(info.id, cat.pid, 20)).exit_code == 0
    assert (await _collect(engine, info.id, cat.pid))["stdout"] == b"abc"
    sleeper = await surface.start_process(info.id, ProcessRequest(command=["sleep", "100"]))
    await surface.signal_process(info.id, sleeper.pid, signal.SIGTERM)
    done = await surface.wait_process(info.id, sleeper.pid, 20)
    assert (done.exit_code, done.signal) == (143, 15), done
    survivor = await surface.start_process(info.id, ProcessRequest(command=["sleep", "100"]))
    await engine.destroy(info.id)
    with pytest.raises(SandboxNotFound):
        surface.list_processes(info.id)
    with pytest.raises(ProcessLookupError):  # it died with its sandbox
        for _ in range(50):
            os.kill(survivor.pid, 0)
            await asyncio.sleep(0.1)


async def test_terminal_input_resize_and_output(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    proc = await surface.start_process(info.id, ProcessRequest(
        command="stty size; read x; stty size; echo \"[$x]\"", pty=PtySize(cols=80, rows=24)))
    assert proc.pty == PtySize(cols=80, rows=24)
    await asyncio.sleep(0.5)
    await surface.resize(info.id, proc.pid, PtySize(cols=120, rows=40))
    await surface.send_stdin(info.id, proc.pid, b"typed\n")
    await surface.wait_process(info.id, proc.pid, 20)
    out = (await _collect(engine, info.id, proc.pid))["pty"]
    assert b"24 80" in out and b"40 120" in out and b"[typed]" in out, out
    plain = await surface.start_process(info.id, ProcessRequest(command=["sleep", "30"]))
    with pytest.raises(InvalidRequest, match="no terminal"):
        await surface.resize(info.id, plain.pid, PtySize(cols=1, rows=1))


async def test_shell_sessions_keep_state_and_survive_timeouts(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    shell = await surface.start_shell(info.id, ShellRequest())
    for i in range(100):
        r = await surface.run_shell(info.id, shell.id, ShellRunRequest(
            command=f"mkdir -p d{i} && cd d{i} && export N{i}={i}"))
        assert r.exit_code == 0, (i, r)
    r = await surface.run_shell(info.id, shell.id, ShellRunRequest(command="basename $PWD; echo $N0 $N99"))
    assert r.stdout == b"d99\n0 99\n", r
    r = await surface.run_shell(info.id, shell.id, ShellRunRequest(command="sleep 60", timeout=1))
    assert r.timed_out, r
    r = await surface.run_shell(info.id, shell.id, ShellRunRequest(command="basename $PWD; echo $N42"))
    assert r.stdout == b"d99\n42\n", r
    assert [s.id for s in surface.list_shells(info.id)] == [shell.id]
    await surface.close_shell(info.id, shell.id)
    with pytest.raises(ProcessNotFound):
        await surface.run_shell(info.id, shell.id, ShellRunRequest(command="true"))


async def test_file_operations_relative_paths_and_errors(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    made = await surface.mkdir(info.id, "a/b", parents=True)
    assert made.path == "/workspace/a/b" and made.type == "dir"
    with pytest.raises(FileExists):
        await surface.mkdir(info.id, "a")
    await engine.write_file(info.id, "a/f", b"data")
    st = await surface.stat(info.id, "/workspace/a/f")
    assert (st.size, st.type, st.permissions) == (4, "file", "-rw-r--r--"), st
    moved = await surface.rename(info.id, "a/f", "g")
    assert moved.path == "/workspace/g"
    assert (await surface.chmod(info.id, "g", 0o600)).mode == 0o600
    with pytest.raises(DirectoryNotEmpty):
        await surface.remove(info.id, "a")
    await surface.remove(info.id, "a", recursive=True)
    with pytest.raises(FileNotFoundError):
        await surface.stat(info.id, "a")
    with pytest.raises(NotSupported, match="one host user"):  # the fake cannot act as another user
        await surface.stat(info.id, "g", user="1000")


async def test_watch_is_a_resource_read_by_number(engine: Engine) -> None:
    info = await engine.create(SPEC)
    surface = engine.surface
    await surface.mkdir(info.id, "w")
    watch = await surface.watch(info.id, "w", recursive=True)
    await engine.write_file(info.id, "w/x", b"1")
    await surface.remove(info.id, "w/x")
    seen: list[tuple[int, str, str]] = []
    for _ in range(100):
        seen = [(n, e.type, e.path) async for n, e in surface.watch_events(info.id, watch.id, follow=False)]
        if any(t == "delete" for _, t, _ in seen):
            break
        await asyncio.sleep(0.05)
    assert seen[0][1] == "create" and seen[-1][1:] == ("delete", "/workspace/w/x"), seen
    later = [e async for _, e in surface.watch_events(info.id, watch.id, since=seen[-1][0], follow=False)]
    assert [e.type for e in later] == ["delete"]
    surface.unwatch(info.id, watch.id)
    with pytest.raises(ProcessNotFound):
        surface.unwatch(info.id, watch.id)


_ECHO = r"""
import base64, hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(); print("ready", s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    lines = head.decode().split("\r\n")
    headers = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:] if ":" in l}
    if headers.get("upgrade", "").lower() == "websocket":
        accept = base64.b64encode(hashlib.sha1((headers["sec-websocket-key"] +
            "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        frame = c.recv(4096); n = frame[1] & 127; mask = frame[2:6]
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(frame[6:6 + n]))
        c.sendall(bytes([0x81, len(data)]) + data); c.close(); continue
    body = ("you said " + lines[0] + " cookie=" + headers.get("cookie", "-") + " token=" +
            headers.get("x-dsec-token", "-") + " connection=" + headers.get("connection", "-")).encode()
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body); c.close()
"""


async def _server(engine: Engine, sid: str) -> int:
    """Start the echo server in the sandbox on a port the kernel picks (a port chosen here could be taken: the
    fake backend's sandboxes share the host's loopback with everything else on the machine)."""
    proc = await engine.surface.start_process(sid, ProcessRequest(command=["python3", "-c", _ECHO]))
    for _ in range(400):
        out = await _collect_now(engine, sid, proc.pid)
        if out.startswith(b"ready ") and out.endswith(b"\n"):
            return int(out.split()[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"the test server did not start: {out!r}")


async def _collect_now(engine: Engine, sid: str, pid: int) -> bytes:
    return b"".join([e.data or b"" async for e in engine.surface.process_output(sid, pid, follow=False)])


async def test_exposed_http_port_needs_the_token_and_hides_it(engine: Engine) -> None:
    info = await engine.create(SPEC)
    port = await _server(engine, info.id)
    exposed = await engine.surface.expose(info.id, port, "http")
    assert exposed.url == f"http://127.0.0.1:{exposed.host_port}" and exposed.host == "127.0.0.1"
    assert await engine.surface.expose(info.id, port, "http") == exposed  # the same exposure again
    async with httpx.AsyncClient(follow_redirects=False) as client:
        r = await client.get(exposed.url + "/x")
        assert r.status_code == 401 and "token" in r.text
        r = await client.get(exposed.url + "/x", headers={"X-DSec-Token": "wrong"})
        assert r.status_code == 401
        r = await client.get(exposed.url + "/x?a=1", headers=exposed.headers)
        assert r.status_code == 200 and r.text.startswith("you said GET /x?a=1 ") and "token=-" in r.text, r.text
        r = await client.get(exposed.url + "/b", auth=("dsec", exposed.token))  # a URL's credentials
        assert r.status_code == 200 and "token=-" in r.text, r.text
        r = await client.get(exposed.url + "/b", auth=("dsec", "wrong"))
        assert r.status_code == 401
        assert exposed.credentials_url == exposed.url.replace("http://", f"http://dsec:{exposed.token}@")
        r = await client.get(f"{exposed.url}/x?dsec_token={exposed.token}&b=2")
        assert r.status_code == 302 and r.headers["location"] == "/x?b=2", r.headers
        cookie = r.headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in r.headers["set-cookie"]
        r = await client.get(exposed.url + "/x?b=2", headers={"Cookie": f"{cookie}; app=1"})
        assert r.status_code == 200 and "cookie=app=1 " in r.text, r.text  # the app never sees the token
        # A browser sends every port's cookies of the host: another sandbox's token never reaches this server,
        # and each request of a client sending token cookies comes on a connection of its own (read here).
        r = await client.get(exposed.url + "/y", headers={"Cookie": f"dsec_token_1=other; {cookie}; app=2",
                                                           "Connection": "keep-alive"})
        assert "cookie=app=2 " in r.text and "other" not in r.text and "connection=close" in r.text, r.text
        r = await client.get(exposed.url + "/z", headers={"Cookie": f"dsec_token_1=other; {cookie}"})
        assert r.status_code == 200 and "cookie=- " in r.text, r.text
    await engine.surface.unexpose(info.id, port)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(exposed.url, headers=exposed.headers)
    with pytest.raises(NotFound):
        await engine.surface.unexpose(info.id, port)


async def test_exposed_port_carries_websocket_and_raw_tcp(engine: Engine) -> None:
    import websockets

    info = await engine.create(SPEC)
    port = await _server(engine, info.id)
    exposed = await engine.surface.expose(info.id, port, "http")
    ws_url = exposed.url.replace("http://", "ws://") if exposed.url else ""
    async with websockets.connect(ws_url + "/echo", additional_headers=exposed.headers) as ws:
        await ws.send("ping over websocket")
        assert await asyncio.wait_for(ws.recv(), 10) == "ping over websocket"
    tcp = await engine.surface.expose(info.id, port, "tcp")  # the same port, now raw: the exposure changes
    assert tcp.url is None and [p.protocol for p in engine.surface.exposed(info.id)] == ["tcp"]
    reader, writer = await asyncio.open_connection(tcp.host, tcp.host_port)
    writer.write(f"DSEC {tcp.token}\n".encode() + b"GET /raw HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 10)
    assert b"you said GET /raw" in reply, reply
    writer.close()
    reader, writer = await asyncio.open_connection(tcp.host, tcp.host_port)
    writer.write(b"DSEC nope\n")
    assert b"401" in await asyncio.wait_for(reader.read(), 10)
    writer.close()


async def test_a_port_nothing_listens_on_answers_502_and_the_sandbox_going_closes_it(engine: Engine) -> None:
    info = await engine.create(SPEC)
    with socket.socket() as held:  # bound, never listening, kept until the end: nothing else can take it
        held.bind(("127.0.0.1", 0))
        free = held.getsockname()[1]
        exposed = await engine.surface.expose(info.id, free, "http")
        async with httpx.AsyncClient() as client:
            r = await client.get(exposed.url or "", headers=exposed.headers)
            assert r.status_code == 502 and f"nothing listens on port {free}" in r.text, r.text
    await engine.destroy(info.id)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(exposed.url or "", headers=exposed.headers)


async def test_logged_surface_calls_replay_without_running(engine: Engine) -> None:
    spec = SandboxSpec(image="base", trajectory="surface/one")
    info = await engine.create(spec)
    surface = engine.surface
    await surface.mkdir(info.id, "logged", seq=0)
    proc = await surface.start_process(info.id, ProcessRequest(command="echo hi > started; sleep 30"), seq=1)
    shell = await surface.start_shell(info.id, ShellRequest(), seq=2)
    r = await surface.run_shell(info.id, shell.id, ShellRunRequest(command="echo $((6*7)) >> ran; cat ran"), seq=3)
    assert r.stdout == b"42\n"
    # the same calls again (a client re-running its rollout): answered from the log, nothing runs again
    again = await surface.mkdir(info.id, "logged", seq=0)
    assert again.path == "/workspace/logged"
    assert (await surface.start_process(info.id, ProcessRequest(command="echo hi > started; sleep 30"),
                                        seq=1)).pid == proc.pid
    assert (await surface.start_shell(info.id, ShellRequest(), seq=2)).id == shell.id
    r = await surface.run_shell(info.id, shell.id, ShellRunRequest(command="echo $((6*7)) >> ran; cat ran"), seq=3)
    assert r.stdout == b"42\n"
    assert await engine.read_file(info.id, "ran") == b"42\n"  # the command did not run twice
    log = await engine.trajectory_log("surface/one", 0, 10)
    # (the read had no call number: an operator's look, kept out of the log)
    assert [c.op for c in log] == ["mkdir", "process", "shell", "shell.run"], log



def test_the_gateways_port_relay_loses_no_byte_sent_before_it_reached_the_node() -> None:
    """uvloop (what uvicorn serves the gateway on) reads a first chunk from a new connection even when the
    protocol paused reading as it was made: the request a client sends at once must still reach the node."""
    import uvloop

    from dsec.cluster.surface import PortFronts
    from dsec.models.surface import PortInfo

    async def scenario() -> None:
        async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
            await writer.drain()
            writer.close()

        listener = await asyncio.start_server(node, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        fronts = PortFronts()
        seen = await fronts.front("sb-1", PortInfo(port=80, protocol="http", host="127.0.0.1", host_port=port,
                                                   token="t"))
        try:
            for _ in range(20):
                reader, writer = await asyncio.open_connection(seen.host, seen.host_port)
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"\r\n\r\nhi")
                writer.close()
        finally:
            await fronts.aclose()
            listener.close()

    uvloop.run(scenario())
