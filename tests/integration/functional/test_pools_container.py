"""Warm pools and burst admission against real container sandboxes on the ``debian-python`` image."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from container_support import await_until, checked_backend, images_dir, sandbox_mounts, short_home, sweep
from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.daemon.admission import Admission
from dsec.daemon.engine import Engine
from dsec.daemon.state import StateStore
from dsec.images.node import NodeImages
from dsec.isolation.cgroups import (
    CPU_SHARES_BUSY,
    CPU_SHARES_IDLE,
    CPU_WEIGHT_BUSY,
    CPU_WEIGHT_IDLE,
    CgroupSet,
    cgroup_mode,
)
from dsec.models import BatchCreateRequest, ExecRequest, PoolConfig, SandboxSpec

pytestmark = [pytest.mark.root]

SHAPE = SandboxSpec(image="debian-python", memory="256Mi", cpu=0.5)
POOL = PoolConfig(image="debian-python", memory="256Mi", cpu=0.5, min=2, max=3)


@pytest.fixture
async def engine(debian_python_image: ImageRef) -> AsyncIterator[Engine]:
    home = short_home("dsec-pool-")
    settings = Settings(home=home, images_dir=images_dir())
    try:
        async with checked_backend(home) as backend:
            eng = Engine(settings, {"container": backend}, NodeImages(settings))
            eng.pools.interval = 0.02
            eng.pools.start()
            try:
                yield eng
            finally:
                await eng.pools.aclose()
                await eng.destroy_all()
                await asyncio.to_thread(eng.images.aclose_sync)  # its prefetch threads, before the home goes
    finally:
        removed = await sweep(home, images_dir())
        shutil.rmtree(home, ignore_errors=True)
        assert removed == []


async def test_claimed_sandbox_gets_its_spec(engine: Engine) -> None:
    """A pool whose members have a network device: the claim's own policy is applied, and the sandbox looks
    as one created with that policy would (its interface in /proc/net/dev and in its own /sys/class/net)."""
    engine.pools.declare(POOL.model_copy(update={"network": "allow"}))
    await engine.pools.wait_filled(60)
    spec = SHAPE.model_copy(update={"labels": {"run": "7"}, "env": {"ANSWER": "42"}, "timeout": 120.0,
                                    "network": ["127.0.0.1:9"]})
    info = await engine.create(spec)
    assert info.pooled and info.labels == {"run": "7"} and info.spec.network == ["127.0.0.1:9"]
    assert info.expires_at == pytest.approx(info.created_at + 120.0)
    fresh = await engine.create(spec.model_copy(update={"memory": 300 * 2**20}))  # another shape: made now
    assert not fresh.pooled
    probe = ExecRequest(command="echo $ANSWER; grep -c eth0 /proc/net/dev; ls /sys/class/net | sort | tr '\\n' ' '")
    pooled, made = await engine.exec(info.id, probe), await engine.exec(fresh.id, probe)
    assert pooled.exit_code == 0, pooled
    assert pooled.stdout.split(b"\n")[:2] == [b"42", b"1"]
    assert b"eth0" in pooled.stdout.split(b"\n")[2], pooled.stdout
    assert pooled.stdout.split(b"\n")[1:] == made.stdout.split(b"\n")[1:], "a claimed sandbox differs from a new one"
    offline = await engine.create(SHAPE)  # network="none": a member with a device is not handed out
    assert not offline.pooled
    for sandbox in (info, fresh, offline):
        await engine.destroy(sandbox.id)
    await engine.pools.wait_filled(60)
    stats = (await engine.statistics()).pools[0]
    assert stats.hits == 1 and stats.ready >= 2 and stats.failures == 0


async def test_destroying_a_claimed_sandbox_tears_it_down_in_the_background(engine: Engine) -> None:
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(60)
    info = await engine.create(SHAPE)
    assert info.pooled
    record = engine.records[info.id]
    backend = engine.backends.loaded["container"]
    cgroups = backend._cgroups(record)  # type: ignore[attr-defined]
    rootfs = str(record.backend_state["rootfs"])
    pid = int(record.backend_state["init_pid"])
    await engine.destroy(info.id)  # answered; the teardown may still run
    assert info.id not in [i.id for i in await engine.list()]
    await engine.wait_teardowns()
    assert (await engine.statistics()).teardowns == 0
    assert not any(Path(d).exists() for d in cgroups.dirs.values())
    assert not sandbox_mounts(engine.settings.home, rootfs)
    assert not Path(f"/proc/{pid}").exists()
    assert info.id not in StateStore.peek(engine.settings.state_db)


async def test_burst_is_queued_not_failed(engine: Engine) -> None:
    short = {"now": "memory: held back by the test"}
    engine.admission = Admission(2, poll=0.02, shortage=lambda: short["now"])
    batch = asyncio.create_task(engine.create_many(BatchCreateRequest(count=6, spec=SHAPE)))
    # Every create resolves its image, then waits: none may start (or fail) while the node is "short".
    assert await await_until(lambda: engine.admission.statistics().waiting == 6, timeout=60)
    await asyncio.sleep(0.3)
    assert engine.admission.statistics().waiting == 6 and not batch.done()
    short["now"] = None  # type: ignore[assignment]
    made = await batch
    assert len(made) == 6 and all(i.queue_seconds >= 0.25 for i in made)
    results = await asyncio.gather(*(engine.exec(i.id, ExecRequest(command="true")) for i in made))
    assert [r.exit_code for r in results] == [0] * 6
    await asyncio.gather(*(engine.destroy(i.id) for i in made))


async def test_idle_sandboxes_are_best_effort_until_they_run_a_command(engine: Engine) -> None:
    info = await engine.create(SHAPE)
    record = engine.records[info.id]
    cgroups = CgroupSet(mode=cgroup_mode(), dirs=dict(record.backend_state["cgroups"]))
    d = cgroups._dir("cpu")
    assert d is not None
    knob, idle, busy = (("cpu.weight", CPU_WEIGHT_IDLE, CPU_WEIGHT_BUSY) if cgroups.mode == "v2"
                        else ("cpu.shares", CPU_SHARES_IDLE, CPU_SHARES_BUSY))
    assert int((d / knob).read_text()) == idle
    # Against the node's own processes the sandboxes' group yields as a whole: SCHED_IDLE where the kernel has
    # it (5.15+; the daemon's default), while each sandbox in it ranks against its siblings by weight.
    if (d.parent / "cpu.idle").exists():
        parent_idle = int((d.parent / "cpu.idle").read_text())
        assert parent_idle == int(engine.settings.sandbox_cpu_idle) and int((d / "cpu.idle").read_text()) == 0
    running = asyncio.create_task(engine.exec(info.id, ExecRequest(command="sleep 1")))
    assert await await_until(lambda: int((d / knob).read_text()) == busy, timeout=10)
    # A background hog started by a command stays behind in the best-effort class once the command returns.
    result = await engine.exec(info.id, ExecRequest(command="nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &"))
    assert result.exit_code == 0
    assert int((d / knob).read_text()) == busy  # the sleep still runs
    assert (await running).exit_code == 0
    # ...after CPU_IDLE_AFTER_S without a command (a command in between keeps it in the normal class)
    assert (await engine.exec(info.id, ExecRequest(command="true"))).exit_code == 0
    assert int((d / knob).read_text()) == busy
    assert await await_until(lambda: int((d / knob).read_text()) == idle, timeout=10)
    await engine.destroy(info.id)
