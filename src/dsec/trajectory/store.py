"""Durable trajectory logs: one interface, SQLite (local mode) and PostgreSQL (cluster mode) behind it.

A trajectory is a name (``"job-17/rollout-3"``), the sandbox bound to it, its latest checkpoint and an
append-only list of calls numbered from 0. This module owns the schema, the group-commit writer and
nothing else: it never decides whether a call matches (``trajectory.replay`` does) and never touches a
sandbox.

Where a commit is expensive (an fsync, a network round trip to PostgreSQL), writes go through one writer
thread per store that drains everything queued, runs it in one transaction and commits once ("group
commit"): concurrent sandboxes share a commit, and the event loop never waits on the database. A caller
that needs durability awaits the commit; one that does not (read-only calls) only enqueues. The queue is
FIFO, so an awaited commit also commits every write queued before it: the log is always a durable
prefix, never a log with holes. Where a commit is a copy into the page cache (SQLite in WAL mode with
``synchronous=NORMAL``, ~20 us) the store commits inline on the event loop instead ("inline"): handing
the write to a thread and waking the loop again cost five times more than the commit itself.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import queue
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec._sqlite import private_database, small_page_cache
from dsec.errors import DSecError, SandboxError

__all__ = ["Binding", "Entry", "SQLiteStore", "Summary", "TrajectoryStore"]

log = logging.getLogger(__name__)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS dsec_trajectories (
        name TEXT PRIMARY KEY, sandbox_id TEXT, spec TEXT NOT NULL, checkpoint TEXT,
        checkpoint_seq INTEGER NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dsec_calls (
        name TEXT NOT NULL, seq INTEGER NOT NULL, op TEXT NOT NULL, digest TEXT NOT NULL,
        request TEXT NOT NULL, status TEXT NOT NULL, response TEXT, truncated INTEGER NOT NULL DEFAULT 0,
        original_bytes BIGINT NOT NULL DEFAULT 0, started_at DOUBLE PRECISION NOT NULL,
        duration_s DOUBLE PRECISION NOT NULL DEFAULT 0, PRIMARY KEY (name, seq))""",
    """CREATE TABLE IF NOT EXISTS dsec_health (node TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL)""",
    # A table of its own rather than a column: logs made before ending existed need no migration.
    """CREATE TABLE IF NOT EXISTS dsec_ended (name TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL)""",
)
_MAX_KEPT = 100_000
"""Deferred writes kept for a store that takes no write (an outage), at most."""
_ENTRY_COLUMNS = "seq, op, digest, request, status, response, truncated, original_bytes, started_at, duration_s"
_UPSERT_CALL = (
    f"INSERT INTO dsec_calls (name, {_ENTRY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (name, seq) DO UPDATE SET op = excluded.op, digest = excluded.digest, "
    "request = excluded.request, status = excluded.status, response = excluded.response, "
    "truncated = excluded.truncated, original_bytes = excluded.original_bytes, "
    "started_at = excluded.started_at, duration_s = excluded.duration_s"
)
_UPSERT_BINDING = (
    "INSERT INTO dsec_trajectories (name, sandbox_id, spec, checkpoint, checkpoint_seq, created_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET sandbox_id = excluded.sandbox_id, "
    "spec = excluded.spec, checkpoint = excluded.checkpoint, checkpoint_seq = excluded.checkpoint_seq, "
    "updated_at = excluded.updated_at"
)


