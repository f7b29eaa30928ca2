"""The async SDK against a real daemon app (engine + FakeBackend over a unix socket)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec._http.connections import parse_url
from dsec._sdk.client import default_client

BINARY = bytes(range(256)) * 3 + b"\xff\xfe\x00not utf-8\x80"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("home"), token="s3cret") as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[dsec.Client]:
    async with dsec.Client(url=daemon.unix_url) as c:
        yield c


@pytest.fixture
async def sb(client: dsec.Client) -> AsyncIterator[dsec.AsyncSandbox]:
    async with await dsec.AsyncSandbox.create(image="tiny", labels={"suite": "sdk"}, client=client) as box:
        yield box


async def test_create_exec_info_and_stats(sb: dsec.AsyncSandbox) -> None:
    result = await sb.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr, result.ok) == (3, b"out\n", b"err\n", False)
    argv = await sb.exec(["printf", "%s|", "a b", "c"], env={"X": "1"})
    assert argv.stdout == b"a b|c|"
    fed = await sb.exec("cat; echo $X", stdin="héllo ", env={"X": "y"})
    assert fed.stdout == "héllo y\n".encode()
    info = await sb.info()
    assert (info.id, info.state, info.image, info.labels) == (sb.id, "running", "tiny", {"suite": "sdk"})
    assert isinstance(await sb.stats(), dsec.SandboxStats)


async def test_set_timeout_moves_the_deadline(sb: dsec.AsyncSandbox) -> None:
    info = await sb.set_timeout(7200)
    assert info.expires_at == pytest.approx(time.time() + 7200, abs=5)
    assert (await sb.info()).expires_at == info.expires_at
    with pytest.raises(dsec.InvalidRequest, match="timeout"):
        await sb.set_timeout(0)


async def test_exec_timeout_is_reported_in_the_result(sb: dsec.AsyncSandbox) -> None:
    result = await sb.exec("sleep 30", timeout=0.3)
    assert result.timed_out and result.limit == "time"
    assert result.exit_code != 0


async def test_exec_stream_yields_chunks_then_exit(sb: dsec.AsyncSandbox) -> None:
    events = [e async for e in sb.exec_stream("echo one; echo two >&2; echo three")]
    assert events[-1].type == "exit" and events[-1].result is not None
    assert events[-1].result.exit_code == 0
    out = b"".join(e.data or b"" for e in events if e.type == "stdout")
    err = b"".join(e.data or b"" for e in events if e.type == "stderr")
    assert (out, err) == (b"one\nthree\n", b"two\n")
    assert all(e.type in ("stdout", "stderr") for e in events[:-1])


async def test_breaking_out_of_exec_stream_kills_the_command(sb: dsec.AsyncSandbox, tmp_path: Path) -> None:
    # The command would write the marker after the first line; leaving the stream must kill it first.
    stream = sb.exec_stream("echo started; sleep 1; echo late > marker")
    async with contextlib.aclosing(stream):
        async for event in stream:
            assert event.type == "stdout" and event.data == b"started\n"
            break
    # The sandbox keeps working after the hang-up.
    assert (await sb.exec("sleep 2; ls")).stdout == b""


async def test_files_round_trip_non_utf8_and_modes(sb: dsec.AsyncSandbox) -> None:
    await sb.files.write("/workspace/blob.bin", BINARY)
    await sb.files.write("/workspace/sub/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert await sb.files.read("/workspace/blob.bin") == BINARY
    assert (await sb.exec("./sub/run.sh")).stdout == b"ran\n"
    entries = {e.name: e for e in await sb.files.list()}
    assert entries["blob.bin"].size == len(BINARY) and entries["blob.bin"].type == "file"
    assert entries["sub"].type == "dir"
    assert {e.name: e.mode for e in await sb.files.list("/workspace/sub")} == {"run.sh": 0o755}


async def test_upload_and_download_files_and_trees(sb: dsec.AsyncSandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "data.bin").write_bytes(BINARY)
    (src / "tool.sh").write_text("echo tool\n")
    (src / "tool.sh").chmod(0o750)
    await sb.files.upload(src / "tool.sh", "/workspace/one.sh")
    await sb.files.upload(src, "/workspace/tree")
    counted = await sb.exec("sh one.sh && cat tree/pkg/data.bin | wc -c")
    assert counted.stdout == f"tool\n{len(BINARY)}\n".encode()
    assert {e.name: e.mode for e in await sb.files.list("/workspace/tree")}["tool.sh"] == 0o750

    await sb.files.download("/workspace/tree/pkg/data.bin", tmp_path / "out" / "data.bin")
    assert (tmp_path / "out" / "data.bin").read_bytes() == BINARY
    await sb.files.download("/workspace/tree", tmp_path / "copy")
    assert (tmp_path / "copy" / "pkg" / "data.bin").read_bytes() == BINARY
    assert (tmp_path / "copy" / "tool.sh").read_text() == "echo tool\n"
    with pytest.raises(dsec.InvalidRequest, match="nothing to upload"):
        await sb.files.upload(tmp_path / "missing", "/workspace/x")


async def test_file_errors_come_back_typed(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.NotFound):
        await sb.files.read("/workspace/absent")
    with pytest.raises(FileNotFoundError) as found:
        await sb.files.read("relative/path")  # relative to the sandbox's working directory
    assert found.value.errno == 2 and found.value.filename == "/workspace/relative/path"
    with pytest.raises(IsADirectoryError):
        await sb.files.read("/workspace")


async def test_connect_list_by_labels_and_close_idempotent(client: dsec.Client) -> None:
    a = await dsec.AsyncSandbox.create(image="tiny", labels={"team": "a", "k": "v"}, client=client)
    b = await dsec.AsyncSandbox.create(image="tiny", labels={"team": "b", "k": "v"}, client=client)
    try:
        again = await dsec.AsyncSandbox.connect(a.id, client=client)
        assert again.id == a.id and (await again.exec("true")).ok
        assert [s.id for s in await dsec.AsyncSandbox.list(labels={"team": "a"}, client=client)] == [a.id]
        listed = await dsec.AsyncSandbox.list(labels={"k": "v"}, backend="container", client=client)
        both = {s.id for s in listed}
        assert both == {a.id, b.id}
    finally:
        await a.close()
        await b.close()
    await a.close()  # a second close is not an error
    with pytest.raises(dsec.SandboxNotFound):
        await dsec.AsyncSandbox.connect(a.id, client=client)
    with pytest.raises(dsec.SandboxNotFound):
        await dsec.AsyncSandbox.connect("no-such-sandbox", client=client)
    assert a.id not in {s.id for s in await dsec.AsyncSandbox.list(client=client)}


async def test_context_manager_destroys(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="tiny", client=client) as box:
        assert (await box.exec("true")).ok
    with pytest.raises(dsec.SandboxNotFound):
        await box.info()


async def test_create_many(client: dsec.Client) -> None:
    boxes = await dsec.AsyncSandbox.create_many(3, image="tiny", labels={"batch": "1"}, client=client)
    try:
        assert len({b.id for b in boxes}) == 3
        outs = [(await b.exec("echo hi")).stdout for b in boxes]
        assert outs == [b"hi\n"] * 3
    finally:
        for b in boxes:
            await b.close()
    with pytest.raises(dsec.InvalidRequest, match="count"):
        await dsec.AsyncSandbox.create_many(0, image="tiny", client=client)


async def test_close_many_destroys_each_in_one_request(client: dsec.Client) -> None:
    boxes = await dsec.AsyncSandbox.create_many(3, image="tiny", labels={"batch": "close-many"}, client=client)
    never = "sb-never-made-0000"
    result = await dsec.AsyncSandbox.close_many([boxes[0], boxes[1].id, never], client=client)
    assert sorted(result.destroyed) == sorted([boxes[0].id, boxes[1].id])
    assert (result.missing, result.failed) == ([never], {})
    assert [b.id for b in await dsec.AsyncSandbox.list({"batch": "close-many"}, client=client)] == [boxes[2].id]
    again = await dsec.AsyncSandbox.close_many(boxes)  # the client of the sandboxes; closed twice is fine
    assert (again.destroyed, sorted(again.missing)) == ([boxes[2].id], sorted([boxes[0].id, boxes[1].id]))
    assert (await dsec.AsyncSandbox.close_many([], client=client)).destroyed == []
    with pytest.raises(dsec.InvalidRequest, match="distinct"):
        await dsec.AsyncSandbox.close_many([boxes[0], boxes[0].id], client=client)


async def test_server_errors_are_reraised_as_their_class(client: dsec.Client) -> None:
    with pytest.raises(dsec.ImageNotFound, match="nope"):
        await dsec.AsyncSandbox.create(image="nope", client=client)
    with pytest.raises(dsec.InvalidRequest, match="snapshot id"):
        await dsec.AsyncSandbox.create(image="tiny", snapshot="nope", client=client)


async def test_snapshot_restores_and_fork_copies(sb: dsec.AsyncSandbox, client: dsec.Client) -> None:
    await sb.files.write("/workspace/state.txt", b"prepared")
    snap = await sb.snapshot()
    restored = await dsec.AsyncSandbox.create(snapshot=snap, client=client)
    children = await sb.fork(2)
    try:
        assert restored.id != sb.id
        assert await restored.files.read("/workspace/state.txt") == b"prepared"
        assert len({c.id for c in children} | {sb.id}) == 3
        await children[0].files.write("/workspace/state.txt", b"changed")
        assert await children[1].files.read("/workspace/state.txt") == b"prepared"
        assert await sb.files.read("/workspace/state.txt") == b"prepared"
    finally:
        for other in (restored, *children):
            await other.close()
    with pytest.raises(dsec.InvalidRequest, match="count"):
        await sb.fork(0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory": "lots"}, "memory"),
        ({"cpu": 0}, "cpu"),
        ({"workdir": "relative"}, "workdir"),
        ({"backend": "teleport"}, "backend"),
        ({"labels": {"a=b": "c"}}, "labels"),
    ],
)
async def test_bad_spec_is_invalid_request_before_any_http(kwargs: dict[str, object], field: str) -> None:
    # The URL points nowhere: reaching the network would raise ConnectionFailed instead.
    async with dsec.Client(url="unix:///nonexistent/dsec.sock") as nowhere:
        with pytest.raises(dsec.InvalidRequest, match=field):
            await dsec.AsyncSandbox.create(image="tiny", client=nowhere, **kwargs)  # type: ignore[arg-type]


async def test_bad_exec_request_is_invalid_request(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.InvalidRequest, match="command"):
        await sb.exec("   ")
    with pytest.raises(dsec.InvalidRequest, match="timeout"):
        await sb.exec("true", timeout=-1)


async def test_no_daemon_is_connection_failed_with_a_hint(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/absent.sock"
    async with dsec.Client(url=url) as nowhere:
        with pytest.raises(dsec.ConnectionFailed) as caught:
            await dsec.AsyncSandbox.list(client=nowhere)
    assert url in str(caught.value) and "dsec up" in str(caught.value)
    assert isinstance(caught.value, ConnectionError)


async def test_tcp_needs_the_token(daemon: Daemon) -> None:
    assert daemon.tcp_url is not None
    async with (
        dsec.Client(url=daemon.tcp_url, token="s3cret") as good,
        await dsec.AsyncSandbox.create(image="tiny", client=good) as box,
    ):
        assert (await box.exec("echo tcp")).stdout == b"tcp\n"
    async with dsec.Client(url=daemon.tcp_url, token="wrong") as bad:
        with pytest.raises(dsec.Unauthorized):
            await dsec.AsyncSandbox.list(client=bad)
        assert (await bad.health()).backends["container"] == "ok"  # health needs no token


async def test_client_defaults_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, daemon: Daemon
) -> None:
    monkeypatch.setenv("DSEC_URL", daemon.unix_url)
    monkeypatch.setenv("DSEC_TOKEN", "tok")
    c = dsec.Client()
    assert (c.url, c.token) == (daemon.unix_url, "tok")
    assert default_client() is default_client() and default_client().url == daemon.unix_url
    monkeypatch.delenv("DSEC_URL")
    monkeypatch.setenv("DSEC_HOME", "/srv/dsec")
    assert dsec.Client().url == "unix:///srv/dsec/run/dsec.sock"


async def test_default_client_is_used_when_none_is_passed(
    monkeypatch: pytest.MonkeyPatch, daemon: Daemon
) -> None:
    monkeypatch.setenv("DSEC_URL", daemon.unix_url)
    box = await dsec.AsyncSandbox.create(image="tiny")
    try:
        assert (await box.exec("echo default")).stdout == b"default\n"
    finally:
        await box.close()
        await default_client().aclose()


def test_url_parsing() -> None:
    assert parse_url("unix:///run/d.sock").uds == "/run/d.sock"
    assert parse_url("http://h:1/").base_url == "http://h:1"
    assert parse_url("https://h/prefix/").base_url == "https://h/prefix" and parse_url("https://h").port == 443
    for bad in ("unix://relative.sock", "ftp://h", "localhost:80"):
        with pytest.raises(dsec.InvalidRequest):
            parse_url(bad)


def test_errors_carry_builtin_bases() -> None:
    assert issubclass(dsec.SandboxTimeout, TimeoutError) and issubclass(dsec.SandboxNotFound, dsec.NotFound)


async def _serve_once(path: Path, answer: bytes) -> asyncio.AbstractServer:
    """A fake daemon that reads one request, writes ``answer`` and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=str(path))


