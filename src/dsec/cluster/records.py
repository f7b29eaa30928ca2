"""The gateway's sandbox records in memory: narrow rows, indexed by job, node and trajectory, and counted.

Owns what the gateway remembers of each sandbox it placed -- node, job, state, the spec's shape and
JSON, when it was made, its trajectory and why it ended -- in a form that stays small at 380,000 live
sandboxes: one tuple of immutable fields a row (tuples of strings and numbers leave the garbage
collector's lists after its first pass), the spec's JSON shared by every sandbox made from the same
spec, and indexes kept as each row changes, so that no call scans every row:

- ``rows``: id -> :class:`Row`; per node, the ids it holds; per job, and for everyone, the ids in
  order (a list page starts from a cursor id); per trajectory, its live sandbox;
- counters: live sandboxes in all, per node, and each node's count and digest of its live sandboxes
  (what the node's ``/v1/health`` reports, so reconciling a node that agrees needs no listing).

A row answers as a :class:`~dsec.models.SandboxInfo` on demand. It must never call a node or the
database: the gateway writes what changes, and :class:`~dsec.cluster.state.StateWriter` persists it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from sortedcontainers import SortedList

from dsec.models import SandboxInfo, SandboxSpec, id_hash

__all__ = ["LIVE", "Records", "Row", "Shape"]

LIVE = frozenset({"running", "paused", "creating"})
"""States in which a sandbox holds room on its node and counts against its job's quota."""


class Shape(NamedTuple):
    """What placement needs of a spec (shared by every row made from specs of the same shape)."""

    backend: str
    cpu: float
    memory: int
    image: str | None


class Row(NamedTuple):
    """One sandbox as the gateway remembers it."""

    node: str
    job: str
    state: str
    shape: Shape
    spec: bytes
    """The spec's JSON (the job label stamped), as the node was asked to create it."""
    created: float
    trajectory: str | None = None
    reason: str | None = None
    """Why it is lost or expired."""
    detail: bytes | None = None
    """The node's whole answer as JSON, kept only where a row cannot rebuild it (trajectory status)."""
    batch: str | None = None
    """The batch it was created in (its ``dsec.batch`` label), until that batch is known done."""


@functools.lru_cache(maxsize=4096)
def _spec(raw: bytes) -> SandboxSpec:
    return SandboxSpec.model_validate_json(raw)


@functools.lru_cache(maxsize=4096)
def _shape(backend: str, cpu: float, memory: int, image: str | None) -> Shape:
    return Shape(backend, cpu, memory, image)


def shape_of(spec: SandboxSpec) -> Shape:
    """The interned shape of ``spec``."""
    return _shape(spec.backend, spec.cpu, spec.memory, spec.image)


