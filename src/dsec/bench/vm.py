"""``dsec bench vm``: a full VM's cold boot (kernel, systemd, desktop) to first exec vs restore from its
template to first exec, measured in one run; host memory per idle VM; screenshot and exec round trips.

Cold boots are few (each is minutes under TCG); restores and idle VMs share the template the first cold
boot made. Every figure comes from one run on this machine; nothing asserts a timing. Leaves no VM behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dsec.backends.vm import VMBackend
from dsec.bench.container import BenchUnavailable, _mem_available
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.errors import DSecError
from dsec.models import ExecRequest, SandboxRecord
from dsec.testing import new_record

__all__ = ["run"]

MiB = 1024 * 1024


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
        await fast.start()
        cold.accel, cold.accel_reason = fast.accel, fast.accel_reason
        await cold.start()
        live: list[tuple[VMBackend, SandboxRecord]] = []

        async def first_exec(backend: VMBackend) -> float:
            rec = new_record("vm", image, memory=memory)
            live.append((backend, rec))
            start = time.monotonic()
            await backend.create(rec, image)
            r = await backend.exec(rec, ExecRequest(command=["true"]))
            took = time.monotonic() - start
            assert r.exit_code == 0, r
            await backend.destroy(rec)
            return took

        try:
            progress(f"accelerator: {fast.accel} ({fast.accel_reason})")
            cold_s, restore_s, shot_s, rtt = [], [], [], []
            for i in range(boots):
                progress(f"cold boot {i + 1}/{boots} (kernel, systemd, desktop) to first exec")
                cold_s.append(await first_exec(cold))
            progress("making the template (one more cold boot + save)")
            template_s = await first_exec(fast)
            for i in range(samples):
                progress(f"restore {i + 1}/{samples} to first exec")
                restore_s.append(await first_exec(fast))
            progress("exec and screenshot round trips")
            rec = new_record("vm", image, memory=memory)
            live.append((fast, rec))
            await fast.create(rec, image)
            for _ in range(samples * 5):
                start = time.monotonic()
                await fast.exec(rec, ExecRequest(command=["true"]))
                rtt.append(time.monotonic() - start)
                start = time.monotonic()
                await fast.screenshot(rec)
                shot_s.append(time.monotonic() - start)
            await fast.destroy(rec)
            progress(f"host memory of {idle_vms} idle VMs")
            await asyncio.sleep(1)
            before = _mem_available()
            recs = []
            for _ in range(idle_vms):
                rec = new_record("vm", image, memory=memory)
                live.append((fast, rec))
                await fast.create(rec, image)
                recs.append(rec)
            await asyncio.sleep(5)
            per_vm = max(before - _mem_available(), 0) / idle_vms
            cgroup = sum([(await fast.stats(r)).memory_bytes for r in recs]) / idle_vms
            for rec in recs:
                await fast.destroy(rec)
        finally:
            for backend, rec in live:
                with contextlib.suppress(Exception):
                    await backend.destroy(rec)
            await fast.cleanup_orphans(set())
            await fast.aclose()
            await cold.aclose()
    s_cold, s_restore, s_rtt, s_shot = summarize(cold_s), summarize(restore_s), summarize(rtt), summarize(shot_s)
    suite.latencies.update({"cold_boot_first_exec": s_cold, "restore_first_exec": s_restore,
                            "exec_round_trip": s_rtt, "screenshot": s_shot})
    suite.rows = [
        Row("restore → first exec", "s", s_restore.p50, s_cold.p50, "cold boot → first exec",
            target="≥ 5x faster", passed=s_cold.p50 / s_restore.p50 >= 5),
        Row("first create of a shape (boot + template save)", "s", template_s),
        Row("exec round trip p50", "ms", s_rtt.p50 * 1e3),
        Row("screenshot (PNG) p50", "ms", s_shot.p50 * 1e3),
        Row("host memory per idle VM (MemAvailable)", "MiB", per_vm / MiB),
        Row("host memory per idle VM (QEMU cgroup)", "MiB", cgroup / MiB, note="includes page cache charged"),
    ]
    suite.extra["accelerator"] = f"{fast.accel} ({fast.accel_reason})"
    suite.extra["memory"] = memory
    return suite
