"""The daemon as a real server: uvicorn on a unix socket, client disconnects, TCP token, up/down."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec
from container_support import short_home
from dsec.config import Settings
from dsec.daemon.auth import TokenFile
from dsec.daemon.engine import Engine
from dsec.daemon.server import Daemon, ServeError, daemon_answers, destroy_every, down, up
from dsec.daemon.state import StateStore
from dsec.models import SandboxRecord
from dsec.testing.fake import FakeBackend, FakeImages


@pytest.fixture
def home() -> Iterator[Path]:
    # Short path: a unix socket path must fit in 108 bytes, and pytest's tmp_path may not.
    path = short_home("dsec-t-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Running:
    """A daemon serving from a background thread of the test process."""

    def __init__(self, settings: Settings, **kwargs: str) -> None:
        self.settings = settings
        self.engine = Engine(settings, {"container": FakeBackend(root=settings.home / "fake")}, FakeImages())
        self.daemon = Daemon(settings, engine=self.engine, **kwargs)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.daemon.run())
        except BaseException as exc:
            self.error = exc
            self.daemon.started.set()

    def __enter__(self) -> Running:
        self.thread.start()
        assert self.daemon.started.wait(30), "daemon did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "daemon thread did not stop"

    def client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.settings.socket_path))
        return httpx.Client(transport=transport, base_url="http://dsec", timeout=30)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def wait_until(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(predicate())  # type: ignore[operator]


def test_serves_on_a_private_unix_socket_and_stops_cleanly(home: Path) -> None:
    settings = Settings(home=home)
    with Running(settings) as running, running.client() as c:
        assert c.get("/v1/health").json()["backends"]["container"] == "ok"
        assert stat.S_IMODE(settings.socket_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(settings.run_dir.stat().st_mode) == 0o700
        sid = c.post("/v1/sandboxes", json={"image": "base"}).json()["id"]
        with pytest.raises(ServeError, match="another DSec daemon"):
            asyncio.run(Daemon(settings, engine=running.engine).run())
    assert not settings.socket_path.exists()
    # A plain stop leaves sandboxes for the next daemon to re-adopt.
    assert (home / "fake" / sid).is_dir()
    assert sid in StateStore.peek(settings.state_db)


def test_stale_socket_is_replaced(home: Path) -> None:
    settings = Settings(home=home)
    settings.run_dir.mkdir(parents=True)
    settings.socket_path.write_text("")  # left by a daemon that was SIGKILLed
    with Running(settings) as running, running.client() as c:
        assert c.get("/v1/health").status_code == 200


def test_client_disconnect_kills_the_command(home: Path) -> None:
    settings = Settings(home=home)
    with Running(settings) as running, running.client() as c:
        sid = c.post("/v1/sandboxes", json={"image": "base"}).json()["id"]
        body = {"command": "echo $$; exec sleep 300", "timeout": None}
        with c.stream("POST", f"/v1/sandboxes/{sid}/exec", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            first = json.loads(next(lines))
            pid = int(base64.b64decode(first["data"]))
            assert not gone(pid)
        # Leaving the block closed the connection mid-stream.
        assert wait_until(lambda: gone(pid)), f"command {pid} survived its client's disconnect"
        metrics = running.engine.metrics
        cancelled = {"backend": "container", "outcome": "cancelled"}
        assert wait_until(lambda: metrics.value("dsec_exec_total", **cancelled) == 1)
        # The sandbox itself is untouched and still usable.
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"command": "echo ok"})
        assert json.loads(r.text.splitlines()[-1])["result"]["exit_code"] == 0


def test_client_disconnect_kills_a_one_response_exec(home: Path) -> None:
    settings = Settings(home=home)
    with Running(settings) as running, running.client() as c:
        sid = c.post("/v1/sandboxes", json={"image": "base"}).json()["id"]
        pid_file = home / "fake" / sid / "pid"
        body = {"command": f"echo $$ > {pid_file}; exec sleep 300", "timeout": None}
        # The client gives up after 2 s without an answer and closes its connection.
        with pytest.raises(httpx.ReadTimeout):
            c.post(f"/v1/sandboxes/{sid}/exec/result", json=body, timeout=httpx.Timeout(30, read=2))
        assert wait_until(lambda: pid_file.is_file() and pid_file.read_text().strip())
        pid = int(pid_file.read_text())
        assert wait_until(lambda: gone(pid)), f"command {pid} survived its client's disconnect"
        metrics = running.engine.metrics
        cancelled = {"backend": "container", "outcome": "cancelled"}
        assert wait_until(lambda: metrics.value("dsec_exec_total", **cancelled) == 1)
        r = c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "echo ok"})
        assert r.status_code == 200 and base64.b64decode(r.json()["stdout"]) == b"ok\n"


def test_tcp_needs_the_token(home: Path) -> None:
    with pytest.raises(ServeError, match="without a token"):
        Daemon(Settings(home=home), tcp="127.0.0.1:0")
    with Running(Settings(home=home), tcp="127.0.0.1:0", token="t0k") as running:
        assert running.daemon.tcp_address is not None
        host, port = running.daemon.tcp_address
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as c:
            assert c.get("/v1/health").status_code == 200
            assert c.get("/v1/sandboxes").status_code == 401
            assert c.get("/v1/sandboxes", headers={"Authorization": "Bearer t0k"}).json() == []
        with running.client() as local:  # the unix socket needs no token
            assert local.get("/v1/sandboxes").status_code == 200


@pytest.mark.slow
def test_up_and_down(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(home=home)
    pid = up(settings, timeout=60, module="dsec.testing.fake_daemon")
    try:
        assert settings.pid_file.read_text().strip() == str(pid)
        assert daemon_answers(settings)
        with pytest.raises(ServeError, match="already answers"):
            up(settings)
        transport = httpx.HTTPTransport(uds=str(settings.socket_path))
        with httpx.Client(transport=transport, base_url="http://dsec", timeout=30) as c:
            assert c.get("/v1/health").json()["sandboxes"] == 0
    finally:
        stopped = down(settings)
    assert stopped
    assert gone(pid)
    assert not settings.pid_file.exists()
    assert not settings.socket_path.exists()
    assert down(settings) is False


def test_destroy_every_names_what_it_could_not_destroy(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dsec down --destroy`` (and ``cluster down --destroy``) destroy through the API, many at a time; a
    sandbox whose destroy fails is named in the error (it used to be ignored and silently kept)."""
    settings = Settings(home=home)
    with Running(settings) as running, dsec.Client(f"unix://{settings.socket_path}") as client:
        made = dsec.Sandbox.create_many(24, image="base", client=client)
        stuck = made[5].id
        real = FakeBackend.destroy

        async def failing(self: FakeBackend, record: SandboxRecord) -> None:
            if record.id == stuck:
                raise OSError(f"device busy under {record.id}")
            await real(self, record)

        monkeypatch.setattr(FakeBackend, "destroy", failing)
        with pytest.raises(ServeError, match=rf"1 of 24 sandbox\(es\) could not be destroyed: {stuck} \(HTTP 5"):
            destroy_every("http://dsec", uds=str(settings.socket_path))
        with running.client() as c:
            assert [info["id"] for info in c.get("/v1/sandboxes").json()] == [stuck]
        monkeypatch.setattr(FakeBackend, "destroy", real)
        assert destroy_every("http://dsec", uds=str(settings.socket_path)) == 1
        assert destroy_every("http://dsec", uds=str(settings.socket_path)) == 0
        with running.client() as c:
            assert c.get("/v1/sandboxes").json() == []
    with pytest.raises(ServeError, match="cannot list the sandboxes to destroy"):
        destroy_every("http://dsec", uds=str(settings.socket_path))


