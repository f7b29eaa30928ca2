"""The vm backend (QEMU q35 booting a VM image's own kernel and systemd) against the conformance suite, plus
what only a full VM has: kernel modules, a desktop driven by screenshots, mouse and keyboard, the guest
powering itself off, and its disk filling up.

Every sandbox is restored from one template per (image, vCPUs, memory): the first test boots it (minutes
under TCG), the others restore in seconds. The image is ``debian-desktop`` (built by ./scripts/setup).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import signal
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from conftest import missing
from dsec.backends.base import ImageRef
from dsec.backends.vm import VMBackend
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest, NotSupported, SandboxError
from dsec.guest.vmimage import find_vm_image
from dsec.models import ExecRequest
from dsec.testing import CHECKS, new_record, sandbox
from dsec.testing.conformance import Check, SharedSandbox
from guest_support import CONFINED_VIEW, conforms, lending

# the first test boots the template: minutes under TCG on a loaded machine
pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1800)]

IMAGE = "debian-desktop"
XTERM = (200, 150)
"""A pixel inside the desktop's terminal (xterm at +40+40, 80x24 characters)."""


def vm_qemu_pids(backend: VMBackend) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline and f"{backend.machines.run_root}/".encode() in cmdline:
                found.append(int(proc.name))
    return found


def pixels(png: bytes) -> bytes:
    """The decompressed image data of a PNG (its IDAT chunks), to compare what two screenshots show."""
    pos, data = 8, b""
    while pos < len(png):
        length = int.from_bytes(png[pos:pos + 4], "big")
        kind = png[pos + 4:pos + 8]
        if kind == b"IDAT":
            data += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    return zlib.decompress(data)


@pytest.fixture(scope="module")
def home(vm_home: Path) -> Path:
    """The session's vm home (conftest.py): its template is shared with the red-team suite."""
    try:
        find_vm_image(IMAGE)
    except DSecError as e:
        missing(str(e))
    return vm_home


@contextlib.asynccontextmanager
async def started(home: Path) -> AsyncIterator[VMBackend]:
    """A started backend on ``home``; on exit, no sandbox or QEMU of it may be left."""
    b = VMBackend(Settings(home=home))
    await b.start()
    try:
        yield b
    finally:
        removed = await b.cleanup_orphans(set())
        await b.aclose()
        left = vm_qemu_pids(b)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert [r for r in removed if r.startswith("sb-")] == [] and left == [], f"leaked: {removed} {left}"


@pytest.fixture
async def backend(home: Path) -> AsyncIterator[VMBackend]:
    async with started(home) as b:
        yield b


@pytest.fixture
def image(backend: VMBackend) -> ImageRef:
    return backend.resolve_image(IMAGE)


async def test_vm_boots_its_own_kernel_with_systemd(backend: VMBackend, image: ImageRef) -> None:
    # the first create boots the template (the slow part); the second is restored from it
    async with sandbox(backend, image) as a, sandbox(backend, image) as b:
        assert a.backend_state["start"] == b.backend_state["start"] == "restore", a.backend_state
        r = await backend.exec(a, ExecRequest(command="uname -r; readlink /proc/1/exe; hostname; "
                                                       "systemctl is-active dsec-agent dsec-desktop"))
        release, init, hostname, agent, desktop = r.stdout.decode().split()
        assert release != os.uname().release and release.endswith("-amd64"), r
        assert init.endswith("/systemd") and hostname == a.id and agent == desktop == "active", r
        # a clone's clock is the host's, not its template's
        clock = await backend.exec(b, ExecRequest(command="date +%s"))
        assert abs(int(clock.stdout) - time.time()) < 120, clock
        rb = await backend.exec(b, ExecRequest(command="cat /etc/machine-id"))
        ra = await backend.exec(a, ExecRequest(command="cat /etc/machine-id"))
        assert ra.stdout != rb.stdout
        # each clone writes to its own overlay over the shared, read-only base
        await backend.write_file(a, "/etc/only-in-a", b"a", None)
        with pytest.raises(DSecError):
            await backend.read_file(b, "/etc/only-in-a", 10)
        assert Path(a.backend_state["erofs"]).parent == backend.sandbox_files / a.id


RESET = ('cg=/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup); '
         'case $cg in */commands) ;; *) echo "not in a commands cgroup: $cg" >&2; exit 3;; esac; '
         'aside=${cg%/commands}/reset && mkdir -p "$aside" && echo $$ > "$aside/cgroup.procs" && '
         'echo 1 > "$cg/cgroup.kill" && until grep -qx "populated 0" "$cg/cgroup.events"; do sleep 0.05; done && '
         'echo $$ > "$cg/cgroup.procs" && rmdir "$aside"')
