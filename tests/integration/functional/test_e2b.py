"""The E2B endpoint driven by the real ``e2b`` SDK (pinned in constraints.txt), sync and async, against a DSec
daemon on the container backend: the ``E2B_DOMAIN`` form over HTTPS from a local CA (``*.localhost`` names
resolve to loopback in the SDK's resolver) and the deprecated ``E2B_API_URL``/``E2B_SANDBOX_URL`` form."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from container_support import daemon_process
from dsec._ports import free_port

e2b = pytest.importorskip("e2b", reason="the E2B endpoint's tests need the e2b SDK: pip install 'dsec[e2b]'")
trustme = pytest.importorskip("trustme")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    TimeoutException,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

ADMIN = "e2b_" + "5" * 40


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A daemon serving E2B on HTTPS (a local CA's certificate for ``*.e2b.localhost`` and 127.0.0.1)."""
    certs = tmp_path_factory.mktemp("ca")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    ca.issue_cert("*.e2b.localhost", "api.e2b.localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(certs / "server.pem"))
    port = free_port()
    args = ["--e2b", f"127.0.0.1:{port}", "--e2b-domain", f"e2b.localhost:{port}",
            "--e2b-tls-cert", str(certs / "server.pem")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSL_CERT_FILE", str(certs / "ca.pem"))  # the SDK's TLS (rustls via pyqwest) trusts it
        _drop_e2b_pools()
        try:
            with daemon_process("dsec-e2b-", tcp_token=ADMIN, args=args) as (unix_url, _tcp):
                yield {"port": port, "unix_url": unix_url, "ca": certs / "ca.pem",
                       "domain": {"api_key": ADMIN, "domain": f"e2b.localhost:{port}"},
                       "urls": {"api_key": ADMIN, "api_url": f"https://127.0.0.1:{port}",
                                "sandbox_url": f"https://127.0.0.1:{port}"}}
        finally:
            _drop_e2b_pools()


def _drop_e2b_pools() -> None:
    """Forget the SDK's process-wide connection pools: each reads the trust store (``SSL_CERT_FILE``) once, when
    it is made, so a pool made by an earlier test of this process would never trust this module's CA."""
    from e2b.api import client_async, client_sync
    for module in (client_sync, client_async):
        with module._transport_lock:
            module._transports.clear()
            module._httpx_transports.clear()


@pytest.fixture(params=["domain", "urls"])
def opts(request: pytest.FixtureRequest, endpoint: dict[str, Any]) -> dict[str, str]:
    return dict(endpoint[request.param])


def test_lifecycle_metadata_timeouts_and_a_second_client(opts: dict[str, str]) -> None:
    sb = Sandbox.create(metadata={"suite": "e2b", "n": "1"}, timeout=120, **opts)
    try:
        info = sb.get_info()
        assert (info.template_id, info.metadata, info.state.value) == ("base", {"suite": "e2b", "n": "1"}, "running")
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
        sb.set_timeout(900)
        assert (sb.get_info().end_at.timestamp() - time.time()) == pytest.approx(900, abs=30)
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"}), **opts).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"}), **opts).next_items() == []
        other = Sandbox.connect(sb.sandbox_id, **opts)  # a second client, by id
        assert other.commands.run("echo from-second").stdout == "from-second\n"
        assert other.is_running()
    finally:
        assert sb.kill() is True
    assert sb.kill() is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id, **opts)
    assert not sb.is_running()


def test_commands_stream_fail_time_out_and_take_envs_and_cwd(opts: dict[str, str]) -> None:
    with Sandbox.create(envs={"FROM_SANDBOX": "yes"}, **opts) as sb:
        out: list[str] = []
        err: list[str] = []
        r = sb.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; done", on_stdout=out.append,
                            on_stderr=err.append)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "o1\no2\no3\n", "e1\ne2\ne3\n")
        assert "".join(out) == r.stdout and "".join(err) == r.stderr
        with pytest.raises(CommandExitException) as failed:
            sb.commands.run("echo partial; exit 7")
        assert (failed.value.exit_code, failed.value.stdout) == (7, "partial\n")
        with pytest.raises(TimeoutException):
            sb.commands.run("sleep 30", timeout=1)
        r = sb.commands.run("echo $FOO $FROM_SANDBOX; pwd", envs={"FOO": "bar"}, cwd="/tmp")
        assert r.stdout == "bar yes\n/tmp\n"
        assert sb.commands.run("pwd").stdout == "/workspace\n"  # debian-python's working directory
        assert sb.commands.run("whoami", user="nobody").stdout == "nobody\n"
        with pytest.raises(SandboxException, match="unable to find user nosuchuser"):
            sb.commands.run("true", user="nosuchuser")


