"""Warm pools and create admission in the engine, over the fake backend (logic only; real sandboxes in
tests/integration/functional/test_pools_container.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_engine import fake_of, make_engine, record_ids, started

from container_support import await_until
from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.daemon import removal
from dsec.daemon.admission import Admission, host_shortage
from dsec.daemon.engine import Engine
from dsec.daemon.host_limits import HostLimits
from dsec.daemon.pools import DEMAND_WINDOW, POOL_LABEL, REFILL_DELAY, pool_key
from dsec.daemon.state import StateStore
from dsec.errors import BackendUnavailable, DaemonStopping, InvalidRequest, QuotaExceeded, SandboxNotFound
from dsec.models import BatchCreateRequest, ExecRequest, PoolConfig, SandboxRecord, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages

POOL = PoolConfig(image="base", min=2, max=4, memory="512Mi")
SHAPE = SandboxSpec(image="base", memory="512Mi")


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    eng = make_engine(tmp_path, reaper_interval=0.05)
    eng.pools.interval = 0.01
    async with started(eng):
        yield eng


def test_pool_config_parse() -> None:
    config = PoolConfig.parse("debian-python:container:min=4,max=64,cpu=0.5,memory=512Mi")
    assert (config.image, config.backend, config.min, config.max) == ("debian-python", "container", 4, 64)
    assert config.cpu == 0.5 and config.memory == 512 * 1024**2
    assert PoolConfig.parse("img:function").max == 16


@pytest.mark.parametrize(("text", "needle"), [
    ("justanimage", "expected IMAGE:BACKEND"),
    ("img:container:size=3", "'size=3' is not one of"),
    ("img:container:min=5,max=2", "must be >= min"),
    ("img:teleport", "teleport"),
    ("img:container:min=-1", "min"),
])
def test_pool_config_parse_rejects(text: str, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle) as err:
        PoolConfig.parse(text)
    assert text in str(err.value)


async def test_claim_applies_labels_env_timeout(engine: Engine) -> None:
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(10)
    [stats] = (await engine.statistics()).pools
    assert stats.ready == 2 and stats.target == 2 and stats.created == 2
    assert await engine.list() == []  # members are invisible until claimed
    spec = SHAPE.model_copy(update={"labels": {"job": "j"}, "env": {"X": "42"}, "timeout": 60.0})
    info = await engine.create(spec)
    assert info.pooled and info.labels == {"job": "j"} and info.spec.env == {"X": "42"}
    assert info.expires_at == pytest.approx(info.created_at + 60.0)
    assert POOL_LABEL not in info.labels
    assert [i.id for i in await engine.list(labels={"job": "j"})] == [info.id]
    result = await engine.exec(info.id, ExecRequest(command="echo $X"))
    assert result.stdout == b"42\n"
    stats = (await engine.statistics()).pools[0]
    assert stats.hits == 1 and stats.misses == 0
    [key] = engine.pools._pools
    assert engine.metrics.value("dsec_pool_claims_total", pool=key, outcome="hit") == 1
    assert b'dsec_pool_ready{pool="base:container:' in engine.metrics.render()
    await engine.pools.wait_filled(10)  # refilled in the background
    assert (await engine.statistics()).pools[0].ready >= 2


async def test_other_shapes_are_not_pooled(engine: Engine) -> None:
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(10)
    other = await engine.create(SandboxSpec(image="base", memory="1Gi"))
    assert not other.pooled
    # A network policy the fake backend cannot apply after creation makes the spec not poolable.
    allow = await engine.create(SHAPE.model_copy(update={"network": "allow"}))
    assert not allow.pooled
    assert (await engine.statistics()).pools[0].hits == 0


async def test_demand_raises_target_within_ceiling(engine: Engine) -> None:
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(10)
    made = [await engine.create(SHAPE) for _ in range(7)]
    stats = (await engine.statistics()).pools[0]
    assert stats.hits >= 2 and stats.hits + stats.misses == 7
    assert stats.target == 4  # 7 claims in the window, capped at max
    await engine.pools.wait_filled(10)
    assert (await engine.statistics()).pools[0].ready == 4
    for info in made:
        await engine.destroy(info.id)
    # Demand gone: the pool shrinks back to its floor once the claims leave the window.
    pool = next(iter(engine.pools._pools.values()))
    pool.claims = type(pool.claims)(t - DEMAND_WINDOW - 1 for t in pool.claims)
    await engine.pools.refill()
    assert (await engine.statistics()).pools[0].ready == 2


async def test_refill_task_sleeps_while_nothing_changes(engine: Engine) -> None:
    """Event-driven: a filled pool with no demand makes no pass at all, however small ``interval`` is; a
    claim wakes it at once; a claim's leaving the demand window is scheduled, not polled for."""
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(10)
    await asyncio.sleep(0.05)  # the pass after the last member joined
    before = engine.pools.passes
    await asyncio.sleep(0.3)  # 30 intervals of 0.01 s
    assert engine.pools.passes == before
    assert engine.pools.next_timed_pass(time.monotonic()) is None
    info = await engine.create(SHAPE)
    assert info.pooled
    await engine.pools.wait_filled(10)
    assert engine.pools.passes > before
    await asyncio.sleep(REFILL_DELAY * 2)  # past the claim's deferral
    wait = engine.pools.next_timed_pass(time.monotonic())
    assert wait is not None and DEMAND_WINDOW - 1 < wait <= DEMAND_WINDOW  # the claim leaves the window
    await engine.destroy(info.id)