@pytest.mark.parametrize(
    "answer",
    [
        b"",  # died before answering
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"id\":",  # died mid-body
    ],
)
async def test_connection_dropped_mid_call_is_connection_failed(tmp_path: Path, answer: bytes) -> None:
    server = await _serve_once(tmp_path / "d.sock", answer)
    async with server, dsec.Client(url=f"unix://{tmp_path}/d.sock") as c:
        with pytest.raises(dsec.ConnectionFailed, match="lost mid-call"):
            await dsec.AsyncSandbox.connect("abc", client=c)


async def test_exec_stream_cut_before_exit_is_connection_failed(
    tmp_path: Path, sb: dsec.AsyncSandbox
) -> None:
    line = b'{"type":"stdout","data":"aGk="}\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = f"{len(line):x}\r\n".encode() + line + b"\r\n0\r\n\r\n"
    server = await _serve_once(tmp_path / "e.sock", head + body)
    async with server, dsec.Client(url=f"unix://{tmp_path}/e.sock") as c:
        cut = dsec.AsyncSandbox(sb._info, c)
        with pytest.raises(dsec.ConnectionFailed, match="without an exit event"):
            async for _ in cut.exec_stream("echo hi"):
                pass


@pytest.mark.parametrize("body", [b'{"exit_code": 0, "stdout"', b'{"type":"stdout","data":"aGk="}\n'])
async def test_exec_answer_that_is_not_a_result_is_connection_failed(
    tmp_path: Path, sb: dsec.AsyncSandbox, body: bytes
) -> None:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    server = await _serve_once(tmp_path / "r.sock", head + body)
    async with server, dsec.Client(url=f"unix://{tmp_path}/r.sock") as c:
        cut = dsec.AsyncSandbox(sb._info, c)
        with pytest.raises(dsec.ConnectionFailed, match="not an ExecResult"):
            await cut.exec("echo hi")


