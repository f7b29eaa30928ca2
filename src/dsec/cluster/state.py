"""The gateway's durable state: which node owns each sandbox, for which job, and which nodes exist.

A gateway restart (crash, upgrade, rescheduling by Ray) rebuilds placement from these tables and loses
nothing. PostgreSQL through psycopg 3. Owns no placement logic.

Tables: ``dsec_cluster_nodes`` (one row a node), ``dsec_cluster_rows`` (one narrow row a sandbox: its
node, job, state, shape, creation time, the digest of its spec, its trajectory and why it ended) and
``dsec_cluster_specs`` (each spec's JSON once, by digest: a batch of 32,000 writes its spec one time).

Reads (:meth:`ClusterState.nodes`, :meth:`ClusterState.rows`, at gateway start) block. Writes go through
:attr:`ClusterState.writer`, an asyncio group commit on the gateway's event loop: every change made while a
commit is in flight joins the next one (a write no caller waits for gathers with others for up to
:data:`GROUP_DELAY` first; a sandbox destroyed before its row was written is never written), which is one
transaction of at most four statements
whatever its size (each takes arrays: ``unnest`` for the upserts, ``= ANY`` for the deletes), sent in
pipeline mode: one round trip. A sandbox changed twice before a commit is written once, as it ended up.
Each caller that waits resumes when its transaction has committed. Commits are not waited for on disk
by default (``synchronous_commit=off``): a gateway crash loses nothing (the server has the rows), a crash
of the PostgreSQL server itself may lose the last ~0.6 s of committed rows, which a restarted gateway
rebuilds from the nodes. ``sync_commit=True`` waits for the disk flush on every commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dsec.cluster.records import Row, Shape
from dsec.errors import BackendUnavailable

__all__ = ["GROUP_DELAY", "ClusterState", "NodeRow", "StateWriter", "spec_digest"]

log = logging.getLogger(__name__)

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS dsec_cluster_nodes (
        name TEXT PRIMARY KEY, url TEXT NOT NULL, token TEXT NOT NULL, alive BOOLEAN NOT NULL,
        capacity JSONB NOT NULL, reason TEXT)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_specs (digest TEXT PRIMARY KEY, spec TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_rows (
        id TEXT PRIMARY KEY, node TEXT NOT NULL, job TEXT NOT NULL, state TEXT NOT NULL, backend TEXT NOT NULL,
        cpu DOUBLE PRECISION NOT NULL, memory BIGINT NOT NULL, image TEXT, spec TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL, trajectory TEXT, reason TEXT, detail TEXT, batch TEXT)""",
    "CREATE INDEX IF NOT EXISTS dsec_cluster_rows_node ON dsec_cluster_rows (node)",
]
_ROW_COLUMNS = "id, node, job, state, backend, cpu, memory, image, spec, created, trajectory, reason, detail, batch"
_ROW_TYPES = ("text[], text[], text[], text[], text[], float8[], int8[], text[], text[], float8[], text[], text[], "
              "text[], text[]")


@dataclass
class NodeRow:
    """A node daemon the gateway knows: its URL, its own token, capacity and whether Ray sees it alive."""

    name: str
    url: str
    token: str
    alive: bool
    capacity: dict[str, Any]
    reason: str | None = None


_PUT_NODE = """INSERT INTO dsec_cluster_nodes (name, url, token, alive, capacity, reason) VALUES (%s,%s,%s,%s,%s,%s)
    ON CONFLICT (name) DO UPDATE SET url=EXCLUDED.url, token=EXCLUDED.token, alive=EXCLUDED.alive,
    capacity=EXCLUDED.capacity, reason=EXCLUDED.reason"""
_PUT_SPECS = """INSERT INTO dsec_cluster_specs (digest, spec) SELECT * FROM unnest(%s::text[], %s::text[])
    ON CONFLICT (digest) DO NOTHING"""
_PUT_ROWS = f"""INSERT INTO dsec_cluster_rows ({_ROW_COLUMNS})
    SELECT * FROM unnest({", ".join("%b::" + t for t in _ROW_TYPES.split(", "))})
    ON CONFLICT (id) DO UPDATE SET node=EXCLUDED.node, job=EXCLUDED.job, state=EXCLUDED.state,
    reason=EXCLUDED.reason, detail=EXCLUDED.detail, batch=EXCLUDED.batch"""
_DELETE_ROWS = "DELETE FROM dsec_cluster_rows WHERE id = ANY(%b::text[])"


def spec_digest(spec: bytes) -> str:
    """The key of a spec's JSON in ``dsec_cluster_specs``."""
    return hashlib.blake2b(spec, digest_size=16).hexdigest()


def _node_params(row: NodeRow) -> tuple[Any, ...]:
    return (row.name, row.url, row.token, row.alive, json.dumps(row.capacity), row.reason)


GROUP_DELAY = 0.02
"""Seconds submitted writes (no caller waits for them) gather before their commit: an RL loop's creates and
destroys go in a few commits a second, and a sandbox destroyed within it is never written at all."""