async def test_reserved_label_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match=POOL_LABEL):
        await engine.create(SandboxSpec(image="base", labels={POOL_LABEL: "x"}))


async def test_refill_failure_backs_off_and_is_reported(engine: Engine) -> None:
    fake_of(engine).create_error = RuntimeError("disk on fire")
    engine.pools.declare(PoolConfig(image="base", min=1, max=1))
    for _ in range(200):
        if (await engine.statistics()).pools[0].failures:
            break
        await asyncio.sleep(0.01)
    stats = (await engine.statistics()).pools[0]
    assert stats.failures == 1 and "disk on fire" in (stats.last_error or "")
    await engine.pools.wait_filled(10)  # retried after the back-off, and it works now
    assert (await engine.statistics()).pools[0].ready == 1


async def test_pool_of_unknown_backend_refused(engine: Engine) -> None:
    with pytest.raises(BackendUnavailable, match="microvm"):
        await engine.declare_pool(PoolConfig(image="base", backend="microvm"))


async def test_shutdown_drains_and_restart_destroys_leftovers(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    eng.pools.interval = 0.01
    await eng.start()
    eng.pools.declare(POOL)
    await eng.pools.wait_filled(10)
    kept = await eng.create(SandboxSpec(image="base"))
    await eng.aclose()
    assert record_ids(eng) == [kept.id]  # the members are gone, the client's sandbox is not
    assert sorted(p.name for p in fake_of(eng).root.iterdir()) == [kept.id]
    # A daemon killed without draining: its members' records are on disk; the next start destroys them.
    eng2 = make_engine(tmp_path)
    eng2.pools.interval = 0.01
    await eng2.start()
    eng2.pools.declare(POOL)
    await eng2.pools.wait_filled(10)
    members = [r.id for p in eng2.pools._pools.values() for r in p.ready]
    eng2.pools._pools.clear()  # forget them, as a SIGKILLed daemon would
    await eng2.aclose()
    eng3 = make_engine(tmp_path, backend=FakeBackend(root=fake_of(eng2).root))
    await eng3.start()
    try:
        assert [i.id for i in await eng3.list()] == [kept.id]
        assert record_ids(eng3) == [kept.id]
        assert not any((fake_of(eng3).root / m).exists() for m in members)
    finally:
        await eng3.destroy_all()
        await eng3.aclose()


class _SlowTeardown(FakeBackend):
    """Destroys wait for ``release`` (or fail with ``destroy_error``): background teardowns stay observable."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.release = asyncio.Event()
        self.destroy_error: BaseException | None = None
        self.destroying = 0

    async def destroy(self, record: SandboxRecord) -> None:
        self.destroying += 1
        try:
            await self.release.wait()
            if self.destroy_error is not None:
                raise self.destroy_error
            await super().destroy(record)
        finally:
            self.destroying -= 1


async def _claimed(eng: Engine, n: int = 1) -> list[str]:
    eng.pools.declare(POOL)
    await eng.pools.wait_filled(10)
    ids = [(await eng.create(SHAPE)).id for _ in range(n)]
    return ids


async def test_pooled_destroy_answers_before_its_teardown(tmp_path: Path) -> None:
    fake = _SlowTeardown(tmp_path / "fake")
    fake.release.set()  # members are made freely; only the client's destroy is held back below
    eng = make_engine(tmp_path, backend=fake)
    eng.pools.interval = 0.01
    await eng.start()
    try:
        [sid] = await _claimed(eng)
        plain = await eng.create(SandboxSpec(image="base", memory="1Gi"))  # not pooled: destroyed in-line
        fake.release.clear()
        await asyncio.wait_for(eng.destroy(sid), 1)  # answered while the teardown waits
        assert (await eng.statistics()).teardowns == 1 and fake.destroying == 1
        with pytest.raises(SandboxNotFound, match="destroyed"):
            await eng.exec(sid, ExecRequest(command="true"))
        assert sid not in [i.id for i in await eng.list()]
        assert (fake.root / sid).exists()  # still being torn down...
        assert sid in record_ids(eng)  # ...and its record says so (state "stopped")
        await eng.destroy(sid)  # idempotent meanwhile
        plain_done = asyncio.create_task(eng.destroy(plain.id))
        await asyncio.sleep(0.05)
        assert not plain_done.done()  # a plain sandbox's destroy still waits for its teardown
        fake.release.set()
        await plain_done
        await eng.wait_teardowns()
        assert (await eng.statistics()).teardowns == 0 and not (fake.root / sid).exists()
        assert sid not in record_ids(eng)
    finally:
        fake.release.set()
        await eng.destroy_all()
        await eng.aclose()


async def test_failed_background_teardown_keeps_the_record(tmp_path: Path) -> None:
    fake = _SlowTeardown(tmp_path / "fake")
    fake.release.set()
    eng = make_engine(tmp_path, backend=fake)
    eng.pools.interval = 0.01
    await eng.start()
    try:
        [sid] = await _claimed(eng)
        fake.destroy_error = RuntimeError("umount: target is busy")
        await eng.destroy(sid)
        await eng.wait_teardowns()
        record = eng.records.store.load(sid)
        assert record is not None and record.state == "failed" and "target is busy" in (record.reason or "")
        assert (await eng.statistics()).teardowns == 0
        assert eng.metrics.value("dsec_teardown_failures_total", backend="container") == 1
    finally:
        fake.destroy_error = None
        await eng.destroy_all()
        await eng.aclose()
    # The next start retries it: the record is not re-adopted, the sandbox is destroyed.
    eng2 = make_engine(tmp_path, backend=FakeBackend(root=fake.root))
    await eng2.start()
    try:
        assert await eng2.list() == [] and sid not in record_ids(eng2)
        assert not (fake.root / sid).exists()
    finally:
        await eng2.aclose()


async def test_restart_during_background_teardown_destroys_instead_of_adopting(tmp_path: Path) -> None:
    fake = _SlowTeardown(tmp_path / "fake")
    fake.release.set()
    eng = make_engine(tmp_path, backend=fake)
    eng.pools.interval = 0.01
    await eng.start()
    [sid] = await _claimed(eng)
    fake.release.clear()
    await eng.destroy(sid)
    # The daemon dies before the teardown ran (SIGKILL: nothing of it runs any more).
    for task in list(eng.teardowns):
        task.cancel()
    await asyncio.gather(*eng.teardowns, return_exceptions=True)
    eng.pools._pools.clear()
    fake.release.set()
    await eng.aclose()
    assert (fake.root / sid).exists()
    eng2 = make_engine(tmp_path, backend=FakeBackend(root=fake.root))
    await eng2.start()
    try:
        assert await eng2.list() == []  # the client destroyed it: never handed back
        assert not (fake.root / sid).exists() and sid not in record_ids(eng2)
    finally:
        await eng2.aclose()


async def test_background_teardowns_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removal, "BACKGROUND_TEARDOWNS", 2)
    fake = _SlowTeardown(tmp_path / "fake")
    fake.release.set()
    eng = make_engine(tmp_path, backend=fake)
    eng.pools.interval = 0.01
    await eng.start()
    try:
        ids = await _claimed(eng, 3)
        fake.release.clear()
        await eng.destroy(ids[0])
        await eng.destroy(ids[1])
        third = asyncio.create_task(eng.destroy(ids[2]))
        await asyncio.sleep(0.05)
        assert not third.done() and (await eng.statistics()).teardowns == 2  # the third waits for its own teardown
        fake.release.set()
        await third
        await eng.wait_teardowns()
        assert not any((fake.root / i).exists() for i in ids)
    finally:
        fake.release.set()
        await eng.destroy_all()
        await eng.aclose()


async def test_aclose_waits_for_background_teardowns(tmp_path: Path) -> None:
    fake = _SlowTeardown(tmp_path / "fake")
    fake.release.set()
    eng = make_engine(tmp_path, backend=fake)
    eng.pools.interval = 0.01
    await eng.start()
    [sid] = await _claimed(eng)
    fake.release.clear()
    await eng.destroy(sid)
    closing = asyncio.create_task(eng.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done()
    fake.release.set()
    await closing
    assert not (fake.root / sid).exists() and record_ids(eng) == []


async def test_refill_waits_for_claims_to_pause(engine: Engine) -> None:
    engine.pools.declare(PoolConfig(image="base", min=4, max=4, memory="512Mi"))
    await engine.pools.wait_filled(10)
    created = (await engine.statistics()).pools[0].created
    await engine.create(SHAPE)  # 3 of 4 left: above half, the refill waits for a pause in claims
    await engine.pools.refill()  # a pass right after the claim starts nothing
    stats = (await engine.statistics()).pools[0]
    assert stats.created == created and stats.filling == 0
    await engine.pools.wait_filled(10)  # ...and the pool is refilled once the claims pause
    assert (await engine.statistics()).pools[0].created == created + 1
    # At half the target or below, the pass right after a claim refills at once.
    await engine.create(SHAPE)
    await engine.create(SHAPE)
    await engine.pools.refill()
    assert (await engine.statistics()).pools[0].filling == 2


async def test_bad_pool_setting_fails_engine_construction(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    settings = dataclasses.replace(eng.settings, pools=("base:container:max=x",))
    with pytest.raises(InvalidRequest, match="max=x"):
        Engine(settings, {"container": FakeBackend(root=tmp_path / "f")}, eng.images)


# -- admission ------------------------------------------------------------------------------------


async def test_burst_queues_instead_of_failing(engine: Engine) -> None:
    short = {"now": "memory: pretend the node is full"}
    engine.admission = Admission(4, poll=0.01, shortage=lambda: short["now"])
    batch = asyncio.create_task(engine.create_many(BatchCreateRequest(count=40, spec=SandboxSpec(image="base"))))
    # all 40 queue (a loaded host may take a while to get there), then stay queued while the shortage lasts
    assert await await_until(lambda: engine.admission.statistics().waiting == 40, timeout=20)
    await asyncio.sleep(0.2)
    stats = engine.admission.statistics()
    assert not batch.done() and stats.waiting == 40 and stats.shortage == short["now"]
    short["now"] = None  # type: ignore[assignment]
    made = await batch
    assert len(made) == 40 and all(i.state == "running" for i in made)
    assert min(i.queue_seconds for i in made) >= 0.15
    stats = engine.admission.statistics()
    assert stats.admitted == 40 and stats.queued == 40 and stats.waiting == 0 and stats.running == 0
    assert stats.queue_seconds >= 40 * 0.15
    assert engine.metrics.value("dsec_admission_queue_seconds_count", backend="container") == 40


async def test_slots_bound_concurrency(engine: Engine) -> None:
    engine.admission = Admission(3, shortage=lambda: None)
    running, peak = 0, 0
    fake = fake_of(engine)
    original = fake.create

    async def slow_create(record, image):  # type: ignore[no-untyped-def]
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        await original(record, image)

    fake.create = slow_create  # type: ignore[method-assign]
    made = await engine.create_many(BatchCreateRequest(count=12, spec=SandboxSpec(image="base")))
    assert len(made) == 12 and peak == 3


async def test_admission_timeout_names_the_shortage(engine: Engine) -> None:
    engine.admission = Admission(2, timeout=0.1, poll=0.01, shortage=lambda: "pids: 32000 of 32768 in use")
    with pytest.raises(QuotaExceeded, match="pids: 32000 of 32768"):
        await engine.create(SandboxSpec(image="base"))
    assert await engine.list() == [] and record_ids(engine) == []
    stats = engine.admission.statistics()
    assert stats.running == 0 and stats.shortage is None  # no create waits: the shortage seen is not "now"


async def test_stopping_fails_the_queue_at_once_and_rolls_back_the_batch(engine: Engine) -> None:
    """drain(): the queued creates of a batch fail with DaemonStopping without a backend call, the admitted
    ones finish, the batch answers at once and its sandboxes are torn down in the background (the engine's
    close waits for them); every later create, batch or claim is refused."""
    engine.admission = Admission(3, shortage=lambda: None)
    fake = fake_of(engine)
    original_create, original_destroy = fake.create, fake.destroy
    calls = {"create": 0, "destroy": 0}

    async def slow_create(record, image):  # type: ignore[no-untyped-def]
        calls["create"] += 1
        await asyncio.sleep(0.02)
        await original_create(record, image)

    async def counted_destroy(record):  # type: ignore[no-untyped-def]
        calls["destroy"] += 1
        await original_destroy(record)

    fake.create = slow_create  # type: ignore[method-assign]
    fake.destroy = counted_destroy  # type: ignore[method-assign]
    batch = asyncio.create_task(engine.create_many(BatchCreateRequest(count=60, spec=SandboxSpec(image="base"))))
    assert await await_until(lambda: engine.admission.statistics().admitted >= 7, timeout=20)
    engine.drain("the test stops the daemon")
    with pytest.raises(DaemonStopping, match=r"create_many\(60\) refused: the test stops the daemon; the (\d+) "
                                             "sandboxes it had made are destroyed again") as err:
        await asyncio.wait_for(batch, 10)
    found = re.search(r"the (\d+) sandboxes", str(err.value))
    assert found is not None and err.value.detail == {"kept": 0}  # a gateway may place it on another node
    made = int(found.group(1))
    admitted = engine.admission.statistics().admitted
    assert made >= 6 and calls["create"] == admitted < 60  # the refused ones never reached the backend
    assert await engine.list() == []  # gone for the API at once
    await engine.wait_teardowns()
    assert calls["destroy"] == made and record_ids(engine) == [] and list(fake.root.iterdir()) == []
    stats = engine.admission.statistics()
    assert stats.running == 0 and stats.waiting == 0 and engine.admission._sem._value == 3  # every slot back
    assert engine.stopping == "the test stops the daemon"
    for refused in (engine.create(SandboxSpec(image="base")),
                    engine.create_many(BatchCreateRequest(count=2, spec=SandboxSpec(image="base")))):
        with pytest.raises(DaemonStopping, match="create refused: the test stops the daemon") as refusal:
            await refused
        assert refusal.value.detail == {"kept": 0}
    assert calls["create"] == admitted


async def test_a_batch_cut_off_while_stopping_retires_what_it_made_before_awaiting(engine: Engine) -> None:
    """The server's graceful timeout cancels a batch still running after the drain (three creates admitted
    and in flight): the members it had made are retired in its rollback, gone for the API and torn down by
    the teardowns the engine's close waits for, so none is left for the next daemon to re-adopt. (They are
    retired before the rollback's first await, where a loop's final cancel could land; asyncio's callback
    order decides whether one does, so this test does not reproduce that.)"""
    engine.admission = Admission(3, shortage=lambda: None)
    fake = fake_of(engine)
    original_create = fake.create
    in_flight: list[asyncio.Task[object]] = []
    creates = 0

    async def create_six(record, image):  # type: ignore[no-untyped-def]
        nonlocal creates
        creates += 1
        if creates > 6:  # the next three (one per slot) are still being made when the daemon stops
            task = asyncio.current_task()
            assert task is not None
            in_flight.append(task)
            await asyncio.Event().wait()
        await original_create(record, image)

    fake.create = create_six  # type: ignore[method-assign]
    batch = asyncio.create_task(engine.create_many(BatchCreateRequest(count=30, spec=SandboxSpec(image="base"))))
    assert await await_until(lambda: len(in_flight) == 3, timeout=20)
    made = {i.id for i in await engine.list() if i.state == "running"}
    assert len(made) == 6
    engine.drain("the test stops the daemon")
    batch.cancel()  # the graceful timeout, with three creates still admitted
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert await engine.list() == []
    await engine.wait_teardowns()
    assert record_ids(engine) == [] and list(fake.root.iterdir()) == []  # the three in flight undone too


async def test_closed_admission_gives_every_slot_back() -> None:
    """Waiters fail with DaemonStopping; a slot granted in the same step as the close, and the slot of a
    waiter cancelled from outside, go back to the semaphore; the admitted create runs to its end."""
    adm = Admission(1, shortage=lambda: None)
    holder_in, holder_out = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with adm.admit():
            holder_in.set()
            await holder_out.wait()

    async def wait_in_queue() -> float:
        async with adm.admit() as waited:
            return waited

    holder = asyncio.create_task(hold())
    await holder_in.wait()
    waiters = [asyncio.create_task(wait_in_queue()) for _ in range(4)]
    cancelled = asyncio.create_task(wait_in_queue())
    assert await await_until(lambda: adm.statistics().waiting == 5, timeout=5)
    cancelled.cancel()
    holder_out.set()
    await holder  # its release hands the slot to the first waiter, which has not run yet...
    adm.close("the daemon is stopping")  # ...when the close comes
    for task in waiters:
        with pytest.raises(DaemonStopping, match="create refused: the daemon is stopping") as refusal:
            await task
        assert refusal.value.detail == {"kept": 0}
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    stats = adm.statistics()
    assert stats.running == 0 and stats.waiting == 0 and stats.admitted == 1
    assert adm._sem._value == 1  # the one slot, given back once
    with pytest.raises(DaemonStopping):
        async with adm.admit():
            pass


async def test_refills_defer_to_users_and_stop_with_the_daemon_without_counting_failures(engine: Engine) -> None:
    """While the node is short, refills are deferred, not queued: a slot held by a refill polling for headroom
    would be admitted before the users' creates queued behind it. Deferred is not a failure of the pool's
    image or shape. Once the daemon stops, no pass starts another refill (each would only be refused)."""
    short = {"now": "memory: pretend the node is full"}
    engine.admission = Admission(4, poll=0.01, shortage=lambda: short["now"])
    members = 0
    make_member = engine.create_member

    async def counted(spec: SandboxSpec) -> SandboxRecord:
        nonlocal members
        members += 1
        return await make_member(spec)

    engine.create_member = counted  # type: ignore[method-assign]
    engine.pools.declare(POOL)  # min 2
    assert await await_until(lambda: members >= 4, timeout=20), "the pool did not try again after a deferral"
    assert engine.admission.statistics().waiting == 0, "a refill queued for admission"
    user = asyncio.create_task(engine.create(SandboxSpec(image="base")))
    assert await await_until(lambda: engine.admission.statistics().waiting == 1, timeout=20)
    short["now"] = None  # type: ignore[assignment]
    assert (await asyncio.wait_for(user, 20)).state == "running"
    await engine.pools.wait_filled(20)
    [stats] = (await engine.statistics()).pools
    assert (stats.failures, stats.last_error, stats.created) == (0, None, 2)
    assert engine.metrics.failures() == {}, "a deferred refill counted as a failed create"
    short["now"] = "memory: full again"
    for _ in range(2):  # the pool is short of members again; its refills are deferred
        assert (await engine.create(SHAPE)).pooled
    engine.drain("the test stops the daemon")
    tried = members
    short["now"] = None  # type: ignore[assignment]  # room again: a refill started now would be made
    passes = engine.pools.passes
    engine.pools._wake.set()
    assert await await_until(lambda: engine.pools.passes > passes, timeout=20)
    await asyncio.sleep(0.05)
    assert members == tried, "a refill started while the daemon stops"
    assert engine.admission.statistics().waiting == 0


def test_pid_limits_are_read_again_after_their_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pid_max / threads-max are cached for a few seconds (not read at every create); the task count never is."""
    from dsec.daemon import admission

    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "loadavg").write_text("0.1 0.2 0.3 2/300 99\n")
    (tmp_path / "sys/kernel/pid_max").write_text("4096\n")
    (tmp_path / "sys/kernel/threads-max").write_text("9000\n")
    assert admission._tasks_and_limit(tmp_path) == (300, 4096)
    (tmp_path / "loadavg").write_text("0.1 0.2 0.3 2/310 99\n")
    (tmp_path / "sys/kernel/pid_max").write_text("8192\n")
    assert admission._tasks_and_limit(tmp_path) == (310, 4096)  # the limit is cached, the count is not
    monkeypatch.setattr(admission, "_LIMIT_TTL", 0.0)
    assert admission._tasks_and_limit(tmp_path) == (310, 8192)
    monkeypatch.setattr(admission, "_limit_cache", None)


