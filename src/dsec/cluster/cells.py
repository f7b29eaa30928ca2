"""Placement authority shared by gateway replicas: nodes in cells, each cell leased to one replica, fenced.

Owns the replicas' shared bookkeeping in PostgreSQL and nothing else:

- **Cells.** Every node belongs to one of ``cells`` cells (a hash of its name). A replica places only on
  the nodes of cells it holds a lease on (``dsec_cluster_cells``: owner, epoch, expiry by the server's
  clock). It renews its leases every ``ttl / 4`` seconds and believes one only until ``ttl`` minus a
  margin after the renewal was *sent*, by its own monotonic clock, so it stops before the server would
  let another replica take the cell. Live replicas (``dsec_cluster_replicas``, heartbeats) share the cells
  evenly: one short of its share takes a free or expired cell (its epoch goes up by one), one over its
  share hands a cell back. A replica started again under the same name frees its previous instance's
  cells at once (that instance is gone: the name is its listen address unless set otherwise).
- **Fencing.** A cell's epoch is its fencing token: every create a replica sends carries
  ``X-DSec-Fence: <cell>:<epoch>``, and a node refuses one older than the newest it has seen for that cell;
  a replica that took a cell over presents the new epoch before it trusts its count of the node.
- **Quotas.** A job's live quota is split into allowances per cell (``dsec_cluster_allowances``); a
  replica places a job's sandboxes in a cell only within that cell's allowance, asks for more in chunks
  (granted only while the sum over cells stays within the quota, under a per-job advisory lock, and only
  to the cell's current owner and epoch) and gives back what it does not use. Allowances belong to cells,
  not replicas, so they move with a cell. A job's creation rate is one token bucket in the database,
  drawn in chunks.
- **Batches.** A batch is recorded ``open`` before its first create and ``done`` before it is answered,
  the latter only while its replica still holds every cell it placed in at the same epoch; a replica that
  takes a cell over marks the open batches of other replicas ``aborted`` first, and destroys their
  members in it.

It must never place a sandbox or call a node.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

from dsec.errors import BackendUnavailable

__all__ = ["CELL_SCHEMA", "CellLeases", "Lease", "cell_of"]

log = logging.getLogger(__name__)

CELL_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS dsec_cluster_replicas (
        instance TEXT PRIMARY KEY, name TEXT NOT NULL, url TEXT NOT NULL, heartbeat DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_cells (
        cell INT PRIMARY KEY, owner TEXT, epoch BIGINT NOT NULL DEFAULT 0,
        expires DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_allowances (
        cell INT NOT NULL, job TEXT NOT NULL, allowance BIGINT NOT NULL, PRIMARY KEY (cell, job))""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_buckets (
        job TEXT PRIMARY KEY, tokens DOUBLE PRECISION NOT NULL, stamp DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dsec_cluster_batches (
        id TEXT PRIMARY KEY, job TEXT NOT NULL, instance TEXT NOT NULL, count INT NOT NULL, state TEXT NOT NULL,
        cells INT[] NOT NULL, epochs BIGINT[] NOT NULL, opened DOUBLE PRECISION NOT NULL)""",
    """CREATE OR REPLACE FUNCTION dsec_now() RETURNS DOUBLE PRECISION AS
        'SELECT extract(epoch from clock_timestamp())::double precision' LANGUAGE sql VOLATILE""",
    # Grant a cell's owner (at its epoch) between p_need and p_want more of a job's quota: all of p_need or
    # nothing, while the sum of the job's allowances stays within p_max. -1: not the owner (fenced).
    """CREATE OR REPLACE FUNCTION dsec_grant(p_cell INT, p_epoch BIGINT, p_owner TEXT, p_job TEXT, p_need BIGINT,
            p_want BIGINT, p_max BIGINT) RETURNS BIGINT AS $$
        DECLARE total BIGINT; granted BIGINT;
        BEGIN
          PERFORM pg_advisory_xact_lock(7311, hashtext(p_job));
          IF NOT EXISTS (SELECT 1 FROM dsec_cluster_cells WHERE cell = p_cell AND owner = p_owner
                         AND epoch = p_epoch AND expires > dsec_now()) THEN
            RETURN -1;
          END IF;
          SELECT coalesce(sum(allowance), 0) INTO total FROM dsec_cluster_allowances WHERE job = p_job;
          granted := least(p_want, p_max - total);
          IF granted < p_need THEN RETURN 0; END IF;
          INSERT INTO dsec_cluster_allowances (cell, job, allowance) VALUES (p_cell, p_job, granted)
            ON CONFLICT (cell, job) DO UPDATE SET allowance = dsec_cluster_allowances.allowance + granted;
          RETURN granted;
        END $$ LANGUAGE plpgsql""",
    # Take up to p_want tokens (at least p_need, or none) from a job's bucket (rate p_rate/s, size p_burst).
    """CREATE OR REPLACE FUNCTION dsec_take(p_job TEXT, p_need DOUBLE PRECISION, p_want DOUBLE PRECISION,
            p_rate DOUBLE PRECISION, p_burst DOUBLE PRECISION) RETURNS DOUBLE PRECISION AS $$
        DECLARE have DOUBLE PRECISION; now DOUBLE PRECISION := dsec_now(); taken DOUBLE PRECISION;
        BEGIN
          INSERT INTO dsec_cluster_buckets (job, tokens, stamp) VALUES (p_job, p_burst, now)
            ON CONFLICT (job) DO NOTHING;
          SELECT least(p_burst, tokens + (now - stamp) * p_rate) INTO have FROM dsec_cluster_buckets
            WHERE job = p_job FOR UPDATE;
          taken := least(p_want, have);
          IF taken < p_need THEN
            UPDATE dsec_cluster_buckets SET tokens = have, stamp = now WHERE job = p_job;
            RETURN 0;
          END IF;
          UPDATE dsec_cluster_buckets SET tokens = have - taken, stamp = now WHERE job = p_job;
          RETURN taken;
        END $$ LANGUAGE plpgsql""",
]


