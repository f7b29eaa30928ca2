"""The E2B endpoint in-process: a daemon (engine over the fake backend) with ``--e2b``, driven by the real e2b SDK
over plain HTTP (the E2B_API_URL/E2B_SANDBOX_URL form). The container-backend run is
tests/integration/functional/test_e2b.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("e2b", reason="the E2B endpoint needs the e2b SDK: pip install 'dsec[e2b]'")

from e2b import CommandExitException, Sandbox, SandboxNotFoundException, SandboxQuery

from container_support import short_home
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.daemon.server import Daemon, ServeError
from dsec.e2b import E2BOptions
from dsec.testing.fake import FakeBackend, FakeImages

KEY = "e2b_" + "7" * 40


@pytest.fixture(scope="module")
def opts() -> Iterator[dict[str, Any]]:
    home = short_home("dsec-e2b-u-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(home=home)
    engine = Engine(settings, {"container": FakeBackend(root=home / "fake")}, FakeImages())
    daemon = Daemon(settings, engine=engine, token=KEY,
                    e2b=E2BOptions(listen=f"127.0.0.1:{port}", default_image="base"))
    thread = threading.Thread(target=lambda: asyncio.run(daemon.run()), daemon=True)
    thread.start()
    assert daemon.started.wait(30)
    url = f"http://127.0.0.1:{port}"
    try:
        yield {"api_key": KEY, "api_url": url, "sandbox_url": url}
    finally:
        daemon.stop()
        thread.join(30)
        shutil.rmtree(home, ignore_errors=True)


def test_a_sandbox_through_the_sdk(opts: dict[str, Any]) -> None:
    sb = Sandbox.create(metadata={"t": "unit"}, timeout=60, **opts)
    r = sb.commands.run("printf out; printf err >&2", envs={"X": "1"})
    assert (r.stdout, r.stderr.endswith("err"), r.exit_code) == ("out", True, 0)
    with pytest.raises(CommandExitException) as failed:
        sb.commands.run("exit 4")
    assert failed.value.exit_code == 4
    sb.files.write("/tmp/f.txt", "data")
    assert sb.files.read("/tmp/f.txt") == "data"
    info = sb.get_info()
    assert info.metadata == {"t": "unit"}
    # its own startedAt (rounded to the microsecond on the way out) given back as startedAfter still lists it
    after = Sandbox.list(query=SandboxQuery(started_after=info.started_at), **opts).next_items()
    assert [s.sandbox_id for s in after] == [sb.sandbox_id]
    handle = sb.commands.run("sleep 30", background=True)
    assert handle.pid in [p.pid for p in sb.commands.list()]
    assert sb.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        handle.wait()
    assert sb.commands.kill(handle.pid) is False  # ended: envd forgets it
    assert sb.files.make_dir("/tmp/d/e") is True and sb.files.make_dir("/tmp/d/e") is False
    assert sorted(e.name for e in sb.files.list("/tmp/d")) == ["e"]
    assert sb.kill() is True
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id, **opts)


def test_routes_without_the_sdk(opts: dict[str, Any]) -> None:
    url = opts["api_url"]
    assert httpx.get(f"{url}/sandboxes").status_code == 401
    headers = {"X-API-Key": KEY}
    answer = httpx.get(f"{url}/v2/templates", headers=headers)
    assert answer.status_code == 501 and "not supported by DSec" in answer.json()["message"]
    assert httpx.get(f"{url}/nowhere", headers=headers).status_code == 404
    gone = httpx.get(f"{url}/health", headers={"E2b-Sandbox-Id": "sb-000000000000"})
    assert gone.status_code == 502 and json.loads(gone.content)["code"] == 502
    bad = httpx.post(f"{url}/sandboxes", headers=headers, content=b"{not json")
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["message"]


def test_the_listener_needs_a_token(tmp_path: Any) -> None:
    with pytest.raises(ServeError, match="--e2b without a token"):
        Daemon(Settings(home=tmp_path), e2b=E2BOptions(listen="127.0.0.1:0"))
