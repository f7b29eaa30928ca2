"""The tests' throwaway PostgreSQL server lives in :mod:`dsec.testing.postgres` (the cluster bench uses it too)."""

from __future__ import annotations

from collections.abc import Iterator

from conftest import missing
from container_support import wait_until
from dsec.testing.postgres import PgServer, pg_bin, postgres_server

__all__ = ["PgServer", "pg_bin", "postgres_or_missing", "postgres_server"]


def postgres_or_missing() -> Iterator[PgServer]:
    """A module fixture's body: a server for the module, or the test reported missing its PostgreSQL."""
    try:
        with postgres_server() as server:
            yield server
    except RuntimeError as exc:
        if "not installed" in str(exc):
            missing(str(exc))
        raise


def read_only(pg: PgServer, on: bool) -> None:
    """Turn the whole server read-only (or back) for every session, the daemon's open ones too (a reload)."""
    import psycopg

    value = "on" if on else "off"
    # This session's own override lets it turn the setting off again once it is on.
    with psycopg.connect(pg.dsn, autocommit=True, options="-c default_transaction_read_only=off") as conn:
        conn.execute(f"ALTER SYSTEM SET default_transaction_read_only = {value}")
        conn.execute("SELECT pg_reload_conf()")
    # pg_reload_conf only signals the postmaster. Once a new session starts with the value, the postmaster has
    # reloaded and signalled every backend, and each applies it before its next command.
    def applied() -> bool:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            row = conn.execute("SHOW default_transaction_read_only").fetchone()
        return row is not None and row[0] == value

    assert wait_until(applied, timeout=30), f"the server still lacks default_transaction_read_only={value}"
