"""SIGKILL the real daemon (a subprocess) with live container sandboxes, restart it, check what it finds.

A killed daemon must leave its sandboxes running; the next daemon on the same home re-adopts the live
ones, cleans up the dead and the half-created ones, and nothing of any of them leaks on the host
(mounts, cgroups, runc state, bundles, processes). A daemon stopped with SIGTERM while calls are in flight
answers them with DaemonStopping and keeps nothing of a batch it could not finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from container_support import (
    assert_clean,
    await_until,
    home_tag,
    images_dir,
    leftovers,
    pid_alive,
    pids_in_sandbox,
    proc_state,
    short_home,
    sweep,
    wait_until,
)
from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.daemon.server import daemon_answers
from dsec.daemon.state import StateStore
from dsec.models import SandboxRecord

pytestmark = [pytest.mark.root, pytest.mark.slow]


class DaemonProcess:
    """``python -m dsec.daemon serve --home HOME`` as a child process that the test can SIGKILL."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.settings = Settings(home=home, images_dir=images_dir())
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "daemon.log"
        self.env: dict[str, str] = {}
        """More environment for the daemon (a test's knobs)."""

    @property
    def url(self) -> str:
        return f"unix://{self.settings.socket_path}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        env = dict(os.environ, DSEC_IMAGES=str(images_dir()), DSEC_HOME=str(self.home), **self.env)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dsec.daemon", "serve", "--home", str(self.home)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True, cwd="/",
            )
        ok = wait_until(lambda: self.proc is not None and (self.proc.poll() is not None
                                                           or daemon_answers(self.settings)), timeout=60)
        assert ok and self.proc.poll() is None, f"daemon did not start:\n{self.log.read_text()[-3000:]}"

    def helper_pids(self) -> list[int]:
        """The daemon's exec helper (its other children are the sandbox inits it adopted as subreaper)."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [int(p) for p in children if b"nsexec" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> None:
        """SIGTERM (what ``dsec down`` sends), without waiting."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def records(self) -> dict[str, SandboxRecord]:
        return StateStore.peek(self.settings.state_db)  # read-only: the daemon may be writing


@pytest.fixture
def daemon(debian_python_image: ImageRef) -> Iterator[DaemonProcess]:
    home = short_home("dsec-kill-")
    d = DaemonProcess(home)
    try:
        yield d
    finally:
        try:
            d.stop()
        finally:
            asyncio.run(sweep(home, images_dir()))  # last resort; the tests assert cleanliness themselves
            shutil.rmtree(home, ignore_errors=True)


def processes_in_home_cgroups(home: Path) -> list[int]:
    """Live host processes in any cgroup of this home's sandboxes (what a leaked dsec-init would be).

    Zombies are not counted: a killed init is reparented to the host's pid 1, which reaps it when it
    gets to it; until then it still names its (already removed) cgroup."""
    needle = f"/dsec-{home_tag(home)}/"
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (p / "cgroup").read_text() and pid_alive(int(p.name)):
                    found.append(int(p.name))
    return found


def _describe(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                + " | " + Path(f"/proc/{pid}/status").read_text().split("\n")[2]
                + " | " + Path(f"/proc/{pid}/cgroup").read_text().replace("\n", ";"))
    except OSError as e:
        return str(e)


def assert_nothing_left(d: DaemonProcess) -> None:
    assert_clean(d.home)
    procs = processes_in_home_cgroups(d.home)
    assert procs == [], [(p, _describe(p)) for p in procs[:3]]
    assert d.records() == {}, "sandbox records left in the state directory"


async def destroy_all(client: dsec.Client) -> None:
    for sb in await dsec.AsyncSandbox.list(client=client):
        await sb.close()
    assert await dsec.AsyncSandbox.list(client=client) == []


