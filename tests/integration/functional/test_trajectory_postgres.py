"""The trajectory log on a real PostgreSQL server started by the test (cluster mode's store).

The log must survive a PostgreSQL restart between calls: the writer reconnects and re-applies its batch,
nothing logged before the restart is lost, and a re-opened trajectory replays across it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import ReplayDivergence
from dsec.models import ExecRequest, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages
from dsec.trajectory.postgres import PostgresStore
from dsec.trajectory.store import Binding, Entry
from postgres_support import PgServer, postgres_or_missing

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


async def test_log_survives_a_restart_between_calls(pg: PgServer) -> None:
    store = PostgresStore(pg.dsn)
    await store.start()
    try:
        await store.put_binding(Binding(name="pg/1", spec="{}", sandbox_id="sb-1"))
        await store.put_entry("pg/1", Entry(seq=0, op="exec", digest="a", request="{}", status="done",
                                            response='{"exit_code": 0}'))
        await asyncio.to_thread(pg.restart)
        # The writer's connection is broken now: it must reconnect and apply this batch once.
        await store.put_entry("pg/1", Entry(seq=1, op="exec", digest="b", request="{}"))
        await store.put_entry("pg/1", Entry(seq=1, op="exec", digest="b", request="{}", status="done",
                                            response='{"exit_code": 1}'))
        entries = await store.entries("pg/1")
        assert [(e.seq, e.status, e.response) for e in entries] == [
            (0, "done", '{"exit_code": 0}'), (1, "done", '{"exit_code": 1}')]
        binding = await store.get_binding("pg/1")
        assert binding is not None and binding.sandbox_id == "sb-1"
    finally:
        await store.aclose()


async def test_engine_replays_across_a_postgres_restart(pg: PgServer, tmp_path: Path) -> None:
    fake = FakeBackend(root=tmp_path / "fake")

    def engine() -> Engine:
        settings = Settings(home=tmp_path / "home")
        return Engine(settings, {"container": fake}, FakeImages(), trajectory_store=PostgresStore(pg.dsn))

    count = ExecRequest(command="echo x >> ran; wc -l < ran")
    first = engine()
    await first.start()
    spec = SandboxSpec(image="base", trajectory="pg/engine")
    info = await first.create(spec)
    one = await first.exec(info.id, count, seq=0)
    await asyncio.to_thread(pg.restart)
    two = await first.exec(info.id, count, seq=1)
    assert (one.stdout, two.stdout) == (b"1\n", b"2\n")
    await first.aclose()  # keeps the sandbox, as a daemon restart does

    second = engine()  # a fresh daemon reads everything back from PostgreSQL
    await second.start()
    try:
        again = await second.create(spec)
        assert again.id == info.id and again.trajectory is not None and again.trajectory.calls == 2
        assert (await second.exec(info.id, count, seq=0)).stdout == b"1\n"
        assert (await second.exec(info.id, count, seq=1)).replayed
        with pytest.raises(ReplayDivergence):
            await second.exec(info.id, ExecRequest(command="echo other"), seq=1)
        assert (await second.exec(info.id, count, seq=2)).stdout == b"3\n"
    finally:
        await second.destroy_all()
        await second.aclose()