async def test_exec_on_the_keep_alive_connections_maps_failures_like_every_call(
        tmp_path: Path, sb: dsec.AsyncSandbox) -> None:
    """sb.exec goes on the keep-alive connections of dsec._http.http11: a dead daemon, a hang-up and an error
    answer come back typed."""
    async with dsec.Client(url=f"unix://{tmp_path}/absent.sock") as nowhere:
        with pytest.raises(dsec.ConnectionFailed, match="dsec up"):
            await dsec.AsyncSandbox(sb._info, nowhere).exec("true")
    for name, answer in (("a", b""), ("b", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"exit_code\":")):
        server = await _serve_once(tmp_path / f"{name}.sock", answer)
        async with server, dsec.Client(url=f"unix://{tmp_path}/{name}.sock") as c:
            with pytest.raises(dsec.ConnectionFailed, match="lost mid-call"):
                await dsec.AsyncSandbox(sb._info, c).exec("true")
    body = b'{"error": {"type": "SandboxTimeout", "message": "too slow", "detail": {}}}'
    head = f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    server = await _serve_once(tmp_path / "t.sock", head.encode() + body)
    async with server, dsec.Client(url=f"unix://{tmp_path}/t.sock") as c:
        with pytest.raises(dsec.SandboxTimeout, match="too slow"):
            await dsec.AsyncSandbox(sb._info, c).exec("true")
    # the pool reuses one connection across execs, and closes with the client
    assert [(await sb.exec(f"echo {i}")).stdout for i in range(3)] == [b"0\n", b"1\n", b"2\n"]