def test_files_round_trip_list_stat_and_signed_urls(opts: dict[str, str], endpoint: dict[str, Any]) -> None:
    with Sandbox.create(**opts) as sb:
        info = sb.files.write("notes/a.txt", "héllo")  # relative: below the working directory
        assert (info.path, info.name) == ("/workspace/notes/a.txt", "a.txt")
        assert sb.files.read("notes/a.txt") == "héllo"
        blob = bytes(range(256)) * 40960  # 10 MiB
        sb.files.write("/tmp/blob.bin", blob)
        assert bytes(sb.files.read("/tmp/blob.bin", format="bytes")) == blob
        names = {e.name: e for e in sb.files.list("/workspace/notes")}
        assert set(names) == {"a.txt"} and names["a.txt"].size == len("héllo".encode())
        assert sb.files.exists("notes/a.txt") and not sb.files.exists("notes/missing.txt")
        stat = sb.files.get_info("/workspace/notes/a.txt")
        assert (stat.type.value, stat.permissions) == ("file", "-rw-r--r--")
        with pytest.raises(FileNotFoundException):
            sb.files.read("/nope.txt")
        if "domain" not in opts:
            return  # a signed URL names its sandbox in the host: only the E2B_DOMAIN form has one
        # A signed URL works without the access token header; an expired one is refused as envd refuses it.
        import pyqwest

        client = pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True))
        got = client.get(sb.download_url("notes/a.txt"))
        assert (got.status, got.content) == (200, "héllo".encode())
        expired = client.get(sb.download_url("notes/a.txt", use_signature_expiration=-60))
        assert expired.status == 401
        assert json.loads(expired.content) == {"code": 401, "message": "signature is already expired"}
        # metadata a client did not check is refused before anything is written, as envd refuses it
        bad = client.post(sb.upload_url("notes/bad.txt"), headers={"Content-Type": "application/octet-stream",
                                                                   "X-Metadata-k": "caf\u00e9"}, content=b"x")
        assert bad.status == 400 and "printable US-ASCII" in json.loads(bad.content)["message"], bad.content
        assert not sb.files.exists("notes/bad.txt")


def test_file_metadata_is_the_files_user_e2b_xattrs(endpoint: dict[str, Any]) -> None:
    with Sandbox.create(**endpoint["domain"]) as sb:
        info = sb.files.write("m/a.txt", "m", metadata={"author": "dsec", "Stage": "one"})
        assert info.metadata == {"author": "dsec", "stage": "one"}  # keys lowercased, as envd's
        assert sb.files.get_info("m/a.txt").metadata == {"author": "dsec", "stage": "one"}
        assert [e.metadata for e in sb.files.list("m")] == [{"author": "dsec", "stage": "one"}]
        assert sb.files.rename("m/a.txt", "m/b.txt").metadata == {"author": "dsec", "stage": "one"}
        shown = sb.commands.run("python3 -c \"import os; print(os.getxattr('m/b.txt', 'user.e2b.author').decode())\"")
        assert shown.stdout == "dsec\n"  # real extended attributes, seen inside the sandbox
        assert sb.files.write("m/b.txt", "again", metadata={"stage": "two"}).metadata == {"stage": "two"}
        assert sb.files.write("m/b.txt", "plain").metadata is None  # an upload replaces the metadata
        assert sb.files.get_info("m/b.txt").metadata is None
        sb.commands.run("python3 -c \"import os; os.setxattr('m/b.txt', 'user.e2b.by', b'hand')\"")
        assert sb.files.get_info("m/b.txt").metadata == {"by": "hand"}


