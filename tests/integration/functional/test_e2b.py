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
        with daemon_process("dsec-e2b-", tcp_token=ADMIN, args=args) as (unix_url, _tcp):
            yield {"port": port, "unix_url": unix_url, "ca": certs / "ca.pem",
                   "domain": {"api_key": ADMIN, "domain": f"e2b.localhost:{port}"},
                   "urls": {"api_key": ADMIN, "api_url": f"https://127.0.0.1:{port}",
                            "sandbox_url": f"https://127.0.0.1:{port}"}}


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
        with pytest.raises(SandboxException, match="not supported by this DSec version"):
            sb.commands.run("whoami", user="root")


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
        with pytest.raises(SandboxException, match="not supported by this DSec version"):
            sb.files.remove("notes/a.txt")
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
    with pytest.raises(TimeoutException):  # the connection is cut, as a dead envd's would be
        handle.wait()


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
        port = client.get(f"https://{mine.get_host(8000)}/")
        assert port.status == 502 and "port exposure" in json.loads(port.content)["message"]
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