class Records:
    """Every sandbox the gateway placed and has not forgotten, with its indexes and counters."""

    def __init__(self, cell_of: Callable[[str], int] = lambda _node: 0) -> None:
        self.cell_of = cell_of
        """Node name -> its cell (live counts are kept per cell and job)."""
        self.rows: dict[str, Row] = {}
        self.live = 0
        """Rows in a live state."""
        self._by_node: dict[str, set[str]] = collections.defaultdict(set)
        self._by_job: dict[str, SortedList] = {}
        self._all = SortedList()
        self._by_trajectory: dict[str, str] = {}
        self._live_on: collections.Counter[str] = collections.Counter()
        self._digest: collections.Counter[str] = collections.Counter()
        self._per_cell: collections.Counter[tuple[int, str]] = collections.Counter()
        self._recent: dict[bytes, bytes] = {}
        self._watching: dict[str, list[set[str]]] = {}
        """Node -> sets collecting the ids of its rows removed meanwhile (see :meth:`removals`)."""

    # -- changes --------------------------------------------------------------------------------------------

    def intern(self, spec: bytes) -> bytes:
        """One object for equal specs made recently (a batch's members, an RL loop's repeated spec)."""
        found = self._recent.get(spec)
        if found is not None:
            return found
        if len(self._recent) >= 4096:
            del self._recent[next(iter(self._recent))]
        self._recent[spec] = spec
        return spec

    def put(self, sid: str, row: Row) -> None:
        """Add a row or replace one (its indexes and counters follow)."""
        old = self.rows.get(sid)
        if old is not None:
            self._unindex(sid, old)
        else:
            self._all.add(sid)
            self._by_job.setdefault(row.job, SortedList()).add(sid)
        self.rows[sid] = row
        self._by_node[row.node].add(sid)
        if row.state in LIVE:
            self._count(sid, row, 1)

    def _count(self, sid: str, row: Row, sign: int) -> None:
        self.live += sign
        self._live_on[row.node] += sign
        self._per_cell[self.cell_of(row.node), row.job] += sign
        self._digest[row.node] ^= id_hash(sid)
        if row.trajectory is not None:
            if sign > 0:
                self._by_trajectory[row.trajectory] = sid
            elif self._by_trajectory.get(row.trajectory) == sid:
                del self._by_trajectory[row.trajectory]

    def set_state(self, sid: str, state: str, reason: str | None = None) -> Row | None:
        """The row with its state (and reason) changed; None when there is no such row."""
        row = self.rows.get(sid)
        if row is None:
            return None
        new = row._replace(state=state, reason=reason)
        self.put(sid, new)
        return new

    def remove(self, sid: str) -> Row | None:
        """Forget a row; it, or None."""
        row = self.rows.pop(sid, None)
        if row is None:
            return None
        self._unindex(sid, row)
        for removed in self._watching.get(row.node, ()):
            removed.add(sid)
        self._all.discard(sid)
        ids = self._by_job.get(row.job)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del self._by_job[row.job]
        return row

    @contextlib.contextmanager
    def removals(self, node: str) -> Iterator[set[str]]:
        """The ids of ``node``'s rows removed while inside: what a listing of the node answered before a
        destroy it had not seen yet must not be taken for a sandbox the records lack."""
        removed: set[str] = set()
        self._watching.setdefault(node, []).append(removed)
        try:
            yield removed
        finally:
            # By identity: two reconciles of one node may hold equal (empty) sets.
            watching = [s for s in self._watching[node] if s is not removed]
            if watching:
                self._watching[node] = watching
            else:
                del self._watching[node]

    def _unindex(self, sid: str, row: Row) -> None:
        ids = self._by_node.get(row.node)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del self._by_node[row.node]
        if row.state in LIVE:
            self._count(sid, row, -1)

    # -- reads ----------------------------------------------------------------------------------------------

    def on_node(self, node: str) -> list[str]:
        """The ids of every row on ``node``."""
        return list(self._by_node.get(node, ()))

    def live_in(self, cell: int, job: str) -> int:
        """Live rows of ``job`` on the nodes of ``cell``."""
        return self._per_cell.get((cell, job), 0)

    def live_on(self, node: str) -> int:
        """Live rows on ``node``."""
        return self._live_on.get(node, 0)

    def digest(self, node: str) -> tuple[int, str]:
        """Count and digest of ``node``'s live rows, as :class:`~dsec.models.NodeInfo` reports them."""
        return self._live_on.get(node, 0), f"{self._digest.get(node, 0):016x}"

    def trajectory(self, name: str) -> str | None:
        """The live sandbox bound to trajectory ``name``."""
        return self._by_trajectory.get(name)

    def jobs(self) -> Iterator[str]:
        """Every job with a row."""
        return iter(self._by_job)

    def page(self, job: str | None, after: str | None, limit: int) -> Iterator[str]:
        """Ids of ``job``'s rows (``None``: everyone's) in id order, after the cursor ``after``; at most
        ``limit`` are asked for by the caller, which may filter and stop early."""
        ids = self._all if job is None else self._by_job.get(job)
        if not ids:
            return iter(())
        start = 0 if after is None else ids.bisect_right(after)
        return iter(ids.islice(start, None))

    def spec(self, row: Row) -> SandboxSpec:
        """The row's spec (parsed once for every row that shares it)."""
        return _spec(row.spec)

    def info(self, sid: str, row: Row) -> SandboxInfo:
        """The row as the API answers it (without an endpoint)."""
        if row.detail is not None:
            info = SandboxInfo.model_validate_json(row.detail)
            return info.model_copy(update={"state": row.state, "reason": row.reason or info.reason})
        spec = _spec(row.spec)
        return SandboxInfo(id=sid, backend=spec.backend, image=spec.image, state=row.state,
                           created_at=row.created, expires_at=row.created + spec.timeout, labels=spec.labels,
                           spec=spec, node=row.node, reason=row.reason)

    def load(self, rows: Iterable[tuple[str, Row]]) -> int:
        """Add rows read back from the database (a restart, a cell taken over) that are not here yet; how
        many. The ordered indexes take them in one sorted update rather than row by row."""
        by_job: dict[str, list[str]] = collections.defaultdict(list)
        added: list[str] = []
        # What :meth:`put` and :meth:`_count` do row by row, with the counters summed per node and job first
        # and the digest folded per node (a restart reads 380,000 rows before it serves).
        live: collections.Counter[tuple[str, str]] = collections.Counter()
        folded: dict[str, int] = {}
        mine, by_node, trajectories = self.rows, self._by_node, self._by_trajectory
        for sid, row in rows:
            if sid in mine:
                continue
            mine[sid] = row
            added.append(sid)
            node = row.node
            by_job[row.job].append(sid)
            by_node[node].add(sid)
            if row.state in LIVE:
                live[node, row.job] += 1
                folded[node] = folded.get(node, 0) ^ id_hash(sid)
                if row.trajectory is not None:
                    trajectories[row.trajectory] = sid
        for (node, job), n in live.items():
            self.live += n
            self._live_on[node] += n
            self._per_cell[self.cell_of(node), job] += n
        for node, value in folded.items():
            self._digest[node] ^= value
        self._all.update(added)
        for job, ids in by_job.items():
            self._by_job.setdefault(job, SortedList()).update(ids)
        return len(added)

    def forget_node(self, node: str) -> list[tuple[str, Row]]:
        """Drop every row of ``node`` from memory only (its cell went to another replica); them."""
        gone = [(sid, self.rows[sid]) for sid in self.on_node(node)]
        for sid, _row in gone:
            self.remove(sid)
        return gone