"""What a borrower of the shared vm sandbox can leave running, ended: a vm's commands share the guest's pid
namespace with systemd, its services and the desktop (``kill -1`` would end those too), but all of them, and
only them, are in the agent's ``commands`` cgroup. The reset's own shell steps into a sibling cgroup, kills
that one whole (``cgroup.kill``: forks under way included), waits until it is empty and steps back."""


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def shared(home: Path) -> AsyncIterator[SharedSandbox]:
    """A backend and a running sandbox the conformance checks that only need one borrow in turn (a guest
    restore and teardown saved per check under TCG); class scope: gone before the module's other tests, whose
    backends sweep this home's orphans."""
    async with started(home) as b, lending(b, b.resolve_image(IMAGE), RESET) as lender:
        yield lender


class TestConformance:
    """The conformance checks, sharing :func:`shared`'s sandbox where a check only needs a running one."""

    @pytest.mark.asyncio(loop_scope="class")
    @pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
    async def test_vm_conforms(self, check: Check, shared: SharedSandbox) -> None:
        await conforms(shared, check, 600)

    @pytest.mark.asyncio(loop_scope="class")
    async def test_the_reset_ends_what_commands_left_and_nothing_else(self, shared: SharedSandbox) -> None:
        backend = shared.backend
        async with shared.lend() as sb:  # (pgrep anchored: the shells' own command lines name the sleeps)
            r = await backend.exec(sb, ExecRequest(command="(trap '' TERM HUP; sleep 600) >/dev/null 2>&1 & "
                                                           "setsid sleep 601 >/dev/null 2>&1 & sleep 0.5; "
                                                           "pgrep -cf '^sleep 60[01]$'"))
            assert r.stdout == b"2\n", r
        r = await backend.exec(sb, ExecRequest(command=(
            'cg=/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup); '
            'for p in $(cat "$cg/cgroup.procs"); do cat /proc/$p/comm 2>/dev/null; done; '  # cat: gone by then
            "pgrep -cf '^sleep 60[01]$'; systemctl is-active dsec-agent dsec-desktop; ls -d ${cg%/commands}/*/")))
        base = "/sys/fs/cgroup/system.slice/dsec-agent.service"
        assert r.stdout.decode().split() == ["sh", "0", "active", "active", f"{base}/agent/", f"{base}/commands/"], r


