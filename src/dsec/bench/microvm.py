"""``dsec bench microvm``: restore-from-snapshot vs cold boot to first exec, exec round trip, idle memory,
and what a network policy adds to a create (namespace, tap, veth, nft rules, the template with a NIC).

The peer is a plain QEMU cold boot of the same guest kernel (same machine type and accelerator) until the
kernel hands over to its init: what any QEMU-based sandbox pays before its own agent can answer. Every
figure comes from one run on this machine; nothing asserts a timing. Leaves no VM behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dsec.backends.microvm import MicroVMBackend
from dsec.bench.container import BenchUnavailable
from dsec.bench.machines import Machines
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.errors import DSecError
from dsec.guest.accel import QEMU
from dsec.isolation.procs import mem_available
from dsec.models import ExecRequest

__all__ = ["run"]

MiB = 1024 * 1024


def _plain_boot(kernel: Path, accel: str) -> float:
    """Seconds for a bare QEMU microvm to boot the kernel until it looks for an init (then it panics, exits)."""
    cmd = [QEMU, "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", accel, "-cpu", "max" if accel == "tcg" else "host",
           "-m", "512", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-kernel", str(kernel),
           "-append", "console=ttyS0 panic=-1 quiet tsc_early_khz=2000000 tsc=reliable rdinit=/nonexistent",
           "-serial", "stdio"]
    start = time.monotonic()
    subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=120, check=False)
    return time.monotonic() - start


@contextlib.contextmanager
def _mounted(images: Any) -> Iterator[Any]:
    """The node's image mounts for one run, all removed afterwards."""
    try:
        yield images
    finally:
        images.aclose_sync(unmount=True)


async def run(samples: int = 5, idle_vms: int = 8, image_name: str = "debian-python",
              progress: Callable[[str], None] = lambda m: None, node: Settings | None = None) -> Suite:
    from dsec.images.node import NodeImages

    node = node or Settings()
    suite = Suite(name="microvm")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-vm-", dir="/tmp") as home, \
            _mounted(NodeImages(Settings(home=Path(home), images_dir=node.images))) as images:
        try:
            image = await asyncio.to_thread(images.resolve, image_name)
        except DSecError as e:
            raise BenchUnavailable(str(e)) from None
        settings = Settings(home=Path(home), images_dir=node.images)
        fast = MicroVMBackend(settings)
        cold = MicroVMBackend(settings, fast_start=False)
        reason = fast.available()
        if reason != "ok":
            raise BenchUnavailable(f"microvm backend: {reason}")
        await fast.start()
        await fast.wait_accelerator()
        cold.accel, cold.accel_reason = fast.accel, fast.accel_reason
        await cold.start()
        spec = {"memory": "512Mi"}
        machines = Machines(fast, cold, image)
        try:
            progress(f"accelerator: {fast.accel} ({fast.accel_reason})")
            progress("warming the template (one cold boot + snapshot)")
            await fast.destroy(await machines.create(**spec))
            progress("warming the template with a NIC (network='allow')")
            await fast.destroy(await machines.create(network="allow", **spec))
            kernel = fast.profile.kernel
            assert kernel is not None
            plain, boots, restores, networked = [], [], [], []
            for i in range(samples):
                progress(f"sample {i + 1}/{samples}: plain QEMU boot, DSec cold boot, DSec restore (no network, "
                         f"network='allow')")
                plain.append(await asyncio.to_thread(_plain_boot, kernel.vmlinuz, fast.accel or "tcg"))
                boots.append(await machines.first_exec(cold, **spec))
                restores.append(await machines.first_exec(fast, **spec))
                networked.append(await machines.first_exec(fast, network="allow", **spec))
            progress("exec round trip")
            rec = await machines.create(**spec)
            rtt = []
            for _ in range(samples * 10):
                start = time.monotonic()
                await fast.exec(rec, ExecRequest(command=["true"]))
                rtt.append(time.monotonic() - start)
            await fast.destroy(rec)
            progress(f"host memory of {idle_vms} idle VMs")
            recs, before = await machines.idle(idle_vms, **spec)
            progress(f"{idle_vms} idle VMs alive: an exec in each")
            answered = 0
            for rec in recs:  # all alive at once: each must still answer
                answered += (await fast.exec(rec, ExecRequest(command=["true"]))).exit_code == 0
            per_vm, cgroup = await machines.idle_memory(recs, before, settle=3)
            for rec in recs:
                await fast.destroy(rec)
        finally:
            await machines.aclose()
    s_plain, s_boot, s_restore, s_rtt = summarize(plain), summarize(boots), summarize(restores), summarize(rtt)
    s_net = summarize(networked)
    suite.latencies.update({"plain_qemu_boot": s_plain, "cold_boot_first_exec": s_boot,
                            "restore_first_exec": s_restore, "restore_first_exec_networked": s_net,
                            "exec_round_trip": s_rtt})
    fits = int(mem_available() / per_vm) if per_vm > 0 else None
    suite.rows = [
        Row("restore → first exec", "ms", s_restore.p50 * 1e3, s_boot.p50 * 1e3, "DSec cold boot → first exec",
            target="≥ 5x faster", passed=s_boot.p50 / s_restore.p50 >= 5),
        Row("restore → first exec", "ms", s_restore.p50 * 1e3, s_plain.p50 * 1e3, "plain QEMU boot to init"),
        Row("restore → first exec, network='allow'", "ms", s_net.p50 * 1e3, s_restore.p50 * 1e3,
            "restore → first exec, network='none'", note="netns + tap + veth + nft + DNS proxy, NIC template"),
        Row("exec round trip p50", "ms", s_rtt.p50 * 1e3),
        Row("host memory per idle VM (MemAvailable)", "MiB", per_vm / MiB),
        Row("host memory per idle VM (QEMU cgroup)", "MiB", cgroup / MiB, note="includes page cache charged"),
        Row("idle VMs that fit in MemAvailable", "VMs", fits, better="higher", target="≥ 100",
            passed=None if fits is None else fits >= 100),
        Row(f"idle VMs alive at once and answering (of {idle_vms})", "VMs", answered, better="higher",
            target="≥ 100 (full: --idle-vms 100)", passed=answered >= 100),
    ]
    suite.extra["accelerator"] = f"{fast.accel} ({fast.accel_reason})"
    return suite
