"""The tests' throwaway PostgreSQL server lives in :mod:`dsec.testing.postgres` (the cluster bench uses it too)."""

from dsec.testing.postgres import PgServer, pg_bin, postgres_server

__all__ = ["PgServer", "pg_bin", "postgres_server"]