@dataclass
class Entry:
    """One logged call."""

    seq: int
    op: str
    """``exec``, ``read``, ``write``, ``list`` or ``snapshot``."""
    digest: str
    """sha256 of the operation and its canonical arguments (what replay matches on)."""
    request: str
    """The call in readable JSON (large bodies replaced by their size and digest): shown on divergence."""
    status: str = "running"
    """``running`` (logged before it ran), ``done`` or ``interrupted`` (the daemon died while it ran)."""
    response: str | None = None
    """JSON of the response as the caller got it (output capped, see ``truncated``)."""
    truncated: bool = False
    """True when the stored response was cut at the log's per-call cap."""
    original_bytes: int = 0
    """Bytes of output (or file body) the call produced before the cap was applied."""
    started_at: float = field(default_factory=time.time)
    duration_s: float = 0.0

    def row(self, name: str) -> tuple[Any, ...]:
        return (name, self.seq, self.op, self.digest, self.request, self.status, self.response,
                int(self.truncated), self.original_bytes, self.started_at, self.duration_s)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Entry:
        seq, op, digest, request, status, response, truncated, original, started, duration = row
        return cls(int(seq), str(op), str(digest), str(request), str(status), response, bool(truncated),
                   int(original), float(started), float(duration))


@dataclass
class Binding:
    """Which sandbox a trajectory drives, how to re-create it, and its latest checkpoint."""

    name: str
    spec: str
    """The ``SandboxSpec`` JSON the trajectory was opened with."""
    sandbox_id: str | None = None
    checkpoint: str | None = None
    """Snapshot id of the latest checkpoint."""
    checkpoint_seq: int = 0
    """Number of calls logged when the checkpoint was taken (calls ``>=`` it are after it)."""
    created_at: float = field(default_factory=time.time)


@dataclass
class Summary:
    """One trajectory as a listing shows it."""

    binding: Binding
    calls: int
    updated_at: float
    ended_at: float | None


_Op = Callable[[Any], None]


