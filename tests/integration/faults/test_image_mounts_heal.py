"""Image mounts that come back: a node's lazy image server killed, its mounts unmounted behind the daemon's back.

The wedge this guards against: the lazy server died (or another process on the home ran the daemon's own
shutdown of the image mounts, as a test using the default home did), and from then on every create of a
mounted image failed (``lowerdir ... No such file or directory``) or read EIO, until the daemon was
restarted, while ``/v1/health`` said ok. Now a create checks the mount first and mounts it afresh, a
dead server is started again, running sandboxes are revived (function) or reported lost (container),
and health shows the fault while it lasts.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from container_support import await_until, images_dir, leftovers, short_home, sweep
from dsec.backends.container import ContainerBackend
from dsec.backends.function import FunctionBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import SandboxLost
from dsec.images.lazyserver import alive, fs_types
from dsec.images.node import NodeImages
from dsec.models import ExecRequest, LifecycleEvent, SandboxSpec

pytestmark = [pytest.mark.root]

# Reads ~500 files of the image that a fresh home's cache has never seen: every one goes through the lazy server.
UNCACHED_READ = ("find /usr/lib/python3.11 -name '*.py' | head -500 | xargs cat | wc -c && "
                 "python3 -c 'import json, email.parser, http.client, asyncio; print(\"imported\")'")


@pytest.fixture
def home(debian_python_image: object) -> Iterator[Path]:
    path = short_home("dsec-heal-")
    try:
        yield path
    finally:
        asyncio.run(sweep(path, images_dir()))
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def engine(home: Path) -> AsyncIterator[Engine]:
    settings = Settings(home=home, images_dir=images_dir())
    eng = Engine(settings, {"container": ContainerBackend(settings), "function": FunctionBackend(settings)},
                 Engine.default_images(settings), reaper_interval=0.2)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.destroy_all()
        await eng.aclose()
        images: NodeImages = eng.images  # type: ignore[assignment]
        await images.aclose(unmount=True)
    assert not any(leftovers(home).values()), leftovers(home)


def lazy_pid(home: Path) -> int:
    return int((home / "lazy" / "lazyfs.pid").read_text())


async def run(engine: Engine, sandbox_id: str, command: str) -> tuple[int, str]:
    r = await engine.exec(sandbox_id, ExecRequest(command=command, timeout=120))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def test_a_killed_lazy_server_is_restarted_and_new_sandboxes_read_uncached_parts(engine: Engine,
                                                                                       home: Path) -> None:
    """The issue's one-step reproduction: SIGKILL the lazy server, then create a sandbox of the mounted image
    and read parts of it no sandbox read before (EIO on the old code, forever)."""
    events: list[LifecycleEvent] = []

    async def follow() -> None:
        async for event in engine.subscribe():
            events.append(event)

    watcher = asyncio.create_task(follow())
    before = (await engine.create(SandboxSpec(image="debian-python", backend="container"))).id
    function = (await engine.create(SandboxSpec(image="debian-python", backend="function"))).id
    assert (await run(engine, before, "cat /etc/debian_version"))[0] == 0
    assert (await run(engine, function, "echo kept > /workspace/state"))[0] == 0
    killed = lazy_pid(home)
    os.kill(killed, signal.SIGKILL)
    assert await await_until(lambda: not alive(killed), timeout=10)

    after = (await engine.create(SandboxSpec(image="debian-python", backend="container"))).id
    code, out = await run(engine, after, UNCACHED_READ)
    assert code == 0 and "imported" in out, out
    assert lazy_pid(home) != killed and alive(lazy_pid(home))

    # The function sandbox gets a new zygote over the image mounted afresh: its workspace (its state) is kept.
    await engine.watchdog.check_images(deep=True)
    await engine.watchdog.check_sandboxes()
    code, out = await run(engine, function, UNCACHED_READ + " && cat /workspace/state")
    assert code == 0 and "imported" in out and out.endswith("kept\n"), out
    # The container sandbox's root still reads through the dead server: reported lost, with the reason.
    assert await await_until(lambda: any(e.kind == "lost" and e.sandbox_id == before for e in events), timeout=15)
    lost = next(e for e in events if e.kind == "lost")
    assert "lazy image server" in str(lost.reason) and "SIGKILL" in str(lost.reason)
    with pytest.raises(SandboxLost, match="lazy image server"):
        await engine.get(before)
    assert engine.metrics.value("dsec_sandboxes_lost_total", backend="container", component="lazy-server") == 1
    server = engine.components.get("lazy-server")
    assert server is not None and server.faults >= 1 and server.state == "ok" and "SIGKILL" in str(server.last_error)
    watcher.cancel()


async def test_mounts_unmounted_by_another_process_come_back(engine: Engine, home: Path) -> None:
    """What wedged the node in the issue: a second ``NodeImages`` on the daemon's home (a test on the default
    home, ``dsec down --destroy`` of a daemon it did not find) ran the daemon's own image shutdown. Now it leaves
    a running daemon's mounts alone; and a mount unmounted anyway is mounted afresh at the next create, while
    sandboxes on it keep working (their overlays hold their own clones of it)."""
    live = (await engine.create(SandboxSpec(image="debian-python", backend="container"))).id
    images: NodeImages = engine.images  # type: ignore[assignment]
    (root,) = [m for m in fs_types() if m.startswith(str(images.mnt_dir)) and fs_types()[m] == "erofs"]
    server = lazy_pid(home)
    code = ("import sys; from pathlib import Path; from dsec.config import Settings; "
            "from dsec.images.node import NodeImages; "
            "n = NodeImages(Settings(home=Path(sys.argv[1]), images_dir=Path(sys.argv[2])), prefetch=False); "
            "r = n.resolve('debian-python'); n.release(r); n.close_idle_sync(); n.aclose_sync(unmount=True)")
    subprocess.run([sys.executable, "-c", code, str(home), str(images_dir())], check=True, timeout=120)
    assert fs_types().get(root) == "erofs" and lazy_pid(home) == server, "another process took the daemon's mount"

    subprocess.run(["umount", root], check=True)  # an older tool, or an operator, does it anyway
    os.rmdir(root)
    fresh = (await engine.create(SandboxSpec(image="debian-python", backend="function"))).id
    assert (await run(engine, fresh, UNCACHED_READ))[0] == 0
    code_live, out = await run(engine, live, UNCACHED_READ)
    assert code_live == 0, out  # the server lives: the sandbox's clone of the mount still reads through it
    assert (await engine.get(live)).state == "running"


def test_an_exiting_lazy_server_leaves_its_successors_mount_alone(tmp_path: Path) -> None:
    """A server replaced while it still served (its mount detached, a new one mounted on the same path) used to
    take the new server's mount down when it exited (libfuse unmounts by path), and the next image mount then
    killed the new server too: a cascade of restarts under the node's sandboxes."""
    from dsec.images.lazyserver import umount

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (tmp_path / "cache").mkdir()

    def start() -> subprocess.Popen[bytes]:
        read, write = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "dsec.images.lazyfs", "--mountpoint", str(blobs), "--cache",
                                 str(tmp_path / "cache"), "--store", str(tmp_path / "store"), "--ready-fd", str(write)],
                                pass_fds=(write,))
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.close(read)
        return proc

    first = start()
    second = None
    try:
        umount(blobs, detach=True)
        second = start()
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        assert fs_types().get(str(blobs), "").startswith("fuse"), "the old server unmounted its successor's mount"
        os.listdir(blobs)  # served
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    assert not fs_types().get(str(blobs), "").startswith("fuse")


def test_a_server_whose_main_thread_ended_is_dead_before_its_last_thread_ends(tmp_path: Path) -> None:
    """A SIGKILLed server's main thread ends at once; its other threads may take seconds (under load), and until
    the last one ends its pidfd is not readable while reads through its mount already fail. A create in that
    window was handed the dead mount (EIO: the CI flake of the test above). Here the main thread ends on its own
    while another thread lives on: the same window, held open."""
    from dsec.images.lazyserver import LazyServer

    code = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "ctypes.CDLL(None).pthread_exit(None)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    server = LazyServer(tmp_path, tmp_path / "lazyfs.log", list)
    try:
        server._track(proc.pid)  # as ensure() does for the server it starts or adopts
        assert server.alive()

        def main_thread_ended() -> bool:
            return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

        assert asyncio.run(await_until(main_thread_ended, timeout=30))
        pidfd = os.pidfd_open(proc.pid)
        try:
            assert not select.select([pidfd], [], [], 0)[0], "the pidfd alone already tells (the window is gone)"
        finally:
            os.close(pidfd)
        assert not server.alive() and server.generation is None
    finally:
        proc.kill()
        proc.wait()
        server.close()
