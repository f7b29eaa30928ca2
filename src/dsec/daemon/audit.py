"""The node's audit trail: every command run in every sandbox, kept outside the sandboxes, bounded.

Owns the audit table (SQLite, ``$DSEC_HOME/audit.db`` by default), its writer and its queries. The exec
path only calls :meth:`AuditLog.record` with a plain tuple (:data:`COLUMNS` order), which appends it to an
in-memory list: no syscall, no lock, no await, no model validation (building a pydantic model there cost
~20x more than the tuple). Output is decoded and commands are serialised by the flusher, off the event
loop. A flusher task moves what accumulated into SQLite every ``flush_interval`` seconds in one
transaction, in a thread, so the event loop never waits on the database. The table is a ring: past
``max_rows`` the oldest rows are deleted in the same transaction. If the database stalls and more than
``max_pending`` records wait, the oldest pending ones are dropped and counted (``statistics()["dropped"]``)
rather than growing the daemon's memory without bound.

Who ran a command is read from :data:`caller`, a context variable the token guard
(:mod:`dsec.daemon.auth`) sets per request; it is ``local`` on the unix socket. This module never runs
anything in a sandbox and never decides what a command means.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsec._sqlite import private_database, small_page_cache
from dsec.errors import InvalidRequest
from dsec.models import AuditEntry

__all__ = ["COLUMNS", "DEFAULT_MAX_ROWS", "OUTPUT_HEAD_BYTES", "AuditLog", "AuditQuery", "as_row", "caller"]

log = logging.getLogger(__name__)

caller: contextvars.ContextVar[str] = contextvars.ContextVar("dsec_caller", default="local")
"""Name of the token of the request being served (set by the token guard)."""

DEFAULT_MAX_ROWS = 200_000
"""Rows the audit table keeps by default (a few hundred bytes each, plus the output heads)."""

OUTPUT_HEAD_BYTES = 4096
"""Bytes of each output stream the trail keeps per command."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS dsec_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, sandbox_id TEXT NOT NULL, node TEXT NOT NULL,
        backend TEXT NOT NULL, who TEXT NOT NULL, job TEXT, op TEXT NOT NULL, command TEXT NOT NULL, cwd TEXT,
        outcome TEXT NOT NULL, exit_code INTEGER, limit_hit TEXT, duration_s REAL NOT NULL, stdout TEXT NOT NULL,
        stderr TEXT NOT NULL, output_bytes INTEGER NOT NULL, trajectory TEXT, error TEXT)""",
    "CREATE INDEX IF NOT EXISTS dsec_audit_sandbox ON dsec_audit (sandbox_id, id)",
    "CREATE INDEX IF NOT EXISTS dsec_audit_at ON dsec_audit (at)",
)
COLUMNS = ("at", "sandbox_id", "node", "backend", "who", "job", "op", "command", "cwd", "outcome", "exit_code",
           "limit_hit", "duration_s", "stdout", "stderr", "output_bytes", "trajectory", "error")
"""The layout of a record tuple (``command`` a str or list, ``stdout``/``stderr`` bytes, at most
``OUTPUT_HEAD_BYTES`` each) and of the table's columns after ``id``."""
_COLUMNS = COLUMNS
_INSERT = f"INSERT INTO dsec_audit ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
_COMMAND, _STDOUT, _STDERR = COLUMNS.index("command"), COLUMNS.index("stdout"), COLUMNS.index("stderr")


