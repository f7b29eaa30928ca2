"""SWE-ReX on DSec, checked by SWE-ReX's own runtime tests: ``tests/test_execution.py`` of the swe-rex sdist
(unpacked by ``scripts/setup``) with its ``remote_runtime`` fixture pointed at a :class:`DSecDeployment` on a real
daemon (one sandbox for the module, as upstream shares one server), plus the deployment's own life cycle.

Of upstream's tests, four are replaced: two assume the server shares the test's filesystem (they write or read
``tmp_path`` on the host; here the same calls meet the sandbox's files through the SDK), ``test_server_dead``
resolves a public host name (no traffic leaves this machine; a dead server is checked in the life-cycle test
instead), and ``test_interrupt_pager`` asserts where bash prints a job notice (see its replacement)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import sys
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("swerex", reason="swe-rex is not installed: pip install 'dsec[swerex]'")

from swerex.exceptions import CommandTimeoutError, DeploymentNotStartedError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

import dsec
from conftest import missing
from container_support import daemon_process
from dsec.integrations.swerex import DSecDeployment, build_image

pytestmark = [pytest.mark.root, pytest.mark.slow]

UPSTREAM = Path(sys.prefix) / "share" / "dsec" / f"swerex-{importlib.metadata.version('swe-rex')}"
"""Where scripts/setup unpacks the sdist's tests, as the package ``swerex_upstream_tests``."""
IMAGE = "swerex-test"



class _Action(BashAction):
    """What upstream's conftest gives its tests as ``A``: a session command with a 5 s timeout."""

    timeout: float | None = 5


class _Command(Command):
    """Upstream's ``C``: a one-off command with a 5 s timeout."""

    timeout: float | None = 5


@pytest.fixture
async def runtime_with_default_session(remote_runtime: RemoteRuntime) -> AsyncIterator[RemoteRuntime]:
    """Upstream's fixture of the same name: the runtime with its default session open. Its bash gets 10 s to
    start, not SWE-ReX's default 1 s: on a loaded 2-core machine a slow start leaves the session half made, and
    every later test of the module would find it "already exists"."""
    await remote_runtime.create_session(CreateBashSessionRequest(startup_timeout=10))
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())


# The sdist ships the tests without their conftest: this module stands in for it (the fixtures and the two
# action classes they import), with ``remote_runtime`` on DSec below.
if (UPSTREAM / "swerex_upstream_tests" / "test_execution.py").is_file():
    sys.path.insert(0, str(UPSTREAM))
    sys.modules["swerex_upstream_tests.conftest"] = sys.modules[__name__]
    from swerex_upstream_tests.test_execution import *  # noqa: F403 (upstream's runtime tests, collected here)

    del test_read_write_file, test_read_large_file, test_server_dead  # type: ignore[name-defined]  # noqa: F821
    del test_interrupt_pager  # type: ignore[name-defined]  # noqa: F821

T = TypeVar("T")


def test_upstream_suite_present() -> None:
    if not (UPSTREAM / "swerex_upstream_tests" / "test_execution.py").is_file():
        missing(f"SWE-ReX's own tests are not unpacked in {UPSTREAM}: run ./scripts/setup")


@pytest.fixture(scope="module")
def daemon_url() -> Iterator[str]:
    with daemon_process("dsec-swerex-") as (unix_url, _):
        yield unix_url


class _Loop:
    """An event loop in a thread of its own: the module's deployment outlives each test's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=900)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def image(daemon_url: str) -> str:
    """The swerex image from :func:`build_image` (a cache hit after the first build on this machine), with
    ``less`` for upstream's pager check (as in the python image upstream tests on)."""
    debs = sorted((UPSTREAM / "debs").glob("less_*.deb"))
    if not debs:
        missing(f"Debian's less package is not in {UPSTREAM / 'debs'}: run ./scripts/setup")

    async def build() -> str:
        async with dsec.Client(daemon_url) as client:
            return (await build_image(IMAGE, debs=debs, client=client)).name
    return asyncio.run(build())


@pytest.fixture(scope="module")
def deployment(daemon_url: str, image: str) -> Iterator[DSecDeployment]:
    loop = _Loop()
    dep = DSecDeployment(image=image, url=daemon_url)
    try:
        loop.run(dep.start())
        yield dep
    finally:
        loop.run(dep.stop())
        loop.close()


@pytest.fixture
async def remote_runtime(deployment: DSecDeployment) -> AsyncIterator[RemoteRuntime]:
    """Upstream's fixture, pointed at the deployment: a fresh client of the sandbox's server per test."""
    r = RemoteRuntime.from_config(deployment.runtime_config)
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def sandbox(deployment: DSecDeployment, daemon_url: str) -> AsyncIterator[dsec.AsyncSandbox]:
    """The deployment's sandbox, through a client of this test's loop."""
    async with dsec.Client(daemon_url) as client:
        yield await dsec.AsyncSandbox.connect(deployment.sandbox.id, client)


