"""The tests' throwaway PostgreSQL server lives in :mod:`dsec.testing.postgres` (the cluster bench uses it too)."""

from __future__ import annotations

from collections.abc import Iterator

from conftest import missing
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

    # This session's own override lets it turn the setting off again once it is on.
    with psycopg.connect(pg.dsn, autocommit=True, options="-c default_transaction_read_only=off") as conn:
        conn.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
        conn.execute("SELECT pg_reload_conf()")
