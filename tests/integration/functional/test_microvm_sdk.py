"""A microvm sandbox driven end to end through the SDK and a real daemon: exec, files, pause/resume, and a
snapshot restored into a second sandbox with ``create(snapshot=...)``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

import dsec
from container_support import images_dir
from dsec.config import Settings
from dsec.daemon.app import create_app
from dsec.daemon.engine import Engine
from guest_support import qemu_of

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow]


@pytest.fixture
def daemon_url(microvm_home: Path, tmp_path: Path) -> Iterator[str]:
    """A daemon with the node's default backends (container + microvm) on a unix socket, on the session's microvm
    home (conftest.py), whose templates it restores from."""
    home = microvm_home
    # Snapshots (a VM's whole RAM each) go to a store of this test's own, not the shared image store.
    settings = Settings(home=home, images_dir=images_dir(), snapshot_store_url=str(tmp_path / "snapshots"))
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine.from_settings(settings)
    sock = str(settings.socket_path)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), uds=sock, log_level="warning", lifespan="off"))
    ready = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            await engine.start()
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            ready.set()
            await task
        except BaseException as exc:
            failure.append(exc)
            ready.set()
        finally:
            await engine.destroy_all()
            await engine.aclose()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    ready.wait(60)
    try:
        if failure:
            raise RuntimeError("daemon failed to start") from failure[0]
        yield f"unix://{sock}"
    finally:
        server.should_exit = True
        thread.join(60)
        settings.socket_path.unlink(missing_ok=True)


async def test_microvm_through_the_sdk(daemon_url: str) -> None:
    client = dsec.Client(url=daemon_url)
    sb = await dsec.AsyncSandbox.create(image="debian-python", backend="microvm", memory="384Mi", client=client,
                                        labels={"t": "vm"})
    try:
        r = await sb.exec("uname -r; echo $HOSTNAME $(hostname)", timeout=60)
        assert r.exit_code == 0 and b"cloud-amd64" in r.stdout, r
        await sb.files.write("/workspace/kept.txt", b"snapshotted\n")
        info = await sb.pause()
        assert info.state == "paused"
        assert (await sb.resume()).state == "running"
        snap = await sb.snapshot()
        await sb.files.write("/workspace/kept.txt", b"changed later\n")
        clone = await dsec.AsyncSandbox.create(snapshot=snap, backend="microvm", client=client, labels={"t": "clone"})
        try:
            assert (await clone.info()).backend == "microvm"
            assert await clone.files.read("/workspace/kept.txt") == b"snapshotted\n"
            r = await clone.exec("hostname")
            assert r.stdout.strip() == clone.id.encode(), "the clone kept the original's identity"
        finally:
            await clone.close()
        children = await sb.fork(2)
        try:
            names = {(await c.exec("hostname")).stdout.strip() for c in children}
            assert names == {c.id.encode() for c in children}, "fork children share an identity"
            assert all([await c.files.read("/workspace/kept.txt") == b"changed later\n" for c in children])
        finally:
            for c in children:
                await c.close()
        # pause with the VM's memory released to disk: its QEMU ends; resume brings back processes and files
        await sb.exec("sleep 600 > /dev/null 2>&1 & echo $! > /workspace/sleeper", timeout=60)
        assert (await sb.pause(release_memory=True)).state == "paused"
        assert qemu_of(sb.id) == [], "the hibernated VM's QEMU (and its RAM) is still there"
        assert (await sb.resume()).state == "running"
        r = await sb.exec("kill -0 $(cat /workspace/sleeper) && cat /workspace/kept.txt", timeout=60)
        assert r.stdout == b"changed later\n", r
    finally:
        await sb.close()
        await client.aclose()