class StateWriter:
    """Group commit of the gateway's writes on its event loop (see the module docstring).

    A failed transaction fails every write in it (each waiting caller sees the error) and the next batch
    starts on a fresh transaction.
    """

    def __init__(self, dsn: str, sync_commit: bool = False) -> None:
        self.dsn = dsn
        self.sync_commit = sync_commit
        self.commits = 0
        """Transactions committed (a counter: fewer than writes when commits were grouped)."""
        self.written = 0
        """Sandbox rows upserted or deleted (a counter)."""
        self._conn: Any = None
        self._rows: dict[str, Row | None] = {}
        """Sandbox id -> its row as it ended up, or None: delete it."""
        self._nodes: list[NodeRow] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._digests: dict[bytes, str] = {}
        """Specs written (or being written) by this gateway -> digest; bounded."""
        self._fresh: set[str] = set()
        """Sandboxes submitted as new whose rows no commit has taken yet."""
        self._urgent = asyncio.Event()
        """Set when a caller waits for the next commit (submissions alone wait :data:`GROUP_DELAY`)."""

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

    def _kick(self) -> asyncio.Future[None]:
        """A waiter on the next commit, which starts now."""
        done = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        self._urgent.set()
        self._start()
        return done

    def _start(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    def submit_rows(self, rows: Sequence[tuple[str, Row]], *, new: bool = False) -> None:
        """Insert or update sandbox rows in a group commit within :data:`GROUP_DELAY`, without waiting (the
        nodes' own records are the truth a restarted gateway reconciles these from); a failure is logged.
        ``new``: sandboxes no commit has written yet (a destroy before their commit writes neither)."""
        if rows:
            for sid, row in rows:
                self._rows[sid] = row
            if new:
                self._fresh.update(sid for sid, _row in rows)
            self._start()

    def submit_delete(self, ids: Sequence[str]) -> None:
        """Forget destroyed sandboxes in a group commit within :data:`GROUP_DELAY`, without waiting."""
        if ids:
            for sid in ids:
                if sid in self._fresh:  # never written: nothing to write now either
                    self._fresh.discard(sid)
                    self._rows.pop(sid, None)
                else:
                    self._rows[sid] = None
            self._start()

    async def put_rows(self, rows: Sequence[tuple[str, Row]]) -> None:
        """Insert or update sandbox rows; returns once committed."""
        for sid, row in rows:
            self._rows[sid] = row
        await asyncio.shield(self._kick())

    async def put_node(self, row: NodeRow) -> None:
        """Insert or update a node; returns once committed."""
        self._nodes.append(row)
        await asyncio.shield(self._kick())

    async def flush(self) -> None:
        """Returns once everything submitted so far has committed (or failed)."""
        if self._rows or self._nodes or (self._flusher is not None and not self._flusher.done()):
            await asyncio.gather(asyncio.shield(self._kick()), return_exceptions=True)

    async def _flush(self) -> None:
        while self._waiters or self._rows or self._nodes:
            if not self._waiters:  # only submissions: more join them until the delay ends or someone waits
                self._urgent.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), GROUP_DELAY)
            rows, self._rows = self._rows, {}
            nodes, self._nodes = self._nodes, []
            waiters, self._waiters = self._waiters, []
            self._fresh = set()  # being written now: a later destroy must delete them
            try:
                await self._commit(rows, nodes)
            except Exception as exc:
                error = exc if isinstance(exc, BackendUnavailable) else BackendUnavailable(
                    f"the gateway could not record its state in PostgreSQL: {exc}")
                if not waiters:
                    log.error("a state write was not recorded (a restarted gateway reconciles it from the "
                              "nodes): %s", error)
                for done in waiters:
                    if not done.done():
                        done.set_exception(error)
                continue
            self.written += len(rows)
            for done in waiters:
                if not done.done():
                    done.set_result(None)

    def _statements(self, rows: dict[str, Row | None], nodes: list[NodeRow]) -> list[tuple[str, Any]]:
        statements: list[tuple[str, Any]] = [(_PUT_NODE, [_node_params(n) for n in nodes])] if nodes else []
        puts = [(sid, row) for sid, row in rows.items() if row is not None]
        if puts:
            new_specs: dict[str, str] = {}
            columns: list[list[Any]] = [[] for _ in range(14)]
            for sid, row in puts:
                digest = self._digests.get(row.spec)
                if digest is None:
                    digest = self._remember(row.spec)
                    new_specs[digest] = row.spec.decode()
                shape = row.shape
                for column, value in zip(columns, (
                        sid, row.node, row.job, row.state, shape.backend, shape.cpu, shape.memory, shape.image,
                        digest, row.created, row.trajectory, row.reason,
                        None if row.detail is None else row.detail.decode(), row.batch), strict=True):
                    column.append(value)
            if new_specs:
                statements.append((_PUT_SPECS, [(list(new_specs), list(new_specs.values()))]))
            statements.append((_PUT_ROWS, [tuple(columns)]))
        gone = [sid for sid, row in rows.items() if row is None]
        if gone:
            statements.append((_DELETE_ROWS, [(gone,)]))
        return statements

    def _remember(self, spec: bytes) -> str:
        if len(self._digests) >= 8192:
            del self._digests[next(iter(self._digests))]
        digest = self._digests[spec] = spec_digest(spec)
        return digest

    async def _commit(self, rows: dict[str, Row | None], nodes: list[NodeRow]) -> None:
        import psycopg

        statements = self._statements(rows, nodes)
        if not statements:
            return
        for attempt in (1, 2):  # a server restart broke the connection: reconnect and replay (upserts)
            conn = await self._connection()
            try:
                # Pipeline mode: BEGIN, the statements and COMMIT go out together, one round trip.
                async with conn.pipeline(), conn.transaction(), conn.cursor() as cur:
                    for sql, params in statements:
                        await cur.executemany(sql, params)
                self.commits += 1
                return
            except psycopg.OperationalError:
                await conn.close()
                self._conn = None
                if attempt == 2:
                    self._digests.clear()  # what this failed transaction wrote may be missing
                    raise
            except Exception:
                self._digests.clear()
                raise

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
            _migrate_v1(cur)
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

    def rows(self, nodes: Sequence[str] | None = None) -> Iterator[tuple[str, Row]]:
        """Every sandbox the gateway placed and has not seen destroyed (lost and expired ones included), or
        those on ``nodes``; each distinct spec and shape is read once and shared by its rows."""
        where, params = ("WHERE node = ANY(%s)", ([*nodes],)) if nodes is not None else ("", ())
        specs = {digest: spec.encode() for digest, spec in self._run(
            f"SELECT digest, spec FROM dsec_cluster_specs WHERE digest IN (SELECT spec FROM dsec_cluster_rows {where})",
            params)}
        shapes: dict[tuple[Any, ...], Shape] = {}
        with self._lock, self._conn.cursor() as cur:
            cur.execute(f"SELECT {_ROW_COLUMNS} FROM dsec_cluster_rows {where}", params)
            # In chunks: iterating the cursor row by row checks its result for each one (a third of the time).
            while chunk := cur.fetchmany(10_000):
                for sid, node, job, state, backend, cpu, memory, image, digest, created, traj, reason, detail, batch \
                        in chunk:
                    key = (backend, cpu, memory, image)
                    shape = shapes.get(key)
                    if shape is None:
                        shape = shapes[key] = Shape(*key)
                    yield sid, Row(node, job, state, shape, specs.get(digest, b"{}"), created, traj, reason,
                                   None if detail is None else detail.encode(), batch)

    def locate(self, sandbox_id: str) -> str | None:
        """The node a sandbox's row names (another replica's sandbox, if it committed), or None."""
        found = self._run("SELECT node FROM dsec_cluster_rows WHERE id = %s", (sandbox_id,))
        return str(found[0][0]) if found else None

    def recorded(self, ids: Sequence[str], job: str | None = None) -> set[str]:
        """Which of ``ids`` have a committed row (of ``job``'s, when given)."""
        if job is None:
            found = self._run("SELECT id FROM dsec_cluster_rows WHERE id = ANY(%s)", ([*ids],))
        else:
            found = self._run("SELECT id FROM dsec_cluster_rows WHERE id = ANY(%s) AND job = %s", ([*ids], job))
        return {str(sid) for sid, in found}


