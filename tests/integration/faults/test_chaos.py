"""Chaos: a real daemon serving container and function sandboxes while its parts are SIGKILLed one at a time.

For each component -- the exec helper, the mount holder, a function sandbox's zygote, a container sandbox's
init, the lazy image server, the daemon itself -- and for a full node disk:

- the next create succeeds (or is refused with an error naming the broken component);
- live sandboxes keep working, or are reported lost with an event and the reason;
- ``/v1/health`` counts the fault on that component and shows it ok again after;
- nothing of the home is left on the host at the end (the fixture checks).

One daemon for the module (a fault per test, in order); the disk test has a daemon of its own on a small tmpfs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import dsec
from container_support import await_until, home_tag, images_dir, leftovers, pid_alive, short_home, sweep, wait_until
from dsec.config import Settings
from dsec.daemon.server import daemon_answers
from dsec.images.lazyserver import fs_types
from dsec.models import ComponentHealth, NodeInfo

pytestmark = [pytest.mark.root, pytest.mark.slow]


class Node:
    """``python -m dsec.daemon serve`` on ``home``, which the test may SIGKILL and start again."""

    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.settings = Settings(home=home, images_dir=images_dir())
        self.url = f"unix://{self.settings.socket_path}"
        self.env = dict(os.environ, DSEC_HOME=str(home), DSEC_IMAGES=str(images_dir()), **env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with (self.home / "daemon.out").open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsec.daemon", "serve", "--home", str(self.home)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=self.env,
                                         start_new_session=True, cwd="/")
        ok = wait_until(lambda: self.proc is not None and (self.proc.poll() is not None
                                                           or daemon_answers(self.settings)), timeout=90)
        assert ok and self.proc.poll() is None, (self.home / "daemon.out").read_text()[-3000:]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return (self.home / "log" / "dsec.log").read_text(errors="replace")


@contextlib.contextmanager
def node_on(home: Path, **env: str) -> Iterator[Node]:
    node = Node(home, **env)
    node.start()
    try:
        yield node
    finally:
        with contextlib.suppress(Exception), dsec.Client(node.url) as client:
            for sb in dsec.Sandbox.list(client=client):
                sb.close()
        node.stop()
        removed = asyncio.run(sweep(home, images_dir()))
        left = {k: v for k, v in leftovers(home).items() if v}
        assert removed == [] and not left, f"left behind: {removed} {left}"


@pytest.fixture(scope="module")
def node(debian_python_image: object) -> Iterator[Node]:
    home = short_home("dsec-chaos-")
    try:
        with node_on(home) as started:
            yield started
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
async def client(node: Node) -> AsyncIterator[dsec.Client]:
    async with dsec.Client(node.url) as c:
        yield c


async def component(client: dsec.Client, name: str) -> ComponentHealth:
    info: NodeInfo = await client.health()
    found = {c.name: c for c in info.components}
    assert name in found, f"no component {name} in {sorted(found)}"
    return found[name]


def pid_of(part: ComponentHealth) -> int:
    assert part.detail and part.detail.startswith("pid "), part
    return int(part.detail.split()[1])


async def wait_ok(client: dsec.Client, name: str, faults: int) -> ComponentHealth:
    """The component counted ``faults`` faults and is ok again."""
    last: list[ComponentHealth] = []

    async def done() -> bool:
        last[:] = [await component(client, name)]
        return last[0].faults >= faults and last[0].state == "ok"

    deadline = asyncio.get_running_loop().time() + 30
    while not await done():
        assert asyncio.get_running_loop().time() < deadline, f"{name} did not recover: {last}"
        await asyncio.sleep(0.2)
    return last[0]


async def mix(client: dsec.Client) -> tuple[dsec.AsyncSandbox, dsec.AsyncSandbox]:
    """A container and a function sandbox, each with a file of state."""
    box = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
    fn = await dsec.AsyncSandbox.create(image="debian-python", backend="function", client=client)
    for sb in (box, fn):
        assert (await sb.exec("echo kept > /workspace/state")).exit_code == 0
    return box, fn


async def works(sb: dsec.AsyncSandbox) -> None:
    r = await sb.exec("cat /workspace/state && python3 -c 'print(6 * 7)'", timeout=60)
    assert r.exit_code == 0 and r.stdout == b"kept\n42\n", r


async def next_creates_work(client: dsec.Client) -> None:
    for backend in ("container", "function"):
        sb = await dsec.AsyncSandbox.create(image="debian-python", backend=backend, client=client)
        try:
            assert (await sb.exec("python3 -c 'import json; print(1)'", timeout=60)).exit_code == 0
        finally:
            await sb.aclose()


def procs(comm: str, needle: str) -> list[int]:
    """Pids of processes named ``comm`` whose command line or cgroup mentions ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip().startswith(comm) and (
                    needle.encode() in (entry / "cmdline").read_bytes() or needle in (entry / "cgroup").read_text()):
                found.append(int(entry.name))
    return found


