"""The gateway's durable state: which node owns each sandbox, for which job, and which nodes exist.

A gateway restart (crash, upgrade, rescheduling by Ray) rebuilds placement from these tables and loses
nothing. PostgreSQL through psycopg 3; every write is an upsert keyed by id, so replaying one is
harmless. Owns no placement logic.

Reads (:meth:`ClusterState.nodes`, :meth:`ClusterState.sandboxes`, at gateway start) block. Writes are
on the create path, so they go through :class:`ClusterState.writer`, an asyncio group commit on the
gateway's event loop: every write submitted while a commit is in flight joins the next one (one
transaction, psycopg's pipeline mode: one round trip for the lot), and each caller resumes when its
transaction has committed. Commits are not waited for on disk by default (``synchronous_commit=off``):
a gateway crash loses nothing (the server has the rows), a crash of the PostgreSQL server itself may
lose the last ~0.6 s (3 x ``wal_writer_delay``) of committed rows. ``sync_commit=True`` waits for the
disk flush on every commit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import BackendUnavailable
from dsec.models import SandboxInfo

__all__ = ["ClusterState", "NodeRow", "SandboxRow", "StateWriter"]

log = logging.getLogger(__name__)

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS dsec_cluster_nodes (
        name TEXT PRIMARY KEY, url TEXT NOT NULL, token TEXT NOT NULL, alive BOOLEAN NOT NULL,
        capacity JSONB NOT NULL, reason TEXT)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_sandboxes (
        id TEXT PRIMARY KEY, node TEXT NOT NULL, job TEXT NOT NULL, trajectory TEXT,
        info JSONB NOT NULL, updated DOUBLE PRECISION NOT NULL DEFAULT extract(epoch from now()))""",
    "CREATE INDEX IF NOT EXISTS dsec_cluster_sandboxes_traj ON dsec_cluster_sandboxes (trajectory)",
]


@dataclass
class NodeRow:
    """A node daemon the gateway knows: its URL, its own token, capacity and whether Ray sees it alive."""

    name: str
    url: str
    token: str
    alive: bool
    capacity: dict[str, Any]
    reason: str | None = None


@dataclass
class SandboxRow:
    """One sandbox placed by the gateway: owning node, job, and its last known info."""

    info: SandboxInfo
    node: str
    job: str

    @property
    def id(self) -> str:
        return self.info.id


_PUT_NODE = """INSERT INTO dsec_cluster_nodes (name, url, token, alive, capacity, reason) VALUES (%s,%s,%s,%s,%s,%s)
    ON CONFLICT (name) DO UPDATE SET url=EXCLUDED.url, token=EXCLUDED.token, alive=EXCLUDED.alive,
    capacity=EXCLUDED.capacity, reason=EXCLUDED.reason"""
_PUT_SANDBOX = """INSERT INTO dsec_cluster_sandboxes (id, node, job, trajectory, info) VALUES (%s,%s,%s,%s,%s)
    ON CONFLICT (id) DO UPDATE SET node=EXCLUDED.node, job=EXCLUDED.job,
    trajectory=EXCLUDED.trajectory, info=EXCLUDED.info, updated=extract(epoch from now())"""
_DELETE_SANDBOX = "DELETE FROM dsec_cluster_sandboxes WHERE id = %s"


def _node_params(row: NodeRow) -> tuple[Any, ...]:
    return (row.name, row.url, row.token, row.alive, json.dumps(row.capacity), row.reason)


def _sandbox_params(row: SandboxRow) -> tuple[Any, ...]:
    return (row.id, row.node, row.job, row.info.trajectory.name if row.info.trajectory else None,
            row.info.model_dump_json())


def _log_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("a state write was not recorded (a restarted gateway reconciles it from the nodes): %s",
                  done.exception())


@dataclass
class _Write:
    sql: str
    params: list[tuple[Any, ...]]
    done: asyncio.Future[None] = field(repr=False)


