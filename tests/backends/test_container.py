"""The container backend (crun + overlayfs + user namespace) against the conformance suite, plus what only
a container has: processes that outlive an exec, pause/resume, cgroup limits and stats, full cleanup,
recovery."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

import dsec.backends.container as container_module
from container_support import (
    assert_clean,
    await_until,
    bundle_dir,
    cgroup_dirs,
    checked_backend,
    home_tag,
    images_dir,
    mounts_under,
    pid_alive,
    pids_in_sandbox,
    proc_state,
    run,
    sandbox_mounts,
    started_backend,
    state_root,
    swept_home,
)
from dsec.backends.base import ImageRef
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest
from dsec.isolation.procs import SEALS, sealed_executable
from dsec.models import ExecRequest, ExecResult, SandboxRecord
from dsec.testing import CHECKS, new_record, sandbox
from dsec.testing.conformance import Check

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, debian_python_image: ImageRef) -> Iterator[Path]:
    """One DSEC_HOME for the module (the static init is built once); swept clean at the end."""
    with swept_home(tmp_path_factory.mktemp("container-home")) as path:
        yield path


@pytest.fixture
async def backend(home: Path, debian_python_image: ImageRef) -> AsyncIterator[ContainerBackend]:
    """A started backend per test; after the test nothing of its sandboxes may remain on the host."""
    async with checked_backend(home) as b:
        yield b


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_container_conforms(check: Check, backend: ContainerBackend,
                                  debian_python_image: ImageRef) -> None:
    await asyncio.wait_for(check(backend, debian_python_image), 120)


async def test_background_process_survives_between_execs(backend: ContainerBackend,
                                                         debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, "sleep 1000 >/dev/null 2>&1 & echo $!")
        assert r.exit_code == 0, r
        pid = int(r.stdout)
        # a later exec (a new process joining the sandbox) still sees it, by pid and by command line
        r = await run(backend, sb, f"kill -0 {pid} && tr '\\0' ' ' < /proc/{pid}/cmdline")
        assert r.exit_code == 0 and r.stdout.strip() == b"sleep 1000", r
        stats = await backend.stats(sb)
        assert stats.pids >= 2, stats  # init + the sleep
        r = await run(backend, sb,
                      f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.05; done; echo gone")
        assert r.stdout == b"gone\n", r


async def test_pause_blocks_execs_until_resume(backend: ContainerBackend,
                                               debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, "sleep 1000 >/dev/null 2>&1 & echo $!")
        sleeper = int(r.stdout)
        await backend.pause(sb)
        try:
            host_init = sb.backend_state["init_pid"]
            state = Path(f"/proc/{host_init}/stat").read_text().rsplit(")", 1)[1].split()[0]
            freezer = Path(sb.backend_state["cgroups"]["freezer"]) / "freezer.state"
            assert freezer.read_text().strip() == "FROZEN", (state, freezer.read_text())
            # An exec issued while paused must not run: it would write the marker.
            task = asyncio.create_task(
                run(backend, sb, "echo ran > /workspace/marker; echo done", timeout=60))
            await asyncio.sleep(1.0)
            assert not task.done(), f"exec finished while the sandbox was paused: {task.result()}"
            with pytest.raises(DSecError):
                await backend.read_file(sb, "/workspace/marker", MiB)
        finally:
            await backend.resume(sb)
        r = await asyncio.wait_for(task, 30)
        assert r.exit_code == 0 and r.stdout == b"done\n", r
        assert await backend.read_file(sb, "/workspace/marker", MiB) == b"ran\n"
        r = await run(backend, sb, f"kill -0 {sleeper} && echo alive")
        assert r.stdout == b"alive\n", "a process did not survive pause/resume"


async def test_a_command_paused_past_its_timeout_still_ends_at_it(backend: ContainerBackend,
                                                                  debian_python_image: ImageRef) -> None:
    """A sandbox paused while a command runs: the SIGKILL of its timeout stays pending while the sandbox is
    frozen, and the call hung until someone resumed it. It now ends a few seconds after its timeout, as
    killed at it, and the command dies once the sandbox is resumed."""
    async with sandbox(backend, debian_python_image) as sb:
        init = int(sb.backend_state["init_pid"])
        call = asyncio.create_task(run(backend, sb, ["sleep", "300"], timeout=1.5))
        assert await await_until(lambda: pids_in_sandbox(init, "sleep"), timeout=10)
        sleeper = pids_in_sandbox(init, "sleep")[0]
        await backend.pause(sb)
        try:
            r = await asyncio.wait_for(call, 30)
            assert r.limit == "time" and r.signal == 9 and r.exit_code == 137, r
            assert b"its exit was not seen" in r.stderr, r
            assert pid_alive(sleeper), "frozen, the command cannot have died yet"
        finally:
            await backend.resume(sb)
        assert await await_until(lambda: not pid_alive(sleeper), timeout=10), "the kill did not land at resume"


async def test_stats_report_memory_and_pids(backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, "for i in 1 2 3; do sleep 1000 >/dev/null 2>&1 & done; "
                                   "python3 -c 'x = bytearray(48 * 1024 * 1024)'")
        assert r.exit_code == 0, r
        stats = await backend.stats(sb)
        assert stats.pids >= 4, stats  # init + 3 sleeps
        assert stats.memory_bytes > 0, stats
        assert stats.memory_peak_bytes >= 48 * MiB, stats  # python touched 48 MiB
        assert stats.cpu_seconds > 0 and stats.oom_kills == 0, stats
        await backend.write_file(sb, "/workspace/blob", os.urandom(2 * MiB), None)
        assert (await backend.stats(sb)).disk_bytes >= 2 * MiB


async def test_cgroups_carry_the_spec_limits_and_are_the_namespace_root(
        backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, memory=300 * MiB, cpu=0.5, pids=77) as sb:
        cg = sb.backend_state["cgroups"]
        if "unified" in cg:
            d = Path(cg["unified"])
            assert (d / "memory.max").read_text().strip() == str(300 * MiB)
            assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
            assert (d / "pids.max").read_text().strip() == "77"
        else:
            assert sorted(cg) == ["cpu", "cpuacct", "devices", "freezer", "memory", "pids"]
            assert (Path(cg["memory"]) / "memory.limit_in_bytes").read_text().strip() == str(300 * MiB)
            assert (Path(cg["cpu"]) / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert (Path(cg["pids"]) / "pids.max").read_text().strip() == "77"
            assert "a *:* rwm" not in (Path(cg["devices"]) / "devices.list").read_text()
        # crun and the init started inside the sandbox's cgroups: the cgroup namespace is rooted there,
        # so a process inside sees its own cgroups as "/" (and nothing of the host's layout).
        r = await run(backend, sb, "cat /proc/self/cgroup")
        lines = r.stdout.decode().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers in ("memory", "pids", "") or "memory" in controllers.split(","):
                assert path == "/", lines
        # the pids limit holds: the loop asks for 200 processes, the sandbox gets at most 77
        await run(backend, sb, "for i in $(seq 200); do sleep 30 & done 2>/dev/null; true")
        stats = await backend.stats(sb)
        assert 0 < stats.pids <= 77, stats


async def test_runtime_failure_names_the_cause_and_leaves_nothing(
        backend: ContainerBackend, debian_python_image: ImageRef, home: Path) -> None:
    record = new_record(backend.name, debian_python_image)
    backend._mask_v2 = not backend._mask_v2  # a wrong mask: crun refuses (hybrid) or the bind fails (v2)
    try:
        with pytest.raises(DSecError) as err:
            await backend.create(record, debian_python_image)
    finally:
        backend._mask_v2 = not backend._mask_v2
        await backend.destroy(record)
    assert "crun run failed" in str(err.value), err.value
    assert "hybrid" in str(err.value) or "dsec-rtshim: mask" in str(err.value), err.value
    assert_clean(home, record.id)


async def test_destroy_leaves_nothing(backend: ContainerBackend, debian_python_image: ImageRef,
                                      home: Path) -> None:
    record = new_record(backend.name, debian_python_image)
    try:
        await backend.create(record, debian_python_image)
        r = await run(backend, record, "sleep 1000 >/dev/null 2>&1 & echo $!")
        assert r.exit_code == 0
        tag = home_tag(home)
        init = record.backend_state["init_pid"]
        # Mounted in the home's mount holder, never in the host's mount table (which every new namespace copies).
        assert sandbox_mounts(home, f"/run/dsec/{tag}/{record.id}"), "sandbox root not mounted where expected"
        assert sandbox_mounts(home, str(bundle_dir(home, record.id) / "disk")), "sandbox disk not mounted"
        assert not mounts_under(f"/run/dsec/{tag}") and not mounts_under(str(home)), "a sandbox mount is on the host"
        assert cgroup_dirs(tag, record.id), "sandbox cgroups not found"
        assert (state_root(home) / "runtime" / record.id).is_dir()
        # bundle and runtime state on a tmpfs, not on DSEC_HOME's disk
        assert os.stat(bundle_dir(home, record.id)).st_dev == os.stat(ContainerBackend.STATE_BASE).st_dev
        assert not (home / "container" / record.id).exists() and not (home / "runtime" / record.id).exists()
        assert pid_alive(init)
        await backend.pause(record)  # destroy must also work on a frozen sandbox
    finally:
        await backend.destroy(record)
    assert_clean(home, record.id)
    assert not pid_alive(init), "the init survived destroy"
    # nothing crun forked stays behind as our zombie (the shim collects it; it used to stay for good); crun runs
    # from the node's sealed copy of it, named after that memfd, or after its fd number before Linux 6.14
    zombies = _zombie_children(lambda comm: comm in ("crun", "memfd:crun") or comm.isdigit())
    assert not zombies, zombies


@pytest.mark.parametrize("late_joiner", [False, True], ids=["usual", "late-joiner"])
def test_teardown_of_cgroups_reads_them_once_and_again_only_for_a_task_that_joined_late(
        monkeypatch: pytest.MonkeyPatch, late_joiner: bool) -> None:
    """``_kill_and_remove_cgroups`` on real cgroups. Once the init has exited it removes the set without
    reading it again (one read of the procs files per destroy, not two). A task that was not in that read (it
    joined after it) fails the rmdir with EBUSY, and is then found, killed and the set removed. A child cgroup
    (one a sandbox made in a hierarchy delegated to it) goes too."""
    import subprocess
    import uuid

    from dsec.isolation.cgroups import CgroupSet, Limits

    cgroups = CgroupSet.create(f"/dsec-t-kill-{uuid.uuid4().hex[:8]}/sb", Limits(memory=1 << 28, cpu=1.0, pids=64))
    init = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(init.pid)
    try:
        for procs in cgroups.procs_files():
            for pid in (init.pid, other.pid):
                Path(procs).write_text(str(pid))
        child = Path(next(iter(cgroups.dirs.values()))) / "child"
        child.mkdir()
        reads: list[list[int]] = []
        real_pids = CgroupSet.pids

        def counted(self: CgroupSet) -> list[int]:
            found = real_pids(self)
            reads.append(found)
            return [p for p in found if p != other.pid] if late_joiner and len(reads) == 1 else found

        monkeypatch.setattr(CgroupSet, "pids", counted)
        if not late_joiner:
            other.kill()  # only the init is left for the first read to find
            other.wait()
        container_module._kill_and_remove_cgroups(cgroups, pidfd)
        assert init.wait(5) == -signal.SIGKILL and other.wait(5) == -signal.SIGKILL
        assert not any(Path(d).exists() for d in cgroups.dirs.values()), cgroups.dirs
        if late_joiner:
            assert len(reads) >= 2 and other.pid in reads[1], reads
        else:
            assert reads == [[init.pid]]
    finally:
        os.close(pidfd)
        for proc in (init, other):
            proc.kill()
            proc.wait()
        monkeypatch.undo()
        cgroups.remove()
        for d in cgroups.dirs.values():
            with contextlib.suppress(OSError):
                Path(d).parent.rmdir()


@pytest.mark.parametrize("cancels", [1, 3])
async def test_cancelled_create_lets_its_worker_finish_and_destroy_leaves_nothing(
        backend: ContainerBackend, debian_python_image: ImageRef, home: Path, cancels: int) -> None:
    """A create cancelled while its worker thread builds the sandbox (a thread cannot be stopped) returns only
    once that thread is done, however often it is cancelled meanwhile: the record then names everything it
    made, and destroy removes all of it (before, the thread could still be mounting or starting crun while the
    caller's cleanup ran)."""
    record = new_record(backend.name, debian_python_image)
    task = asyncio.create_task(backend.create(record, debian_python_image))
    await asyncio.sleep(0.005)  # the worker is busy with the bundle, cgroups, mounts or crun
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0)  # the next cancellation lands while the create waits for its worker
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
        assert record.backend_state.get("init_pid"), record.backend_state  # the worker ran to its end
    finally:
        await backend.destroy(record)
    assert_clean(home, record.id)