def test_host_shortage_reads_the_host() -> None:
    assert host_shortage(0, 0) is None
    assert "memory" in (host_shortage(1 << 60, 0) or "")
    assert "pids" in (host_shortage(0, 1 << 40) or "")
    with pytest.raises(ValueError, match="at least one"):
        Admission(0)


# -- host limits (a stand-in /proc/sys: tests never change the shared host's sysctls) -----------------


def test_host_limits_raise_and_restore(tmp_path: Path) -> None:
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel/pid_max").write_text("32768\n")
    (tmp_path / "kernel/threads-max").write_text("9999999\n")  # already above its floor: left alone
    limits = HostLimits(root=tmp_path, floors={"kernel/pid_max": 4_194_304, "kernel/threads-max": 1_000_000,
                                               "fs/missing": 5})
    assert limits.raise_all() == {"kernel/pid_max": (32768, 4_194_304)}
    assert (tmp_path / "kernel/pid_max").read_text() == "4194304\n"
    assert (tmp_path / "kernel/threads-max").read_text() == "9999999\n"
    assert limits.restore() == ["kernel/pid_max"]
    assert (tmp_path / "kernel/pid_max").read_text() == "32768\n"


def test_host_limits_leave_a_value_changed_since(tmp_path: Path) -> None:
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel/pid_max").write_text("32768\n")
    limits = HostLimits(root=tmp_path, floors={"kernel/pid_max": 100_000})
    limits.raise_all()
    (tmp_path / "kernel/pid_max").write_text("200000\n")  # an operator (or another daemon) moved it
    assert limits.restore() == []
    assert (tmp_path / "kernel/pid_max").read_text() == "200000\n"