async def test_exec_helper_killed(node: Node, client: dsec.Client) -> None:
    box, fn = await mix(client)
    helper = await component(client, "exec-helper")
    os.kill(pid_of(helper), signal.SIGKILL)
    after = await wait_ok(client, "exec-helper", helper.faults + 1)
    assert pid_of(after) != pid_of(helper) and "exec helper" in str(after.last_error)
    await works(box)
    await works(fn)
    await next_creates_work(client)
    for sb in (box, fn):
        await sb.aclose()
    assert "exec-helper" in node.log()


async def test_exec_helper_killed_and_restarted_by_the_next_exec_is_counted(client: dsec.Client) -> None:
    """An exec right after the kill restarts the helper itself, before the watchdog looks: health still counts
    the fault, with how the helper ended."""
    box = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
    helper = await component(client, "exec-helper")
    os.kill(pid_of(helper), signal.SIGKILL)
    assert await await_until(lambda: not pid_alive(pid_of(helper)), timeout=10)
    assert (await box.exec("echo at once")).stdout == b"at once\n"
    after = await wait_ok(client, "exec-helper", helper.faults + 1)
    assert "SIGKILL" in str(after.last_error), after
    await box.aclose()


async def test_mount_holder_killed(node: Node, client: dsec.Client) -> None:
    box, fn = await mix(client)
    holder = await component(client, "mount-holder")
    os.kill(pid_of(holder), signal.SIGKILL)
    after = await wait_ok(client, "mount-holder", holder.faults + 1)
    assert pid_of(after) != pid_of(holder)
    await works(box)
    assert await box.files.read("/workspace/state") == b"kept\n"  # files go through the holder's mounts
    await next_creates_work(client)
    await box.aclose()  # its mounts are torn down in the new holder (leftovers checked at the end)
    await fn.aclose()


async def test_zygote_killed(node: Node, client: dsec.Client) -> None:
    box, fn = await mix(client)
    (zygote,) = [p for p in procs("dsec-zygote", fn.id) if Path(f"/proc/{p}/status").exists()][:1]
    os.kill(zygote, signal.SIGKILL)
    # revived by the watchdog (a new zygote over the same workspace): the state is kept
    assert await await_until(lambda: zygote not in procs("dsec-zygote", fn.id) and bool(procs("dsec-zygote", fn.id)),
                             timeout=20)
    for _ in range(50):
        with contextlib.suppress(dsec.SandboxError):
            await works(fn)
            break
        await asyncio.sleep(0.2)
    await works(fn)
    await works(box)
    await next_creates_work(client)
    for sb in (box, fn):
        await sb.aclose()


async def test_sandbox_init_killed(node: Node, client: dsec.Client) -> None:
    box, fn = await mix(client)
    inits = procs("dsec-init", f"dsec-{home_tag(node.home)}/{box.id}")
    assert inits, "no init found for the sandbox"
    events: list[dsec.LifecycleEvent] = []

    async def follow() -> None:
        async for event in client.events():
            events.append(event)

    watcher = asyncio.create_task(follow())
    os.kill(inits[0], signal.SIGKILL)
    assert await await_until(lambda: any(e.kind == "lost" and e.sandbox_id == box.id for e in events), timeout=20)
    watcher.cancel()
    lost = next(e for e in events if e.kind == "lost")
    assert "init process" in str(lost.reason) and "SIGKILL" in str(lost.reason)
    with pytest.raises(dsec.SandboxLost, match="SIGKILL"):
        await box.exec("true")
    await works(fn)  # the other sandboxes are untouched
    await next_creates_work(client)
    await fn.aclose()
    assert box.id in node.log()