async def test_sigkill_with_20_live_sandboxes_then_readopt(daemon: DaemonProcess) -> None:
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        sbs = await dsec.AsyncSandbox.create_many(20, image="debian-python", labels={"run": "kill"},
                                                  client=client)
        for sb in sbs:
            await sb.files.write("/workspace/who", sb.id)
        r = await sbs[0].exec("sleep 1000 >/dev/null 2>&1 & echo $!")
        background = int(r.stdout)
    ids = {sb.id for sb in sbs}
    records = daemon.records()
    assert set(records) == ids and all(r.state == "running" for r in records.values())
    inits = {i: records[i].backend_state["init_pid"] for i in ids}
    helpers = daemon.helper_pids()
    assert helpers, "the daemon has no exec helper child"

    daemon.kill()
    assert all(pid_alive(pid) for pid in inits.values()), "a sandbox died with its daemon"
    # the exec helper must not outlive its daemon (it holds the sandboxes' seccomp program and sockets)
    assert wait_until(lambda: not any(pid_alive(p) for p in helpers), timeout=20), "exec helper leaked"

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        listed = await dsec.AsyncSandbox.list(labels={"run": "kill"}, client=client)
        assert {sb.id for sb in listed} == ids
        for sb in listed:
            assert (await sb.info()).state == "running"
            r = await sb.exec("cat /workspace/who")
            assert r.exit_code == 0 and r.stdout.decode() == sb.id, r
        survivor = next(sb for sb in listed if sb.id == sbs[0].id)
        r = await survivor.exec(f"kill -0 {background} && echo alive")
        assert r.stdout == b"alive\n", "a process inside a sandbox did not survive the daemon's death"
        await destroy_all(client)
    assert not any(pid_alive(pid) for pid in inits.values())
    daemon.stop()
    assert_nothing_left(daemon)


async def test_dead_sandboxes_cleaned_live_ones_readopted(daemon: DaemonProcess) -> None:
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        sbs = await dsec.AsyncSandbox.create_many(6, image="debian-python", client=client)
        for sb in sbs:
            await sb.files.write("/workspace/who", sb.id)
    records = daemon.records()
    dead, live = sbs[:3], sbs[3:]
    daemon.kill()
    for sb in dead:
        os.kill(records[sb.id].backend_state["init_pid"], signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(records[sb.id].backend_state["init_pid"]) for sb in dead))

    daemon.start()
    for sb in dead:
        assert_clean(daemon.home, sb.id)
        assert sb.id not in daemon.records()
    async with dsec.Client(url=daemon.url) as client:
        assert {sb.id for sb in await dsec.AsyncSandbox.list(client=client)} == {sb.id for sb in live}
        for sb in dead:
            with pytest.raises(dsec.SandboxNotFound):
                await dsec.AsyncSandbox.connect(sb.id, client=client)
        for sb in live:
            again = await dsec.AsyncSandbox.connect(sb.id, client=client)
            assert (await again.exec("cat /workspace/who")).stdout.decode() == sb.id
        await destroy_all(client)
    daemon.stop()
    assert_nothing_left(daemon)


async def test_sigkill_during_create_many(daemon: DaemonProcess) -> None:
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        task = asyncio.create_task(dsec.AsyncSandbox.create_many(10, image="debian-python", client=client))
        # kill as soon as the daemon has started creating (records are written before the backend acts)
        started = await await_until(lambda: bool(daemon.records()) or task.done(),
                                    timeout=60, interval=0.005)
        daemon.kill()
        assert started
        with contextlib.suppress(dsec.DSecError, OSError):
            await task
    at_kill = daemon.records()
    assert at_kill, "nothing was being created when the daemon was killed"

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        listed = await dsec.AsyncSandbox.list(client=client)
        survivors = {sb.id for sb in listed}
        assert survivors <= set(at_kill)
        for sb in listed:  # fully usable...
            r = await sb.exec("echo usable; cat /proc/1/cmdline")
            assert r.stdout.startswith(b"usable\n/dev/.dsec-init"), r
        left = leftovers(daemon.home)
        left.pop("shared")  # shared by the survivors
        for kind, paths in left.items():  # ...or fully gone
            strays = [p for p in paths if not any(i in p for i in survivors)]
            assert strays == [], f"{kind} of sandboxes that were not re-adopted: {strays}"
        assert set(daemon.records()) == survivors
        await destroy_all(client)
    daemon.stop()
    assert_nothing_left(daemon)