def test_pause_resume_and_killed_during_a_command(opts: dict[str, str]) -> None:
    sb = Sandbox.create(**opts)
    try:
        sb.files.write("/tmp/kept", "state")
        assert sb.pause() is True
        assert sb.get_info().state.value == "paused"
        assert sb.pause() is False  # already paused
        resumed = sb.connect()
        assert resumed.files.read("/tmp/kept") == "state"
        handle = sb.commands.run("sleep 60", background=True)
    finally:
        sb.kill()
    with pytest.raises(TimeoutException, match="killed or reached its end of life"):
        handle.wait()  # the connection is reset, as E2B's proxy resets a dead envd's stream: the SDK probes health


def test_keys_scope_sandboxes_and_bad_calls_get_clear_errors(endpoint: dict[str, Any]) -> None:
    import subprocess
    import sys

    opts = endpoint["domain"]
    with pytest.raises(AuthenticationException):
        Sandbox.create(**{**opts, "api_key": "e2b_" + "0" * 40})
    home = endpoint["unix_url"].removeprefix("unix://").rsplit("/run/", 1)[0]
    dsec_cli = str(Path(sys.executable).with_name("dsec"))
    keys = [subprocess.run([dsec_cli, "token", "create", f"job-{j}", "--job", j, "--e2b"],
                           env={"DSEC_HOME": home, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           check=True).stdout.strip() for j in ("a", "b")]
    mine = Sandbox.create(**{**opts, "api_key": keys[0]})
    try:
        assert [s.sandbox_id for s in Sandbox.list(**{**opts, "api_key": keys[0]}).next_items()] == [mine.sandbox_id]
        assert Sandbox.list(**{**opts, "api_key": keys[1]}).next_items() == []
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(mine.sandbox_id, **{**opts, "api_key": keys[1]})
        assert Sandbox.kill(mine.sandbox_id, **{**opts, "api_key": keys[1]}) is False
        import pyqwest

        client = pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True))
        api = f"https://api.{opts['domain']}"
        answer = client.get(f"{api}/templates", headers={"X-API-Key": keys[0]})
        assert answer.status == 501 and "not supported by DSec" in json.loads(answer.content)["message"]
        answer = client.post(f"{api}/volumes", headers={"X-API-Key": keys[0]}, content=b"{}")
        assert answer.status == 501 and "volumes" in json.loads(answer.content)["message"]
        port = client.get(f"https://{mine.get_host(8000)}/")  # nothing listens there: the node answers 502
        assert port.status == 502
        with pytest.raises(SandboxException, match="image 'no-such-image'"):
            Sandbox.create("no-such-image", **opts)
    finally:
        mine.kill()


async def test_async_sdk(opts: dict[str, str]) -> None:
    sb = await AsyncSandbox.create(metadata={"flavour": "async"}, **opts)
    try:
        chunks: list[str] = []
        r = await sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
        assert r.stdout == "a\nb\n" and chunks == ["a\n", "b\n"]
        with pytest.raises(CommandExitException):
            await sb.commands.run("false")
        await sb.files.write("/tmp/x", b"\x00\xffbytes")
        assert bytes(await sb.files.read("/tmp/x", format="bytes")) == b"\x00\xffbytes"
        results = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(8)))
        assert [x.stdout for x in results] == [f"{i}\n" for i in range(8)]
        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"flavour": "async"}), **opts).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
    finally:
        await sb.kill()



