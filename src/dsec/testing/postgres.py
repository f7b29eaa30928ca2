"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` + ``pg_ctl`` in a temporary directory.

It listens on a free loopback port and a unix socket in its own directory, trusts local connections,
and is stopped (immediately) and deleted on exit. As root it runs as the ``postgres`` user, since
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec._ports import free_port

__all__ = ["PgServer", "pg_bin", "postgres_server"]


def pg_bin() -> Path | None:
    """Directory of initdb/pg_ctl (Debian keeps them out of PATH), or None when PostgreSQL is absent."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return versions[-1].parent if versions else None


@dataclass
class PgServer:
    bindir: Path
    base: Path
    port: int
    user: str | None

    @property
    def dsn(self) -> str:
        return f"postgresql://dsec@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """The postmaster's process id (its children are the server's backends), None when it is not running."""
        try:
            return int((self.base / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _ctl(self, *args: str) -> None:
        cmd = [str(self.bindir / "pg_ctl"), "-D", str(self.base / "data"), "-l", str(self.base / "pg.log"), *args]
        proc = subprocess.run(cmd, user=self.user, capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0:
            log = (self.base / "pg.log").read_text() if (self.base / "pg.log").exists() else ""
            raise RuntimeError(f"pg_ctl {args[0]} failed: {proc.stderr}\n{log[-2000:]}")

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} -c fsync=on"
        self._ctl("-w", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-w", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def postgres_server() -> Iterator[PgServer]:
    """A running server; ``RuntimeError`` if PostgreSQL is not installed (callers skip or fail)."""
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql (./scripts/setup)")
    base = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        entry = pwd.getpwnam(user)
        os.chown(base, entry.pw_uid, entry.pw_gid)
    server = PgServer(bindir, base, free_port(), user)
    try:
        subprocess.run([str(bindir / "initdb"), "-D", str(base / "data"), "-U", "dsec", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], user=user, capture_output=True, check=True, timeout=120)
        server.start()
        try:
            yield server
        finally:
            with contextlib.suppress(RuntimeError):
                server.stop("immediate")
    finally:
        shutil.rmtree(base, ignore_errors=True)