async def test_sigterm_during_create_many_answers_daemon_stopping(daemon: DaemonProcess) -> None:
    """The queued creates of a batch are failed at once and what it made is destroyed: the call gets
    DaemonStopping naming the node, not the HTTP 500 the server's graceful timeout produced before, and the
    next daemon finds nothing of the batch."""
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        task = asyncio.create_task(dsec.AsyncSandbox.create_many(400, image="debian-python", client=client))
        # stop once some are made and most still queue (32 create slots)
        made = await await_until(lambda: sum(r.state == "running" for r in daemon.records().values()) >= 3
                                 or task.done(), timeout=120, interval=0.01)
        assert made and not task.done(), "the batch ended before the daemon was stopped"
        daemon.terminate()
        with pytest.raises(dsec.DaemonStopping, match=r"create_many\(400\) refused: the DSec daemon on node .* is "
                                                      r"stopping; .* the \d+ sandboxes it had made are destroyed"):
            await task
    assert daemon.proc is not None and daemon.proc.wait(60) == 0
    log = daemon.log.read_text()
    assert "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert daemon.records() == {}, "the batch's sandboxes outlived the daemon that rolled it back"

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        assert await dsec.AsyncSandbox.list(client=client) == []
    daemon.stop()
    assert_nothing_left(daemon)


async def test_sigterm_cuts_off_a_long_exec_with_daemon_stopping(daemon: DaemonProcess) -> None:
    """An exec still running at the end of the server's graceful timeout is answered DaemonStopping (it was
    a bare HTTP 500) and its command is killed and reaped before the daemon exits (not left a zombie for
    the host's init, which shows in the sandbox as a live ``sleep``); the sandbox stays for the next daemon."""
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        sb = await dsec.AsyncSandbox.create(image="debian-python", client=client)
        call = asyncio.create_task(sb.exec("touch /tmp/running; exec sleep 300", timeout=600))
        running = await await_until(lambda: call.done() or _exists(daemon, sb.id, "/tmp/running"), timeout=60)
        assert running and not call.done(), call
        init = daemon.records()[sb.id].backend_state["init_pid"]
        assert await await_until(lambda: pids_in_sandbox(init, "sleep"), timeout=10)
        sleeps = pids_in_sandbox(init, "sleep")
        assert len(sleeps) == 1, sleeps
        daemon.terminate()
        with pytest.raises(dsec.DaemonStopping, match=r"exec/result was cut off \(the command it was running is "
                                                      r"killed\): the DSec daemon on node .* is stopping"):
            await call
    assert daemon.proc is not None and daemon.proc.wait(60) == 0
    assert proc_state(sleeps[0]) == "gone", proc_state(sleeps[0])

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        again = await dsec.AsyncSandbox.connect(sb.id, client=client)
        r = await again.exec("for c in /proc/[0-9]*/comm; do cat $c; done")
        assert r.exit_code == 0 and "sleep" not in r.stdout.decode().split(), r
        await destroy_all(client)
    daemon.stop()
    assert_nothing_left(daemon)


def _exists(daemon: DaemonProcess, sandbox_id: str, path: str) -> bool:
    """Whether ``path`` exists in the sandbox, seen from the host through its init's root."""
    pid = daemon.records()[sandbox_id].backend_state["init_pid"]
    return Path(f"/proc/{pid}/root{path}").exists()


# Reads ~500 files of the image that the home's fresh cache has never seen: every one goes through the lazy server.
_UNCACHED_READ = ("find /usr/lib/python3.11 -name '*.py' | head -500 | xargs cat | wc -c && "
                  "python3 -c 'import json, email.parser, http.client, asyncio; print(\"imported\")'")


def _kill_daemon_then_lazy_server(daemon: DaemonProcess) -> None:
    """SIGKILL the daemon, then its lazy image server: the server dies while no daemon runs."""
    from dsec.images.lazyserver import alive

    daemon.kill()
    server = int((daemon.home / "lazy" / "lazyfs.pid").read_text())
    os.kill(server, signal.SIGKILL)
    assert wait_until(lambda: not alive(server), timeout=10)


def _kept_state(path: str) -> str:
    with open(path) as f:
        return f.read()