def test_background_commands_list_connect_stdin_and_kill(endpoint: dict[str, Any]) -> None:
    from e2b import NotFoundException

    with Sandbox.create(**endpoint["domain"]) as sb:
        sleeper = sb.commands.run("sleep 30", background=True)
        cat = sb.commands.run("cat", background=True, stdin=True, user="nobody", cwd="/tmp", envs={"K": "v"})
        listed = {p.pid: p for p in sb.commands.list()}
        assert {sleeper.pid, cat.pid} <= set(listed)
        assert (listed[cat.pid].cmd, listed[cat.pid].args, listed[cat.pid].cwd) == ("/bin/bash", ["-l", "-c", "cat"],
                                                                                  "/tmp")
        assert listed[cat.pid].envs == {"K": "v"}
        sb.commands.send_stdin(cat.pid, "one\n")
        again = sb.commands.connect(cat.pid)  # a second handle, from now on
        assert again.pid == cat.pid
        again.send_stdin(b"two\n")
        again.close_stdin()
        result = again.wait()
        assert result.exit_code == 0 and result.stdout.endswith("two\n")
        assert cat.wait().stdout == "one\ntwo\n"  # the first handle saw everything from the start
        assert sb.commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException):
            sb.commands.run(f"kill -0 {sleeper.pid}")
        with pytest.raises(CommandExitException) as killed:
            sleeper.wait()
        assert killed.value.exit_code == -1  # envd's "signal: killed"
        assert sb.commands.kill(sleeper.pid) is False and sleeper.pid not in [p.pid for p in sb.commands.list()]
        # StreamInput (the SDK itself sends SendInput): envd's generated client, in order, then EOF
        import pyqwest
        from e2b.envd.process import process_connect, process_pb
        from protobuf import Oneof

        streamed = sb.commands.run("cat", background=True, stdin=True)
        client = process_connect.ProcessClientSync(
            f"https://49983-{sb.sandbox_id}.{endpoint['domain']['domain']}",
            http_client=pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True)))
        chosen = process_pb.ProcessSelector(selector=Oneof("pid", streamed.pid))

        def inputs() -> Iterator[Any]:
            yield process_pb.StreamInputRequest(event=Oneof("start", process_pb.StreamInputRequest.StartEvent(
                process=chosen)))
            for part in (b"a", b"b\n"):
                yield process_pb.StreamInputRequest(event=Oneof("data", process_pb.StreamInputRequest.DataEvent(
                    input=process_pb.ProcessInput(input=Oneof("stdin", part)))))

        client.stream_input(inputs(), headers={"X-Access-Token": sb._envd_access_token or ""})
        streamed.close_stdin()
        assert streamed.wait().stdout == "ab\n"
        with pytest.raises(NotFoundException):
            sb.commands.connect(999999)
        with pytest.raises(NotFoundException):
            sb.commands.send_stdin(999999, "x")


def test_a_terminal_takes_input_resizes_and_dies(endpoint: dict[str, Any]) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    with Sandbox.create(**endpoint["domain"]) as sb:
        term = sb.pty.create(PtySize(cols=80, rows=24), envs={"ABC": "123"}, cwd="/")
        sb.pty.send_stdin(term.pid, b"echo $ABC; tput cols\n")
        sb.pty.resize(term.pid, PtySize(cols=100, rows=30))
        sb.pty.send_stdin(term.pid, b"tput cols; pwd; exit\n")
        out: list[bytes] = []
        assert term.wait(on_pty=out.append).exit_code == 0
        text = b"".join(out).decode()
        assert "123" in text and "100" in text and "\r\n/\r\n" in text
        other = sb.pty.create(PtySize(cols=80, rows=24), user="nobody")
        assert sb.pty.kill(other.pid) is True
        with pytest.raises(CommandExitException):
            sb.commands.run(f"kill -0 {other.pid}")
        with pytest.raises(CommandExitException):
            other.wait()
        assert sb.pty.kill(other.pid) is False


