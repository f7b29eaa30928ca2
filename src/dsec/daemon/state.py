"""Durable sandbox records: one row per sandbox in a SQLite database at ``Settings.state_db``.

Owns the on-disk format of :class:`~dsec.models.SandboxRecord` and nothing else: it never talks to
backends, never decides what a record means, and never raises on a corrupt record or database (a daemon
that cannot start because one record is damaged would orphan every other sandbox).

One database, not one file per record: a pooled create -> exec -> destroy writes its record four times and
removes it once, and as files each write was a new inode and a rename over the old one (~0.1-0.5 ms of the
event loop's time on ext4, most of it allocating and freeing inodes) where a row costs ~10 us. The database
is in WAL mode with ``synchronous=NORMAL``: a commit survives the daemon being killed (it is in the WAL, in
the page cache) and a host crash cannot corrupt the file, only lose the last commits, and after a host crash
every sandbox is dead anyway (``cleanup_orphans`` reclaims what is left). Records of a daemon from before the
database (``<id>.json`` files under ``Settings.legacy_state_dir``) are moved into it at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from dsec._sqlite import private_database, small_page_cache
from dsec.models import SandboxRecord

__all__ = ["StateStore"]

log = logging.getLogger(__name__)

# Ids name things on the host (cgroups, mounts, files): anything else is refused.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

_SCHEMA = """
create table if not exists records (id text primary key, data text not null) without rowid;
create table if not exists corrupt (id text not null, data text not null, error text not null, at real not null);
"""


def _check_id(sandbox_id: str) -> str:
    if not _ID_RE.match(sandbox_id) or ".." in sandbox_id:
        raise ValueError(f"not a valid sandbox id for a record: {sandbox_id!r}")
    return sandbox_id


def _parse(sandbox_id: str, data: str) -> SandboxRecord:
    """The record stored under ``sandbox_id``; ValidationError or ValueError (another sandbox's) if it is not."""
    record = SandboxRecord.model_validate_json(data)
    if record.id != sandbox_id:
        raise ValueError(f"record id {record.id!r} does not match its key {sandbox_id!r}")
    return record


class StateStore:
    """Reads and writes sandbox records atomically in one database (opened at first use).

    ``read_only`` opens an existing database for reading alone (a tool or test looking at a running daemon's
    records): nothing is created, imported or moved, and corrupt rows are only skipped.
    """

    BUSY_TIMEOUT_S = 2.0
    """How long a call waits for another process's lock on the database (the daemon's calls run on its event
    loop, which stands still meanwhile): then ``sqlite3.OperationalError`` ("database is locked")."""

    def __init__(self, path: Path, legacy_dir: Path | None = None, *, read_only: bool = False) -> None:
        self.path = path
        self.legacy_dir = None if read_only else legacy_dir
        self.read_only = read_only
        self._db: sqlite3.Connection | None = None
        self._closed = False
        # The engine writes from the event loop; a lock keeps any other thread's call whole.
        self._lock = threading.Lock()

    @classmethod
    def peek(cls, path: Path) -> dict[str, SandboxRecord]:
        """Every readable record of the database at ``path`` by id, read-only (``{}`` while there is none): what
        a tool or a test sees of a running daemon's records, changing nothing."""
        if not path.exists():
            return {}
        store = cls(path, read_only=True)
        try:
            return {record.id: record for record in store.load_all()}
        finally:
            store.close()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            if self._closed:
                log.warning("sandbox record database %s used after close; opened again", self.path)
                self._closed = False
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        if self.read_only:
            return self._connect()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_database(self.path)  # records hold the sandboxes' environments
        try:
            return self._connect()
        except sqlite3.DatabaseError as exc:
            # Only a file that is no database, or a damaged one: a lock held by another process, a full disk
            # or an I/O error is raised (the daemon then does not start) -- moving the file aside would make
            # the next start destroy every live sandbox as an orphan.
            if exc.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{secrets.token_hex(3)}")
            log.error("sandbox record database %s is unreadable (%s); moved to %s, starting an empty one: "
                      "the sandboxes it named are cleaned up as orphans", self.path, exc, aside)
            for suffix in ("", "-wal", "-shm"):
                src = self.path.with_name(self.path.name + suffix)
                if src.exists():
                    os.replace(src, aside.with_name(aside.name + suffix))
            private_database(self.path)
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:  # an existing database only, opened read-only: no pragma, no schema
            db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                                 check_same_thread=False, timeout=self.BUSY_TIMEOUT_S)
        else:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                 timeout=self.BUSY_TIMEOUT_S)
        try:
            small_page_cache(db)
            if not self.read_only:
                db.execute("pragma journal_mode=wal")
                db.execute("pragma synchronous=normal")
                db.executescript(_SCHEMA)
            db.execute("select count(*) from records").fetchone()  # a damaged file fails here, not at a save
        except BaseException:
            db.close()
            raise
        return db

    def save(self, record: SandboxRecord) -> None:
        """Write (or replace) a record atomically: readers see the old or the new one, never half of one."""
        data = record.model_dump_json()
        with self._lock:
            self._conn().execute("insert into records (id, data) values (?, ?) "
                                 "on conflict (id) do update set data = excluded.data", (_check_id(record.id), data))

    def load(self, sandbox_id: str) -> SandboxRecord | None:
        """One record, or None if absent or unreadable."""
        with self._lock:
            row = self._conn().execute("select data from records where id = ?", (_check_id(sandbox_id),)).fetchone()
        if row is None:
            return None
        try:
            return _parse(sandbox_id, row[0])
        except (ValidationError, ValueError):
            log.exception("cannot read the record of sandbox %s", sandbox_id)
            return None

    def ids(self) -> list[str]:
        """The ids of every record, sorted."""
        with self._lock:
            return [r[0] for r in self._conn().execute("select id from records order by id")]

    def load_all(self) -> list[SandboxRecord]:
        """Every readable record, sorted by id. Corrupt ones are logged and moved to the ``corrupt`` table;
        records of an older daemon's files (``legacy_dir``) are moved in first."""
        self._import_legacy()
        records: list[SandboxRecord] = []
        with self._lock:
            db = self._conn()
            rows = db.execute("select id, data from records order by id").fetchall()
            for sandbox_id, data in rows:
                try:
                    record = _parse(sandbox_id, data)
                except (ValidationError, ValueError) as exc:
                    if not self.read_only:
                        self._move_corrupt(db, sandbox_id, data, exc)
                    continue
                records.append(record)
        return records

    def _move_corrupt(self, db: sqlite3.Connection, sandbox_id: str, data: str, exc: Exception) -> None:
        """Move one unreadable row to the ``corrupt`` table (in one transaction); a failure to is logged and the
        row stays (a corrupt record never keeps the others from loading)."""
        try:
            with db:  # commits the explicit transaction below, or rolls it back
                db.execute("begin")
                db.execute("insert into corrupt values (?, ?, ?, ?)", (sandbox_id, data, str(exc), time.time()))
                db.execute("delete from records where id = ?", (sandbox_id,))
        except sqlite3.Error:
            log.exception("corrupt record of sandbox %s (%s): cannot move it to the corrupt table of %s",
                          sandbox_id, exc, self.path)
            return
        log.error("corrupt record of sandbox %s (%s); moved to the corrupt table of %s", sandbox_id, exc, self.path)

    def _import_legacy(self) -> None:
        """Move ``<id>.json`` records of a daemon from before the database into it (the file goes once its row is
        written); unreadable ones are renamed ``*.corrupt`` and left there, as that daemon did."""
        if self.legacy_dir is None or not self.legacy_dir.is_dir():
            return
        for path in sorted(self.legacy_dir.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                # Left by a daemon killed between write and replace: the old record (if any) is intact.
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            try:
                record = SandboxRecord.model_validate_json(path.read_bytes())
                if f"{record.id}.json" != path.name:
                    raise ValueError(f"record id {record.id!r} does not match its file name")
                self.save(record)
            except (OSError, ValidationError, ValueError) as exc:
                aside = path.with_name(path.name + ".corrupt")
                log.error("corrupt sandbox record %s (%s); moved to %s", path, exc, aside)
                try:
                    os.replace(path, aside)
                except OSError:
                    log.exception("cannot move corrupt record %s aside", path)
                continue
            path.unlink(missing_ok=True)
            log.info("sandbox record %s moved into %s", path, self.path)
        with contextlib.suppress(OSError):
            self.legacy_dir.rmdir()  # only once empty (corrupt files stay for a person to look at)

    def delete(self, sandbox_id: str) -> None:
        """Remove a record; absent records are fine."""
        with self._lock:
            self._conn().execute("delete from records where id = ?", (_check_id(sandbox_id),))

    def close(self) -> None:
        """Close the database; a later call opens it again, with a warning in the log."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
                self._closed = True