def cell_of(node: str, cells: int) -> int:
    """The cell a node belongs to (the same for every replica)."""
    return zlib.crc32(node.encode()) % cells


@dataclass(frozen=True)
class Lease:
    """A cell this replica may place in until ``deadline`` (its own monotonic clock)."""

    cell: int
    epoch: int
    deadline: float

    @property
    def fence(self) -> str:
        """The ``X-DSec-Fence`` header value of creates placed under this lease."""
        return f"{self.cell}:{self.epoch}"


class CellLeases:
    """This replica's leases, heartbeat, allowances, token draws and batch records (see the module docstring)."""

    def __init__(self, dsn: str, *, name: str, instance: str, url: str, cells: int, ttl: float = 8.0) -> None:
        if cells < 1:
            raise ValueError(f"cells must be at least 1, got {cells}")
        self.dsn, self.name, self.instance, self.url = dsn, name, instance, url
        self.cells, self.ttl = cells, ttl
        self.margin = min(1.0, ttl / 4)
        """A lease is believed until ``ttl - margin`` after its renewal was sent."""
        self.leases: dict[int, Lease] = {}
        self.peers: dict[str, str] = {}
        """Live replica instance -> URL, as last read (this one included)."""
        self.draining: set[int] = set()
        """Cells this replica is handing back (no new placements; released once their creates finished)."""
        # Two connections: renewals never wait behind a burst of grants and batch records.
        self._conns: dict[str, Any] = {}
        self._locks = {"beat": asyncio.Lock(), "work": asyncio.Lock()}

    async def _db(self, which: str = "work") -> Any:
        conn = self._conns.get(which)
        if conn is None or conn.closed:
            import psycopg

            try:
                conn = self._conns[which] = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True,
                                                                                  connect_timeout=5)
            except psycopg.OperationalError as exc:
                raise BackendUnavailable(f"the gateway's PostgreSQL does not answer: {exc}") from exc
        return conn

    async def _run(self, sql: str, params: tuple[Any, ...] = (), which: str = "work") -> list[tuple[Any, ...]]:
        import psycopg

        async with self._locks[which]:
            conn = await self._db(which)
            try:
                cur = await conn.execute(sql, params)
                return list(await cur.fetchall()) if cur.description else []
            except psycopg.OperationalError as exc:
                await conn.close()
                self._conns.pop(which, None)
                raise BackendUnavailable(f"the gateway's PostgreSQL does not answer: {exc}") from exc

    async def setup(self) -> None:
        """Create the tables and every cell's row (idempotent, serialised between replicas)."""
        import psycopg

        async with self._locks["work"]:
            conn = await self._db()
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(7312)")
                for statement in CELL_SCHEMA:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO dsec_cluster_cells (cell) SELECT generate_series(0, %s - 1) "
                                   "ON CONFLICT (cell) DO NOTHING", (self.cells,))
                cur = await conn.execute("SELECT count(*) FROM dsec_cluster_cells")
                row = await cur.fetchone()
                # An earlier instance of this replica (same name) is gone: its listen address is ours now.
                # Its cells are freed at once rather than after its leases run out, during which this
                # instance would hold no cell and answer for none of the sandboxes it served before.
                await conn.execute(
                    """WITH old AS (DELETE FROM dsec_cluster_replicas WHERE name = %s AND instance <> %s
                                    RETURNING instance)
                       UPDATE dsec_cluster_cells SET owner = NULL, expires = 0
                       WHERE owner IN (SELECT instance FROM old)""", (self.name, self.instance))
            if row is not None and int(row[0]) != self.cells:
                raise psycopg.errors.DataException(
                    f"the database has {row[0]} cells and this gateway was started with --cells {self.cells}: every "
                    "replica of a cluster must use the same count")

    # -- leases -----------------------------------------------------------------------------------------------

    def lease(self, cell: int) -> Lease | None:
        """The lease on ``cell`` if this replica holds one that is still good now."""
        lease = self.leases.get(cell)
        return lease if lease is not None and time.monotonic() < lease.deadline else None

    async def owner(self, cell: int) -> tuple[str, str | None] | None:
        """The replica that owns ``cell`` now, read afresh (its instance and URL); None while no replica does
        (handed back, or its owner's lease ran out, and not taken yet)."""
        rows = await self._run(
            """SELECT c.owner, r.url FROM dsec_cluster_cells c LEFT JOIN dsec_cluster_replicas r ON r.instance = c.owner
               WHERE c.cell = %s AND c.owner IS NOT NULL AND c.expires > dsec_now()""", (cell,))
        return (str(rows[0][0]), None if rows[0][1] is None else str(rows[0][1])) if rows else None

    async def tick(self) -> tuple[set[int], set[int]]:
        """Heartbeat, renew, and take or hand back cells towards an even share; (cells gained, cells lost)."""
        sent = time.monotonic()
        rows = await self._run(
            """WITH beat AS (INSERT INTO dsec_cluster_replicas (instance, name, url, heartbeat)
                             VALUES (%s, %s, %s, dsec_now())
                             ON CONFLICT (instance) DO UPDATE SET heartbeat = dsec_now(), url = EXCLUDED.url)
               UPDATE dsec_cluster_cells SET expires = dsec_now() + %s
               WHERE owner = %s AND cell = ANY(%s) RETURNING cell, epoch""",
            (self.instance, self.name, self.url, self.ttl, self.instance, list(self.leases)), "beat")
        kept = {int(cell): Lease(int(cell), int(epoch), sent + self.ttl - self.margin) for cell, epoch in rows}
        lost = set(self.leases) - set(kept)
        self.draining &= set(kept)
        peers = await self._run("SELECT instance, url FROM dsec_cluster_replicas WHERE heartbeat > dsec_now() - %s",
                                (self.ttl,), "beat")
        self.peers = {str(i): str(u) for i, u in peers}
        share = math.ceil(self.cells / max(1, len(self.peers)))
        gained: set[int] = set()
        if len(kept) < share:
            sent = time.monotonic()
            rows = await self._run(
                """UPDATE dsec_cluster_cells SET owner = %s, epoch = epoch + 1, expires = dsec_now() + %s
                   WHERE cell IN (SELECT cell FROM dsec_cluster_cells WHERE owner IS NULL OR expires < dsec_now()
                                  ORDER BY cell LIMIT %s FOR UPDATE SKIP LOCKED)
                   RETURNING cell, epoch""", (self.instance, self.ttl, share - len(kept)), "beat")
            for cell, epoch in rows:
                kept[int(cell)] = Lease(int(cell), int(epoch), sent + self.ttl - self.margin)
                gained.add(int(cell))
        elif len(kept) > share and not self.draining:
            self.draining.add(max(kept))  # one at a time, the gateway releases it once its creates are done
            log.info("%d replica(s) share %d cells: handing cell %d back (this replica holds %d)", len(self.peers),
                     self.cells, max(kept), len(kept))
        self.leases = kept
        return gained, lost

    async def release(self, cell: int) -> None:
        """Hand ``cell`` back (its creates are done): another replica may take it at once."""
        lease = self.leases.pop(cell, None)
        self.draining.discard(cell)
        if lease is not None:
            await self._run("UPDATE dsec_cluster_cells SET owner = NULL, expires = 0 WHERE cell = %s AND owner = %s "
                            "AND epoch = %s", (cell, self.instance, lease.epoch))

    async def leave(self) -> None:
        """Hand every cell back and drop the heartbeat (a graceful stop)."""
        for cell in list(self.leases):
            await self.release(cell)
        await self._run("DELETE FROM dsec_cluster_replicas WHERE instance = %s", (self.instance,))

    # -- quotas -----------------------------------------------------------------------------------------------

    async def allowances(self, cell: int) -> dict[str, int]:
        """Job -> allowance in ``cell``."""
        return {str(j): int(a) for j, a in
                await self._run("SELECT job, allowance FROM dsec_cluster_allowances WHERE cell = %s", (cell,))}

    async def grant(self, cell: int, job: str, need: int, want: int, max_live: int) -> int:
        """At least ``need`` (up to ``want``) more of ``job``'s quota in ``cell``; 0 when the quota has no room,
        -1 when this replica no longer owns the cell."""
        lease = self.lease(cell)
        if lease is None:
            return -1
        rows = await self._run("SELECT dsec_grant(%s, %s, %s, %s, %s, %s, %s)",
                               (cell, lease.epoch, self.instance, job, need, want, max_live))
        return int(rows[0][0])

    async def shrink(self, cell: int, job: str, amount: int) -> bool:
        """Give ``amount`` of ``job``'s allowance in ``cell`` back (fenced: only while owning the cell);
        whether it was given back."""
        lease = self.lease(cell)
        if lease is None:
            return False
        rows = await self._run("""UPDATE dsec_cluster_allowances SET allowance = allowance - %s
                                  WHERE cell = %s AND job = %s AND allowance >= %s
                                  AND EXISTS (SELECT 1 FROM dsec_cluster_cells WHERE cell = %s AND owner = %s
                                              AND epoch = %s) RETURNING allowance""",
                               (amount, cell, job, amount, cell, self.instance, lease.epoch))
        return bool(rows)

    async def take(self, job: str, need: float, want: float, rate: float, burst: float) -> float:
        """Tokens drawn from ``job``'s bucket: at least ``need`` (up to ``want``), or 0."""
        rows = await self._run("SELECT dsec_take(%s, %s, %s, %s, %s)", (job, need, want, rate, burst))
        return float(rows[0][0])

    # -- batches ----------------------------------------------------------------------------------------------

    async def open_batch(self, batch: str, job: str, count: int, cells: dict[int, int]) -> None:
        """Record a batch before its first create (``cells``: cell -> epoch it is placed under)."""
        await self._run("""INSERT INTO dsec_cluster_batches (id, job, instance, count, state, cells, epochs, opened)
                           VALUES (%s, %s, %s, %s, 'open', %s, %s, dsec_now())""",
                        (batch, job, self.instance, count, list(cells), list(cells.values())))

    async def close_batch(self, batch: str, done: bool) -> bool:
        """Mark a batch done (only while this replica holds every cell it used, at the same epoch) or
        aborted; whether it is now in that state."""
        if not done:
            await self._run("UPDATE dsec_cluster_batches SET state = 'aborted' WHERE id = %s AND state = 'open'",
                            (batch,))
            return True
        rows = await self._run(
            """UPDATE dsec_cluster_batches b SET state = 'done' WHERE id = %s AND state = 'open'
               AND NOT EXISTS (SELECT 1 FROM unnest(b.cells, b.epochs) AS u(cell, epoch)
                               LEFT JOIN dsec_cluster_cells c ON c.cell = u.cell
                               WHERE c.owner IS DISTINCT FROM %s OR c.epoch <> u.epoch)
               RETURNING id""", (batch, self.instance))
        return bool(rows)

    async def abort_foreign(self, cell: int) -> set[str]:
        """Mark every open batch of another replica that placed in ``cell`` aborted (this replica just took
        the cell over); the ids of those and of the other replicas' batches aborted before: their members in
        the cell are this replica's to destroy."""
        rows = await self._run("""UPDATE dsec_cluster_batches SET state = 'aborted'
                                  WHERE state IN ('open', 'aborted') AND instance <> %s AND %s = ANY(cells)
                                  RETURNING id""", (self.instance, cell))
        return {str(r[0]) for r in rows}

    async def forget_batches(self, age: float = 3600.0) -> None:
        """Drop batch records older than ``age`` seconds (their outcome no longer matters to anyone)."""
        await self._run("DELETE FROM dsec_cluster_batches WHERE opened < dsec_now() - %s", (age,))

    async def batch_state(self, batch: str) -> str | None:
        """``open``, ``done`` or ``aborted``; None for an unknown batch."""
        rows = await self._run("SELECT state FROM dsec_cluster_batches WHERE id = %s", (batch,))
        return str(rows[0][0]) if rows else None

    async def aclose(self) -> None:
        for conn in self._conns.values():
            await conn.close()