def _zombie_children(named: Callable[[str], bool]) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat_file.read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        if named(name.split("(", 1)[1]) and fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.append(int(stat_file.parent.name))
    return found


async def test_recover_live_and_dead(backend: ContainerBackend, debian_python_image: ImageRef,
                                     home: Path) -> None:
    images = images_dir()
    async with sandbox(backend, debian_python_image) as live, sandbox(backend, debian_python_image) as dead:
        await backend.write_file(live, "/workspace/keep", b"kept", None)
        # a second backend on the same home stands in for a restarted daemon
        async with started_backend(home, images) as restarted:
            copy = SandboxRecord.model_validate_json(live.model_dump_json())
            assert await restarted.recover(copy) is True
            r = await run(restarted, copy, "cat /workspace/keep")
            assert r.stdout == b"kept", r
            await restarted.pause(copy)
            paused = SandboxRecord.model_validate_json(copy.model_dump_json())
            assert await restarted.recover(paused) is True and paused.state == "paused"
            await restarted.resume(copy)

            init = dead.backend_state["init_pid"]
            os.kill(init, signal.SIGKILL)
            assert await await_until(lambda: not pid_alive(init)), "init did not die"
            assert await restarted.recover(SandboxRecord.model_validate_json(dead.model_dump_json())) is False
        # a recycled pid with a different start time is not mistaken for the init
        bogus = SandboxRecord.model_validate_json(live.model_dump_json())
        bogus.backend_state["init_start"] = "1"
        assert await backend.recover(bogus) is False
        assert await backend.recover(SandboxRecord.model_validate_json(live.model_dump_json())) is True


