"""One gateway replica's placement authority: the nodes it may place on, its fences, allowances and batches.

Owns the replica's side of :mod:`dsec.cluster.cells`: which cells (hence nodes) it holds now, the fence
header of a create sent to a node, the per-cell allowances of each job's live quota with the sandboxes
placed but not yet recorded (so two decisions in flight cannot both spend the same allowance), the rate
tokens drawn from each job's shared bucket, and the open/done/aborted record of each batch. Without
leases (one gateway over a fixed node list, as in unit tests) it allows every node and keeps quotas in
the placer alone.

It must never call a node: the gateway does, and tells it what happened.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping

from dsec.cluster.cells import CellLeases, cell_of
from dsec.cluster.placement import JobQuota, Placer
from dsec.cluster.records import Records
from dsec.daemon.fence import FENCE_HEADER
from dsec.errors import BackendUnavailable, QuotaExceeded

__all__ = ["FENCE_HEADER", "Authority"]

log = logging.getLogger(__name__)

_TOKEN_CHUNK = 0.1
"""Rate tokens are drawn from a job's shared bucket this many seconds' worth at a time (at least what a
decision needs), so single creates draw rarely."""


def _headroom(used: int, max_live: int) -> int:
    """Quota a cell holds beyond what it uses: enough that single creates rarely ask the database, little
    enough that another replica is not kept waiting for it. Capped at an eighth of the job's quota: a
    small quota held as one cell's headroom would leave nothing for the job's other cells."""
    return min(max(16, used // 16), max_live // 8)


class Authority:
    """What this replica may place, and under which fences and allowances."""

    def __init__(self, leases: CellLeases | None, records: Records, placer: Placer) -> None:
        self.leases = leases
        self.records = records
        self.placer = placer
        self.allowed: dict[tuple[int, str], int] = {}
        """(cell, job) -> the allowance this replica holds in that cell."""
        self.pending: collections.Counter[tuple[int, str]] = collections.Counter()
        """(cell, job) -> sandboxes placed there and not yet recorded or given back."""
        self._granting: dict[tuple[int, str], asyncio.Lock] = {}
        self._shrinking = asyncio.Lock()
        self._settling: set[int] = set()
        self.aborted: set[str] = set()
        """Batches other replicas left unfinished, as found when taking cells over: their members are destroyed
        wherever this replica finds them."""
        if leases is not None:
            placer.local_rate = False

    @property
    def cells(self) -> int:
        return self.leases.cells if self.leases is not None else 1

    def cell(self, node: str) -> int:
        """The cell of ``node``."""
        return cell_of(node, self.leases.cells) if self.leases is not None else 0

    def mine(self, node: str) -> bool:
        """Whether this replica may place on ``node`` now."""
        if self.leases is None:
            return True
        cell = self.cell(node)
        return self.leases.lease(cell) is not None and cell not in self.leases.draining

    def fence(self, node: str) -> dict[str, str] | None:
        """The headers of a create or reconcile on ``node`` (None without leases); BackendUnavailable when
        this replica no longer holds the node's cell."""
        if self.leases is None:
            return None
        lease = self.leases.lease(self.cell(node))
        if lease is None:
            raise BackendUnavailable(f"this gateway replica no longer holds the cell of node {node} (its lease "
                                     "ran out or moved to another replica); nothing was created there", node=node,
                                     lease="lost")
        return {FENCE_HEADER: lease.fence}

    # -- quotas -----------------------------------------------------------------------------------------------

    def _quota(self, job: str) -> JobQuota:
        return self.placer.job(job).quota

    async def draw_tokens(self, job: str, count: int) -> None:
        """Before placing ``count`` of ``job``: enough creation-rate tokens in the placer's bucket, drawn
        from the job's shared bucket when short. QuotaExceeded when the bucket has too few."""
        quota = self._quota(job)
        if self.leases is None or quota.max_rate is None:
            return
        entry = self.placer.job(job)
        if count > quota.bucket or entry.tokens >= count:
            return  # the placer refuses a batch over the burst, with the reason
        need = count - entry.tokens
        got = await self.leases.take(job, need, max(need, quota.max_rate * _TOKEN_CHUNK), quota.max_rate,
                                     quota.bucket)
        if got <= 0:
            raise QuotaExceeded(f"job {job!r} may create {quota.max_rate:g} sandboxes per second; asked for {count} "
                                f"with {int(entry.tokens)} left now", job=job, max_rate=quota.max_rate,
                                requested=count)
        entry.tokens += got

    async def admit(self, job: str, counts: Mapping[str, int]) -> dict[int, int]:
        """Reserve a placement's sandboxes against ``job``'s allowances in their cells, asking the database
        for more where short; cell -> count reserved (hand it to :meth:`settle` when they are recorded or
        given back). QuotaExceeded (or BackendUnavailable for a cell no longer held) reserves nothing."""
        per_cell: collections.Counter[int] = collections.Counter()
        for node, n in counts.items():
            per_cell[self.cell(node)] += n
        quota = self._quota(job)
        if self.leases is None or quota.max_live is None:
            return dict(per_cell)
        reserved: dict[int, int] = {}
        try:
            for cell, n in per_cell.items():
                key = (cell, job)
                self.pending[key] += n
                reserved[cell] = n
                await self._cover(cell, job, quota.max_live)
        except BaseException:
            self.settle(job, reserved)
            raise
        return reserved

    async def _cover(self, cell: int, job: str, max_live: int) -> None:
        assert self.leases is not None
        key = (cell, job)
        retried = False
        # One request to the database per (cell, job) at a time: decisions in flight together wait for it and
        # see what it granted, rather than each asking for the whole shortfall.
        async with self._granting.setdefault(key, asyncio.Lock()):
            while (short := self._used(cell, job) - self.allowed.get(key, 0)) > 0:
                want = short + _headroom(self._used(cell, job), max_live)
                got = await self.leases.grant(cell, job, short, want, max_live)
                if got < 0:
                    raise BackendUnavailable(f"this gateway replica no longer holds cell {cell}; nothing was created",
                                             lease="lost", cell=cell)
                if got == 0 and not retried:
                    retried = True  # this replica's other cells may hold some of the job's quota unused
                    await self.shrink(job)
                    continue
                if got == 0:
                    raise QuotaExceeded(f"job {job!r} would have more than its quota of {max_live} live sandboxes "
                                        "across the cluster", job=job, max_live=max_live)
                self.allowed[key] = self.allowed.get(key, 0) + got

    def _used(self, cell: int, job: str) -> int:
        return self.records.live_in(cell, job) + self.pending.get((cell, job), 0)

    def settle(self, job: str, reserved: Mapping[int, int]) -> None:
        """Reserved sandboxes were recorded (they count as live now) or given back."""
        for cell, n in reserved.items():
            key = (cell, job)
            self.pending[key] -= n
            if self.pending[key] <= 0:
                del self.pending[key]

    async def load_cell(self, cell: int) -> None:
        """This replica is taking ``cell`` over: its allowances come with it. None is given back until
        :meth:`settled` (the cell's nodes are being reconciled: what they hold may count more than its rows)."""
        if self.leases is not None:
            self._settling.add(cell)
            for job, allowance in (await self.leases.allowances(cell)).items():
                self.allowed[cell, job] = allowance

    def settled(self, cell: int) -> None:
        """``cell``'s nodes are reconciled: its records count what it holds."""
        self._settling.discard(cell)

    def drop_cell(self, cell: int) -> None:
        """``cell`` went to another replica: its allowances went with it."""
        for key in [k for k in self.allowed if k[0] == cell]:
            del self.allowed[key]
        self._settling.discard(cell)

    async def shrink(self, short: str | None = None) -> None:
        """Give back the allowances this replica holds beyond what its cells use, keeping some headroom, so
        a job's quota can flow to the replicas that need it. ``short``: a job one of this replica's cells
        could not be granted more of; all of its unused allowance in the other cells is given back (waiting
        for a round in progress, which may not have)."""
        if self.leases is None or (short is None and self._shrinking.locked()):
            return
        async with self._shrinking:
            for (cell, job), allowed in list(self.allowed.items()):
                if cell in self._settling:
                    continue
                used = self._used(cell, job)
                head = 0 if job == short else _headroom(used, self._quota(job).max_live or 0)
                spare = allowed - used - head
                if spare <= 0 or (job != short and spare < min(16, max(head, 1))):
                    continue  # a little spare is not worth a round trip, unless it is what a cell is short of
                # Taken out here first: a decision made while the database is asked sees the smaller allowance.
                self.allowed[cell, job] = self.allowed.get((cell, job), 0) - spare
                if not await self.leases.shrink(cell, job, spare):
                    self.allowed[cell, job] = self.allowed.get((cell, job), 0) + spare

    # -- batches ----------------------------------------------------------------------------------------------

    async def open_batch(self, batch: str, job: str, count: int, nodes: list[str]) -> None:
        """Record a batch placed on ``nodes`` before its first create."""
        if self.leases is None:
            return
        cells = {}
        for node in nodes:
            lease = self.leases.lease(self.cell(node))
            if lease is None:
                raise BackendUnavailable(f"this gateway replica no longer holds the cell of node {node}")
            cells[lease.cell] = lease.epoch
        await self.leases.open_batch(batch, job, count, cells)

    async def close_batch(self, batch: str, done: bool) -> bool:
        """Mark the batch done (False when it could not be: another replica took one of its cells and
        aborted it) or aborted."""
        if self.leases is None:
            return True
        return await self.leases.close_batch(batch, done)