async def test_lazy_server_killed_while_no_daemon_runs(daemon: DaemonProcess) -> None:
    """Issue 30: the daemon SIGKILLed, then its lazy image server; the next daemon starts a new server and mounts
    the image afresh. A function sandbox's new zygote must sit on the live mount (it used to be started on the
    dead one: every read of an uncached part failed with EIO while health said ok); a container sandbox, whose
    root cannot move, is reported lost with the reason at once, not left to fail its calls."""
    from dsec.images.lazyserver import fs_types

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        box = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
        fn = await dsec.AsyncSandbox.create(image="debian-python", backend="function", client=client)
        assert (await box.exec("cat /etc/debian_version")).exit_code == 0
        await fn.files.write("/workspace/state", "kept")
        assert await fn.call(_kept_state, "/workspace/state") == "kept"
    old_root = daemon.records()[fn.id].backend_state["image_rootfs"]
    _kill_daemon_then_lazy_server(daemon)

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        events: list[dsec.LifecycleEvent] = []

        async def follow() -> None:
            async for event in client.events(since=0):
                events.append(event)

        watcher = asyncio.create_task(follow())
        try:
            # The container's root reads through the dead server: lost, with the reason, before any call fails.
            assert await await_until(lambda: any(e.kind == "lost" and e.sandbox_id == box.id for e in events),
                                     timeout=15)
            lost = next(e for e in events if e.kind == "lost" and e.sandbox_id == box.id)
            assert "image mount" in str(lost.reason) and "lazy image server" in str(lost.reason), lost.reason
            with pytest.raises(dsec.SandboxLost, match="image mount"):
                await box.exec("true")
            # The function sandbox works on: its new zygote reads the image mounted afresh; its workspace is kept.
            again = await dsec.AsyncSandbox.connect(fn.id, client=client)
            result = await asyncio.wait_for(again.exec(_UNCACHED_READ, timeout=60), 90)
            assert result.exit_code == 0 and b"imported" in result.stdout, result
            assert await asyncio.wait_for(again.call(_kept_state, "/workspace/state"), 90) == "kept"
            assert not any(e.kind == "lost" and e.sandbox_id == fn.id for e in events)
            # It sits on a new path: the dead mount's is never reused while something may still sit on it.
            new_root = daemon.records()[fn.id].backend_state["image_rootfs"]
            assert new_root != old_root and fs_types().get(new_root) == "erofs"
            assert old_root not in fs_types(), "the dead image mount was left mounted"
            info = await client.health()
            assert info.status == "ok", info
        finally:
            watcher.cancel()
        await destroy_all(client)
    daemon.stop()
    assert_nothing_left(daemon)


async def test_lazy_server_killed_while_no_daemon_runs_more_sandboxes_than_recovered_at_once(
        daemon: DaemonProcess) -> None:
    """As above, with more function sandboxes than recovery offers to the backend at once (1 here; 32 by default):
    the first re-pin found the dead mount and detached it, and every sandbox not yet recovered then failed its
    check that its image root is there, and was destroyed with its workspace. All must live on, each on the image
    mounted afresh, each with its workspace."""
    from dsec.images.lazyserver import fs_types

    daemon.env["DSEC_RECOVERY_PARALLELISM"] = "1"
    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        fns = [await dsec.AsyncSandbox.create(image="debian-python", backend="function", client=client)
               for _ in range(3)]
        for i, fn in enumerate(fns):
            await fn.files.write("/workspace/state", f"kept {i}")
    old_roots = {daemon.records()[fn.id].backend_state["image_rootfs"] for fn in fns}
    _kill_daemon_then_lazy_server(daemon)

    daemon.start()
    async with dsec.Client(url=daemon.url) as client:
        for i, fn in enumerate(fns):
            again = await dsec.AsyncSandbox.connect(fn.id, client=client)
            assert await asyncio.wait_for(again.call(_kept_state, "/workspace/state"), 90) == f"kept {i}"
        result = await asyncio.wait_for(again.exec(_UNCACHED_READ, timeout=60), 90)
        assert result.exit_code == 0 and b"imported" in result.stdout, result
        records = daemon.records()
        for fn in fns:
            new_root = records[fn.id].backend_state["image_rootfs"]
            assert new_root not in old_roots and fs_types().get(new_root) == "erofs"
        assert not old_roots & set(fs_types()), "the dead image mount was left mounted"
        info = await client.health()
        assert info.status == "ok", info
        await destroy_all(client)
    daemon.stop()
    assert_nothing_left(daemon)