async def test_cleanup_orphans_spares_known(backend: ContainerBackend, debian_python_image: ImageRef,
                                            home: Path) -> None:
    orphan = new_record(backend.name, debian_python_image)
    try:
        await backend.create(orphan, debian_python_image)
        async with sandbox(backend, debian_python_image) as kept:
            removed = await backend.cleanup_orphans({kept.id})
            assert removed == [orphan.id]
            assert_clean(home, orphan.id)
            r = await run(backend, kept, "echo still here")
            assert r.stdout == b"still here\n"
    finally:
        with contextlib.suppress(DSecError):
            await backend.destroy(orphan)


@pytest.mark.parametrize("copy", ["sealed-copy", "copy-refused", "copy-does-not-run"])
async def test_crun_runs_from_the_nodes_sealed_copy_or_else_from_its_path(
        home: Path, debian_python_image: ImageRef, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        copy: str) -> None:
    """The backend keeps one sealed copy of crun and starts every sandbox from it (crun then skips copying
    itself); where the kernel refuses one, or the copy does not run, crun runs from its path as before and the
    log says so."""
    if copy == "copy-refused":
        def refused(path: str, name: str) -> int:
            raise OSError(errno.EPERM, "memfd refused")
        monkeypatch.setattr(container_module, "sealed_executable", refused)
    elif copy == "copy-does-not-run":
        def of_false(path: str, name: str) -> int:
            return sealed_executable("/bin/false", name)
        monkeypatch.setattr(container_module, "sealed_executable", of_false)
    async with checked_backend(home) as b:
        if copy == "sealed-copy":
            assert b._runtime_exe is not None and fcntl.fcntl(b._runtime_exe, fcntl.F_GET_SEALS) == SEALS
            assert Path(f"/proc/self/fd/{b._runtime_exe}").read_bytes() == Path(b.runtime).read_bytes()
        elif copy == "copy-refused":
            assert b._runtime_exe is None and f"no sealed copy of {b.runtime} ([Errno 1] memfd refused)" in caplog.text
        else:
            assert b._runtime_exe is None
            assert f"the sealed copy of {b.runtime} does not run (exit status 1)" in caplog.text
        async with sandbox(b, debian_python_image) as record:
            r = await run(b, record, "echo up")
            assert r.exit_code == 0 and r.stdout == b"up\n", r
    assert b._runtime_exe is None  # closed with the backend