@pytest.mark.slow
def test_up_reports_early_death_with_the_log(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(home=home)
    with pytest.raises(ServeError, match="cannot listen on TCP") as err:
        up(settings, tcp="256.0.0.1:1", token="x", timeout=60, module="dsec.testing.fake_daemon")
    assert "exited with status 1" in str(err.value)
    assert not settings.pid_file.exists()
    assert not os.path.exists(settings.socket_path)


# ------------------------------------------------------------------------------ token scopes and rate limits
def _tcp(running: Running) -> str:
    assert running.daemon.tcp_address is not None
    host, port = running.daemon.tcp_address
    return f"http://{host}:{port}"


def test_job_tokens_see_only_their_own_sandboxes(home: Path) -> None:
    settings = Settings(home=home)
    tokens = TokenFile(settings.tokens_file)
    job_a, job_b = tokens.create("a", job="job-a"), tokens.create("b", job="job-b")
    assert stat.S_IMODE(settings.tokens_file.stat().st_mode) == 0o600
    assert job_a not in settings.tokens_file.read_text()  # only digests are stored
    with Running(settings, tcp="127.0.0.1:0", token="admin-t0k") as running:
        url = _tcp(running)
        with dsec.Client(url, job_a) as ca, dsec.Client(url, job_b) as cb, dsec.Client(url, "admin-t0k") as admin:
            a = dsec.Sandbox.create(image="base", labels={"dsec.job": "job-b", "k": "v"}, client=ca)
            b = dsec.Sandbox.create(image="base", client=cb)
            mine = dsec.Sandbox.create(image="base", client=admin)
            # the job label is the token's, whatever the body claimed
            assert a.info().labels == {"dsec.job": "job-a", "k": "v"}
            assert [s.id for s in dsec.Sandbox.list(client=ca)] == [a.id]
            assert [s.id for s in dsec.Sandbox.list(client=cb)] == [b.id]
            assert [s.id for s in dsec.Sandbox.list(labels={"dsec.job": "job-b"}, client=ca)] == [a.id]
            assert {s.id for s in dsec.Sandbox.list(client=admin)} == {a.id, b.id, mine.id}
            # another job's sandbox answers exactly like a missing one, on every route
            for other in (b.id, mine.id, "sb-doesnotexist"):
                with pytest.raises(dsec.SandboxNotFound):
                    dsec.Sandbox.connect(other, client=ca)
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {job_a}"}, timeout=30) as h:
                for method, path in (("POST", f"/v1/sandboxes/{b.id}/exec"), ("DELETE", f"/v1/sandboxes/{b.id}"),
                                     ("GET", f"/v1/sandboxes/{b.id}/files/list?path=/"),
                                     ("POST", f"/v1/sandboxes/{b.id}/fork")):
                    r = h.request(method, path, json={"command": "true"} if "exec" in path else {"count": 1})
                    assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxNotFound", (path, r.text)
                # admin-only routes
                assert h.get("/metrics").status_code == 403
                assert h.post("/v1/images/pull", json={"reference": "x"}).json()["error"]["type"] == "Forbidden"
                r = h.post("/v1/sandboxes", json={"image": "base", "trajectory": "job-b/r1"})
                assert r.status_code == 403 and "job-a/" in r.json()["error"]["message"]
                assert h.get("/v1/images").status_code == 200
            # its own sandbox works fully, the admin controls everyone's
            assert a.exec("echo hi").exit_code == 0
            dsec.Sandbox.connect(b.id, client=admin).close()
            with pytest.raises(dsec.SandboxNotFound):
                dsec.Sandbox.connect(b.id, client=cb)
            a.close()
            mine.close()
        # a revoked token is refused at once by the running daemon
        tokens.remove("a")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {job_a}"}, timeout=30) as h:
            assert h.get("/v1/sandboxes").status_code == 401


def test_rate_limits_answer_429_with_retry_after(home: Path) -> None:
    settings = Settings(home=home)
    tokens = TokenFile(settings.tokens_file)
    slow = tokens.create("slow", job="j", requests_per_s=2)
    creator = tokens.create("creator", job="k", creates_per_s=1)
    with Running(settings, tcp="127.0.0.1:0") as running:  # a token file alone is enough for TCP
        url = _tcp(running)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {slow}"}, timeout=30) as h:
            codes = [h.get("/v1/sandboxes") for _ in range(4)]
            limited = [r for r in codes if r.status_code == 429]
            assert codes[0].status_code == 200 and limited, [r.status_code for r in codes]
            assert int(limited[0].headers["Retry-After"]) >= 1
            body = limited[0].json()["error"]
            assert body["type"] == "RateLimited" and 0 < body["detail"]["retry_after"] <= 1.0, body
            time.sleep(body["detail"]["retry_after"])
            assert h.get("/v1/sandboxes").status_code == 200
        with dsec.Client(url, creator) as c:
            first = dsec.Sandbox.create(image="base", client=c)
            with pytest.raises(dsec.RateLimited) as exc:
                dsec.Sandbox.create(image="base", client=c)
            assert isinstance(exc.value, dsec.QuotaExceeded) and 0 < exc.value.retry_after <= 1.0
            assert "creates/s" in str(exc.value)
            first.exec("true")  # other calls are not creates
            first.close()
        with pytest.raises(dsec.Unauthorized), dsec.Client(url, "wrong") as c:
            dsec.Sandbox.list(client=c)


def test_token_file_is_validated(home: Path) -> None:
    tokens = TokenFile(Settings(home=home).tokens_file)
    for kwargs, match in (({"job": "j", "admin": True}, "either"), ({}, "either"),
                          ({"job": "bad job"}, "job name"), ({"job": "j", "requests_per_s": 0}, "positive"),
                          ({"job": "j", "creates_per_s": float("nan")}, "positive")):
        with pytest.raises(dsec.InvalidRequest, match=match):
            tokens.create("t", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(dsec.InvalidRequest, match="token name"):
        tokens.create("../x", job="j")
    tokens.create("t", job="j")
    with pytest.raises(dsec.InvalidRequest, match="already exists"):
        tokens.create("t", admin=True)
    with pytest.raises(dsec.InvalidRequest, match="no token named"):
        tokens.remove("nope")
    Settings(home=home).tokens_file.write_text("{not json")
    with pytest.raises(dsec.InvalidRequest, match="unreadable"):
        tokens.entries()
    with pytest.raises(ServeError, match="without a token"):
        Daemon(Settings(home=home / "other"), tcp="127.0.0.1:0")