def _migrate_v1(cur: Any) -> None:
    """Rows of the first schema (one JSONB ``info`` a sandbox in ``dsec_cluster_sandboxes``) into the
    narrow tables, once; the old table is kept, renamed, for an operator to drop."""
    cur.execute("SELECT to_regclass('dsec_cluster_sandboxes') IS NOT NULL")
    if not cur.fetchone()[0]:
        return
    cur.execute("""SELECT id, node, job, trajectory, info FROM dsec_cluster_sandboxes""")
    old = cur.fetchall()
    for sid, node, job, trajectory, info in old:
        spec = json.dumps(info["spec"], separators=(",", ":")).encode()
        cur.execute(_PUT_SPECS, ([spec_digest(spec)], [spec.decode()]))
        detail = json.dumps(info) if trajectory else None
        cur.execute(f"INSERT INTO dsec_cluster_rows ({_ROW_COLUMNS}) VALUES ({', '.join(['%s'] * 14)}) "
                    "ON CONFLICT (id) DO NOTHING",
                    (sid, node, job, info["state"], info["backend"], float(info["spec"]["cpu"]),
                     int(info["spec"]["memory"]), info.get("image"), spec_digest(spec), float(info["created_at"]),
                     trajectory, info.get("reason"), detail, None))
    cur.execute("ALTER TABLE dsec_cluster_sandboxes RENAME TO dsec_cluster_sandboxes_v1")
    log.warning("moved %d sandbox row(s) of the first schema to dsec_cluster_rows "
                "(dsec_cluster_sandboxes_v1 may be dropped)", len(old))
