"""The gateway's durable state on a real PostgreSQL server: group commit, ordering, narrow rows, faults.

Writes submitted while a commit is in flight share the next transaction; writes no caller waits for gather
for a moment, and a new sandbox destroyed before its commit is never written; a sandbox put then deleted
before a commit ends up deleted; a batch sharing one spec stores that spec once; rows read back are the rows
written (shape, state, reason, trajectory detail); rows of the first schema are moved over once; a server
restart between writes is survived (reconnect, replay); a server that is down fails the write with
``BackendUnavailable`` naming PostgreSQL, and the writer works again once the server is back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import psycopg
import pytest

from dsec.cluster.records import Row, Shape
from dsec.cluster.state import GROUP_DELAY, ClusterState, NodeRow
from dsec.errors import BackendUnavailable
from dsec.models import SandboxInfo, SandboxSpec
from postgres_support import PgServer, postgres_or_missing

pytestmark = [pytest.mark.slow]

SPEC = SandboxSpec(image="debian-python", backend="function").model_dump_json().encode()
SHAPE = Shape("function", 1.0, 1024**3, "debian-python")


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


def row(node: str = "n1", job: str = "j", spec: bytes = SPEC, **kw: object) -> Row:
    return Row(node, job, "running", SHAPE, spec, time.time(), **kw)  # type: ignore[arg-type]


async def synchronous_commit(state: ClusterState) -> str:
    cur = await (await state.writer._connection()).execute("SHOW synchronous_commit")
    return str((await cur.fetchone())[0])


def count(pg: PgServer, table: str) -> int:
    with psycopg.connect(pg.dsn) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]


async def test_concurrent_writes_share_commits_in_order(pg: PgServer) -> None:
    state = ClusterState(pg.dsn)
    try:
        writer = state.writer
        await writer.put_node(NodeRow("n1", "http://127.0.0.1:1", "t" * 20, True, {"cpu": 2}))
        before = writer.commits
        ids = [f"sb-{i}" for i in range(60)]
        await asyncio.gather(*(writer.put_rows([(i, row())]) for i in ids))
        assert writer.commits - before < len(ids), "60 concurrent writes took 60 transactions"
        # A put then a delete of one id, submitted together: it ends up deleted.
        writer.submit_rows([("sb-x", row())])
        writer.submit_delete(["sb-x", "sb-0"])
        await writer.flush()
        found = dict(await asyncio.to_thread(lambda: list(state.rows())))
        assert set(found) == set(ids) - {"sb-0"}
        assert found["sb-5"].node == "n1" and found["sb-5"].job == "j" and found["sb-5"].shape == SHAPE
        assert found["sb-5"].spec == SPEC
        assert [n.name for n in await asyncio.to_thread(state.nodes)] == ["n1"]
        # The default: commits are not waited for on disk.
        assert await synchronous_commit(state) == "off"
    finally:
        await state.aclose()


async def test_submitted_writes_gather_and_a_row_destroyed_before_its_commit_is_never_written(
        pg: PgServer) -> None:
    state = ClusterState(pg.dsn)
    try:
        writer = state.writer
        await writer.put_rows([("rl-old", row())])  # committed: its destroy must reach the table
        before, written = writer.commits, writer.written
        for i in range(50):  # an RL loop: creates, most destroyed moments later
            writer.submit_rows([(f"rl-{i}", row())], new=True)
            if i % 5:
                writer.submit_delete([f"rl-{i}"])
            await asyncio.sleep(0.001)
        writer.submit_delete(["rl-old"])
        await asyncio.sleep(GROUP_DELAY * 3 + 0.2)
        assert writer.commits - before <= 4, "submissions were not gathered"
        assert writer.written - written == 11, "rows destroyed before their commit were written"
        found = dict(await asyncio.to_thread(lambda: list(state.rows())))
        assert {sid for sid in found if sid.startswith("rl-")} == {f"rl-{i}" for i in range(0, 50, 5)}
        # A caller that waits does not wait for the submissions' delay.
        writer.submit_rows([("rl-late", row())], new=True)
        start = time.perf_counter()
        await writer.put_rows([("rl-waited", row())])
        assert time.perf_counter() - start < 5.0
        assert {"rl-late", "rl-waited"} <= set(dict(await asyncio.to_thread(lambda: list(state.rows()))))
    finally:
        await state.aclose()


async def test_a_batch_writes_its_spec_once_and_rows_read_back(pg: PgServer) -> None:
    state = ClusterState(pg.dsn)
    try:
        spec = SandboxSpec(image="img", backend="function", labels={"batch": "b1"}).model_dump_json().encode()
        specs = count(pg, "dsec_cluster_specs")
        batch = [(f"b-{i}", row(spec=spec)) for i in range(2000)]
        await state.writer.put_rows(batch)
        assert count(pg, "dsec_cluster_specs") == specs + 1
        info = SandboxInfo(id="t-1", backend="function", image="img", state="running", created_at=1.0,
                           expires_at=2.0, labels={}, spec=SandboxSpec(image="img", backend="function"), node="n2")
        lost = row(node="n2", trajectory="job/7", detail=info.model_dump_json().encode())._replace(
            state="lost", reason="node n2 died: gone")
        await state.writer.put_rows([("t-1", lost)])
        found = dict(await asyncio.to_thread(lambda: list(state.rows())))
        assert found["t-1"] == lost._replace(created=found["t-1"].created)
        assert all(found[sid].spec == spec for sid, _ in batch)
        assert len({id(found[sid].spec) for sid, _ in batch}) == 1, "rows read back share their spec"
    finally:
        await state.aclose()


def test_rows_of_the_first_schema_move_over_once(pg: PgServer) -> None:
    info = SandboxInfo(id="old-1", backend="function", image="img", state="running", created_at=5.0,
                       expires_at=6.0, labels={"dsec.job": "j9"},
                       spec=SandboxSpec(image="img", backend="function", cpu=2.0, labels={"dsec.job": "j9"}),
                       node="n7")
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("""CREATE TABLE dsec_cluster_sandboxes (id TEXT PRIMARY KEY, node TEXT NOT NULL, job TEXT NOT NULL,
            trajectory TEXT, info JSONB NOT NULL, updated DOUBLE PRECISION NOT NULL DEFAULT 0)""")
        conn.execute("INSERT INTO dsec_cluster_sandboxes (id, node, job, info) VALUES (%s, %s, %s, %s)",
                     ("old-1", "n7", "j9", info.model_dump_json()))
    state = ClusterState(pg.dsn)
    try:
        found = dict(state.rows())["old-1"]
        assert (found.node, found.job, found.state, found.shape.cpu, found.created) == ("n7", "j9", "running", 2.0, 5.0)
        assert json.loads(found.spec)["labels"] == {"dsec.job": "j9"}
    finally:
        state.close()
    again = ClusterState(pg.dsn)  # nothing left to move: the old table was renamed
    again.close()
    assert count(pg, "dsec_cluster_sandboxes_v1") == 1


async def test_server_restart_and_outage(pg: PgServer) -> None:
    state = ClusterState(pg.dsn, sync_commit=True)
    try:
        await state.writer.put_rows([("r-1", row())])
        assert await synchronous_commit(state) == "on"
        await asyncio.to_thread(pg.restart)
        await state.writer.put_rows([("r-2", row())])  # the broken connection is replaced, the write replayed
        await asyncio.to_thread(pg.stop)
        try:
            with pytest.raises(BackendUnavailable, match="PostgreSQL"):
                await state.writer.put_rows([("r-3", row())])
        finally:
            await asyncio.to_thread(pg.start)
        await state.writer.put_rows([("r-4", row())])
        fresh = ClusterState(pg.dsn)
        try:
            ids = {sid for sid, _ in fresh.rows()}
            assert ids >= {"r-1", "r-2", "r-4"} and "r-3" not in ids
        finally:
            fresh.close()
    finally:
        await state.aclose()