class _Writer:
    """One thread that applies queued writes in batches, one transaction and one commit per batch."""

    def __init__(self, store: TrajectoryStore, name: str) -> None:
        self._store = store
        self._queue: queue.SimpleQueue[tuple[_Op, asyncio.Future[None] | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.commits = 0
        self.writes = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, op: _Op, wait: bool) -> asyncio.Future[None] | None:
        future: asyncio.Future[None] | None = asyncio.get_running_loop().create_future() if wait else None
        self._queue.put((op, future))
        return future

    def close(self) -> None:
        if self._thread.ident is None:  # never started: its store's start failed before it
            return
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._queue.get_nowait()
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
            error: BaseException | None = None
            try:
                self._store._apply([op for op, _ in batch])
                self.commits += 1
                self.writes += len(batch)
            except BaseException as exc:  # reported to every waiter; nothing here may kill the thread
                log.exception("trajectory log: a batch of %d writes failed", len(batch))
                error = exc
            for _, future in batch:
                if future is not None:
                    future.get_loop().call_soon_threadsafe(_settle, future, error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    elif isinstance(error, DSecError):
        future.set_exception(error)
    else:
        future.set_exception(SandboxError(f"writing the trajectory log failed: {type(error).__name__}: {error}",
                                          component="trajectory-store"))


class TrajectoryStore(abc.ABC):
    """Where trajectory logs live. Subclasses give a connection and the SQL placeholder style."""

    placeholder = "?"
    inline = False
    """Commit on the caller's thread instead of the writer thread (only where a commit is cheap)."""
    where = "the trajectory store"
    """What the store is, for errors (a path, a database host)."""
    defer_s = 0.05
    """Inline mode: the longest a write that need not be durable waits to share the next commit (a call's
    response usually rides with the next call's durable ``running`` entry: one commit per call)."""

    def __init__(self) -> None:
        self._writer = _Writer(self, f"dsec-trajectory-{type(self).__name__}")
        self._read_lock = threading.Lock()
        # Reads run on a thread of their own: during a database outage each one retries for up to a
        # half-minute, and on the loop's default executor (6 threads on 2 cores) they held every thread that
        # creates and destroys use.
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-trajectory-read")
        self._inline_commits = 0
        self._inline_writes = 0
        # Inline mode: writes that need not be durable before the caller goes on, committed in one transaction
        # with the next durable write, before the next read, or after defer_s at the latest (in order).
        self._pending: list[_Op] = []
        self._unsettled = 0
        """Writer mode: writes submitted without waiting that are not committed yet."""
        self._failed: list[_Op] = []
        """Writer mode: writes submitted without waiting whose batch failed; applied again ahead of the next
        durable write or barrier, whose caller gets the error if they fail again."""

    # -- what a backend database provides -------------------------------------------------------------

    @abc.abstractmethod
    def _connect(self) -> Any:
        """A new DB-API connection with the schema in place."""

    @abc.abstractmethod
    def _apply(self, ops: list[_Op]) -> None:
        """Run ``ops`` (each takes a cursor) in one transaction and commit it durably."""

    @abc.abstractmethod
    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run one read-only query and return its rows."""

    def _sql(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the schema and start the writer thread."""
        await asyncio.to_thread(self._prepare)
        self._writer.start()

    def _prepare(self) -> None:
        """Create the schema (subclasses open their connections here)."""

    async def aclose(self) -> None:
        """Commit what is queued and stop the writer."""
        self._flush_pending()
        if self._failed:
            try:
                await self._redo_failed()
            except DSecError as exc:  # nobody is left to tell: the calls read as interrupted after a restart
                log.error("trajectory log: %d deferred writes lost at close (%s)", len(self._failed), exc)
        await asyncio.to_thread(self._writer.close)
        await asyncio.to_thread(self._reader.shutdown)
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        """Close connections."""

    def statistics(self) -> dict[str, int]:
        """Commits and writes so far (writes per commit shows how well group commit batches)."""
        return {"commits": self._writer.commits + self._inline_commits,
                "writes": self._writer.writes + self._inline_writes}

    # -- writes ---------------------------------------------------------------------------------------

    async def _write(self, sql: str, args: tuple[Any, ...], durable: bool) -> None:
        await self._write_all([(sql, args)], durable)

    async def _write_all(self, writes: list[tuple[str, tuple[Any, ...]]], durable: bool) -> None:
        """``writes`` (statements and their arguments) in one transaction."""
        statements = [(self._sql(sql), args) for sql, args in writes]

        def op(cur: Any) -> None:
            for statement, args in statements:
                cur.execute(statement, args)

        if self.inline:
            if not durable:
                self._pending.append(op)
                if len(self._pending) == 1:
                    asyncio.get_running_loop().call_later(self.defer_s, self._flush_pending)
                return
            deferred = self._take_pending()
            try:
                self._commit_inline([*deferred, op])
            except DSecError:
                self._keep(deferred)
                raise
            return
        if durable:
            await self._redo_failed(op)
            return
        self._unsettled += 1
        self._writer.submit(op, True).add_done_callback(  # type: ignore[union-attr]  # wait=True: a future
            functools.partial(self._settled, op))

    def _settled(self, op: _Op, future: asyncio.Future[None]) -> None:
        self._unsettled -= 1
        if not future.cancelled() and future.exception() is not None:
            self._failed.append(op)  # its caller has its answer already: the next one to wait gets the error
            log.warning("trajectory log: a deferred write failed (%s); it is applied again with the next write",
                        future.exception())

    async def _redo_failed(self, op: _Op | None = None) -> None:
        """Commit the deferred writes whose batch failed, then ``op``, in one transaction; on failure they are
        kept (up to :data:`_MAX_KEPT`) and the caller gets the error."""
        ops, self._failed = self._failed, []
        if not ops and op is None:
            return
        done = [*ops, op] if op is not None else ops

        def again(cur: Any) -> None:
            for each in done:
                each(cur)

        try:
            await self._writer.submit(again if ops else done[0], True)  # type: ignore[misc]  # wait=True: a future
        except BaseException:
            self._failed[:0] = ops
            self._cap(self._failed)
            raise

    def _take_pending(self) -> list[_Op]:
        ops, self._pending = self._pending, []
        return ops

    def _keep(self, ops: list[_Op]) -> None:
        """Deferred writes whose commit failed go back before the ones queued since, for the next commit (the
        watchdog's probe makes one every few seconds): a call's answer is not lost to an outage of the store.
        Past :data:`_MAX_KEPT` the oldest are dropped; those calls read as interrupted after a restart."""
        self._pending[:0] = ops
        self._cap(self._pending)

    def _cap(self, kept: list[_Op]) -> None:
        """Drop the oldest of ``kept`` past :data:`_MAX_KEPT` (those calls read as interrupted after a restart)."""
        if len(kept) > _MAX_KEPT:
            dropped = len(kept) - _MAX_KEPT
            del kept[:dropped]
            log.error("trajectory log: %d deferred writes dropped while %s takes no write; those calls read as "
                      "interrupted after a restart", dropped, self.where)

    def _commit_inline(self, ops: list[_Op]) -> None:
        try:
            self._apply(ops)
        except DSecError:
            raise
        except Exception as exc:
            raise SandboxError(f"writing the trajectory log ({self.where}) failed: {type(exc).__name__}: {exc}",
                               component="trajectory-store") from exc
        self._inline_commits += 1
        self._inline_writes += len(ops)

    def _commit_pending(self) -> None:
        """Commit the deferred inline writes; on failure they are kept for the next commit and this raises."""
        ops = self._take_pending()
        if ops:
            try:
                self._commit_inline(ops)
            except DSecError:
                self._keep(ops)
                raise

    def _flush_pending(self) -> None:
        """Commit the deferred inline writes (a loop callback: a failure is logged, not raised; the next caller
        that waits on the log gets it)."""
        try:
            self._commit_pending()
        except DSecError as exc:
            log.error("trajectory log: %d deferred writes wait for the store (%s)", len(self._pending), exc)

    async def barrier(self) -> None:
        """Return once every write issued so far is committed (deferred ones included); a deferred write that
        cannot be committed is this caller's error (and is kept for the next commit)."""
        if self.inline:
            self._commit_pending()
            return
        if self._unsettled:
            await self._writer.submit(lambda cur: None, True)  # type: ignore[misc]  # FIFO: all before it
        await self._redo_failed()

    async def probe(self, node: str) -> str | None:
        """None if a durable write succeeds now, else why not (one small upsert; the daemon's watchdog asks)."""
        try:
            await self._write("INSERT INTO dsec_health (node, at) VALUES (?, ?) ON CONFLICT (node) DO UPDATE SET "
                              "at = excluded.at", (node, time.time()), True)
        except DSecError as exc:
            return exc.message
        return None

    async def put_entry(self, name: str, entry: Entry, *, durable: bool = True) -> None:
        """Insert or replace call ``entry.seq``; with ``durable`` return only once it is committed."""
        await self._write(_UPSERT_CALL, entry.row(name), durable)

    async def put_binding(self, binding: Binding) -> None:
        """Insert or replace a trajectory's binding, durably."""
        now = time.time()
        await self._write(_UPSERT_BINDING, (
            binding.name, binding.sandbox_id, binding.spec, binding.checkpoint, binding.checkpoint_seq,
            binding.created_at, now), True)

    async def end(self, name: str) -> None:
        """Mark a trajectory ended (re-opening its name starts a new one), durably."""
        await self._write("INSERT INTO dsec_ended (name, at) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET "
                          "at = excluded.at", (name, time.time()), True)

    async def delete(self, name: str) -> None:
        """Delete a trajectory: its binding, its calls and its end mark, in one transaction, durably."""
        await self._write_all([(f"DELETE FROM {table} WHERE name = ?", (name,))
                               for table in ("dsec_calls", "dsec_ended", "dsec_trajectories")], True)

    async def truncate(self, name: str, length: int) -> None:
        """Drop calls ``>= length`` (used when a fork copies a prefix), durably."""
        await self._write("DELETE FROM dsec_calls WHERE name = ? AND seq >= ?", (name, length), True)

    async def copy_prefix(self, source: str, target: str, length: int) -> None:
        """Copy calls ``< length`` of ``source`` into ``target`` (a fork's shared history), durably; applied
        again after a lost commit acknowledgement (PostgreSQL's retry) it copies nothing twice."""
        await self._write(
            f"INSERT INTO dsec_calls (name, {_ENTRY_COLUMNS}) SELECT CAST(? AS TEXT), {_ENTRY_COLUMNS} FROM dsec_calls "
            "WHERE name = ? AND seq < ? ON CONFLICT (name, seq) DO NOTHING", (target, source, length), True)

    # -- reads ----------------------------------------------------------------------------------------

    async def get_binding(self, name: str) -> Binding | None:
        """A trajectory's binding, or None if the trajectory was never opened."""
        rows = await self._read(
            "SELECT name, spec, sandbox_id, checkpoint, checkpoint_seq, created_at FROM dsec_trajectories "
            "WHERE name = ?", (name,))
        if not rows:
            return None
        n, spec, sandbox_id, checkpoint, checkpoint_seq, created = rows[0]
        return Binding(str(n), str(spec), sandbox_id, checkpoint, int(checkpoint_seq), float(created))

    async def ended_at(self, name: str) -> float | None:
        """When a trajectory was ended, or None while it goes on."""
        rows = await self._read("SELECT at FROM dsec_ended WHERE name = ?", (name,))
        return float(rows[0][0]) if rows else None

    async def summaries(self, prefix: str = "", limit: int = 1000) -> list[Summary]:
        """Trajectories whose name starts with ``prefix``, by name, at most ``limit``."""
        rows = await self._read(
            "SELECT t.name, t.spec, t.sandbox_id, t.checkpoint, t.checkpoint_seq, t.created_at, t.updated_at, e.at, "
            "(SELECT COUNT(*) FROM dsec_calls c WHERE c.name = t.name) FROM dsec_trajectories t "
            "LEFT JOIN dsec_ended e ON e.name = t.name WHERE substr(t.name, 1, ?) = ? ORDER BY t.name LIMIT ?",
            (len(prefix), prefix, limit))
        return [Summary(Binding(str(n), str(spec), sandbox_id, checkpoint, int(seq), float(created)), int(calls),
                        float(updated), None if ended is None else float(ended))
                for n, spec, sandbox_id, checkpoint, seq, created, updated, ended, calls in rows]

    async def checkpoints(self, name: str) -> list[str]:
        """Snapshot ids a trajectory's log took (its logged ``snapshot`` calls), oldest first."""
        rows = await self._read("SELECT response FROM dsec_calls WHERE name = ? AND op = 'snapshot' AND "
                                "status = 'done' ORDER BY seq", (name,))
        found = [json.loads(r[0]) for r in rows if r[0] is not None]
        return [snap for snap in found if isinstance(snap, str)]

    async def used_elsewhere(self, snap_id: str, name: str) -> bool:
        """True when a trajectory other than ``name`` has ``snap_id`` in its log or as its checkpoint (a branch
        shares the calls, and so the checkpoints, before its branch point)."""
        rows = await self._read(
            "SELECT 1 FROM dsec_calls WHERE op = 'snapshot' AND response = ? AND name <> ? UNION ALL "
            "SELECT 1 FROM dsec_trajectories WHERE checkpoint = ? AND name <> ?",
            (json.dumps(snap_id), name, snap_id, name))
        return bool(rows)

    async def entries(self, name: str, start: int = 0, limit: int = 1_000_000) -> list[Entry]:
        """Calls ``start .. start+limit-1`` of a trajectory, in order."""
        rows = await self._read(
            f"SELECT {_ENTRY_COLUMNS} FROM dsec_calls WHERE name = ? AND seq >= ? ORDER BY seq LIMIT ?",
            (name, start, limit))
        return [Entry.from_row(r) for r in rows]

    async def index(self, name: str) -> list[tuple[int, str, str, str]]:
        """``(seq, op, digest, status)`` of every call of a trajectory, in order: what matching needs, without
        the requests and responses (up to 2 MiB of stored output per call)."""
        rows = await self._read("SELECT seq, op, digest, status FROM dsec_calls WHERE name = ? ORDER BY seq", (name,))
        return [(int(seq), str(op), str(digest), str(status)) for seq, op, digest, status in rows]

    async def entry(self, name: str, seq: int) -> Entry:
        """Call ``seq`` of a trajectory (one the log holds: a missing one is a :class:`SandboxError` naming it)."""
        rows = await self._read(f"SELECT {_ENTRY_COLUMNS} FROM dsec_calls WHERE name = ? AND seq = ?", (name, seq))
        if not rows:
            raise SandboxError(f"trajectory {name!r}: the log has no call {seq}, which it listed", trajectory=name,
                               seq=seq)
        return Entry.from_row(rows[0])

    async def _read(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        statement = self._sql(sql)
        await self.barrier()  # a read sees every write made before it (deferred responses included)
        return await asyncio.get_running_loop().run_in_executor(self._reader, self._locked_query, statement, args)

    def _locked_query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._read_lock:
            return self._query(sql, args)


class SQLiteStore(TrajectoryStore):
    """Local mode: one SQLite file in WAL mode.

    ``sync="normal"`` (default): a commit is in the OS before the caller continues, so it survives the
    death of the client or the daemon, not a host crash (which also kills the sandbox whose state those
    calls made). ``sync="full"`` fsyncs every group commit as well.

    The log holds every logged call with its output. A file it creates is 0600. ``private`` (the daemon's own
    file in its home) also gives that mode to a file that is there (and to the -wal and -shm left with it);
    otherwise (a path the operator named, perhaps shared on purpose) an existing file keeps its mode, with a
    warning if other users can read or change it or another user owns it.
    """

    def __init__(self, path: Path, sync: str = "normal", *, private: bool = True) -> None:
        super().__init__()
        if sync not in ("normal", "full"):
            raise ValueError(f"sync must be 'normal' or 'full', got {sync!r}")
        self.path = path
        self.where = str(path)
        self.sync = sync
        self.private = private
        self.inline = sync == "normal"
        self._write_conn: sqlite3.Connection | None = None
        self._read_conn: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.sync.upper()}")
        small_page_cache(conn)
        return conn

    def _prepare(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.private:
            private_database(self.path)
        else:
            self._create_or_check()
        self._write_conn = self._connect()
        for statement in _SCHEMA:
            self._write_conn.execute(statement)
        self._read_conn = self._connect()

    def _create_or_check(self) -> None:
        """A new file 0600 (SQLite's -wal and -shm files take its mode); an existing one as it is, with a warning
        if other users can read or change it (and so what a replay returns), or if another user owns it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o066:
            log.warning("trajectory log %s is mode %04o: other users can read or change every logged command and "
                        "its output (chmod 600 it unless it is shared on purpose)", self.path, mode)
        if st.st_uid != os.geteuid():
            log.warning("trajectory log %s belongs to uid %d, not to this daemon's (%d): that user can read and change "
                        "every logged command and its output", self.path, st.st_uid, os.geteuid())

    def _close(self) -> None:
        for conn in (self._write_conn, self._read_conn):
            if conn is not None:
                conn.close()
        self._write_conn = self._read_conn = None

    def _apply(self, ops: list[_Op]) -> None:
        conn = self._write_conn
        if conn is None:
            raise SandboxError("the trajectory log is closed")
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for op in ops:
                op(cur)
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._read_conn is None:
            raise SandboxError("the trajectory log is closed")
        return list(self._read_conn.execute(sql, args).fetchall())