def test_file_operations_users_and_watches(endpoint: dict[str, Any]) -> None:
    from e2b import FilesystemEventType, FileType, NotFoundException

    with Sandbox.create(**endpoint["domain"]) as sb:
        assert sb.files.make_dir("w/deep/er") is True and sb.files.make_dir("w/deep/er") is False
        watch = sb.files.watch_dir("w", recursive=True)
        sb.files.write("w/a.txt", "x")
        events = [(e.type, e.name) for e in watch.get_new_events()]
        assert events == [(FilesystemEventType.CREATE, "a.txt"), (FilesystemEventType.CHMOD, "a.txt"),
                          (FilesystemEventType.WRITE, "a.txt")]  # envd's upload: create, chown, write
        moved = sb.files.rename("w/a.txt", "w/deep/b.txt")
        assert (moved.path, moved.type) == ("/workspace/w/deep/b.txt", FileType.FILE)
        assert {(e.type, e.name) for e in watch.get_new_events()} >= {(FilesystemEventType.RENAME, "a.txt"),
                                                                      (FilesystemEventType.CREATE, "deep/b.txt")}
        sb.files.remove("w/deep")
        assert (FilesystemEventType.REMOVE, "deep/b.txt") in {(e.type, e.name) for e in watch.get_new_events()}
        watch.stop()
        sb.files.remove("w/deep")  # already gone: fine, as envd's RemoveAll
        assert not sb.files.exists("w/deep") and sb.files.exists("w")
        assert [e.name for e in sb.files.list("w", depth=2)] == []
        with pytest.raises(NotFoundException):
            sb.files.rename("w/missing", "w/x")
        with pytest.raises(NotFoundException):
            sb.files.watch_dir("nowhere")
        with pytest.raises(SandboxException, match="not a directory"):
            sb.files.watch_dir("/etc/hostname")
        # user=: files are written and read as that user, and checked as that user; a watcher sees envd's
        # upload (create, write, and the chown that gives the file to its user), as for root's writes above.
        sb.files.make_dir("/tmp/seen", user="nobody")
        seen = sb.files.watch_dir("/tmp/seen")
        sb.files.write("/tmp/seen/n.txt", "n", user="nobody")
        assert sorted(e.type.value for e in seen.get_new_events()) == sorted(
            k.value for k in (FilesystemEventType.CREATE, FilesystemEventType.WRITE, FilesystemEventType.CHMOD))
        seen.stop()
        sb.files.write("/tmp/mine.txt", "n", user="nobody")
        info = sb.files.get_info("/tmp/mine.txt")
        assert (info.owner, info.group, info.size) == ("nobody", "nogroup", 1)
        assert sb.files.read("/tmp/mine.txt", user="nobody") == "n"
        with pytest.raises(SandboxException, match=r"[Pp]ermission denied"):
            sb.files.write("/root/nope.txt", "x", user="nobody")
        with pytest.raises(SandboxException, match=r"[Pp]ermission denied"):
            sb.files.make_dir("/root/nope", user="nobody")
        link = sb.commands.run("ln -s /tmp/mine.txt /tmp/link && echo ok").stdout
        assert link == "ok\n" and sb.files.get_info("/tmp/link").symlink_target == "/tmp/mine.txt"


def test_get_host_reaches_a_server_in_the_sandbox(endpoint: dict[str, Any]) -> None:
    import pyqwest

    with Sandbox.create(allow_internet_access=False, **endpoint["domain"]) as sb:  # inbound works without egress
        sb.files.write("/tmp/site/hello.txt", "hi from the sandbox")
        server = sb.commands.run("python3 -m http.server 8000", background=True, cwd="/tmp/site", timeout=0)
        client = pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True))
        url = f"https://{sb.get_host(8000)}/hello.txt"
        deadline = time.monotonic() + 30
        while True:
            got = client.get(url)
            if got.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (got.status, got.content) == (200, b"hi from the sandbox")
        posted = client.post(f"https://{sb.get_host(8000)}/hello.txt", content=b"body")
        assert posted.status == 501  # http.server has no POST: its own answer, relayed
        server.kill()


def test_private_ports_answer_only_to_the_traffic_token(endpoint: dict[str, Any]) -> None:
    import pyqwest
    from e2b import SandboxNetworkOpts

    with Sandbox.create(secure=True, network=SandboxNetworkOpts(allow_public_traffic=False),
                        **endpoint["domain"]) as sb:
        token = sb.traffic_access_token
        assert token is not None and Sandbox.connect(sb.sandbox_id, **endpoint["domain"]).traffic_access_token == token
        sb.files.write("/tmp/site/hello.txt", "private")
        sb.commands.run("python3 -m http.server 8000", background=True, cwd="/tmp/site", timeout=0)
        client = pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True))
        url = f"https://{sb.get_host(8000)}/hello.txt"
        refused = client.get(url)
        assert refused.status == 403 and b"e2b-traffic-access-token" in refused.content, refused.content
        assert client.get(url, headers={"e2b-traffic-access-token": "eta1_" + "0" * 64}).status == 403
        deadline = time.monotonic() + 30
        while (got := client.get(url, headers={"e2b-traffic-access-token": token})).status != 200:
            assert time.monotonic() < deadline, got.status
            time.sleep(0.2)
        assert got.content == b"private"
        assert sb.files.read("/tmp/site/hello.txt") == "private"  # envd itself takes its access token, as before
    with Sandbox.create(**endpoint["domain"]) as public:
        assert public.traffic_access_token is None


