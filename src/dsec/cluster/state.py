"""The gateway's durable state: which node owns each sandbox, for which job, and which nodes exist.

A gateway restart (crash, upgrade, rescheduling by Ray) rebuilds placement from these tables and loses
nothing. PostgreSQL through psycopg 3; every write is an upsert keyed by id, so replaying one is
harmless. Calls block: the gateway runs them in a worker thread. Owns no placement logic.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from dsec.errors import BackendUnavailable
from dsec.models import SandboxInfo

__all__ = ["ClusterState", "NodeRow", "SandboxRow"]

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


class ClusterState:
    """Nodes and sandboxes in PostgreSQL (``dsn`` is a libpq URL)."""

    def __init__(self, dsn: str) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise BackendUnavailable("the cluster gateway needs psycopg 3: pip install 'dsec[cluster]'") from exc
        self._conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        self._lock = threading.Lock()
        with self._lock, self._conn.transaction(), self._conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(7310)")
            for statement in _SCHEMA:
                cur.execute(statement)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    def put_node(self, row: NodeRow) -> None:
        """Insert or update a node."""
        self._run(
            """INSERT INTO dsec_cluster_nodes (name, url, token, alive, capacity, reason) VALUES (%s,%s,%s,%s,%s,%s)
               ON CONFLICT (name) DO UPDATE SET url=EXCLUDED.url, token=EXCLUDED.token, alive=EXCLUDED.alive,
               capacity=EXCLUDED.capacity, reason=EXCLUDED.reason""",
            (row.name, row.url, row.token, row.alive, json.dumps(row.capacity), row.reason))

    def nodes(self) -> list[NodeRow]:
        """Every node ever registered."""
        return [NodeRow(n, u, t, a, c, r) for n, u, t, a, c, r in
                self._run("SELECT name, url, token, alive, capacity, reason FROM dsec_cluster_nodes")]

    def put_sandboxes(self, rows: list[SandboxRow]) -> None:
        """Insert or update sandboxes (one transaction)."""
        if not rows:
            return
        with self._lock, self._conn.transaction(), self._conn.cursor() as cur:
            cur.executemany(
                """INSERT INTO dsec_cluster_sandboxes (id, node, job, trajectory, info) VALUES (%s,%s,%s,%s,%s)
                   ON CONFLICT (id) DO UPDATE SET node=EXCLUDED.node, job=EXCLUDED.job,
                   trajectory=EXCLUDED.trajectory, info=EXCLUDED.info, updated=extract(epoch from now())""",
                [(r.id, r.node, r.job, r.info.trajectory.name if r.info.trajectory else None,
                  r.info.model_dump_json()) for r in rows])

    def delete_sandbox(self, sandbox_id: str) -> None:
        """Forget a destroyed sandbox."""
        self._run("DELETE FROM dsec_cluster_sandboxes WHERE id = %s", (sandbox_id,))

    def sandboxes(self) -> list[SandboxRow]:
        """Every sandbox the gateway placed and has not seen destroyed (lost ones included)."""
        return [SandboxRow(SandboxInfo.model_validate(info), node, job) for node, job, info in
                self._run("SELECT node, job, info FROM dsec_cluster_sandboxes ORDER BY updated")]