class StateWriter:
    """Group commit of the gateway's writes on its event loop (see the module docstring).

    Writes commit in submission order; a failed transaction fails every write in it (each caller sees
    the error) and the next batch starts on a fresh transaction.
    """

    def __init__(self, dsn: str, sync_commit: bool = False) -> None:
        self.dsn = dsn
        self.sync_commit = sync_commit
        self.commits = 0
        """Transactions committed (a counter: fewer than writes when commits were grouped)."""
        self._conn: Any = None
        self._pending: list[_Write] = []
        self._flusher: asyncio.Task[None] | None = None

    async def _connection(self) -> Any:
        if self._conn is None or self._conn.closed:
            import psycopg

            try:
                self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True, connect_timeout=10)
            except psycopg.OperationalError as exc:
                raise BackendUnavailable(f"the gateway's PostgreSQL does not answer: {exc}") from exc
            if not self.sync_commit:
                await self._conn.execute("SET synchronous_commit TO off")
        return self._conn

    def _enqueue(self, sql: str, params: Sequence[tuple[Any, ...]]) -> asyncio.Future[None]:
        item = _Write(sql, list(params), asyncio.get_running_loop().create_future())
        self._pending.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return item.done

    async def write(self, sql: str, params: Sequence[tuple[Any, ...]]) -> None:
        """Run ``sql`` once per params tuple, in the next group commit; returns once committed."""
        if params:
            await asyncio.shield(self._enqueue(sql, params))

    def submit(self, sql: str, params: Sequence[tuple[Any, ...]]) -> None:
        """Like :meth:`write`, without waiting: the next group commit carries it, in submission order; a
        failure is logged (for writes whose truth is kept elsewhere too: the gateway's sandbox rows, which
        a restarted gateway reconciles from the nodes' own records)."""
        if params:
            self._enqueue(sql, params).add_done_callback(_log_failure)

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._commit(batch)
            except Exception as exc:
                error = exc if isinstance(exc, BackendUnavailable) else BackendUnavailable(
                    f"the gateway could not record its state in PostgreSQL: {exc}")
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(error)
                continue
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)

    async def _commit(self, batch: list[_Write]) -> None:
        import psycopg

        for attempt in (1, 2):  # a server restart broke the connection: reconnect and replay (upserts)
            conn = await self._connection()
            try:
                # Pipeline mode: BEGIN, the statements and COMMIT go out together, one round trip.
                async with conn.pipeline(), conn.transaction(), conn.cursor() as cur:
                    i = 0
                    while i < len(batch):  # consecutive writes of one statement: one executemany
                        j = i
                        params: list[tuple[Any, ...]] = []
                        while j < len(batch) and batch[j].sql == batch[i].sql:
                            params += batch[j].params
                            j += 1
                        await cur.executemany(batch[i].sql, params)
                        i = j
                self.commits += 1
                return
            except psycopg.OperationalError:
                await conn.close()
                self._conn = None
                if attempt == 2:
                    raise

    async def put_node(self, row: NodeRow) -> None:
        """Insert or update a node."""
        await self.write(_PUT_NODE, [_node_params(row)])

    async def put_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        """Insert or update sandboxes."""
        await self.write(_PUT_SANDBOX, [_sandbox_params(r) for r in rows])

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Forget a destroyed sandbox."""
        await self.write(_DELETE_SANDBOX, [(sandbox_id,)])

    def submit_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        """Insert or update sandboxes in the next group commit, without waiting for it."""
        self.submit(_PUT_SANDBOX, [_sandbox_params(r) for r in rows])

    def submit_delete(self, sandbox_id: str) -> None:
        """Forget a destroyed sandbox in the next group commit, without waiting for it."""
        self.submit(_DELETE_SANDBOX, [(sandbox_id,)])

    async def aclose(self) -> None:
        """Wait for the writes in flight, close the connection."""
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._conn is not None:
            await self._conn.close()


class ClusterState:
    """Nodes and sandboxes in PostgreSQL (``dsn`` is a libpq URL): blocking reads, :attr:`writer` for writes."""

    def __init__(self, dsn: str, sync_commit: bool = False) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise BackendUnavailable("the cluster gateway needs psycopg 3: pip install 'dsec[cluster]'") from exc
        try:
            self._conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise BackendUnavailable(f"the gateway's PostgreSQL does not answer: {exc}") from exc
        self._lock = threading.Lock()
        with self._lock, self._conn.transaction(), self._conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(7310)")
            for statement in _SCHEMA:
                cur.execute(statement)
        self.writer = StateWriter(dsn, sync_commit)

    def close(self) -> None:
        """Close the reading connection (:meth:`aclose` closes the writer too)."""
        self._conn.close()

    async def aclose(self) -> None:
        """Let the writes in flight commit, then close both connections."""
        await self.writer.aclose()
        await asyncio.to_thread(self.close)

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    def nodes(self) -> list[NodeRow]:
        """Every node ever registered."""
        return [NodeRow(n, u, t, a, c, r) for n, u, t, a, c, r in
                self._run("SELECT name, url, token, alive, capacity, reason FROM dsec_cluster_nodes")]

    def sandboxes(self) -> list[SandboxRow]:
        """Every sandbox the gateway placed and has not seen destroyed (lost ones included)."""
        return [SandboxRow(SandboxInfo.model_validate(info), node, job) for node, job, info in
                self._run("SELECT node, job, info FROM dsec_cluster_sandboxes ORDER BY updated")]