async def test_lazy_server_killed(node: Node, client: dsec.Client) -> None:
    box, fn = await mix(client)
    server = await component(client, "lazy-server")
    for _ in range(100):  # health is as of the watchdog's last pass (every second): it may predate the mount
        if server.detail and server.detail.startswith("pid "):
            break
        await asyncio.sleep(0.1)
        server = await component(client, "lazy-server")
    os.kill(pid_of(server), signal.SIGKILL)
    after = await wait_ok(client, "lazy-server", server.faults + 1)
    assert pid_of(after) != pid_of(server) and "SIGKILL" in str(after.last_error)
    await next_creates_work(client)
    for _ in range(50):  # the function sandbox gets a new zygote on the image mounted afresh
        with contextlib.suppress(dsec.SandboxError):
            await works(fn)
            break
        await asyncio.sleep(0.2)
    await works(fn)
    with pytest.raises(dsec.SandboxLost, match="lazy image server"):  # its root reads through the dead server
        for _ in range(100):
            await box.exec("true")
            await asyncio.sleep(0.2)
    await fn.aclose()


def image_mounts(home: Path) -> dict[str, int]:
    """The home's image mounts: mount point -> device number (a mount made again on the same path has another)."""
    prefix = f"{home}/lazy/mnt/"
    return {p: os.stat(p).st_dev for p, fs in fs_types().items() if fs == "erofs" and p.startswith(prefix)}


async def test_daemon_killed(node: Node) -> None:
    async with dsec.Client(node.url) as c:
        box, fn = await mix(c)
    mounts = image_mounts(node.home)
    assert mounts, "no image mount under the home: nothing to compare"
    node.stop(signal.SIGKILL)
    assert pid_alive(int((node.home / "lazy" / "lazyfs.pid").read_text())), "the lazy server died with the daemon"
    node.start()
    async with dsec.Client(node.url) as c:
        box = await dsec.AsyncSandbox.connect(box.id, client=c)
        fn = await dsec.AsyncSandbox.connect(fn.id, client=c)
        # The image mount the sandboxes sit on is adopted as it is: not replaced on its path while the function
        # sandbox's new zygote is started on it (its root was then empty, or missing)
        assert image_mounts(node.home) == mounts
        await works(box)
        await works(fn)
        await next_creates_work(c)
        info = await c.health()
        assert info.status == "ok", info.components
        for sb in (box, fn):
            await sb.aclose()


@pytest.fixture
def small_home(debian_python_image: object, tmp_path: Path) -> Iterator[Path]:
    """A home on a 768 MiB ext4 loop disk (file-backed EROFS needs a disk filesystem under the metadata): a disk
    that fills."""
    image = tmp_path / "disk.img"
    with image.open("wb") as f:
        f.truncate(768 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    home = short_home("dsec-chaosd-")
    subprocess.run(["mount", "-o", "loop", str(image), str(home)], check=True)
    try:
        yield home
    finally:
        asyncio.run(sweep(home, images_dir()))
        subprocess.run(["umount", "-d", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


def test_node_disk_full(small_home: Path) -> None:
    with node_on(small_home, DSEC_IMAGE_CACHE_MIN_FREE="0") as node:
        asyncio.run(_fill_and_free(node, small_home))


async def _fill_and_free(node: Node, home: Path) -> None:
    async with dsec.Client(node.url) as client:
        box = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
        assert (await box.exec("python3 -c 'print(1)'", timeout=60)).exit_code == 0
        filler = home / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
        disk = await component(client, "node-disk")
        for _ in range(50):
            if disk.state == "down":
                break
            await asyncio.sleep(0.2)
            disk = await component(client, "node-disk")
        assert disk.state == "down" and "full" in str(disk.error), disk
        with pytest.raises(dsec.BackendUnavailable, match=r"disk of .* is full"):
            await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
        assert (await box.exec("echo still here")).stdout == b"still here\n"  # cached parts keep working
        filler.unlink()
        await wait_ok(client, "node-disk", disk.faults)
        again = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
        assert (await again.exec("true")).exit_code == 0
        for sb in (box, again):
            await sb.aclose()
    assert "node-disk" in node.log()