async def test_backend_settings_isolated_per_home(tmp_path: Path) -> None:
    """Two homes never share a tag, so one's orphan cleanup cannot touch the other's sandboxes."""
    a = ContainerBackend(Settings(home=tmp_path / "a"))
    b = ContainerBackend(Settings(home=tmp_path / "b"))
    assert a.cgroup_parent != b.cgroup_parent and a.mounts != b.mounts and a.state_root != b.state_root


@pytest.mark.parametrize("planted", ["symlink", "world-writable", "other-owner"])
async def test_state_root_planted_by_someone_else_is_moved_aside(tmp_path: Path, planted: str) -> None:
    """The bundles' tmpfs directory has a predictable name in a world-writable /dev/shm: one that another user
    made (or a symlink elsewhere) is moved aside and a private one made, so nobody can keep the backend from
    starting, and nothing is written through the planted one."""

    class Backend(ContainerBackend):
        STATE_BASE = tmp_path / "shm"

    Backend.STATE_BASE.mkdir(mode=0o1777)
    backend = Backend(Settings(home=tmp_path / "home"))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    if planted == "symlink":
        backend.state_root.symlink_to(target)
    else:
        backend.state_root.mkdir(mode=0o700)
        if planted == "world-writable":
            os.chmod(backend.state_root, 0o777)
        else:
            os.chown(backend.state_root, 65534, 65534)
    try:
        await backend.start()
        st = os.lstat(backend.state_root)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        (aside,) = Backend.STATE_BASE.glob(f"{backend.state_root.name}.planted-*")
        assert aside.is_symlink() == (planted == "symlink") and list(target.iterdir()) == []
    finally:
        await backend.aclose()


