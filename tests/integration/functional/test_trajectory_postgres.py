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
from dsec.errors import BackendUnavailable, DSecError, ReplayDivergence
from dsec.models import ExecRequest, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages
from dsec.trajectory.postgres import PostgresStore
from dsec.trajectory.store import Binding, Entry
from postgres_support import PgServer, postgres_or_missing, read_only

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


async def test_a_deferred_answer_whose_commit_fails_is_the_next_callers_error(pg: PgServer) -> None:
    """A call's answer is logged without waiting (group commit); when its batch cannot commit, the next caller
    that waits on the log (a read, a durable write) gets the error, and the answer is committed once the
    database takes writes again: neither a log line alone nor a silently lost answer."""
    store = PostgresStore(pg.dsn, retry_for=1)
    await store.start()
    answer = Entry(seq=0, op="exec", digest="a", request="{}", status="done", response='{"exit_code": 0}')
    try:
        await store.put_entry("pg/deferred", Entry(seq=0, op="exec", digest="a", request="{}"))
        await asyncio.to_thread(read_only, pg, True)
        for _ in range(100):  # the reload reaches the writer's session a moment later
            if await store.probe("test") is not None:
                break
            await asyncio.sleep(0.1)
        await store.put_entry("pg/deferred", answer, durable=False)  # answered before its commit
        with pytest.raises(DSecError, match="read-only"):
            await store.barrier()
        with pytest.raises(DSecError, match="read-only"):  # still failing: the next durable write says so too
            await store.put_entry("pg/deferred", Entry(seq=1, op="exec", digest="b", request="{}"))
        await asyncio.to_thread(read_only, pg, False)
        entries = await store.entries("pg/deferred")
        assert [(e.seq, e.status, e.response) for e in entries] == [(0, "done", '{"exit_code": 0}')]
    finally:
        await asyncio.to_thread(read_only, pg, False)
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


async def test_a_fork_prefix_applied_twice_copies_nothing_twice(pg: PgServer) -> None:
    """The writer applies a batch again when the server's acknowledgement was lost (a restart mid-commit):
    a fork's prefix copy must not fail the whole batch with a unique violation then."""
    store = PostgresStore(pg.dsn)
    await store.start()
    try:
        await store.put_binding(Binding(name="pg/src", spec="{}", sandbox_id="sb-1"))
        for seq in range(3):
            await store.put_entry("pg/src", Entry(seq=seq, op="exec", digest=f"d{seq}", request="{}",
                                                  status="done", response='{"exit_code": 0}'))
        await store.copy_prefix("pg/src", "pg/src~2", 2)
        await store.copy_prefix("pg/src", "pg/src~2", 2)  # what a re-applied batch does
        assert [(e.seq, e.digest) for e in await store.entries("pg/src~2")] == [(0, "d0"), (1, "d1")]
    finally:
        await store.aclose()


def test_connections_are_bounded_unless_the_dsn_says_otherwise() -> None:
    """A black-holed server must fail a call within the retry window, not after TCP's ~15 min: keepalives,
    a TCP user timeout and a statement timeout, each only where the DSN sets none."""
    defaults = PostgresStore("postgresql://dsec@db.invalid/log")._timeouts()
    assert defaults["tcp_user_timeout"] == 10_000 and defaults["keepalives"] == 1, defaults
    assert "statement_timeout" in defaults["options"] and defaults["connect_timeout"] == 5
    given = PostgresStore("postgresql://dsec@db.invalid/log?connect_timeout=3&options=-c%20search_path%3Dx")
    assert "connect_timeout" not in given._timeouts() and "options" not in given._timeouts()


async def test_reads_waiting_out_an_outage_hold_no_thread_the_daemon_needs(pg: PgServer) -> None:
    """Reads of the log retry for up to ``retry_for`` while the server is down; on the event loop's default
    executor (6 threads on a 2-core node) a few of them held every thread that creates and destroys use."""
    store = PostgresStore(pg.dsn, retry_for=1.0)
    await store.start()
    await asyncio.to_thread(pg.stop)
    try:
        reads = [asyncio.create_task(store.get_binding(f"pg/outage-{i}")) for i in range(8)]
        await asyncio.sleep(0.5)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
        done, _ = await asyncio.wait(reads, timeout=60)
        assert len(done) == 8 and all(isinstance(t.exception(), BackendUnavailable) for t in done)
    finally:
        await asyncio.to_thread(pg.start)
        await store.aclose()


async def test_a_statement_cancelled_by_its_timeout_is_not_retried_as_an_outage(pg: PgServer) -> None:
    """``statement_timeout`` cancels a statement with QueryCanceled, an OperationalError to psycopg: it was
    retried as if the server were down, each try taking the timeout again. It fails at once now."""
    store = PostgresStore(pg.dsn + "?options=-c%20statement_timeout%3D200", retry_for=30.0)
    await store.start()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(BackendUnavailable, match="cancelled a statement"):
            await asyncio.to_thread(store._query, "SELECT pg_sleep(2)", ())
        assert asyncio.get_running_loop().time() - started < 10
    finally:
        await store.aclose()


def test_libpq_environment_settings_are_not_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c search_path=x")
    assert "options" not in PostgresStore("postgresql://dsec@db.invalid/log")._timeouts()
    monkeypatch.setenv("PGSERVICE", "dsec")
    assert PostgresStore("postgresql://dsec@db.invalid/log")._timeouts() == {}


async def test_lists_ends_and_deletes(pg: PgServer) -> None:
    from trajectory_support import check_list_end_and_delete

    store = PostgresStore(pg.dsn)
    await store.start()
    try:
        await check_list_end_and_delete(store)
    finally:
        await store.aclose()
