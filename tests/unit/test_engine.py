"""Engine: records, lifecycle, timeouts, recovery and metrics, over the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic
import pytest

from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.daemon.state import StateStore
from dsec.errors import (
    BackendUnavailable,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SandboxTimeout,
)
from dsec.models import BatchCreateRequest, ExecRequest, SandboxRecord, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages

SPEC = SandboxSpec(image="base")


class FlakyBackend(FakeBackend):
    """Fails its ``fail_on``-th create (1-based)."""

    def __init__(self, root: Path, fail_on: int) -> None:
        super().__init__(root=root)
        self.fail_on = fail_on
        self.creates = 0

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        self.creates += 1
        if self.creates == self.fail_on:
            self.create_error = SandboxError("flaky create")
        await super().create(record, image)


def make_engine(tmp_path: Path, backend: FakeBackend | None = None, **kwargs: float) -> Engine:
    fake = backend or FakeBackend(root=tmp_path / "fake")
    settings = Settings(home=tmp_path / "home")
    return Engine(settings, {"container": fake}, FakeImages(), **kwargs)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def started(eng: Engine) -> AsyncIterator[Engine]:
    """``eng`` started; on the way out its sandboxes are destroyed and it is closed."""
    await eng.start()
    try:
        yield eng
    finally:
        await eng.destroy_all()
        await eng.aclose()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with started(make_engine(tmp_path, reaper_interval=0.05)) as eng:
        yield eng


def fake_of(engine: Engine) -> FakeBackend:
    backend = engine.backends.loaded["container"]
    assert isinstance(backend, FakeBackend)
    return backend


def record_ids(engine: Engine) -> list[str]:
    return sorted(StateStore.peek(engine.settings.state_db))


async def test_create_get_list_destroy(engine: Engine) -> None:
    a = await engine.create(SandboxSpec(image="base", labels={"job": "x", "n": "1"}))
    b = await engine.create(SandboxSpec(image="base", labels={"job": "x", "n": "2"}))
    assert a.id.startswith("sb-") and len(a.id) == 15 and a.id != b.id
    assert a.state == "running" and a.expires_at == pytest.approx(a.created_at + 3600)
    assert (await engine.get(a.id)).labels == {"job": "x", "n": "1"}
    assert {i.id for i in await engine.list({"job": "x"})} == {a.id, b.id}
    assert [i.id for i in await engine.list({"n": "2"})] == [b.id]
    assert await engine.list({"job": "y"}) == []
    assert await engine.list(backend="vm") == []
    assert record_ids(engine) == sorted([a.id, b.id])
    assert engine.metrics.value("dsec_sandboxes_live", backend="container") == 2
    assert engine.metrics.value("dsec_sandboxes_created_total", backend="container") == 2

    await engine.destroy(a.id)
    await engine.destroy(a.id)  # idempotent
    with pytest.raises(SandboxNotFound, match="destroyed"):
        await engine.get(a.id)
    assert record_ids(engine) == [b.id]
    assert not (fake_of(engine).root / a.id).exists()
    assert engine.metrics.value("dsec_sandboxes_live", backend="container") == 1
    assert (await engine.health()).sandboxes == 1


async def test_create_failure_cleans_up_and_counts(engine: Engine) -> None:
    fake_of(engine).create_error = RuntimeError("boom")
    with pytest.raises(SandboxError, match="RuntimeError: boom"):
        await engine.create(SPEC)
    assert await engine.list() == []
    assert record_ids(engine) == []
    assert list(fake_of(engine).root.iterdir()) == []
    failed = engine.metrics.value("dsec_sandboxes_failed_total", backend="container", reason="SandboxError")
    assert failed == 1
    assert engine.metrics.value("dsec_sandboxes_live", backend="container") == 0


async def test_create_refusals(engine: Engine) -> None:
    with pytest.raises(ImageNotFound, match="nope"):
        await engine.create(SandboxSpec(image="nope"))
    with pytest.raises(InvalidRequest, match="not a snapshot id"):
        await engine.create(SandboxSpec(image="base", snapshot="snap-1"))
    with pytest.raises(NotFound, match="snap-0123456789abcdef"):
        await engine.create(SandboxSpec(image="base", snapshot="snap-0123456789abcdef"))
    with pytest.raises(InvalidRequest, match="trajectory"):
        await engine.create(SandboxSpec(image="base", trajectory=" "))
    with pytest.raises(BackendUnavailable, match="'vm'"):
        await engine.create(SandboxSpec(image="base", backend="vm"))
    with pytest.raises(InvalidRequest, match="image is required"):
        await engine.create(SandboxSpec())
    failed = engine.metrics.value("dsec_sandboxes_failed_total", backend="container", reason="ImageNotFound")
    assert failed == 1
    assert record_ids(engine) == []


async def test_unavailable_backend_reason_is_reported(tmp_path: Path) -> None:
    eng = Engine(Settings(home=tmp_path), {}, FakeImages(), unavailable={"container": "runc is missing"})
    await eng.start()
    try:
        with pytest.raises(BackendUnavailable, match="runc is missing"):
            await eng.create(SPEC)
        assert (await eng.health()).backends["container"] == "runc is missing"
    finally:
        await eng.aclose()


async def test_unknown_ids_raise_not_found(engine: Engine) -> None:
    for call in (
        engine.get("sb-000000000000"),
        engine.destroy("sb-000000000000"),
        engine.read_file("sb-000000000000", "/a", max_bytes=10),
        engine.stats("sb-000000000000"),
    ):
        with pytest.raises(SandboxNotFound, match="sb-000000000000"):
            await call
    with pytest.raises(SandboxNotFound):
        engine.exec_stream("sb-000000000000", ExecRequest(command="true"))


async def test_set_timeout_moves_the_deadline_both_ways(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base", timeout=0.3))
    later = await engine.set_timeout(info.id, 600)
    assert later.expires_at == pytest.approx(time.time() + 600, abs=5)
    await asyncio.sleep(0.6)  # past the first deadline: the reaper keeps it
    assert (await engine.get(info.id)).state == "running"
    assert StateStore.peek(engine.settings.state_db)[info.id].expires_at == later.expires_at
    await engine.set_timeout(info.id, 0.2)
    deadline = time.monotonic() + 20
    while await engine.list() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    with pytest.raises(SandboxTimeout, match=r"passed its timeout of [\d.]+ s and was destroyed"):
        await engine.get(info.id)
    with pytest.raises(SandboxNotFound):
        await engine.set_timeout("sb-000000000000", 10)


async def test_timeout_destroys_and_leaves_tombstone(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base", timeout=0.5))
    deadline = time.monotonic() + 20
    while await engine.list() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    with pytest.raises(SandboxTimeout, match=r"passed its timeout of 0\.5 s and was destroyed") as err:
        await engine.get(info.id)
    assert isinstance(err.value, TimeoutError)
    with pytest.raises(SandboxTimeout):
        engine.exec_stream(info.id, ExecRequest(command="true"))
    await engine.destroy(info.id)  # already gone: not an error
    assert record_ids(engine) == []
    assert not (fake_of(engine).root / info.id).exists()
    assert engine.metrics.value("dsec_sandboxes_expired_total", backend="container") == 1
    assert engine.metrics.value("dsec_sandboxes_live", backend="container") == 0


async def test_tombstones_are_bounded(tmp_path: Path) -> None:
    eng = make_engine(tmp_path, tombstone_limit=2)
    await eng.start()
    try:
        ids = [(await eng.create(SPEC)).id for _ in range(3)]
        for sandbox_id in ids:
            await eng.destroy(sandbox_id)
        with pytest.raises(SandboxNotFound, match="no sandbox"):
            await eng.get(ids[0])
        with pytest.raises(SandboxNotFound, match="was destroyed"):
            await eng.get(ids[2])
    finally:
        await eng.aclose()


def test_a_plain_tombstone_costs_its_id_and_a_slot_only(tmp_path: Path) -> None:
    """A node remembers its last 10,000 gone sandboxes: the plain ones (destroyed, no job) keep no message or tuple
    of their own, so the memory the tombstones fill over a daemon's first hours stays small; the others keep what
    makes them different."""
    import tracemalloc

    from dsec.daemon.auth import JOB_LABEL
    from dsec.daemon.records import Records
    from dsec.testing import new_record

    records = Records(StateStore(tmp_path / "state.db"), "node-a", lambda record: None, tombstone_limit=3000)
    gone = [new_record("container", "base") for _ in range(2000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for record in gone:
            records.tombstone(record, "destroyed", f"sandbox {record.id} was destroyed")
        per_tombstone = (tracemalloc.get_traced_memory()[0] - before) / len(gone)
    finally:
        tracemalloc.stop()
    assert per_tombstone < 160, per_tombstone  # an OrderedDict slot (the id is the record's own string)
    with pytest.raises(SandboxNotFound, match=f"^sandbox {gone[7].id} was destroyed$"):
        records.lookup(gone[7].id)
    assert records.owner_labels(gone[7].id) is None
    owned = new_record("container", "base", labels={JOB_LABEL: "job-1"})
    records.tombstone(owned, "destroyed", f"sandbox {owned.id} was destroyed")
    assert records.owner_labels(owned.id) == {JOB_LABEL: "job-1"}
    expired = new_record("container", "base")
    records.tombstone(expired, "expired", f"sandbox {expired.id} passed its timeout of 5 s and was destroyed")
    with pytest.raises(SandboxTimeout, match="passed its timeout of 5 s"):
        records.lookup(expired.id)
    lost = new_record("container", "base")
    records.tombstone(lost, "lost", f"sandbox {lost.id} was lost")
    with pytest.raises(SandboxLost, match=f"^sandbox {lost.id} was lost$"):
        records.lookup(lost.id)


async def test_recovery_keeps_live_drops_dead_and_orphans(tmp_path: Path) -> None:
    first = make_engine(tmp_path)
    await first.start()
    live = await first.create(SandboxSpec(image="base", labels={"keep": "1"}))
    dead = await first.create(SPEC)
    await first.aclose()  # sandboxes stay alive for re-adoption
    fake_root = tmp_path / "fake"
    assert (fake_root / live.id).is_dir()
    (fake_root / dead.id).rename(tmp_path / "gone")  # its "processes" died with the host
    (fake_root / "sb-0123456789ab").mkdir()  # leftover with no record
    store = StateStore(Settings(home=tmp_path / "home").state_db)
    half = SandboxRecord(id="sb-aaaaaaaaaaaa", spec=SPEC, state="creating", created_at=1, expires_at=2,
                         backend_state={"root": str(fake_root / "sb-aaaaaaaaaaaa")})
    (fake_root / half.id).mkdir()
    store.save(half)  # a create the first daemon was in the middle of
    store.close()

    second = make_engine(tmp_path)
    await second.start()
    try:
        assert [i.id for i in await second.list()] == [live.id]
        assert (await second.get(live.id)).labels == {"keep": "1"}
        for gone in (dead.id, half.id):
            with pytest.raises(SandboxNotFound):
                await second.get(gone)
        assert sorted(p.name for p in fake_root.iterdir()) == [live.id]
        assert record_ids(second) == [live.id]
        assert second.metrics.value("dsec_sandboxes_live", backend="container") == 1
        result = await second.exec(live.id, ExecRequest(command="echo still here"))
        assert result.stdout == b"still here\n"
    finally:
        await second.destroy_all()
        await second.aclose()


async def test_create_many_is_all_or_nothing(tmp_path: Path) -> None:
    eng = make_engine(tmp_path, FlakyBackend(tmp_path / "fake", fail_on=3))
    await eng.start()
    try:
        with pytest.raises(SandboxError, match="flaky create"):
            await eng.create_many(BatchCreateRequest(count=5, spec=SPEC))
        assert await eng.list() == []
        assert record_ids(eng) == []
        assert list((tmp_path / "fake").iterdir()) == []
        made = await eng.create_many(BatchCreateRequest(count=4, spec=SPEC))
        assert len({i.id for i in made}) == 4
        assert len(await eng.list()) == 4
    finally:
        await eng.destroy_all()
        await eng.aclose()


async def test_exec_output_env_stdin_and_exit(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base", env={"A": "spec", "B": "spec"}, workdir="/work"))
    r = await engine.exec(info.id, ExecRequest(
        command='echo "$A $B"; pwd; cat; echo err >&2; exit 3', env={"B": "req"}, stdin=b"in\xff"))
    assert r.exit_code == 3 and not r.ok
    lines = r.stdout.split(b"\n")
    assert lines[0] == b"spec req"
    assert lines[1].endswith(b"/work")
    assert lines[2] == b"in\xff"
    assert r.stderr == b"err\n"
    assert engine.metrics.value("dsec_exec_total", backend="container", outcome="nonzero") == 1
    assert engine.metrics.value("dsec_exec_seconds_count", backend="container") == 1


async def test_exec_limits(engine: Engine) -> None:
    info = await engine.create(SPEC)
    slow = await engine.exec(info.id, ExecRequest(command=["sleep", "30"], timeout=0.3))
    assert (slow.limit, slow.exit_code, slow.signal) == ("time", 137, 9)
    assert slow.timed_out
    loud = await engine.exec(info.id, ExecRequest(command="yes", max_output=1000))
    assert loud.truncated and loud.limit == "output" and len(loud.stdout) == 1000
    killed = await engine.exec(info.id, ExecRequest(command="kill -TERM $$"))
    assert (killed.exit_code, killed.signal, killed.limit) == (143, 15, None)
    assert engine.metrics.value("dsec_limit_hits_total", backend="container", limit="time") == 1
    assert engine.metrics.value("dsec_limit_hits_total", backend="container", limit="output") == 1


async def test_concurrent_execs(engine: Engine) -> None:
    info = await engine.create(SPEC)
    results = await asyncio.gather(*(
        engine.exec(info.id, ExecRequest(command="sleep 0.2; echo $N", env={"N": str(n)})) for n in range(8)
    ))
    assert [r.stdout for r in results] == [f"{n}\n".encode() for n in range(8)]
    assert engine.metrics.value("dsec_exec_total", backend="container", outcome="ok") == 8


async def test_destroy_ends_running_execs(engine: Engine) -> None:
    info = await engine.create(SPEC)
    stream = engine.exec_stream(info.id, ExecRequest(command="echo started; exec sleep 30", timeout=None))
    first = await anext(stream)
    assert first.type == "stdout" and first.data == b"started\n"
    await engine.destroy(info.id)
    rest = [event async for event in stream]
    assert rest[-1].type == "exit" and rest[-1].result is not None
    assert rest[-1].result.signal == 9


async def test_pause_blocks_exec_until_resume(engine: Engine) -> None:
    info = await engine.create(SPEC)
    assert (await engine.pause(info.id)).state == "paused"
    assert (await engine.pause(info.id)).state == "paused"
    with pytest.raises(SandboxStateError, match="paused"):
        engine.exec_stream(info.id, ExecRequest(command="true"))
    assert (await engine.resume(info.id)).state == "running"
    assert (await engine.exec(info.id, ExecRequest(command="true"))).ok


async def test_files_round_trip_and_path_checks(engine: Engine) -> None:
    info = await engine.create(SPEC)
    await engine.write_file(info.id, "/workspace/d/a.bin", b"\x00\xff\xfe", 0o755)
    assert await engine.read_file(info.id, "/workspace/d/a.bin") == b"\x00\xff\xfe"
    [entry] = await engine.list_files(info.id, "/workspace/d")
    assert (entry.name, entry.path, entry.type, entry.mode, entry.size) == (
        "a.bin", "/workspace/d/a.bin", "file", 0o755, 3)
    assert await engine.read_file(info.id, "d/a.bin") == b"\x00\xff\xfe"  # relative to the workdir
    with pytest.raises(FileNotFoundError, match="relative/path"):
        await engine.read_file(info.id, "relative/path")
    with pytest.raises(InvalidRequest, match="NUL"):
        await engine.write_file(info.id, "/a\0b", b"")
    with pytest.raises(pydantic.ValidationError, match="cwd"):  # refused by the model, before the engine
        ExecRequest(command="true", cwd="")
    assert (await engine.exec(info.id, ExecRequest(command="pwd", cwd="d"))).stdout.endswith(b"/workspace/d\n")
    # The fake runs commands on the host with cwd = the sandbox's /workspace: relative paths only.
    assert (await engine.exec(info.id, ExecRequest(command="ln -s /etc up && ln -s ../.. rel"))).ok
    with pytest.raises(InvalidRequest, match="outside the sandbox"):
        await engine.read_file(info.id, "/workspace/rel/x")
    with pytest.raises(InvalidRequest, match="outside the sandbox"):
        await engine.read_file(info.id, "/workspace/up/passwd")
    with pytest.raises(InvalidRequest, match="larger than 2 bytes"):
        await engine.read_file(info.id, "/workspace/d/a.bin", max_bytes=2)
    assert (await engine.stats(info.id)).disk_bytes >= 3


async def test_health_lists_every_backend(engine: Engine) -> None:
    health = await engine.health()
    assert health.backends["container"] == "ok"
    assert set(health.backends) == {"function", "container", "microvm", "vm"}
    assert health.node == engine.settings.node


async def test_node_state_is_published_when_it_changes_and_when_the_daemon_stops(engine: Engine) -> None:
    """``node`` events: the image cache when it changed (not every round), at once when the daemon begins to
    stop; a subscriber asking for the state gets it first."""
    images: dict[str, int] = {}

    async def cached() -> dict[str, int]:
        return dict(images)

    engine.node_state.images = cached
    await engine.node_state.check()
    await engine.node_state.check()  # unchanged: nothing more
    images["debian-python"] = 4096
    await engine.node_state.check()
    states = [e.detail for e in engine.events.recent() if e.kind == "node"]
    assert states == [{"images": {}, "stopping": None}, {"images": {"debian-python": 4096}, "stopping": None}]
    stream = engine.subscribe(node_state=True)
    try:
        first = await anext(stream)
        assert (first.kind, first.detail) == ("node", {"images": {"debian-python": 4096}, "stopping": None})
        engine.drain("the test stops it")
        stopping = await asyncio.wait_for(anext(stream), 5)
        assert (stopping.kind, stopping.detail) == (
            "node", {"images": {"debian-python": 4096}, "stopping": "the test stops it"})
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