async def test_engine_raises_and_restores_host_limits(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "sys/kernel/pid_max").write_text("32768\n")
    eng.host_limits = HostLimits(root=tmp_path / "sys", floors={"kernel/pid_max": 65536})
    await eng.start()
    assert (tmp_path / "sys/kernel/pid_max").read_text() == "65536\n"
    await eng.aclose()
    assert (tmp_path / "sys/kernel/pid_max").read_text() == "32768\n"


async def test_a_pool_larger_than_one_fill_wave_fills_completely(engine: Engine) -> None:
    """Each finished fill leaves ``filling`` before it wakes the refill task: a pass that saw it still
    "filling" started no replacement, and a 16-member pool stalled at 15 with nothing filling."""
    engine.pools.declare(PoolConfig(image="base", min=16, max=32))
    await engine.pools.wait_filled(20)
    stats = (await engine.statistics()).pools[0]
    assert stats.ready == 16 and stats.filling == 0, stats


class _Versioned(FakeImages):
    """Images whose tag can move (``digest``), with pins counted (``pinned``) and an optional stall in
    :meth:`resolve` (``hold``), as NodeImages would behave."""

    def __init__(self) -> None:
        super().__init__()
        self.digest = "v1"
        self.lookups = 0
        self.pinned = 0
        self.hold: threading.Event | None = None
        self.resolving = threading.Event()
        self.returned = threading.Event()
        self.repinned: list[str] = []
        self.known: str | None = None  # set: a stale answer is all memory holds (the store is asked in the back)
        self.store_hold: threading.Event | None = None

    def resolve(self, name: str) -> ImageRef:
        self.resolving.set()
        if self.hold is not None:
            assert self.hold.wait(30)
        self.pinned += 1
        self.returned.set()
        return dataclasses.replace(super().resolve(name), digest=self.digest)

    def release(self, ref: ImageRef) -> None:
        self.pinned -= 1

    def known_digest(self, name: str) -> tuple[str | None, bool]:
        # What NodeImages answers from memory: by default fresh (every claim sees a move at once).
        return (self.known, False) if self.known is not None else (self.digest, True)

    def current_digest(self, name: str) -> str | None:
        self.lookups += 1
        if self.store_hold is not None:
            assert self.store_hold.wait(30)
        self.known = None
        return self.digest

    def pin_manifest(self, digest: str) -> Path:
        self.pinned += 1
        self.repinned.append(digest)
        return self.rootfs