class AuditQuery:
    """Filters of an audit query; every one given must match (newest first, ``before`` pages back)."""

    def __init__(self, *, sandbox_id: str | None = None, who: str | None = None, job: str | None = None,
                 outcome: str | None = None, since: float | None = None, until: float | None = None,
                 before: int | None = None, limit: int = 100) -> None:
        if not 1 <= limit <= 10_000:
            raise InvalidRequest(f"audit limit must be between 1 and 10000, got {limit}")
        if since is not None and until is not None and since > until:
            raise InvalidRequest(f"audit query: since ({since}) is after until ({until})")
        self.sandbox_id, self.who, self.job, self.outcome = sandbox_id, who, job, outcome
        self.since, self.until, self.before, self.limit = since, until, before, limit

    def sql(self) -> tuple[str, list[Any]]:
        """The SELECT for these filters."""
        where: list[str] = []
        args: list[Any] = []
        for column, value in (("sandbox_id", self.sandbox_id), ("who", self.who), ("job", self.job),
                              ("outcome", self.outcome)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        for clause, bound in (("at >= ?", self.since), ("at <= ?", self.until), ("id < ?", self.before)):
            if bound is not None:
                where.append(clause)
                args.append(bound)
        text = f"SELECT id, {', '.join(_COLUMNS)} FROM dsec_audit"
        if where:
            text += " WHERE " + " AND ".join(where)
        return text + " ORDER BY id DESC LIMIT ?", [*args, self.limit]


def as_row(entry: AuditEntry) -> tuple[Any, ...]:
    """The record tuple of ``entry`` (for callers that hold a model; the exec path builds tuples itself)."""
    return (entry.at, entry.sandbox_id, entry.node, entry.backend, entry.who, entry.job, entry.op,
            entry.command, entry.cwd, entry.outcome, entry.exit_code, entry.limit, entry.duration_s,
            entry.stdout.encode(), entry.stderr.encode(), entry.output_bytes, entry.trajectory, entry.error)


def _stored(record: tuple[Any, ...]) -> tuple[Any, ...]:
    """A record tuple as the table stores it: command as text (JSON for an argv), output heads decoded."""
    row = list(record)
    command = row[_COMMAND]
    row[_COMMAND] = command if isinstance(command, str) else json.dumps(list(command))
    row[_STDOUT] = head(row[_STDOUT])
    row[_STDERR] = head(row[_STDERR])
    return tuple(row)


def _entry(row: Sequence[Any]) -> AuditEntry:
    values = dict(zip(("id", *_COLUMNS), row, strict=True))
    command = values["command"]
    if isinstance(command, str) and command.startswith("["):
        with contextlib.suppress(ValueError):
            command = json.loads(command)
    values["command"] = command
    values["limit"] = values.pop("limit_hit")
    return AuditEntry.model_validate(values)


def head(data: bytes, limit: int = OUTPUT_HEAD_BYTES) -> str:
    """The first ``limit`` bytes of ``data`` as text (undecodable bytes replaced)."""
    return data[:limit].decode("utf-8", errors="replace")


class AuditLog:
    """A bounded audit table fed from an in-memory list by a periodic flusher."""

    def __init__(self, path: Path, *, max_rows: int = DEFAULT_MAX_ROWS, flush_interval: float = 0.5,
                 max_pending: int = 100_000) -> None:
        if max_rows < 1:
            raise InvalidRequest(f"the audit trail must keep at least one row, got max_rows={max_rows}")
        self.path = path
        self.max_rows = max_rows
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self._pending: list[tuple[Any, ...]] = []
        self._dropped = 0
        self._written = 0
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # one connection, used from worker threads
        self._flusher: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()

    # -- the hot path ---------------------------------------------------------------------------------

    def record(self, row: tuple[Any, ...]) -> None:
        """Queue one command's record, a tuple in :data:`COLUMNS` order (O(1), no I/O); the flusher writes it
        within ``flush_interval``."""
        pending = self._pending
        pending.append(row)
        if len(pending) > self.max_pending:
            del pending[0]
            self._dropped += 1

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (or create) the table and start the flusher."""
        await asyncio.to_thread(self._open)
        self._flusher = asyncio.create_task(self._flush_forever(), name="dsec-audit-flusher")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        private_database(self.path)  # every command every sandbox ran, with the head of its output
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # survives a daemon crash; an audit row is not worth an fsync
        small_page_cache(db)
        for statement in _SCHEMA:
            db.execute(statement)
        self._db = db

    async def aclose(self) -> None:
        """Stop the flusher, write what is pending, close the database."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self._db is not None:
            await self.flush()
            with self._lock:
                self._db.close()
            self._db = None

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            try:
                await self.flush()
            except Exception:
                log.exception("audit flush failed; its records are kept for the next try")

    async def flush(self) -> None:
        """Write every pending record now (queries call it so that they see the latest commands)."""
        async with self._flushing:
            batch, self._pending = self._pending, []
            if not batch or self._db is None:
                self._pending[:0] = batch
                return
            try:
                await asyncio.to_thread(self._write, batch)
            except BaseException:
                self._pending[:0] = batch  # not lost: retried on the next flush
                raise
            self._written += len(batch)

    def _write(self, batch: list[tuple[Any, ...]]) -> None:
        with self._lock:
            db = self._db
            assert db is not None
            db.execute("BEGIN")
            try:
                db.executemany(_INSERT, [_stored(r) for r in batch])
                # The ring: rows more than max_rows behind the newest go, in the same transaction.
                db.execute("DELETE FROM dsec_audit WHERE id <= (SELECT MAX(id) FROM dsec_audit) - ?",
                           (self.max_rows,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    # -- queries --------------------------------------------------------------------------------------

    async def query(self, query: AuditQuery) -> list[AuditEntry]:
        """Records matching ``query``, newest first."""
        await self.flush()
        if self._db is None:
            return []
        text, args = query.sql()
        rows = await asyncio.to_thread(self._select, text, args)
        return [_entry(r) for r in rows]

    def _select(self, text: str, args: list[Any]) -> list[tuple[Any, ...]]:
        with self._lock:
            assert self._db is not None
            return list(self._db.execute(text, args))

    def statistics(self) -> dict[str, int]:
        """Pending, written and dropped records since start, and the cap."""
        return {"pending": len(self._pending), "written": self._written, "dropped": self._dropped,
                "max_rows": self.max_rows}
