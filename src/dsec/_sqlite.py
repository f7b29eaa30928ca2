"""SQLite files that hold what sandboxes were given or ran: created private to the daemon's user, read through
a small page cache.

Owns the file modes of those databases (records, the audit trail, the trajectory log) and the size of their
connections' page caches; must never open a connection: each store opens its own.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

__all__ = ["PAGE_CACHE_KIB", "private_database", "small_page_cache"]

PAGE_CACHE_KIB = 256
"""SQLite's page cache per connection of the daemon's databases. Its default (2 MiB) fills as a file grows past
it, and the daemon's append-mostly files (the audit trail, the trajectory log) do within minutes of load:
~2 MiB of a daemon's RSS per connection, climbing for as long as the file grows slower than that, for pages
the kernel's page cache holds anyway (a miss is a pread of a cached page)."""


def small_page_cache(db: sqlite3.Connection) -> None:
    """Cap ``db``'s page cache at :data:`PAGE_CACHE_KIB`."""
    db.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")


def private_database(path: Path) -> None:
    """Create the SQLite file ``path`` 0600 before SQLite opens it (the -wal and -shm files it makes take its
    mode); one that was there keeps its contents and gets the mode, and so do its -wal, -shm and -journal
    files if a daemon that died left them (SQLite reuses them as they are). For the daemon's databases that
    hold what sandboxes were given or ran (records, the audit trail, the home's trajectory log), in a home
    others can usually list."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):
        try:
            fd = os.open(f"{path}{suffix}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