_WS_ECHO = r"""
import base64, hashlib, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); print("ready", flush=True)
c, _ = s.accept(); head = b""
while b"\r\n\r\n" not in head:
    head += c.recv(4096)
key = [l.split(":", 1)[1].strip() for l in head.decode().split("\r\n") if l.lower().startswith("sec-websocket-key")][0]
accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
          + f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode())
def exactly(n):
    out = b""
    while len(out) < n:
        out += c.recv(n - len(out))
    return out
while True:
    b0, b1 = exactly(2); n = b1 & 127; mask = exactly(4)
    data = bytes(b ^ mask[i % 4] for i, b in enumerate(exactly(n)))
    c.sendall(bytes([b0, len(data)]) + data)  # an echo; a close frame echoed is the close handshake
    if b0 & 15 == 8:
        break
"""


async def test_a_websocket_reaches_a_server_in_the_sandbox(endpoint: dict[str, Any]) -> None:
    import ssl

    import websockets

    sb = await AsyncSandbox.create(**endpoint["domain"])
    try:
        server = await sb.commands.run(f"python3 -c '{_WS_ECHO}' 8765", background=True, timeout=0)
        deadline = time.monotonic() + 30
        while "ready" not in server.stdout:
            assert time.monotonic() < deadline, server.stderr
            await asyncio.sleep(0.1)
        tls = ssl.create_default_context(cafile=str(endpoint["ca"]))
        url = f"wss://{sb.get_host(8765)}/echo"
        async with websockets.connect(url, ssl=tls, host="127.0.0.1", port=endpoint["port"]) as ws:
            await ws.send("over the E2B listener")
            assert await asyncio.wait_for(ws.recv(), 10) == "over the E2B listener"
            await ws.send(b"\x00\xffbytes")
            assert await asyncio.wait_for(ws.recv(), 10) == b"\x00\xffbytes"
    finally:
        await sb.kill()


async def test_async_sdk_processes_terminals_and_watches(endpoint: dict[str, Any]) -> None:
    from e2b import FilesystemEvent, FilesystemEventType
    from e2b.sandbox.commands.command_handle import PtySize

    sb = await AsyncSandbox.create(**endpoint["domain"])
    try:
        cat = await sb.commands.run("cat", background=True, stdin=True)
        assert cat.pid in [p.pid for p in await sb.commands.list()]
        await sb.commands.send_stdin(cat.pid, "async\n")
        await cat.close_stdin()
        assert (await cat.wait()).stdout == "async\n"
        sleeper = await sb.commands.run("sleep 30", background=True, user="nobody")
        seen = await sb.commands.connect(sleeper.pid)
        assert await seen.kill() is True
        with pytest.raises(CommandExitException):
            await seen.wait()
        out: list[bytes] = []
        term = await sb.pty.create(PtySize(cols=90, rows=20), on_data=out.append)
        await sb.pty.resize(term.pid, PtySize(cols=120, rows=20))
        await sb.pty.send_stdin(term.pid, b"tput cols; exit\n")
        assert (await term.wait()).exit_code == 0 and "120" in b"".join(out).decode()
        await sb.files.make_dir("/tmp/aw")
        events: list[FilesystemEvent] = []
        watch = await sb.files.watch_dir("/tmp/aw", on_event=events.append)  # the streamed WatchDir
        await sb.files.write("/tmp/aw/f.txt", "1")
        await sb.files.rename("/tmp/aw/f.txt", "/tmp/aw/g.txt")
        deadline = time.monotonic() + 10
        while (FilesystemEventType.RENAME, "f.txt") not in {(e.type, e.name) for e in events}:
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.05)
        await watch.stop()
        assert (FilesystemEventType.CREATE, "f.txt") in {(e.type, e.name) for e in events}
        assert await sb.files.exists("/tmp/aw/g.txt") and (await sb.files.get_info("/tmp/aw")).type.value == "dir"
        await sb.files.remove("/tmp/aw")
        assert not await sb.files.exists("/tmp/aw")
    finally:
        await sb.kill()
