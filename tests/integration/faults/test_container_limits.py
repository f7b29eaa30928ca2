"""Limits and faults on real container sandboxes, through the real daemon app and the SDK.

A daemon (engine + ContainerBackend + the image store) serves on a unix socket from a thread of the
test process; the tests drive it with ``dsec.AsyncSandbox`` and raw httpx. Every limit must end the
offending command with a clear verdict, leave the sandbox usable and the host unaffected.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import dsec
from container_support import assert_clean, images_dir, leftovers, short_home, sweep
from dsec.backends.base import ImageRef
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.daemon.server import Daemon
from dsec.images.node import NodeImages

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024


@dataclass
class Served:
    settings: Settings
    engine: Engine
    url: str

    def http(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.settings.socket_path))
        return httpx.Client(transport=transport, base_url="http://dsec", timeout=60)


@pytest.fixture(scope="module")
def served(debian_python_image: ImageRef) -> Iterator[Served]:
    # Short home: a unix socket path must fit in 108 bytes.
    home = short_home("dsec-lim-")
    settings = Settings(home=home, images_dir=images_dir())
    engine = Engine(settings, {"container": ContainerBackend(settings)}, NodeImages(settings),
                    reaper_interval=0.2)
    daemon = Daemon(settings, engine=engine)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(daemon.run())
        except BaseException as exc:
            errors.append(exc)
            daemon.started.set()

    thread = threading.Thread(target=run, name="dsec-limits-daemon", daemon=True)
    thread.start()
    try:
        assert daemon.started.wait(60) and not errors, f"daemon did not start: {errors}"
        yield Served(settings, engine, f"unix://{settings.socket_path}")
    finally:
        try:
            if not errors:
                with Served(settings, engine, "").http() as client:
                    for info in client.get("/v1/sandboxes").json():
                        client.delete(f"/v1/sandboxes/{info['id']}")
        finally:
            daemon.stop()
            thread.join(60)
            removed = asyncio.run(sweep(home, images_dir()))
            shutil.rmtree(home, ignore_errors=True)
        assert not thread.is_alive(), "daemon thread did not stop"
        assert removed == [], f"sandboxes left behind: {removed}"


@pytest.fixture
async def client(served: Served) -> AsyncIterator[dsec.Client]:
    c = dsec.Client(url=served.url)
    try:
        yield c
        assert await dsec.AsyncSandbox.list(client=c) == [], "a test left a sandbox running"
    finally:
        await c.aclose()


def host_process_count() -> int:
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())


async def test_memory_bomb_is_oom_killed_and_sandbox_survives(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="debian-python", memory="64Mi", client=client) as sb:
        r = await sb.exec(["python3", "-c", "x = bytearray(512 * 1024 * 1024)"], timeout=120)
        assert r.limit == "memory" and r.exit_code == 137 and r.signal == 9, r
        stats = await sb.stats()
        assert stats.oom_kills >= 1, stats
        r = await sb.exec("echo alive")
        assert r.stdout == b"alive\n" and r.limit is None, r
        # and within the limit, memory is usable
        r = await sb.exec(["python3", "-c", "x = bytearray(16 * 1024 * 1024); print(len(x))"])
        assert r.stdout == b"16777216\n", r


_FORK_BOMB = r"""
import os, sys, time
kids, err = [], None
try:
    for _ in range(2000):
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    err = e.errno
print(len(kids), err, flush=True)
for k in kids:
    os.kill(k, 9)
for k in kids:
    os.waitpid(k, 0)
