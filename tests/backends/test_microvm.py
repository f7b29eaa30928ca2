"""The microvm backend (QEMU -M microvm + guest agent) against the conformance suite, plus what only a VM has:
its own kernel, snapshot restore with fresh identity, and faults (panic, power-off, agent killed, QEMU killed)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from conftest import missing
from container_support import images_dir, short_home
from dsec.backends.base import ImageRef
from dsec.backends.microvm import MicroVMBackend
from dsec.backends.qemu.qmp import qmp
from dsec.backends.surface import ProcessSpec
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest, PermissionDenied, SandboxError
from dsec.guest.kernel import default_guest_dir, find_kernel
from dsec.guest.protocol import MAX_GUEST_PAYLOAD, OUTPUT_WINDOW
from dsec.models import ExecRequest
from dsec.testing import CHECKS, new_record, sandbox
from dsec.testing.conformance import Check, SharedSandbox
from guest_support import CONFINED_VIEW, conforms, lending

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow]

SMALL = {"memory": "384Mi"}


def qemu_pids(tag: str) -> list[int]:
    """QEMU processes whose runtime directory belongs to this home's tag."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline and f"/run/dsec-vm/{tag}/".encode() in cmdline:
                found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def home(microvm_home: Path) -> Path:
    """The session's microvm home (conftest.py): its templates are shared with the other microvm modules."""
    return microvm_home


@pytest.fixture(scope="module")
def own_home() -> Iterator[Path]:
    """A home of this module's own, for the tests that break its template, re-adopt its guests with a second
    backend or sweep its orphans (they boot one template here, the price of not touching the shared one)."""
    try:
        find_kernel(default_guest_dir())
    except DSecError as e:
        missing(str(e))
    path = short_home("dsec-vm-")
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def started(home: Path) -> AsyncIterator[MicroVMBackend]:
    """A started backend on ``home``; on exit, no sandbox or QEMU of it may be left."""
    b = MicroVMBackend(Settings(home=home, images_dir=images_dir()))
    await b.start()
    try:
        yield b
    finally:
        removed = await b.cleanup_orphans(set())
        await b.aclose()
        left = qemu_pids(b.tag)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert [r for r in removed if r.startswith("sb-")] == [] and left == [], f"leaked: {removed} {left}"


@pytest.fixture
async def backend(home: Path, debian_python_image: ImageRef) -> AsyncIterator[MicroVMBackend]:
    async with started(home) as b:
        yield b


@pytest.fixture
async def own_backend(own_home: Path, debian_python_image: ImageRef) -> AsyncIterator[MicroVMBackend]:
    async with started(own_home) as b:
        yield b


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def shared(home: Path, debian_python_image: ImageRef) -> AsyncIterator[SharedSandbox]:
    """A backend and a running sandbox the conformance checks that only need one borrow in turn (a guest
    restore saved per check under TCG); class scope: gone before the module's other tests, whose backends
    sweep this home's orphans."""
    # commands have a pid namespace of their own (the agent is outside it): kill -1 ends what a check left
    # running and nothing else
    async with started(home) as b, lending(b, debian_python_image, "kill -KILL -1 2>/dev/null; true") as lender:
        yield lender


class TestConformance:
    """The conformance checks, sharing :func:`shared`'s sandbox where a check only needs a running one."""

    @pytest.mark.asyncio(loop_scope="class")
    @pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
    async def test_microvm_conforms(self, check: Check, shared: SharedSandbox) -> None:
        await conforms(shared, check, 180)


async def test_guest_kernel_is_not_the_host_kernel(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command="uname -r; cat /proc/sys/kernel/random/boot_id"))
        guest_release, guest_boot = r.stdout.decode().split()
        assert guest_release != os.uname().release and guest_release.endswith("cloud-amd64"), r
        assert guest_boot != Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert sb.backend_state["accel"] in ("kvm", "tcg")


async def test_guest_sees_the_images_own_owners(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    # The store keeps the image shifted by uid_shift; the guest sees the owners the image was built with.
    host = (debian_python_image.rootfs / "etc" / "shadow").stat()
    shift = debian_python_image.uid_shift
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command="stat -c %u:%g /etc/shadow /etc/passwd"))
        assert r.stdout.decode().split() == [f"{host.st_uid - shift}:{host.st_gid - shift}", "0:0"], r
        assert host.st_gid != shift, "test image: /etc/shadow should belong to group shadow"