def _count(name: str) -> str:
    """A command printing how many processes named ``name`` run in the sandbox (no procps in the image)."""
    return f"grep -lx {name} /proc/[0-9]*/comm 2>/dev/null | wc -l"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_large_environment_passes_and_an_oversized_one_is_refused(backend: ContainerBackend,
                                                                        debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        # 600 KiB of environment: past the default socket send buffer (~208 KiB) the helper's request
        # needs a larger one; each value stays under the kernel's 128 KiB per string.
        env = {f"BIG{i}": chr(ord("a") + i) * (100 * 1024) for i in range(6)}
        r = await run(backend, sb, 'printf %s "$BIG5" | wc -c', env=env)
        assert (r.exit_code, r.stdout.strip()) == (0, str(100 * 1024).encode()), r
        large = {f"LARGE{i}": "x" * (100 * 1024) for i in range(18)}  # 1.8 MiB: under the kernel's 2 MiB
        r = await run(backend, sb, 'printf %s "$LARGE17" | wc -c', env=large)
        assert (r.exit_code, r.stdout.strip()) == (0, str(100 * 1024).encode()), r
        huge = {f"HUGE{i}": "x" * (100 * 1024) for i in range(22)}  # 2.2 MiB: past what execve takes
        with pytest.raises(InvalidRequest, match="at most 2097152 \\(ARG_MAX\\)"):
            await run(backend, sb, "true", env=huge)
        r = await run(backend, sb, "echo still")  # the node's exec helper is alive and serves the next call
        assert r.stdout == b"still\n", r


async def test_stalled_consumer_neither_buffers_nor_outlives_limits(backend: ContainerBackend,
                                                                   debian_python_image: ImageRef) -> None:
    """A client that stops reading (slow HTTP peer) must not make the daemon buffer `yes`, nor keep the
    command alive past its cap or timeout: limits are enforced as output is read, not as it is consumed."""
    async with sandbox(backend, debian_python_image) as sb:
        # a running command first, to show the probe sees one
        probe = asyncio.create_task(backend.exec(sb, ExecRequest(command="exec sleep 5", timeout=10)))
        await asyncio.sleep(0.5)
        assert (await backend.exec(sb, ExecRequest(command=_count("sleep")))).stdout.strip() == b"1"
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
        stream = backend.exec_stream(sb, ExecRequest(command="yes", timeout=2, max_output=1 * MiB))
        rss_before = _rss_bytes()
        try:
            first = await anext(stream)
            assert first.type == "stdout"
            await asyncio.sleep(3)  # the consumer stalls past the timeout
            # nothing was consumed, yet `yes` is gone: killed at read time when it passed the cap
            r = await backend.exec(sb, ExecRequest(command=_count("yes")))
            assert r.stdout.strip() == b"0", r
            assert _rss_bytes() - rss_before < 64 * MiB
            events = [e async for e in stream]
        finally:
            await stream.aclose()
        result = events[-1].result
        assert result is not None and result.truncated and result.limit == "output", result
        assert len(first.data or b"") + sum(len(e.data or b"") for e in events[:-1]) == 1 * MiB


async def test_stalled_consumer_timeout_fires(backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        stream = backend.exec_stream(sb, ExecRequest(command="echo start; exec sleep 30", timeout=1))
        try:
            first = await anext(stream)
            assert first.data == b"start\n"
            await asyncio.sleep(2.5)  # not reading: the timer, not the consumer, must end the command
            r = await backend.exec(sb, ExecRequest(command=_count("sleep")))
            assert r.stdout.strip() == b"0", r
            events = [e async for e in stream]
        finally:
            await stream.aclose()
        result = events[-1].result
        assert result is not None and result.limit == "time" and result.signal == signal.SIGKILL, result


async def test_slow_consumer_gets_every_byte_of_a_large_output(backend: ContainerBackend,
                                                               debian_python_image: ImageRef) -> None:
    """Backpressure pauses the pipes for a slow reader; a command that exits meanwhile loses nothing."""
    async with sandbox(backend, debian_python_image) as sb:
        stream = backend.exec_stream(sb, ExecRequest(command="head -c 8000000 /dev/zero"))
        received = 0
        result: ExecResult | None = None
        try:
            async for event in stream:
                if event.type == "stdout":
                    received += len(event.data or b"")
                    await asyncio.sleep(0.01)
                elif event.type == "exit":
                    result = event.result
        finally:
            await stream.aclose()
        assert result is not None and result.exit_code == 0 and not result.truncated, result
        assert received == len(result.stdout) == 8_000_000


async def test_memory_bomb_run_by_a_shell_gets_memory_verdict(backend: ContainerBackend,
                                                              debian_python_image: ImageRef) -> None:
    """A string command runs under ``sh -c``, which forks its last command: the bomb's SIGKILL reaches the
    caller as exit code 137 with no signal, and the verdict must still name the memory limit."""
    async with sandbox(backend, debian_python_image, memory="64Mi") as sb:
        r = await run(backend, sb, "python3 -c 'x = bytearray(512 << 20)'; exit $?", timeout=60)
        assert r.exit_code == 137 and r.signal is None and r.limit == "memory", r
        r = await run(backend, sb, "exit 137")
        assert r.exit_code == 137 and r.limit is None, r


async def test_exec_helper_killed_mid_exec(backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    """The node's exec helper dies (the OOM killer, a bug) while a command runs: the call fails naming it, the
    command is killed (it would run on unwatched otherwise) and reaped, and the next exec starts a new helper."""
    async with sandbox(backend, debian_python_image) as sb:
        call = asyncio.create_task(run(backend, sb, "exec sleep 300"))
        init = int(sb.backend_state["init_pid"])
        assert await await_until(lambda: call.done() or pids_in_sandbox(init, "sleep"))
        sleeps = pids_in_sandbox(init, "sleep")
        assert len(sleeps) == 1 and not call.done(), (sleeps, call)
        helper = backend._helper
        assert helper is not None and helper._proc is not None
        helper._proc.kill()
        with pytest.raises(DSecError, match="exec helper went away while running '/bin/sh': the command is killed"):
            await asyncio.wait_for(call, 30)
        # Killed and reaped: the daemon (a subreaper) inherits the dead helper's children, and must collect them.
        assert await await_until(lambda: proc_state(sleeps[0]) == "gone", timeout=10), proc_state(sleeps[0])
        r = await run(backend, sb, "echo again")
        assert r.exit_code == 0 and r.stdout == b"again\n", r
        assert backend._helper is helper and helper._proc is not None and helper._proc.poll() is None