async def test_pools_declared_and_claimed_through_the_api(client: dsec.Client) -> None:
    shape = dsec.PoolConfig(image="tiny", memory="300Mi", min=1, max=2)
    declared = await client.declare_pool(shape)
    assert declared.config == shape and declared.target == 1
    for _ in range(500):
        stats = await client.statistics()
        if stats.pools[0].ready == 1:
            break
        await asyncio.sleep(0.01)
    assert stats.pools[0].ready == 1 and stats.admission.slots >= 1
    async with await dsec.AsyncSandbox.create(image="tiny", memory="300Mi", labels={"p": "1"},
                                              client=client) as box:
        assert box._info.pooled  # the create's answer says so (a later info() does not)
        info = await box.info()
        assert info.labels == {"p": "1"} and not info.pooled
        assert (await box.exec("echo hi")).stdout == b"hi\n"
    assert (await client.statistics()).pools[0].hits == 1
    await client.declare_pool(shape.model_copy(update={"min": 0, "max": 0}))  # empty it for the other tests
    with pytest.raises(dsec.InvalidRequest, match="max"):
        # Unchecked here, so the daemon's own validation answers.
        await client.api.declare_pool(dsec.PoolConfig.model_construct(image="tiny", min=3, max=1))


async def test_pause_releasing_memory_is_refused_where_the_backend_cannot(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.NotSupported, match="cannot release a paused sandbox's memory"):
        await sb.pause(release_memory=True)
    assert (await sb.info()).state == "running"  # refused: nothing changed
    assert (await sb.exec("echo ok")).stdout == b"ok\n"


async def test_computer_use_on_a_backend_without_a_display(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.NotSupported, match="has no display"):
        await sb.screenshot()
    with pytest.raises(dsec.NotSupported, match="has no display"):
        await sb.keyboard(keys=["ctrl+c"])
    # refused by the SDK before any request: the message names the field
    with pytest.raises(dsec.InvalidRequest, match="button"):
        await sb.mouse(1, 2, button="fourth")
    with pytest.raises(dsec.InvalidRequest, match="exactly one"):
        await sb.keyboard(text="a", keys=["b"])