class _Mortal(FakeBackend):
    """A fake whose sandboxes can be declared dead, and whose network change can be held."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.dead: set[str] = set()
        self.destroyed: list[str] = []
        self.network_entered = asyncio.Event()
        self.hold_network = True
        self.policies: list[tuple[str, str | list[str]]] = []

    def alive(self, record: SandboxRecord) -> bool:
        return record.id not in self.dead

    async def destroy(self, record: SandboxRecord) -> None:
        self.destroyed.append(record.id)
        await super().destroy(record)

    async def set_network(self, record: SandboxRecord, network: str | list[str]) -> None:
        self.network_entered.set()
        if self.hold_network:
            await asyncio.Event().wait()  # until cancelled
        self.policies.append((record.id, network))


def _versioned_engine(tmp_path: Path) -> tuple[Engine, _Mortal, _Versioned]:
    backend, images = _Mortal(tmp_path / "fake"), _Versioned()
    eng = Engine(Settings(home=tmp_path / "home"), {"container": backend}, images)  # type: ignore[arg-type]
    eng.pools.interval = 0.01
    return eng, backend, images


async def test_a_claim_hands_out_only_live_members_of_the_image_version_the_tag_names(tmp_path: Path) -> None:
    eng, backend, images = _versioned_engine(tmp_path)
    async with started(eng):
        eng.pools.declare(POOL)
        await eng.pools.wait_filled(10)
        members = [r.id for r in eng.pools._pools[next(iter(eng.pools._pools))].ready]
        assert len(members) == 2
        # The first member died while it waited: the next one is handed out, the dead one destroyed.
        backend.dead.add(members[0])
        info = await eng.create(SHAPE)
        assert info.pooled and info.id == members[1]
        assert await await_until(lambda: members[0] in backend.destroyed, 10)
        # The image is imported again (its tag moves): members of the old version are destroyed, not served.
        await eng.pools.wait_filled(10)
        old = [r.id for r in eng.pools._pools[next(iter(eng.pools._pools))].ready]
        images.digest = "v2"
        fresh = await eng.create(SHAPE)
        assert not fresh.pooled, "a member of the old image version was handed out"
        assert await await_until(lambda: set(old) <= set(backend.destroyed), 10)
        assert eng.pins.image_of(fresh.id).digest == "v2"
        assert await await_until(lambda: eng.pools.statistics()[0].ready >= 1, 10)
        again = await eng.create(SHAPE)
        assert again.pooled and eng.pins.image_of(again.id).digest == "v2"



async def test_a_trim_removes_members_of_an_earlier_image_version_first(tmp_path: Path) -> None:
    """After a re-import, a pool shrinking keeps the new version's members (a trim removed the newest, so it
    kept the old ones, which the next claims then destroyed instead of serving)."""
    eng, backend, images = _versioned_engine(tmp_path)
    async with started(eng):
        eng.pools.declare(POOL.model_copy(update={"min": 2, "max": 2}))
        await eng.pools.wait_filled(10)
        pool = eng.pools._pools[next(iter(eng.pools._pools))]
        old = [r.id for r in pool.ready]
        images.digest = "v2"
        eng.pools.declare(POOL.model_copy(update={"min": 4, "max": 4}))
        await eng.pools.wait_filled(10)
        new = [r.id for r in pool.ready if r.id not in old]
        assert len(new) == 2 and all(eng.pins.image_of(i).digest == "v2" for i in new)
        eng.pools.declare(POOL.model_copy(update={"min": 2, "max": 2}))
        assert await await_until(lambda: set(old) <= set(backend.destroyed), 10), backend.destroyed
        assert [r.id for r in pool.ready] == new and not set(new) & set(backend.destroyed)
        assert (await eng.create(SHAPE)).id == new[0]


async def test_a_claim_never_waits_for_the_store_to_learn_where_a_tag_points(tmp_path: Path) -> None:
    """Memory holds only a stale answer and the store hangs: claims still answer at once (with what is
    known), and one lookup per image runs in the background."""
    eng, _backend, images = _versioned_engine(tmp_path)
    async with started(eng):
        eng.pools.declare(POOL.model_copy(update={"min": 3, "max": 3}))
        await eng.pools.wait_filled(10)
        images.known, images.store_hold = "v1", threading.Event()
        try:
            for _ in range(3):
                info = await asyncio.wait_for(eng.create(SHAPE), 5)
                assert info.pooled
            assert await await_until(lambda: images.lookups == 1, 5) and list(eng.pins._tag_refreshes) == ["base"]
        finally:
            images.store_hold.set()
        assert await await_until(lambda: not eng.pins._tag_refreshes, 10)


async def test_landlock_off_and_a_different_cpu_are_other_shapes(engine: Engine) -> None:
    engine.pools.declare(POOL)
    await engine.pools.wait_filled(10)
    # Members are made confined (/proc and /dev read-only): an unconfined sandbox is never one of them.
    unconfined = await engine.create(SHAPE.model_copy(update={"landlock": False}))
    assert not unconfined.pooled
    near = await engine.create(SHAPE.model_copy(update={"cpu": 1.0000001}))  # a microVM would get 2 vCPUs
    assert not near.pooled
    assert (await engine.statistics()).pools[0].hits == 0
    assert pool_key("i", "container", 1.0, 1, 1, 8, None) == \
        "i:container:cpu=1,memory=1,disk=1,pids=8,workdir=,net=none"
    assert pool_key("i", "container", 0.5, 1, 1, 8, None).startswith("i:container:cpu=0.5,")
    # Of the network, only whether the sandbox has a device is part of the shape.
    assert pool_key("i", "c", 1, 1, 1, 8, None, "allow") == pool_key("i", "c", 1, 1, 1, 8, None, ["10.0.0.1:80"])
    assert pool_key("i", "c", 1, 1, 1, 8, None, "allow").endswith(",net=device")


async def test_a_pool_with_a_network_device_serves_every_policy_but_none(tmp_path: Path) -> None:
    eng, backend, _images = _versioned_engine(tmp_path)
    backend.hold_network = False
    async with started(eng):
        eng.pools.declare(POOL.model_copy(update={"network": "allow"}))
        await eng.pools.wait_filled(10)
        offline = await eng.create(SHAPE)  # no device wanted: a member with one is not handed out
        assert not offline.pooled
        same = await eng.create(SHAPE.model_copy(update={"network": "allow"}))
        assert same.pooled and backend.policies == []  # the member's own policy: nothing to apply
        narrow = await eng.create(SHAPE.model_copy(update={"network": ["127.0.0.1:9"]}))
        assert narrow.pooled and backend.policies == [(narrow.id, ["127.0.0.1:9"])]
        assert narrow.spec.network == ["127.0.0.1:9"]


async def test_a_pool_with_a_network_is_refused_on_a_backend_that_cannot_change_policies(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="takes network='none' only"):
        await engine.declare_pool(POOL.model_copy(update={"network": "allow"}))
    with pytest.raises(InvalidRequest, match="takes network='none' only"):
        Engine(Settings(home=engine.settings.home.parent / "other", pools=("base:container:network=allow",)),
               {"container": FakeBackend()}, FakeImages())  # type: ignore[arg-type]
    assert PoolConfig.parse("img:container:network=allow").network == "allow"
    with pytest.raises(InvalidRequest, match="network"):
        PoolConfig.parse("img:container:network=sometimes")


async def test_a_claim_cut_off_while_applying_its_network_destroys_the_member(tmp_path: Path) -> None:
    eng, backend, _images = _versioned_engine(tmp_path)
    async with started(eng):
        eng.pools.declare(POOL.model_copy(update={"network": ["127.0.0.1:9"]}))
        await eng.pools.wait_filled(10)
        claim = asyncio.create_task(eng.create(SHAPE.model_copy(update={"network": "allow"})))
        await asyncio.wait_for(backend.network_entered.wait(), 10)
        [taken] = [r for r in eng.pins._refs if r not in {m.id for p in eng.pools._pools.values() for m in p.ready}]
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        assert await await_until(lambda: taken not in StateStore.peek(eng.settings.state_db), 10)
        assert taken in backend.destroyed and eng.pins.image_of(taken) is None


async def test_a_create_cancelled_while_its_image_resolves_gives_the_pin_back(tmp_path: Path) -> None:
    eng, _backend, images = _versioned_engine(tmp_path)
    async with started(eng):
        images.hold = threading.Event()
        create = asyncio.create_task(eng.create(SandboxSpec(image="base")))
        assert await asyncio.to_thread(images.resolving.wait, 10)
        create.cancel()
        with pytest.raises(asyncio.CancelledError):
            await create
        images.hold.set()
        assert await asyncio.to_thread(images.returned.wait, 10)
        assert await await_until(lambda: images.pinned == 0, 10), "the cancelled create's image pin was kept"
        assert await eng.list() == []


async def test_a_create_whose_record_cannot_be_saved_gives_the_pin_back(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _backend, images = _versioned_engine(tmp_path)
    async with started(eng):
        def full(record: SandboxRecord) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(eng.records.store, "save", full)
        with pytest.raises(OSError, match="No space left"):
            await eng.create(SandboxSpec(image="base"))
        assert images.pinned == 0, "the image stayed pinned for a sandbox that was never made"
        monkeypatch.undo()
        assert (await eng.create(SandboxSpec(image="base"))).state == "running" and images.pinned == 1


async def test_a_slow_trim_does_not_hold_up_other_pools_and_close_waits_for_it(tmp_path: Path) -> None:
    class SlowToDestroy(FakeBackend):
        def __init__(self, root: Path) -> None:
            super().__init__(root=root)
            self.release = asyncio.Event()
            self.destroyed: list[str] = []

        async def destroy(self, record: SandboxRecord) -> None:
            if record.spec.memory == 512 * 2**20:  # pool A's members
                await self.release.wait()
            self.destroyed.append(record.id)
            await super().destroy(record)

    backend = SlowToDestroy(tmp_path / "fake")
    eng = make_engine(tmp_path, backend)
    eng.pools.interval = 0.01
    await eng.start()
    try:
        eng.pools.declare(POOL.model_copy(update={"min": 3, "max": 3}))
        await eng.pools.wait_filled(10)
        trimmed = [r.id for p in eng.pools._pools.values() for r in p.ready]
        eng.pools.declare(POOL.model_copy(update={"min": 0, "max": 0}))  # empties A: a trim that hangs
        assert await await_until(lambda: eng.pools.statistics()[0].ready == 0, 10)
        eng.pools.declare(PoolConfig(image="base", min=2, max=2, memory="256Mi"))  # B
        await eng.pools.wait_filled(10)  # filled while A's trim still hangs
        assert not set(trimmed) & set(backend.destroyed)
        closing = asyncio.create_task(eng.pools.aclose())
        await asyncio.sleep(0.1)
        assert not closing.done(), "close did not wait for the trim in flight"
        backend.release.set()
        await asyncio.wait_for(closing, 10)
        assert set(trimmed) <= set(backend.destroyed)
    finally:
        backend.release.set()
        await eng.destroy_all()
        await eng.aclose()
    assert record_ids(eng) == []


async def test_a_restarted_daemon_pins_the_image_version_a_sandbox_was_made_of(tmp_path: Path) -> None:
    """The tag moved while no daemon ran: the re-adopted sandbox's own version is pinned again (by digest),
    not the one its name resolves to now."""
    eng, backend, images = _versioned_engine(tmp_path)
    await eng.start()
    info = await eng.create(SandboxSpec(image="base"))
    await eng.aclose()  # the daemon stops; the sandbox lives on
    images.digest, images.pinned = "v2", 0
    again = Engine(Settings(home=tmp_path / "home"), {"container": backend}, images)  # type: ignore[arg-type]
    async with started(again):
        assert again.pins.image_of(info.id).digest == "v1" and images.repinned == ["sha256:v1"]
        assert images.pinned == 1
        await again.destroy(info.id)
        assert images.pinned == 0


async def test_a_background_admission_never_holds_a_slot_while_the_host_is_short() -> None:
    from dsec.daemon.admission import Deferred

    answers = iter([None, "memory: 100 MiB available"])  # short just after the check before the slot
    adm = Admission(2, poll=0.01, shortage=lambda: next(answers, "memory: 100 MiB available"))
    with pytest.raises(Deferred, match="short of memory"):
        async with adm.admit(background=True):
            pass
    assert adm._sem._value == 2 and adm.statistics().waiting == 0, "the deferred refill kept its slot"


async def test_a_shortage_is_not_reported_for_a_create_that_waits_only_for_a_slot() -> None:
    short: dict[str, str | None] = {"now": "pids: 32000 of 32768 in use"}
    adm = Admission(1, timeout=0.1, poll=0.01, shortage=lambda: short["now"])
    with pytest.raises(QuotaExceeded):
        async with adm.admit():
            pass
    short["now"], adm.timeout = None, 10.0
    held = asyncio.Event()

    async def hold() -> None:
        async with adm.admit():
            held.set()
            await asyncio.sleep(0.3)

    holder = asyncio.create_task(hold())
    await held.wait()
    waiter = asyncio.create_task(hold())  # waits for the one slot, not for headroom
    assert await await_until(lambda: adm.statistics().waiting == 1, 5)
    assert adm.statistics().shortage is None, "the timed-out create's shortage is reported as current"
    await asyncio.gather(holder, waiter)


def test_a_malformed_image_cache_reserve_stops_the_daemon_with_its_name(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_IMAGE_CACHE_MIN_FREE", "plenty")
    with pytest.raises(InvalidRequest, match="DSEC_IMAGE_CACHE_MIN_FREE"):
        make_engine(tmp_path)


async def test_a_poolable_create_on_an_unavailable_backend_is_counted_as_a_failure(tmp_path: Path) -> None:
    eng = Engine(Settings(home=tmp_path / "home"), {"container": FakeBackend(root=tmp_path / "f")},
                 FakeImages(), unavailable={"container": "crun not found"})  # type: ignore[arg-type]
    async with started(eng):
        with pytest.raises(BackendUnavailable, match="crun not found"):
            await eng.create(SHAPE)
        assert eng.metrics.failures() == {"BackendUnavailable": 1}, "the alert on node-side failures saw nothing"