async def test_read_write_file_in_sandbox(remote_runtime: RemoteRuntime, sandbox: dsec.AsyncSandbox) -> None:
    """Upstream's test_read_write_file, reading back through the sandbox instead of the host."""
    await remote_runtime.write_file(WriteFileRequest(path="/tmp/rw/test.txt", content="test"))
    assert await sandbox.files.read("/tmp/rw/test.txt") == b"test"
    assert (await remote_runtime.read_file(ReadFileRequest(path="/tmp/rw/test.txt"))).content == "test"


async def test_read_large_file_from_sandbox(remote_runtime: RemoteRuntime, sandbox: dsec.AsyncSandbox) -> None:
    """Upstream's test_read_large_file, the file written into the sandbox."""
    await sandbox.files.write("/tmp/large_file.txt", "x" * 1024 * 1024)
    response = await remote_runtime.read_file(ReadFileRequest(path="/tmp/large_file.txt"))
    assert len(response.content) == 1024 * 1024


async def test_interrupt_pager_in_sandbox(runtime_with_default_session: RemoteRuntime) -> None:
    """Upstream's test_interrupt_pager without its last line: that the job's ``Killed`` notice lands in the next
    command's output is bash's timing (here, with bookworm's bash, it comes after that command's prompt). The
    interrupt's fallback (^Z, ``kill -9 %1``) ran, the pager is gone, the session works."""
    rt = runtime_with_default_session
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(_Action(command="echo 'blargh'|less -+F", timeout=0.1))
    interrupted = await rt.run_in_session(BashInterruptAction(timeout=2))  # each step's wait (default 0.2 s)
    assert "Stopped" in interrupted.output
    r = await rt.run_in_session(_Action(command="echo 'asdf'; cat /proc/[0-9]*/comm 2>/dev/null | grep -cx less",
                                        check="silent"))
    assert r.output.split()[:2] == ["asdf", "0"]  # then, or not yet, bash's notice of the killed job


async def test_session_state_and_upload(remote_runtime: RemoteRuntime, tmp_path: Path,
                                        sandbox: dsec.AsyncSandbox) -> None:
    """cd, exported variables and functions persist in a session; an upload lands in the sandbox, not on the
    host."""
    await remote_runtime.create_session(CreateBashSessionRequest(session="state"))
    try:
        await remote_runtime.run_in_session(
            BashAction(session="state", command="mkdir -p /tmp/s && cd /tmp/s && export X=42 && f() { echo hi; }",
                       check="raise"))
        out = await remote_runtime.run_in_session(BashAction(session="state", command="pwd; echo $X; f",
                                                             check="raise"))
        assert out.output.split() == ["/tmp/s", "42", "hi"]
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest(session="state"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("A")
    await remote_runtime.upload(UploadRequest(source_path=str(tmp_path / "d"), target_path="/tmp/up"))
    assert await sandbox.files.read("/tmp/up/a.txt") == b"A"
    assert not Path("/tmp/up/a.txt").exists() or Path("/tmp/up/a.txt").read_text() != "A"


async def test_deployment_life_cycle(daemon_url: str, image: str) -> None:
    """start, is_alive, the runtime, stop (twice); a stopped deployment raises as SWE-ReX's do; a server that
    dies is reported with its output."""
    dep = DSecDeployment(image=image, url=daemon_url, startup_timeout=120)
    with pytest.raises(DeploymentNotStartedError):
        await dep.is_alive()
    await dep.start()
    try:
        assert await dep.is_alive()
        r = await dep.runtime.execute(Command(command="echo $((6*7))", shell=True))
        assert r.stdout == "42\n"
        sandbox_id = dep.sandbox.id
        server = next(p for p in await dep.sandbox.processes.list() if p.command[0] == "swerex-remote")
        process = await dep.sandbox.processes.connect(server.pid)
        await process.kill()
        await process.wait(timeout=30)
        with pytest.raises(dsec.DSecError, match="swerex-remote exited"):
            await dep.is_alive()
    finally:
        await dep.stop()
    await dep.stop()
    with pytest.raises(DeploymentNotStartedError):
        _ = dep.runtime
    async with dsec.Client(daemon_url) as client:
        assert sandbox_id not in {s.id for s in await dsec.AsyncSandbox.list(client=client)}


async def test_image_without_server(daemon_url: str) -> None:
    """An image without swerex-remote is refused with what to do, and leaves no sandbox."""
    dep = DSecDeployment(image="debian-python", url=daemon_url)
    with pytest.raises(dsec.InvalidRequest, match="build_image"):
        await dep.start()
    async with dsec.Client(daemon_url) as client:
        left = await dsec.AsyncSandbox.list(labels={"dsec.integration": "swerex"}, client=client)
        images = [(await s.info()).spec.image for s in left]
    assert "debian-python" not in images