sys.exit(3 if err else 0)
"""


async def test_fork_bomb_hits_pids_limit_host_unaffected(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="debian-python", pids=64, client=client) as sb:
        before = host_process_count()
        r = await sb.exec(["python3", "-c", _FORK_BOMB], timeout=120)
        forked, err = r.stdout.split()
        assert err == b"11", r  # EAGAIN: fork refused by the pids cgroup
        assert int(forked) < 64, r
        assert r.exit_code == 3 and r.limit == "pids", r
        # the host's process table was never flooded: the bomb's processes were all in the sandbox
        assert host_process_count() - before < 64, (before, host_process_count())
        stats = await sb.stats()
        assert stats.pids <= 64, stats
        r = await sb.exec("echo alive")
        assert r.stdout == b"alive\n", r
    # a real shell fork bomb too: it stays under the limit, the sandbox can clean itself up (kill -1
    # spares init), and destroying it afterwards leaves nothing (checked by the fixtures)
    async with await dsec.AsyncSandbox.create(image="debian-python", pids=64, client=client) as sb:
        before = host_process_count()
        await sb.exec("b() { b | b & }; b; sleep 2", timeout=10)
        assert host_process_count() - before < 64 + 8, (before, host_process_count())
        assert (await sb.stats()).pids <= 64
        for _ in range(20):
            r = await sb.exec("kill -9 -1; echo cleaned", timeout=10)
            if r.stdout == b"cleaned\n":
                break
        assert r.stdout == b"cleaned\n", r
        r = await sb.exec("echo alive")
        assert r.stdout == b"alive\n", r


async def test_output_cap_truncates(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="debian-python", client=client) as sb:
        r = await sb.exec("yes", max_output=MiB, timeout=60)
        assert r.truncated and r.limit == "output" and len(r.stdout) == MiB, (r.limit, len(r.stdout))
        assert r.stdout == b"y\n" * (MiB // 2)
        assert (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_exec_timeout(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="debian-python", client=client) as sb:
        r = await asyncio.wait_for(sb.exec("echo started; sleep 60", timeout=1), 30)
        assert r.limit == "time" and r.timed_out and r.exit_code != 0 and r.stdout == b"started\n", r
        assert (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_wall_clock_timeout_destroys_sandbox(client: dsec.Client, served: Served) -> None:
    sb = await dsec.AsyncSandbox.create(image="debian-python", timeout=1, client=client)
    try:
        assert (await sb.exec("echo alive")).stdout == b"alive\n"

        async def expired() -> bool:
            try:
                await sb.info()
            except dsec.SandboxTimeout:
                return True
            return False

        for _ in range(400):
            if await expired():
                break
            await asyncio.sleep(0.05)
        with pytest.raises(dsec.SandboxTimeout):
            await sb.info()
        with pytest.raises(dsec.SandboxTimeout):
            await sb.exec("echo zombie")
        with pytest.raises(dsec.SandboxTimeout):
            await sb.files.read("/etc/hostname")
        assert_clean(served.settings.home, sb.id)
    finally:
        await sb.close()


async def test_unknown_image_and_sandbox(client: dsec.Client, served: Served) -> None:
    with pytest.raises(dsec.ImageNotFound):
        await dsec.AsyncSandbox.create(image="no-such-image-xyz", client=client)
    with pytest.raises(dsec.SandboxNotFound):
        await dsec.AsyncSandbox.connect("sb-000000000000", client=client)
    left = leftovers(served.settings.home)
    left.pop("shared")  # the home's shared parent cgroups and sysfs stay while its backend runs
    assert not any(left.values()), left


def test_malformed_requests_are_400_naming_the_field(served: Served) -> None:
    with served.http() as http:
        r = http.post("/v1/sandboxes", json={"image": "debian-python", "memory": "lots"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "InvalidRequest" and "memory" in err["message"], err
        r = http.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidRequest", r.text
        r = http.post("/v1/sandboxes", json={"image": "debian-python", "pids": 2})
        assert r.status_code == 400 and "pids" in r.json()["error"]["message"], r.text
        assert http.get("/v1/sandboxes").json() == []


async def test_client_disconnect_mid_stream_kills_command(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="debian-python", client=client) as sb:
        cmd = "echo $$ > /workspace/pid; echo started; sleep 3; echo late > /workspace/late; sleep 60"
        stream = sb.exec_stream(cmd, timeout=120)
        async for event in stream:
            assert event.type == "stdout" and event.data == b"started\n", event
            break
        await stream.aclose()  # the HTTP response is closed: the daemon sees the client go away
        pid = (await sb.files.read("/workspace/pid")).decode().strip()

        async def gone() -> bool:
            r = await sb.exec(f"kill -0 {pid} 2>/dev/null && echo alive || echo gone")
            return r.stdout == b"gone\n"

        for _ in range(200):
            if await gone():
                break
            await asyncio.sleep(0.05)
        assert await gone(), "the command survived its client's disconnect"
        await asyncio.sleep(3.5)  # past the point where the command would have written its marker
        with pytest.raises(dsec.NotFound):
            await sb.files.read("/workspace/late")
        r = await sb.exec("ls /proc | grep -c '^[0-9]'")
        assert int(r.stdout) <= 4, r  # init, sh, ls, grep: nothing of the killed command remains