async def test_clones_get_fresh_identity(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    cmd = "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1"
    async with sandbox(backend, debian_python_image, **SMALL) as a, sandbox(backend, debian_python_image, **SMALL) as b:
        assert a.backend_state["start"] == b.backend_state["start"] == "restore", (a.backend_state, b.backend_state)
        ra = await backend.exec(a, ExecRequest(command=cmd))
        rb = await backend.exec(b, ExecRequest(command=cmd))
        la, lb = ra.stdout.splitlines(), rb.stdout.splitlines()
        assert la[0] == a.id.encode() and lb[0] == b.id.encode()
        assert la[1] != lb[1] and la[2] != lb[2], (la, lb)


async def test_pause_resume_and_snapshot_restore(backend: MicroVMBackend, debian_python_image: ImageRef,
                                                 tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    snap.mkdir()
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        await backend.write_file(sb, "/workspace/state.txt", b"before snapshot", None)
        await backend.pause(sb)
        run = asyncio.create_task(backend.exec(sb, ExecRequest(command="echo resumed", timeout=30)))
        await asyncio.sleep(1)
        assert not run.done(), "a paused VM ran a command"
        await backend.resume(sb)
        assert (await run).stdout == b"resumed\n"
        await backend.snapshot(sb, snap)
        await backend.write_file(sb, "/workspace/state.txt", b"after snapshot", None)
        # the snapshot's shape wins over the spec's (a VM's RAM size is part of its state)
        record = new_record("microvm", debian_python_image, memory="1Gi")
        try:
            await backend.restore(record, debian_python_image, [snap])
            assert record.spec.memory == 384 * 1024 * 1024
            assert await backend.read_file(record, "/workspace/state.txt", 100) == b"before snapshot"
            r = await backend.exec(record, ExecRequest(command="hostname"))
            assert r.stdout.strip() == record.id.encode()
        finally:
            await backend.destroy(record)
        # a paused VM stays paused across a snapshot
        await backend.pause(sb)
        again = tmp_path / "again"
        again.mkdir()
        await backend.snapshot(sb, again)
        status = (await qmp(Path(sb.backend_state["rundir"]), [("query-status", {})]))[-1]["status"]
        assert status in ("paused", "postmigrate"), status  # stopped either way: vCPUs do not run
        await backend.resume(sb)
    with pytest.raises(SandboxError, match="not a readable microvm snapshot"):
        await backend.restore(new_record("microvm", debian_python_image, **SMALL), debian_python_image,
                              [tmp_path / "nope"])
    # a snapshot whose state file is gone is reported as such, and nothing is left running
    (snap / "state").unlink()
    with pytest.raises(SandboxError, match="state file is missing"):
        await backend.restore(new_record("microvm", debian_python_image, **SMALL), debian_python_image, [snap])


async def test_corrupt_snapshot_fails_cleanly(backend: MicroVMBackend, debian_python_image: ImageRef,
                                             tmp_path: Path) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        await backend.snapshot(sb, tmp_path)
    (tmp_path / "state").write_bytes(b"QEVM" + os.urandom(4096))
    record = new_record("microvm", debian_python_image, **SMALL)
    try:
        with pytest.raises(SandboxError, match=r"restoring .* failed: QEMU exited"):
            await asyncio.wait_for(backend.restore(record, debian_python_image, [tmp_path]), 60)
    finally:
        await backend.destroy(record)
    assert qemu_pids(backend.tag) == []


@pytest.mark.parametrize("how,reason", [
    ("echo c > /proc/sysrq-trigger", "panicked"),
    ("echo o > /proc/sysrq-trigger", "powered off"),
])
async def test_guest_death_is_reported(how: str, reason: str, backend: MicroVMBackend,
                                       debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        with pytest.raises(SandboxError, match=reason):
            await asyncio.wait_for(backend.exec(sb, ExecRequest(command=how, timeout=30)), 60)
        with pytest.raises(SandboxError, match=reason):
            await backend.exec(sb, ExecRequest(command="true"))
        assert qemu_pids(backend.tag) == []


async def test_qemu_killed_mid_exec(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        run = asyncio.create_task(backend.exec(sb, ExecRequest(command="echo started; sleep 60", timeout=90)))
        await asyncio.sleep(1.5)
        os.kill(sb.backend_state["qemu_pid"], signal.SIGKILL)
        with pytest.raises(SandboxError, match="SIGKILL"):
            await asyncio.wait_for(run, 20)


class _Output:
    """A process's sink: its stdout and its exit."""

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.exit: asyncio.Future[tuple[int, int | None]] = asyncio.get_running_loop().create_future()

    def output(self, stream: str, data: bytes) -> None:
        self.stdout += data if stream == "stdout" else b""

    def exited(self, exit_code: int, signal: int | None) -> None:
        self.exit.set_result((exit_code, signal))


async def test_stdin_streams_through_the_agent_within_a_window(backend: MicroVMBackend,
                                                               debian_python_image: ImageRef) -> None:
    """Far more stdin than the agent may hold (8 MiB) reaches a command, one that reads at once as one that reads
    late: the host sends within a window the agent credits as the command takes it. A process's writes wait too
    (what backpressures an SDK client's send_stdin)."""
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command="wc -c", stdin=b"x" * (64 << 20), timeout=300))
        assert (r.exit_code, r.stdout.strip()) == (0, b"67108864"), r
        r = await backend.exec(sb, ExecRequest(command="sleep 2; wc -c", stdin=b"y" * (24 << 20), timeout=300))
        assert (r.exit_code, r.stdout.strip()) == (0, b"25165824"), r
        sink = _Output()
        proc = await backend.start_process(sb, ProcessSpec(argv=["sh", "-c", "sleep 2; wc -c"]), sink)
        try:
            await proc.write(b"z" * (24 << 20))
            await proc.close_stdin()
            assert await asyncio.wait_for(sink.exit, 120) == (0, None) and sink.stdout.strip() == b"25165824"
        finally:
            await proc.aclose()


_FLOOD_SERVER = """
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(bytes(range(256)) * 65536); c.close()
"""


async def _held_at_window(held: Callable[[], int]) -> None:
    """Wait until the host holds a full window for a stalled consumer (less a first frame it took), then check it
    stays there."""
    for _ in range(600):
        if held() >= OUTPUT_WINDOW - MAX_GUEST_PAYLOAD:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(2)
    assert OUTPUT_WINDOW - MAX_GUEST_PAYLOAD <= held() <= OUTPUT_WINDOW


async def test_output_to_a_consumer_that_does_not_read_is_held_in_the_guest(backend: MicroVMBackend,
                                                                            debian_python_image: ImageRef) -> None:
    """A command (or a guest port's server) writing far more than the window to a consumer that does not read:
    what the daemon queues for its channel stays at the window (the agent stops reading the pipe or socket, so
    the guest holds the rest), other channels on the guest keep working meanwhile, and reading it all gives every
    byte, in order, then the exit."""
    count = 8_000_000  # 63 MB of `seq`
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        client = backend.agent.client(sb)
        assert client.output_credits  # this checkout's agent (the initramfs is built from its source)

        def held() -> int:
            return max((client.queued(ch) for ch in list(client._channels)), default=0)

        stream = backend.exec_stream(sb, ExecRequest(command=f"seq 1 {count}", max_output=128 << 20, timeout=600))
        first = await anext(stream)  # the generator (an exec streamed to a slow client) now holds
        await _held_at_window(held)
        r = await backend.exec(sb, ExecRequest(command="echo meanwhile"))
        assert (r.exit_code, r.stdout) == (0, b"meanwhile\n")
        got, most = bytearray(first.data or b""), 0
        async for event in stream:
            most = max(most, held())
            if event.type == "stdout":
                got += event.data or b""
            elif event.type == "exit":
                assert event.result is not None and event.result.exit_code == 0
        assert most <= OUTPUT_WINDOW
        assert got == "".join(f"{i}\n" for i in range(1, count + 1)).encode()

        sink = _Output()
        proc = await backend.start_process(sb, ProcessSpec(argv=["python3", "-c", _FLOOD_SERVER]), sink)
        try:
            for _ in range(900):
                if sink.stdout.endswith(b"\n"):
                    break
                await asyncio.sleep(0.1)
            port = await backend.open_port(sb, int(sink.stdout))
            try:
                await _held_at_window(held)
                r = await backend.exec(sb, ExecRequest(command="echo meanwhile"))
                assert r.stdout == b"meanwhile\n"
                data = bytearray()
                while chunk := await asyncio.wait_for(port.read(1 << 16), 60):
                    data += chunk
                    most = max(most, held())
            finally:
                await port.aclose()
            assert most <= OUTPUT_WINDOW and data == bytes(range(256)) * 65536
        finally:
            await proc.aclose()


async def test_guest_out_of_memory_kills_the_command_not_the_vm(backend: MicroVMBackend,
                                                                debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(
            command="python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 24))'", timeout=120))
        # sh reports its child's SIGKILL as 137; the agent saw the guest's OOM killer act
        assert r.exit_code == 128 + 9 and r.limit == "memory", r
        assert (await backend.exec(sb, ExecRequest(command="echo alive"))).stdout == b"alive\n"


async def test_bad_specs_are_refused(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    with pytest.raises(InvalidRequest, match="memory"):
        await backend.create(new_record("microvm", debian_python_image, memory="64Mi"), debian_python_image)
    with pytest.raises(InvalidRequest, match="allow_privilege_escalation=True is not available"):
        await backend.create(new_record("microvm", debian_python_image, allow_privilege_escalation=True),
                             debian_python_image)
    # network policies on microvm (and their bad input): tests/integration/security/test_network_policy.py


async def test_killing_the_agent_from_inside_does_not_hang(backend: MicroVMBackend,
                                                           debian_python_image: ImageRef) -> None:
    """Commands run in a pid namespace of their own: their pid 1 is a waiting init the kernel shields from
    its namespace's signals, and the agent (the guest's pid 1, which the guest kernel shields too) is not
    visible; the attempts return and the sandbox keeps working."""
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await asyncio.wait_for(backend.exec(sb, ExecRequest(
            command="kill -9 1; kill -SEGV 1; kill -9 -1; pidof dsec-agent; echo tried; cat /proc/1/comm")), 60)
        assert r.stdout == b"tried\ndsec-pidns-init\n", r
        assert (await backend.exec(sb, ExecRequest(command="echo alive"))).stdout == b"alive\n"


async def test_hibernate_releases_ram_and_resume_restores_everything(backend: MicroVMBackend,
                                                                     debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command="sleep 1000 >/dev/null 2>&1 & echo $!"))
        pid = int(r.stdout)
        await backend.write_file(sb, "/workspace/f", b"kept", None)
        qemu = sb.backend_state["qemu_pid"]
        await backend.hibernate(sb)
        assert not Path(f"/proc/{qemu}").exists() or Path(f"/proc/{qemu}/stat").read_text().split()[2] == "Z"
        assert qemu_pids(backend.tag) == [], "QEMU still holds the VM's memory"
        with pytest.raises(SandboxError):
            await backend.exec(sb, ExecRequest(command="true"))
        await backend.resume(sb)
        r = await backend.exec(sb, ExecRequest(command=f"kill -0 {pid} && hostname && cat f"))
        assert r.exit_code == 0 and r.stdout == sb.id.encode() + b"\nkept", r
        # a hibernated sandbox whose saved state vanished says so on resume
        await backend.hibernate(sb)
        (Path(sb.backend_state["hibernated"]) / "state").unlink()
        with pytest.raises(SandboxError, match=r"saved state .* is missing"):
            await backend.resume(sb)


async def test_a_restarted_backend_re_adopts_running_vms(own_home: Path, own_backend: MicroVMBackend,
                                                         debian_python_image: ImageRef) -> None:
    """What a daemon restart does: a new backend recovers the record and talks to the same guest."""
    backend = own_backend
    record = new_record("microvm", debian_python_image, **SMALL)
    await backend.create(record, debian_python_image)
    second = MicroVMBackend(Settings(home=own_home, images_dir=images_dir()))
    try:
        await backend.exec(record, ExecRequest(command="echo before > /workspace/mark"))
        await backend.aclose()  # the old daemon goes away; its VMs keep running
        await second.start()
        assert await second.recover(record)
        r = await second.exec(record, ExecRequest(command="cat /workspace/mark; hostname"))
        assert r.stdout == b"before\n" + record.id.encode() + b"\n", r
    finally:
        await second.destroy(record)
        await second.aclose()
    assert not await second.recover(record)


async def test_orphan_sweep_leaves_the_container_backends_sandboxes_alone(
        own_home: Path, own_backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    """Both backends share a DSEC_HOME in a daemon: the microvm sweep must not take container sandboxes for
    its own orphans (it once killed them through their cgroups), nor the container sweep microvm ones."""
    from container_support import started_backend

    backend = own_backend
    async with started_backend(own_home, images_dir()) as containers, \
            sandbox(containers, debian_python_image) as box, sandbox(backend, debian_python_image, **SMALL) as vm:
        assert await backend.cleanup_orphans({vm.id}) == []
        assert await containers.cleanup_orphans({box.id}) == []
        assert (await containers.exec(box, ExecRequest(command="echo ok"))).stdout == b"ok\n"
        assert (await backend.exec(vm, ExecRequest(command="echo ok"))).stdout == b"ok\n"


async def test_console_flood_is_bounded_and_the_panic_still_named(backend: MicroVMBackend,
                                                                   debian_python_image: ImageRef) -> None:
    """The guest writes what it likes to its serial console: the host keeps only a bounded tail."""
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command="head -c 300000 /dev/zero | tr '\\0' x > /dev/ttyS0; echo done",
                                               timeout=120))
        assert r.stdout == b"done\n", r
        vm = backend.machines.machines[sb.id]
        await asyncio.sleep(0.5)
        assert 0 < len(vm.console) <= 64 * 1024
        assert not list(Path(sb.backend_state["rundir"]).glob("*.log*")) or \
            all(p.stat().st_size < 64 * 1024 for p in Path(sb.backend_state["rundir"]).glob("*.log"))
        with pytest.raises(SandboxError, match="panicked"):
            await asyncio.wait_for(backend.exec(sb, ExecRequest(command="echo c > /proc/sysrq-trigger")), 60)


async def small_template(backend: MicroVMBackend, image: ImageRef) -> Path:
    """The template of a SMALL sandbox, made (and restored from once) if it was not there."""
    async with sandbox(backend, image, **SMALL) as first:
        assert first.backend_state["start"] == "restore"
    [template] = [d for d in (backend.root / "templates").iterdir() if (d / "state").is_file()
                  and '"memory_mib": 384' in (d / "meta.json").read_text()]
    return template


async def test_corrupt_template_falls_back_to_cold_boot_and_is_rebuilt(own_backend: MicroVMBackend,
                                                                       debian_python_image: ImageRef) -> None:
    backend = own_backend
    template = await small_template(backend, debian_python_image)
    (template / "state").write_bytes(os.urandom(1000))
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        assert sb.backend_state["start"] == "boot" and "restoring" in sb.backend_state["restore_error"], \
            sb.backend_state
        assert (await backend.exec(sb, ExecRequest(command="echo booted"))).stdout == b"booted\n"
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        assert sb.backend_state["start"] == "restore", "the corrupt template was not rebuilt"


async def test_a_slow_template_restore_falls_back_to_cold_boot_and_keeps_the_template(
        own_backend: MicroVMBackend, debian_python_image: ImageRef, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore that only ran out of time (a loaded host) is no sign of a bad template: the create boots cold
    and the template stays, for the next create to restore from."""
    backend = own_backend
    template = await small_template(backend, debian_python_image)
    kept = (template / "state").stat().st_ino
    monkeypatch.setattr(backend.profile, "restore_timeout", 0.001)  # no guest answers its first ping that fast
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        assert sb.backend_state["start"] == "boot" and "did not answer within" in sb.backend_state["restore_error"], \
            sb.backend_state
    monkeypatch.undo()
    assert (template / "state").stat().st_ino == kept, "a template whose restore was only slow was discarded"
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        assert sb.backend_state["start"] == "restore"


async def test_vcpus_and_disk_limits(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, cpu=2, memory="384Mi", disk="64Mi") as sb:
        r = await backend.exec(sb, ExecRequest(command="nproc; grep MemTotal /proc/meminfo"))
        nproc, memtotal = r.stdout.decode().splitlines()
        assert nproc == "2" and 300_000 < int(memtotal.split()[1]) <= 384 * 1024, r
        r = await backend.exec(sb, ExecRequest(command="head -c 100000000 /dev/zero > big", timeout=120))
        assert r.exit_code != 0 and b"No space left" in r.stderr, r
        with pytest.raises(SandboxError, match="disk is full"):
            await backend.write_file(sb, "/workspace/more", os.urandom(80 * 1024 * 1024), None)
        await backend.exec(sb, ExecRequest(command="rm -f big"))
        await backend.write_file(sb, "/workspace/small", b"fits again", None)


async def test_image_user_and_workdir_apply(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    """An image's ``User`` and ``WorkingDir`` shape execs as they do in a container."""
    import dataclasses

    from dsec.models import ImageConfig

    image = dataclasses.replace(debian_python_image, config=ImageConfig(
        env=dict(debian_python_image.config.env), user="nobody", workdir="/srv/app"))
    record = new_record("microvm", image, workdir=None, **SMALL)
    try:
        await backend.create(record, image)
        assert record.spec.workdir == "/srv/app"
        r = await backend.exec(record, ExecRequest(command='id -u; id -g; echo "$HOME"; pwd'))
        assert r.stdout.decode().split() == ["65534", "65534", "/nonexistent", "/srv/app"], r
    finally:
        await backend.destroy(record)


async def test_pristine_exec_runs_the_images_binaries_whatever_guest_root_did(backend: MicroVMBackend,
                                                                               debian_python_image: ImageRef) -> None:
    """Guest root may replace binaries and remove the image's device node; a pristine
    exec still runs the image as booted (its EROFS disk mounted afresh by device number) with the workspace
    as the agent left it, a fresh /tmp, and its own writes thrown away."""
    import hashlib

    image_bash = hashlib.sha256((debian_python_image.rootfs / "usr/bin/bash").read_bytes()).hexdigest()
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        # (mounting over a binary and making a device node need capabilities commands no longer have: see
        # test_commands_run_without_the_capabilities_that_undo_protections)
        subvert = ("printf '#!/bin/sh\\necho ALL TESTS PASSED\\n' > /workspace/fake && chmod +x /workspace/fake && "
                   "cp /workspace/fake /usr/bin/python3.11 && cp /workspace/fake /usr/local/bin/python3 && "
                   "echo 'root::0:0::/:/bin/sh' > /etc/passwd && echo 'print(6 * 7)' > /workspace/solution.py && "
                   "echo scratch > /tmp/agent-tmp && rm /dev/vda && echo done")
        r = await backend.exec(sb, ExecRequest(command=["bash", "-c", subvert]))
        assert r.stdout == b"done\n", r
        r = await backend.exec(sb, ExecRequest(command="python3 /workspace/solution.py"))
        assert r.stdout == b"ALL TESTS PASSED\n", r
        r = await backend.exec(sb, ExecRequest(
            command="python3 solution.py; sha256sum /usr/bin/bash; grep -c '^root:x:' /etc/passwd; ls -A /tmp; "
                    "touch /workspace/from-grader; echo x > /usr/bin/evil; echo end", pristine=True))
        lines = r.stdout.decode().splitlines()
        assert lines[0] == "42" and lines[1].split()[0] == image_bash and lines[2] == "1", r
        assert lines[3] == "end", f"the pristine /tmp is not fresh: {r}"
        r = await backend.exec(sb, ExecRequest(command="ls /usr/bin/evil", pristine=True))
        assert r.exit_code != 0, r  # a pristine command's writes outside the workspace die with it
        r = await backend.exec(sb, ExecRequest(command="ls /workspace/from-grader && python3 -V"))
        assert r.stdout == b"/workspace/from-grader\nALL TESTS PASSED\n", r  # the agent's root as it left it
        r = await backend.exec(sb, ExecRequest(command="pwd", cwd="/no/such/dir", pristine=True))
        assert r.exit_code == 126 and b"pristine exec: /no/such/dir" in r.stderr, r


_CONFINEMENT_PROBE = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fn):
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
out = {"bnd": int(status["CapBnd"], 16), "eff": int(status["CapEff"], 16), "nnp": status["NoNewPrivs"].strip(),
       "uid": os.getuid()}
out["mount"] = 0 if libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None) == 0 else ctypes.get_errno()
out["sysctl"] = attempt(lambda: open("/proc/sys/kernel/core_pattern", "w").write("|/tmp/x"))
out["uevent_helper"] = attempt(lambda: open("/sys/kernel/uevent_helper", "w").write("/tmp/x"))
out["agent_root"] = attempt(lambda: os.listdir("/proc/1/root/"))
out["agent_ns"] = attempt(lambda: os.open("/proc/1/ns/mnt", os.O_RDONLY))
out["userns"] = 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()
out["mknod"] = attempt(lambda: os.mknod("/tmp/sda", 0o600 | 0o060000, os.makedev(8, 0)))
os.makedirs("/workspace/owned", exist_ok=True)
out["chown"] = attempt(lambda: os.chown("/workspace/owned", 1000, 1000))
""" + CONFINED_VIEW + "print(json.dumps(out))\n"
_KEPT_CAPS = {0, 1, 3, 4, 5, 6, 7, 10, 11, 13, 14, 15, 18, 23, 28, 29, 31}
"""CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, NET_BIND_SERVICE, NET_BROADCAST, NET_RAW, IPC_LOCK,
IPC_OWNER, SYS_CHROOT, SYS_NICE, LEASE, AUDIT_WRITE, SETFCAP (docs/design/microvm.md, "microvm: confined commands")."""


async def test_commands_run_without_the_capabilities_that_undo_protections(
        backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, **SMALL) as sb:
        r = await backend.exec(sb, ExecRequest(command=["python3", "-c", _CONFINEMENT_PROBE], timeout=60))
        assert r.exit_code == 0, r
        import json

        out = json.loads(r.stdout)
        kept = {cap for cap in range(64) if out["bnd"] >> cap & 1}
        assert kept == _KEPT_CAPS, f"bounding set {sorted(kept)}"
        assert out["eff"] == out["bnd"] and out["uid"] == 0 and out["nnp"] == "1", out
        assert out["mount"] == errno.EPERM and out["mknod"] == errno.EPERM, out
        assert out["sysctl"] == errno.EROFS and out["uevent_helper"] in (errno.EROFS, errno.ENOENT), out
        assert out["agent_root"] == errno.EACCES and out["agent_ns"] == errno.EACCES, out
        assert out["userns"] in (errno.ENOSPC, errno.EPERM), out
        assert out["chown"] == 0, "root lost CAP_CHOWN"
        # their own pid namespace: no agent, no kernel thread (whose root is the initramfs's, with a path into the
        # writable layer) to reach through /proc/<pid>/root
        assert set(out["comms"]) <= {"dsec-pidns-init", "python3", "sh"}, out["comms"]
        assert all("ro" in opts.split(",") for opts in out["submounts"].values()), out["submounts"]


async def test_protected_and_hidden_paths(backend: MicroVMBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, protected=["/etc/passwd", "/usr/bin"],
                       hidden=["/workspace/tests"], **SMALL) as sb:
        assert sb.backend_state["hidden"] == ["/workspace/tests"]
        await backend.write_file(sb, "/workspace/tests/t.py", b"secret", None)
        assert await backend.read_file(sb, "/workspace/tests/t.py", 100) == b"secret"  # beneath the cover
        r = await backend.exec(sb, ExecRequest(command=(
            "ls -A /workspace/tests; echo x >> /etc/passwd; echo $?; rm /usr/bin/ls; echo $?; "
            "mv /usr/bin /usr/bin2; echo $?"), timeout=60))
        codes = r.stdout.decode().split()
        assert len(codes) == 3 and "0" not in codes, r  # nothing listed, and every change refused
        assert b"Read-only file system" in r.stderr and b"busy" in r.stderr, r.stderr
        with pytest.raises(PermissionDenied, match="read-only"):  # EROFS: the protected path's bind
            await backend.write_file(sb, "/usr/bin/evil", b"x", None)
        await backend.reveal(sb)
        assert sb.backend_state["hidden"] == []
        r = await backend.exec(sb, ExecRequest(command="cat /workspace/tests/t.py; echo >> /workspace/tests/t.py",
                                               timeout=60))
        assert r.stdout == b"secret" and b"Read-only file system" in r.stderr, r
        await backend.reveal(sb)  # a second reveal has nothing left to do
        pristine = await backend.exec(sb, ExecRequest(command="sha256sum /usr/bin/ls | cut -c1-8", pristine=True))
        assert pristine.exit_code == 0 and len(pristine.stdout) == 9, pristine


async def test_bad_protected_and_hidden_paths_are_refused(backend: MicroVMBackend,
                                                          debian_python_image: ImageRef) -> None:
    for spec, message in (({"protected": ["/no/such/file"]}, "protected path /no/such/file does not exist"),
                          ({"protected": ["/bin/ls"]}, "symbolic link"),  # /bin -> usr/bin in Debian
                          ({"hidden": ["/etc/passwd"]}, "not a directory")):
        with pytest.raises(InvalidRequest, match=message):
            await backend.create(new_record("microvm", debian_python_image, **spec, **SMALL), debian_python_image)
    assert qemu_pids(backend.tag) == [], "a refused create left its VM running"
