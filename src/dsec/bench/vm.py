"""``dsec bench vm``: a full VM's cold boot (kernel, systemd, desktop) to first exec vs restore from its
template to first exec, measured in one run; what a network policy adds to a restore (namespace, tap, veth,
nft rules, DNS proxy, the template with a NIC); host memory per idle VM; screenshot and exec round trips.

The peer is plain QEMU: the same q35 command line, kernel and disk image (a qcow2 overlay of its own), no
DSec around it, started cold and timed until the guest agent's first frame (systemd has started it: the
earliest moment anything could run in the guest), then left idle for its memory. Cold boots are few (each
is minutes under TCG); restores and idle VMs share the template the first cold boot made. Every figure comes
from one run on this machine; nothing asserts a timing. Leaves no VM behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dsec.backends.base import ImageRef
from dsec.backends.qemu.profile import Shape
from dsec.backends.vm import VMBackend
from dsec.bench.container import BenchUnavailable
from dsec.bench.machines import Machines
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.errors import DSecError
from dsec.guest.vmimage import find_vm_image
from dsec.models import ExecRequest, parse_size

__all__ = ["run"]

MiB = 1024 * 1024


def _pss(pid: int) -> int:
    """Proportional set size of a process in bytes (shared pages split among the processes mapping them)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _plain_vm(backend: VMBackend, image: ImageRef, mem_mib: int, workdir: Path, idle: float,
              timeout: float) -> tuple[float, int]:
    """Boot the VM image with plain QEMU (DSec's q35 command line, no DSec); return seconds until the guest
    agent's first frame and the QEMU's PSS after ``idle`` more seconds."""
    vm = find_vm_image(image.name, backend.vm_dir)
    d = Path(tempfile.mkdtemp(prefix="plain-", dir=workdir))
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(vm.disk),
                    str(d / "disk.qcow2")], check=True, capture_output=True)
    for name in ("vmlinuz", "initrd.img"):
        (d / name).symlink_to(vm.dir / name)
    memory = ["memory-backend-ram", "id=mem", f"size={mem_mib}M"]
    cmd = backend.profile.command(d, d / "disk.qcow2", Shape(1, mem_mib, vm.disk_bytes), memory,
                                  backend.accel or "tcg")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            while True:
                try:
                    sock.connect(str(d / "agent.sock"))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if proc.poll() is not None or time.monotonic() - start > timeout:
                        raise DSecError("plain QEMU ended or never opened the agent socket") from None
                    time.sleep(0.01)
            sock.settimeout(max(timeout - (time.monotonic() - start), 1))
            if not sock.recv(1):
                raise DSecError("plain QEMU closed the agent socket before the agent spoke")
            booted = time.monotonic() - start
            time.sleep(idle)
            return booted, _pss(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()


async def run(boots: int = 1, samples: int = 3, idle_vms: int = 3, image_name: str = "debian-desktop",
              memory: str = "1Gi", progress: Callable[[str], None] = lambda m: None) -> Suite:
    suite = Suite(name="vm")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-fvm-", dir="/tmp") as home:
        settings = Settings(home=Path(home))
        fast = VMBackend(settings)
        cold = VMBackend(settings, fast_start=False)
        reason = fast.available()
        if reason != "ok":
            raise BenchUnavailable(f"vm backend: {reason}")
        try:
            image = fast.resolve_image(image_name)
        except DSecError as e:
            raise BenchUnavailable(str(e)) from None
        if image is None:
            raise BenchUnavailable(f"no VM image {image_name!r}: build it with `dsec image build-vm {image_name} "
                                   "--desktop` (./scripts/setup does)")
        await fast.start()
        await fast.wait_accelerator()
        cold.accel, cold.accel_reason = fast.accel, fast.accel_reason
        await cold.start()
        machines = Machines(fast, cold, image)

        async def first_exec(backend: VMBackend, network: str = "none") -> float:
            return await machines.first_exec(backend, memory=memory, network=network)

        try:
            progress(f"accelerator: {fast.accel} ({fast.accel_reason})")
            cold_s, restore_s, shot_s, rtt, plain_s, plain_pss, networked = [], [], [], [], [], [], []
            for i in range(boots):
                progress(f"plain QEMU boot {i + 1}/{boots} to the agent's first frame, then idle")
                booted, mem = await asyncio.to_thread(_plain_vm, fast, image, int(parse_size(memory) // MiB),
                                                      Path(home), 5.0, 3 * fast.profile.boot_timeout)
                plain_s.append(booted)
                plain_pss.append(mem)
                progress(f"cold boot {i + 1}/{boots} (kernel, systemd, desktop) to first exec")
                cold_s.append(await first_exec(cold))
            progress("making the template (one more cold boot + save)")
            template_s = await first_exec(fast)
            progress("making the template with a NIC (network='allow': one more cold boot + save)")
            nic_template_s = await first_exec(fast, network="allow")
            for i in range(samples):
                progress(f"restore {i + 1}/{samples} to first exec (network='none', then 'allow')")
                restore_s.append(await first_exec(fast))
                networked.append(await first_exec(fast, network="allow"))
            progress("exec and screenshot round trips")
            rec = await machines.create(memory=memory)
            for _ in range(samples * 5):
                start = time.monotonic()
                await fast.exec(rec, ExecRequest(command=["true"]))
                rtt.append(time.monotonic() - start)
                start = time.monotonic()
                await fast.screenshot(rec)
                shot_s.append(time.monotonic() - start)
            await fast.destroy(rec)
            progress(f"host memory of {idle_vms} idle VMs")
            recs, before = await machines.idle(idle_vms, memory=memory)
            per_vm, cgroup = await machines.idle_memory(recs, before, settle=5)
            pss = sum(_pss(fast.machines.get(r).pid) for r in recs) / idle_vms
            for rec in recs:
                await fast.destroy(rec)
        finally:
            await machines.aclose()
    s_cold, s_restore, s_rtt, s_shot = summarize(cold_s), summarize(restore_s), summarize(rtt), summarize(shot_s)
    s_plain, s_net = summarize(plain_s), summarize(networked)
    suite.latencies.update({"cold_boot_first_exec": s_cold, "restore_first_exec": s_restore,
                            "restore_first_exec_networked": s_net,
                            "plain_qemu_boot_agent": s_plain, "exec_round_trip": s_rtt, "screenshot": s_shot})
    plain_mem = sum(plain_pss) / len(plain_pss)
    suite.rows = [
        Row("restore → first exec", "s", s_restore.p50, s_cold.p50, "cold boot → first exec",
            target="≥ 5x faster", passed=s_cold.p50 / s_restore.p50 >= 5),
        Row("restore → first exec (vs plain QEMU)", "s", s_restore.p50, s_plain.p50,
            "plain QEMU boot → agent up", note="the peer stops at the agent's first frame (before systemd is done)"),
        Row("cold boot → first exec", "s", s_cold.p50, s_plain.p50, "plain QEMU boot → agent up",
            note="DSec also waits for systemd and the desktop to settle"),
        Row("restore → first exec, network='allow'", "s", s_net.p50, s_restore.p50,
            "restore → first exec, network='none'", note="netns + tap + veth + nft + DNS proxy, NIC template"),
        Row("first create of a shape (boot + template save)", "s", template_s),
        Row("first create of a shape with a NIC (boot + agent's network set-up + save)", "s", nic_template_s),
        Row("exec round trip p50", "ms", s_rtt.p50 * 1e3),
        Row("screenshot (PNG) p50", "ms", s_shot.p50 * 1e3),
        Row("host memory per idle VM (QEMU PSS)", "MiB", pss / MiB, plain_mem / MiB, "plain QEMU VM, idle",
            note="restored VMs share the template's RAM file"),
        Row("host memory per idle VM (MemAvailable)", "MiB", per_vm / MiB),
        Row("host memory per idle VM (QEMU cgroup)", "MiB", cgroup / MiB, note="includes page cache charged"),
    ]
    suite.extra["accelerator"] = f"{fast.accel} ({fast.accel_reason})"
    suite.extra["memory"] = memory
    return suite