async def test_loads_a_kernel_module(backend: VMBackend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await backend.exec(sb, ExecRequest(command="modprobe dummy && grep -c '^dummy ' /proc/modules"))
        assert r.exit_code == 0 and r.stdout == b"1\n", r
        r = await backend.exec(sb, ExecRequest(command="ip link add d0 type dummy && ip -o link show d0"))
        assert r.exit_code == 0 and b"d0" in r.stdout, r


async def test_typing_into_the_desktop_terminal(backend: VMBackend, image: ImageRef, tmp_path: Path) -> None:
    async with sandbox(backend, image) as sb:
        before = await backend.screenshot(sb)
        assert before[:8] == b"\x89PNG\r\n\x1a\n"
        await backend.mouse(sb, *XTERM, action="click")  # twm: the keyboard follows the pointer
        await backend.keyboard(sb, text="echo typed-by-dsec > /tmp/typed\n")
        for _ in range(120):
            r = await backend.exec(sb, ExecRequest(command="cat /tmp/typed 2>/dev/null"))
            if r.stdout:
                break
            await asyncio.sleep(0.5)
        if r.stdout != b"typed-by-dsec\n":
            (tmp_path / "screen.png").write_bytes(await backend.screenshot(sb))
            ps = await backend.exec(sb, ExecRequest(command="ps -eo pid,ppid,etimes,wchan:16,cmd | grep -E "
                                                            "'xterm|bash|twm|Xorg' | grep -v grep; cat /proc/uptime"))
            pytest.fail(f"the keystrokes did not reach the terminal's shell (start: {sb.backend_state['start']}; "
                        f"screen: {tmp_path / 'screen.png'}):\n{ps.stdout.decode(errors='replace')}")
        after = await backend.screenshot(sb)
        assert pixels(after) != pixels(before), "typing changed nothing on the screen"
        await backend.keyboard(sb, keys=["ctrl+c", "enter"])
        await backend.mouse(sb, *XTERM, button="right", action="click")
        await backend.mouse(sb, 5, 5, action="scroll_down")


async def test_computer_use_refuses_bad_input(backend: VMBackend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        with pytest.raises(InvalidRequest, match="outside the"):
            await backend.mouse(sb, 100000, 5)
        with pytest.raises(InvalidRequest, match="button="):
            await backend.mouse(sb, 5, 5, button="fourth")
        with pytest.raises(InvalidRequest, match="action="):
            await backend.mouse(sb, 5, 5, action="lick")
        with pytest.raises(InvalidRequest, match="unknown key 'hyper'"):
            await backend.keyboard(sb, keys=["hyper+x"])
        with pytest.raises(InvalidRequest, match="cannot be typed"):
            await backend.keyboard(sb, text="naïve")
        with pytest.raises(InvalidRequest, match="exactly one"):
            await backend.keyboard(sb)
        # nothing was sent: the sandbox works on
        assert (await backend.exec(sb, ExecRequest(command="echo ok"))).stdout == b"ok\n"


async def test_guest_powering_off_is_reported(backend: VMBackend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        with pytest.raises(SandboxError, match="powered off"):
            await asyncio.wait_for(backend.exec(sb, ExecRequest(command="systemctl poweroff; sleep 600",
                                                                timeout=300)), 400)
        with pytest.raises(SandboxError, match="powered off"):
            await backend.exec(sb, ExecRequest(command="true"))
        assert vm_qemu_pids(backend) == []


async def test_disk_full_is_a_clear_error_and_bounded_on_the_host(backend: VMBackend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        overlay = Path(sb.backend_state["erofs"])
        r = await backend.exec(sb, ExecRequest(
            # root may use the blocks reserved for it: fill all free blocks but 64 KiB, then dd runs out
            command="fallocate -l $(( $(stat -f -c '%f*%S' /) - 65536 )) /fill; sync; "
                    "dd if=/dev/zero of=/more bs=1M count=64 2>&1; echo dd=$?", timeout=300))
        out = r.stdout.decode()
        assert "No space left on device" in out and "dd=1" in out, out
        with pytest.raises(DSecError, match=r"No space left|ENOSPC|space"):
            await backend.write_file(sb, "/workspace/big", b"x" * (1 << 20), None)
        # the guest's filesystem is full, not the host's: the overlay grew by metadata only, and the VM runs on
        assert overlay.stat().st_size < 512 * 1024**2, overlay.stat().st_size
        r = await backend.exec(sb, ExecRequest(command="rm /fill /more; echo ok"))
        assert r.stdout == b"ok\n", r


async def test_disk_size_grows_the_guest_filesystem(backend: VMBackend, image: ImageRef) -> None:
    size = 6 * 1024**3  # the image's filesystem is 4 GiB
    async with sandbox(backend, image, disk=size) as sb:
        assert sb.backend_state["start"] == "restore" and sb.backend_state["disk_bytes"] == size, sb.backend_state
        r = await backend.exec(sb, ExecRequest(command="blockdev --getsize64 /dev/vda; df -B1 --output=size / | tail -1"
                                                       ))
        device, fs = map(int, r.stdout.split())
        assert device == size and fs > 5.5 * 1024**3, r
        # the host's overlay has that virtual size, and stays sparse
        overlay = Path(sb.backend_state["erofs"])
        assert overlay.stat().st_size < 256 * 1024**2, overlay.stat().st_size
    with pytest.raises(InvalidRequest, match=r"disk=.* free on the host"):
        await backend.create(new_record("vm", image, disk=1024**5), image)


async def test_pause_resume_and_snapshot_restore(backend: VMBackend, image: ImageRef, tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    snap.mkdir()
    async with sandbox(backend, image) as sb:
        await backend.write_file(sb, "/var/state.txt", b"before snapshot", None)
        await backend.pause(sb)
        run = asyncio.create_task(backend.exec(sb, ExecRequest(command="echo resumed", timeout=60)))
        await asyncio.sleep(1)
        assert not run.done(), "a paused VM ran a command"
        await backend.resume(sb)
        assert (await run).stdout == b"resumed\n"
        await backend.snapshot(sb, snap)
        assert (snap / "disk.qcow2").is_file()  # the disk goes with the RAM
        await backend.write_file(sb, "/var/state.txt", b"after snapshot", None)
        record = new_record("vm", image)
        try:
            await backend.restore(record, image, [snap])
            assert await backend.read_file(record, "/var/state.txt", 100) == b"before snapshot"
            r = await backend.exec(record, ExecRequest(command="hostname"))
            assert r.stdout.strip() == record.id.encode()
        finally:
            await backend.destroy(record)
        assert await backend.read_file(sb, "/var/state.txt", 100) == b"after snapshot"
    with pytest.raises(SandboxError, match="not a readable vm snapshot"):
        await backend.restore(new_record("vm", image), image, [tmp_path / "nope"])


async def test_bad_specs_and_images_are_refused(backend: VMBackend, image: ImageRef) -> None:
    with pytest.raises(InvalidRequest, match="memory"):
        await backend.create(new_record("vm", image, memory="64Mi"), image)
    assert backend.resolve_image("no-such-vm-image") is None  # the engine then resolves the store's image
    # pristine execs need a confined sandbox (refused before the sandbox is looked up)
    with pytest.raises(NotSupported, match="pristine execs on the vm backend need a confined sandbox"):
        await backend.exec(new_record("vm", image), ExecRequest(command="true", pristine=True))
    # a protected path the image lacks: refused naming it, nothing left running
    with pytest.raises(InvalidRequest, match="/no/such/file"):
        await backend.create(new_record("vm", image, protected=["/no/such/file"]), image)
    assert vm_qemu_pids(backend) == []


_CONFINED_PROBE = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("append_protected", lambda: open("/etc/passwd", "a").write("x::0:0::/:/bin/sh\n"))
attempt("write_etc", lambda: open("/etc/ld.so.preload", "w").write("/workspace/evil.so\n"))
attempt("write_usr", lambda: open("/usr/local/bin/twm", "w").write("#!/bin/sh\n"))
attempt("write_agent", lambda: open("/usr/local/sbin/dsec-agent", "ab").write(b"x"))
attempt("write_unit", lambda: open("/etc/systemd/system/dsec-agent.service", "a").write("ExecStartPre=/bin/true\\n"))
attempt("write_workspace", lambda: open("/workspace/ok", "w").write("ok"))
attempt("write_tmp", lambda: open("/tmp/ok", "w").write("ok"))
attempt("raw_disk", lambda: os.close(os.open("/dev/vda", os.O_WRONLY)))
attempt("hidden_listing", lambda: out.__setitem__("listing", os.listdir("/workspace/tests")))
attempt("systemd_socket", lambda: os.stat("/run/systemd/private"))
out["umount"] = 0 if libc.umount2(b"/etc/passwd", 2) == 0 else ctypes.get_errno()
''' + CONFINED_VIEW + "print(json.dumps(out))\n"


async def test_grading_paths_confine_commands(backend: VMBackend, image: ImageRef, tmp_path: Path) -> None:
    """protected= and hidden= on a vm: commands confined (read-only system but the work directories, their own
    /run, no raw disk, no mount, no module loading), the agent's upkeep not (clock, disk growth), pristine execs
    on the image's base disk, reveal, and an agent that died ends the guest instead of serving unconfined."""
    async with sandbox(backend, image, protected=["/etc/passwd"], hidden=["/workspace/tests"]) as sb:
        assert sb.backend_state["hidden"] == ["/workspace/tests"]
        clock = await backend.exec(sb, ExecRequest(command="date +%s"))
        assert abs(int(clock.stdout) - time.time()) < 120, clock  # set by the agent's unconfined upkeep
        await backend.write_file(sb, "/workspace/tests/test_grade.py", b"assert 42\n", None)
        r = await backend.exec(sb, ExecRequest(command=["python3", "-c", _CONFINED_PROBE]))
        res = json.loads(r.stdout)
        assert {k: res[k] for k in ("append_protected", "write_etc", "write_usr", "write_unit")} == \
            dict.fromkeys(("append_protected", "write_etc", "write_usr", "write_unit"), errno.EROFS), res
        assert res["write_agent"] in (errno.EROFS, errno.ETXTBSY) and res["raw_disk"] == errno.EACCES, res
        assert res["write_workspace"] == res["write_tmp"] == 0, res
        assert res["listing"] == [] and res["systemd_socket"] == errno.ENOENT and res["umount"] == errno.EPERM, res
        # their own pid namespace (no agent, service or desktop process to signal or to read the uncovered disk
        # through /proc/<pid>/root of); every mount under /sys and /proc/sys read-only (tracefs, cgroup, ...)
        assert set(res["comms"]) <= {"dsec-pidns-init", "python3"}, res["comms"]
        assert any(p.startswith("/sys/fs/cgroup") for p in res["submounts"]), res["submounts"]
        assert all("ro" in opts.split(",") for opts in res["submounts"].values()), res["submounts"]
        r = await backend.exec(sb, ExecRequest(command="modprobe dummy"))
        assert r.exit_code != 0, r
        r = await backend.exec(sb, ExecRequest(command="kill -9 -1; pkill -9 Xorg; pidof dsec-agent; echo tried"))
        assert r.stdout == b"tried\n", r
        r = await backend.agent.system_exec(sb, ExecRequest(command="systemctl is-active dsec-agent dsec-desktop"))
        assert r.stdout.split() == [b"active", b"active"], r
        # pristine: the image's own binaries, whatever the sandbox's disk holds (the files API, as guest root,
        # can replace them: commands cannot)
        real = (await backend.exec(sb, ExecRequest(command="sha256sum /usr/bin/sha256sum"))).stdout.split()[0]
        await backend.write_file(sb, "/usr/bin/sha256sum", b"#!/bin/sh\necho 0000  PASS\n", 0o755)
        fooled = await backend.exec(sb, ExecRequest(command="sha256sum /usr/bin/sha256sum"))
        assert fooled.stdout.startswith(b"0000"), fooled
        graded = await backend.exec(sb, ExecRequest(command=["sha256sum", "/usr/bin/python3"], pristine=True))
        plain = await backend.exec(sb, ExecRequest(command=["cat", "/usr/bin/python3"]))
        assert graded.exit_code == 0 and graded.stdout.split()[0].decode() == \
            hashlib.sha256(plain.stdout).hexdigest(), graded
        graded = await backend.exec(sb, ExecRequest(command="head -c 20 /usr/bin/sha256sum | od -c | head -1",
                                                    pristine=True))
        assert b"E   L   F" in graded.stdout, graded  # the image's binary, not the replacement script
        assert real != b"0000"
        # a snapshot's clone is its guest: still confined, tests still hidden, its clock set by the upkeep
        await backend.snapshot(sb, tmp_path)
        clone = new_record("vm", image, protected=["/etc/passwd"], hidden=["/workspace/tests"])
        try:
            await backend.restore(clone, image, [tmp_path])
            assert clone.backend_state["hidden"] == ["/workspace/tests"]
            r = await backend.exec(clone, ExecRequest(command="ls -A /workspace/tests; date +%s; "
                                                              "echo x >> /etc/hostname"))
            assert r.stdout.split()[:-1] == [] and abs(int(r.stdout) - time.time()) < 120, r
            assert b"Read-only file system" in r.stderr, r
        finally:
            await backend.destroy(clone)
        await backend.reveal(sb)
        r = await backend.exec(sb, ExecRequest(command="cat /workspace/tests/test_grade.py; "
                                                       "echo x >> /workspace/tests/test_grade.py"))
        assert r.stdout == b"assert 42\n" and b"Read-only file system" in r.stderr, r
        # the agent dies (commands cannot reach it: here the backend's own upkeep kills it): systemd restarts
        # it, and the new agent ends the guest instead of serving unconfined (the killing call itself fails,
        # its agent gone; the next calls see the guest power off)
        with pytest.raises(SandboxError):
            await backend.agent.system_exec(sb, ExecRequest(command="kill -9 $(pidof dsec-agent)", timeout=30))
        with pytest.raises(SandboxError, match="the guest powered off"):
            for _ in range(60):
                await backend.exec(sb, ExecRequest(command="true", timeout=30))
                await asyncio.sleep(1)


async def test_memory_bomb_is_oom_killed(backend: VMBackend, image: ImageRef) -> None:
    """A command that eats memory is OOM-killed in the guest's commands cgroup (limit='memory'), capped at the
    spec's memory (256 MiB to fill, not the default guest's 768); the guest, its agent and its desktop live on."""
    async with sandbox(backend, image, memory="256Mi") as sb:
        bomb = "b = []\nwhile True: b.append(bytearray(1 << 20))"
        r = await backend.exec(sb, ExecRequest(command=["python3", "-c", bomb], timeout=300))
        assert r.limit == "memory" and r.signal == signal.SIGKILL, r
        r = await backend.exec(sb, ExecRequest(command="cat /proc/self/oom_score_adj; cat /proc/self/cgroup; "
                                                       "systemctl is-active dsec-desktop"))
        assert r.stdout.split() == [b"0", b"0::/system.slice/dsec-agent.service/commands", b"active"], r
