"""Cluster mode: the trajectory log on PostgreSQL (psycopg 3), behind :class:`TrajectoryStore`.

Same schema and group commit as SQLite. A PostgreSQL restart (or failover) between calls must not lose
a call or fail the rollout: a batch that hits a broken connection reconnects and is applied again
(every write is an idempotent upsert keyed by trajectory and sequence number), for up to
``retry_for`` seconds. Commits use the server's ``synchronous_commit`` (on by default: durable on disk).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from dsec.errors import BackendUnavailable
from dsec.trajectory.store import _SCHEMA, TrajectoryStore, _Op

__all__ = ["PostgresStore"]

log = logging.getLogger(__name__)


class PostgresStore(TrajectoryStore):
    """The log in a PostgreSQL database given by a libpq connection string (``postgresql://...``)."""

    placeholder = "%s"

    def __init__(self, dsn: str, *, retry_for: float = 30.0) -> None:
        super().__init__()
        try:
            import psycopg
        except ImportError as exc:
            raise BackendUnavailable(
                "the PostgreSQL trajectory log needs psycopg 3: pip install 'dsec[postgres]'") from exc
        self._psycopg = psycopg
        self.dsn = dsn
        with_info = psycopg.conninfo.conninfo_to_dict(dsn)  # (never the password: errors show it)
        self.where = f"PostgreSQL {with_info.get('host', 'localhost')}/{with_info.get('dbname', '')}"
        self.retry_for = retry_for
        self._write_conn: Any = None
        self._read_conn: Any = None

    def _connect(self, autocommit: bool = False) -> Any:
        return self._psycopg.connect(self.dsn, autocommit=autocommit, **self._timeouts())

    def _timeouts(self) -> dict[str, Any]:
        """libpq settings that bound how long a dead or black-holed server can hold a call, each only where the
        DSN does not set it: without them a failover that drops packets held the writer for the kernel's TCP
        retransmission time (~15 min), not the ``retry_for`` the log promises."""
        given = self._psycopg.conninfo.conninfo_to_dict(self.dsn)
        if "service" in given or os.environ.get("PGSERVICE"):
            return {}  # a service file may set any of them: passing ours would override it
        # (libpq's environment too: an explicit keyword overrides PGOPTIONS and PGCONNECT_TIMEOUT)
        given.update({key: "" for key, env in (("options", "PGOPTIONS"), ("connect_timeout", "PGCONNECT_TIMEOUT"))
                      if os.environ.get(env)})
        defaults = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3,
                    "keepalives_count": 3, "tcp_user_timeout": 10_000, "options": "-c statement_timeout=30000"}
        return {k: v for k, v in defaults.items() if k not in given}

    def _prepare(self) -> None:
        conn = self._retrying(self._connect)
        with conn.transaction(), conn.cursor() as cur:
            # Two daemons starting at once must not race on CREATE TABLE: serialise on an advisory lock.
            cur.execute("SELECT pg_advisory_xact_lock(7307)")
            for statement in _SCHEMA:
                cur.execute(statement)
        self._write_conn = conn

    def _close(self) -> None:
        for conn in (self._write_conn, self._read_conn):
            if conn is not None:
                conn.close()
        self._write_conn = self._read_conn = None

    def _retrying(self, action: Any) -> Any:
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            try:
                return action()
            except self._psycopg.errors.QueryCanceled as exc:  # an OperationalError, but the server is up
                raise BackendUnavailable(f"the trajectory log database cancelled a statement: {exc}") from exc
            except self._psycopg.OperationalError as exc:
                if time.monotonic() >= deadline:
                    raise BackendUnavailable(f"the trajectory log database is unreachable: {exc}") from exc
                log.warning("trajectory log: PostgreSQL unreachable (%s); retrying", exc)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _apply(self, ops: list[_Op]) -> None:
        def attempt() -> None:
            if self._write_conn is None or self._write_conn.closed or self._write_conn.broken:
                self._write_conn = self._connect()
            conn = self._write_conn
            try:
                with conn.transaction(), conn.cursor() as cur:
                    for op in ops:
                        op(cur)
            except self._psycopg.OperationalError:
                conn.close()
                raise

        self._retrying(attempt)

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        def attempt() -> list[tuple[Any, ...]]:
            if self._read_conn is None or self._read_conn.closed or self._read_conn.broken:
                self._read_conn = self._connect(autocommit=True)
            try:
                with self._read_conn.cursor() as cur:
                    cur.execute(sql, args)
                    return list(cur.fetchall())
            except self._psycopg.OperationalError:
                self._read_conn.close()
                raise

        result: list[tuple[Any, ...]] = self._retrying(attempt)
        return result
