"""The gateway's durable state on a real PostgreSQL server: group commit, ordering, and faults.

Writes submitted while a commit is in flight share the next transaction; a put and a delete of one
sandbox commit in submission order; a server restart between writes is survived (reconnect, replay);
a server that is down fails the write with ``BackendUnavailable`` naming PostgreSQL, and the writer
works again once the server is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from dsec.cluster.state import ClusterState, NodeRow, SandboxRow
from dsec.errors import BackendUnavailable
from dsec.models import SandboxInfo, SandboxSpec
from postgres_support import PgServer, postgres_or_missing

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


def row(sandbox_id: str, node: str = "n1", job: str = "j") -> SandboxRow:
    spec = SandboxSpec(image="debian-python", backend="function")
    info = SandboxInfo(id=sandbox_id, backend="function", image="debian-python", state="running",
                       created_at=time.time(), expires_at=time.time() + 60, labels={}, spec=spec, node=node)
    return SandboxRow(info, node, job)


async def synchronous_commit(state: ClusterState) -> str:
    cur = await (await state.writer._connection()).execute("SHOW synchronous_commit")
    return str((await cur.fetchone())[0])


async def test_concurrent_writes_share_commits_in_order(pg: PgServer) -> None:
    state = ClusterState(pg.dsn)
    try:
        writer = state.writer
        await writer.put_node(NodeRow("n1", "http://127.0.0.1:1", "t" * 20, True, {"cpu": 2}))
        before = writer.commits
        ids = [f"sb-{i}" for i in range(60)]
        await asyncio.gather(*(writer.put_sandboxes([row(i)]) for i in ids))
        assert writer.commits - before < len(ids), "60 concurrent writes took 60 transactions"
        # A put then a delete of one id, submitted together: the delete wins (submission order).
        await asyncio.gather(writer.put_sandboxes([row("sb-x")]), writer.delete_sandbox("sb-x"),
                             writer.delete_sandbox("sb-0"))
        found = {r.id: r for r in await asyncio.to_thread(state.sandboxes)}
        assert set(found) == set(ids) - {"sb-0"}
        assert found["sb-5"].node == "n1" and found["sb-5"].job == "j"
        assert [n.name for n in await asyncio.to_thread(state.nodes)] == ["n1"]
        # The default: commits are not waited for on disk.
        assert await synchronous_commit(state) == "off"
    finally:
        await state.writer.aclose()
        state.close()


async def test_server_restart_and_outage(pg: PgServer) -> None:
    state = ClusterState(pg.dsn, sync_commit=True)
    try:
        await state.writer.put_sandboxes([row("r-1")])
        assert await synchronous_commit(state) == "on"
        await asyncio.to_thread(pg.restart)
        await state.writer.put_sandboxes([row("r-2")])  # the broken connection is replaced, the write replayed
        await asyncio.to_thread(pg.stop)
        try:
            with pytest.raises(BackendUnavailable, match="PostgreSQL"):
                await state.writer.put_sandboxes([row("r-3")])
        finally:
            await asyncio.to_thread(pg.start)
        await state.writer.put_sandboxes([row("r-4")])
        fresh = ClusterState(pg.dsn)
        try:
            assert {r.id for r in fresh.sandboxes()} >= {"r-1", "r-2", "r-4"}
            assert "r-3" not in {r.id for r in fresh.sandboxes()}
        finally:
            fresh.close()
    finally:
        await state.writer.aclose()
        state.close()
