"""A gateway replica's cells over time: taking a cell over, losing or handing one back, the lease loop.

Owns the transitions of :mod:`dsec.cluster.cells` as the gateway sees them. Taking a cell over: its rows
are read from the database (the previous owner's records), its allowances loaded, the other replicas'
open batches that placed there aborted, each of its live nodes reconciled under the new fence (so a
create the previous owner still sends is refused, and one it sent before is counted) and followed, and
the members of aborted batches destroyed. Losing a cell (its lease ran out, or it was handed back once
its creates finished): its nodes leave placement and its rows leave memory (not the database; the next
owner reads them). The gateway is reached through :class:`CellHost`; this module never calls a node.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from dsec.cluster.authority import Authority
from dsec.cluster.cells import CellLeases
from dsec.cluster.placement import Placer
from dsec.cluster.records import LIVE, Records, Row
from dsec.cluster.state import ClusterState, NodeRow

__all__ = ["CellHost", "CellKeeper", "adopt_rows"]

log = logging.getLogger(__name__)

_CHUNK = 5_000
"""Rows loaded between two turns of the event loop while a cell is taken over."""
_RECONCILING = 64
"""Nodes reconciled at once while cells are taken over: a few at a time finish (and are placed on) within
moments, where all 2,000 of a restart at once would each finish only after every one had been asked."""


class CellHost(Protocol):
    """What the keeper needs of the gateway."""

    state: ClusterState
    placer: Placer
    records: Records
    authority: Authority
    node_rows: dict[str, NodeRow]

    def know(self, node: NodeRow) -> None:
        """Account ``node`` in placement (usable only once reconciled)."""

    async def rejoin(self, node: NodeRow) -> None:
        """Reconcile ``node`` (under this replica's fence), follow it, place on it."""

    async def release_node(self, node: str) -> None:
        """Stop following ``node`` and forget that it was reconciled."""

    async def lose_dead(self, node: NodeRow) -> None:
        """``node`` is dead: its live rows are lost."""

    async def destroy_rows(self, ids: list[str]) -> None:
        """Destroy these sandboxes on their nodes and forget them."""

    def creating_in(self, cell: int) -> int:
        """Creates in flight on the nodes of ``cell``."""


def adopt_rows(host: CellHost, rows: Iterable[tuple[str, Row]]) -> int:
    """Rows read back from the database into the records, their sandboxes into placement (one adoption
    per job, node and shape); how many were new."""
    added = [(sid, row) for sid, row in rows if sid not in host.records.rows]
    host.records.load(added)
    held: collections.Counter[tuple[str, str, Any]] = collections.Counter(
        (row.job, row.node, row.shape) for _sid, row in added if row.state in LIVE)
    for (job, node, shape), count in held.items():
        host.placer.adopt(job, node, shape, count)
        if shape.image:
            host.placer.add_image(node, shape.image)
    return len(added)


class CellKeeper:
    """The lease loop of one replica (see the module docstring)."""

    def __init__(self, host: CellHost, leases: CellLeases) -> None:
        self.host = host
        self.leases = leases
        self.takeovers = 0
        """Cells taken over (a counter)."""
        self._ticks = 0
        self._taking: dict[int, asyncio.Task[None]] = {}
        self._chores: asyncio.Task[None] | None = None
        self._reconciling = asyncio.Semaphore(_RECONCILING)
        self._reading = asyncio.Lock()

    def nodes_in(self, cell: int) -> list[str]:
        """The known nodes of ``cell``."""
        return [n for n in self.host.node_rows if self.host.authority.cell(n) == cell]

    async def tick(self) -> None:
        """One round: renew (never held up by anything else), start taking over what was gained, drop what
        was lost, hand back drained cells, give back unused allowances."""
        gained, lost = await self.leases.tick()
        for cell in sorted(lost):
            log.warning("cell %d: this replica's lease ran out or moved; its nodes leave placement here", cell)
            task = self._taking.pop(cell, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await self._drop(cell)
        for cell in sorted(gained):
            self._taking[cell] = asyncio.create_task(self.take_over(cell), name=f"dsec-cell-{cell}")
        for cell in list(self.leases.draining):
            for node in self.nodes_in(cell):
                self.host.placer.mark_dead(node)  # nothing new is placed in a cell being handed back
            if not self.host.creating_in(cell) and cell not in self._taking:
                await self._drop(cell)
                # Every row of its creates committed before the cell changes hands: the next owner reads them
                # back, and a request for one in between finds it recorded (and waits for that owner).
                await self.host.state.writer.flush()
                await self.leases.release(cell)
                log.info("cell %d handed back to share the cells with a new replica", cell)
        self._ticks += 1
        if self._chores is None or self._chores.done():  # beside the renewals, never in their way
            self._chores = asyncio.create_task(self._tidy())

    async def _tidy(self) -> None:
        try:
            await self.host.authority.shrink()
            if self._ticks % 600 == 1:
                await self.leases.forget_batches()
        except Exception:
            log.exception("giving back unused quota failed")

    def taking(self, cell: int | None = None) -> bool:
        """Whether ``cell`` (None: any cell) is being taken over: its rows may not all be in memory yet."""
        return bool(self._taking) if cell is None else cell in self._taking

    async def settle(self) -> None:
        """Until the takeovers under way are done."""
        while self._taking:
            await asyncio.gather(*self._taking.values(), return_exceptions=True)

    async def forever(self) -> None:
        """Tick every quarter of the lease's life until cancelled."""
        while True:
            await asyncio.sleep(self.leases.ttl / 4)
            try:
                await self.tick()
            except Exception:
                log.exception("cell lease round failed")

    async def take_over(self, cell: int) -> None:
        """This replica now owns ``cell`` (see the module docstring)."""
        started = time.monotonic()
        host = self.host
        nodes = self.nodes_in(cell)
        for node in nodes:
            host.know(host.node_rows[node])
        loaded = await self._read_back(nodes)
        await host.authority.load_cell(cell)
        aborted = await self.leases.abort_foreign(cell)
        host.authority.aborted |= aborted  # members a later reconcile adopts are destroyed too

        async def one(node: NodeRow) -> None:
            async with self._reconciling:
                await (host.rejoin(node) if node.alive else host.lose_dead(node))

        await asyncio.gather(*(one(host.node_rows[n]) for n in nodes))
        doomed = [sid for n in nodes for sid in host.records.on_node(n)
                  if host.records.rows[sid].batch in aborted and host.records.rows[sid].state in LIVE]
        host.authority.settled(cell)
        if doomed:
            log.warning("cell %d: destroying %d member(s) of %d batch(es) another replica left unfinished", cell,
                        len(doomed), len(aborted))
            await host.destroy_rows(doomed)
        self.takeovers += 1
        if len(self._taking) <= 1:  # the last of the takeovers under way (a start takes every cell at once)
            gc.collect()
            gc.freeze()
        self._taking.pop(cell, None)
        log.info("cell %d taken over: %d node(s), %d row(s) read back, in %.2f s", cell, len(nodes), loaded,
                 time.monotonic() - started)

    async def _read_back(self, nodes: list[str]) -> int:
        """The rows of ``nodes`` read back into the records and placement; how many were new. One cell at a
        time (the first cell's nodes are reconciled while the next one's rows are read), loaded in chunks
        with a turn for the event loop between them: the lease renewals and requests do not wait for
        380,000 rows."""
        async with self._reading:
            rows = await asyncio.to_thread(lambda: list(self.host.state.rows(nodes)))
            loaded = 0
            for start in range(0, len(rows), _CHUNK):
                loaded += adopt_rows(self.host, rows[start:start + _CHUNK])
                await asyncio.sleep(0)
            return loaded

    async def _drop(self, cell: int) -> None:
        host = self.host
        for node in self.nodes_in(cell):
            await host.release_node(node)
            freed: collections.Counter[tuple[str, Any]] = collections.Counter()
            for _sid, row in host.records.forget_node(node):
                if row.state in LIVE:
                    freed[row.job, row.shape] += 1
            for (job, shape), count in freed.items():
                host.placer.release(job, None, shape, count)
            host.placer.forget(node)
        host.authority.drop_cell(cell)
