"""The node's sandbox records: the live ones, the ones being destroyed, and the tombstones of those gone.

Owns the ``sandbox id -> record`` map, its durable copy (:class:`~dsec.daemon.state.StateStore`), the bounded
tombstones that let a lookup say *why* an id is gone (expired, lost, destroyed) and to which job it belonged,
and what a client is told of a record (:class:`~dsec.models.SandboxInfo`). Must never call a backend, pin
an image or publish an event: the engine decides when a record is made, changed or dropped.
"""

from __future__ import annotations

import asyncio
import builtins
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from dsec.daemon.auth import JOB_LABEL
from dsec.daemon.state import StateStore
from dsec.errors import SandboxLost, SandboxNotFound, SandboxStateError, SandboxTimeout
from dsec.models import SandboxInfo, SandboxRecord, TrajectoryStatus

__all__ = ["Records"]


class Records:
    """Every sandbox record of node ``node``; ``trajectory(record)`` is the trajectory state a client sees."""

    def __init__(self, store: StateStore, node: str, trajectory: Callable[[SandboxRecord], TrajectoryStatus | None],
                 *, tombstone_limit: int = 10_000) -> None:
        self.store = store
        self.node = node
        self._trajectory = trajectory
        self._live: dict[str, SandboxRecord] = {}
        self.destroying: dict[str, asyncio.Task[None]] = {}
        """Ids whose destroy (or expiry, or loss) is under way -> its task (a second destroy waits for it)."""
        self.reviving: dict[str, asyncio.Task[bool]] = {}
        """Ids the watchdog (or recovery) is reviving -> its task (a destroy, expiry or loss waits for it)."""
        # Ids destroyed recently -> their state alone, or (state, message, job) when the message is not the
        # plain one or a job owned it. Bounded: a long-lived daemon creates millions, and the plain tombstone
        # (most of them) costs the id and a dict slot only, not a tuple and a message apiece.
        self._tombstones: OrderedDict[str, str | tuple[str, str, str | None]] = OrderedDict()
        self._tombstone_limit = tombstone_limit

    # -- the map ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __getitem__(self, sandbox_id: str) -> SandboxRecord:
        return self._live[sandbox_id]

    def values(self) -> builtins.list[SandboxRecord]:
        """The live records now (a copy: the map may change while a caller awaits)."""
        return list(self._live.values())

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of ``sandbox_id`` if this node has one (in any state)."""
        return self._live.get(sandbox_id)

    def add(self, record: SandboxRecord) -> None:
        """Make ``record`` visible (listed, looked up)."""
        self._live[record.id] = record

    def pop(self, sandbox_id: str) -> SandboxRecord | None:
        """Forget ``sandbox_id``'s record (None if it was not visible)."""
        return self._live.pop(sandbox_id, None)

    def save(self, record: SandboxRecord) -> None:
        """Persist ``record``."""
        self.store.save(record)

    def delete(self, sandbox_id: str) -> None:
        """Drop ``sandbox_id``'s durable record."""
        self.store.delete(sandbox_id)

    # -- lookups ---------------------------------------------------------------------------------------------

    def lookup(self, sandbox_id: str) -> SandboxRecord:
        """The record of ``sandbox_id``, or the error that says why there is none (timed out, lost, destroyed,
        never here)."""
        record = self._live.get(sandbox_id)
        if record is not None:
            return record
        tomb = self._tomb(sandbox_id)
        if tomb is not None and tomb[0] == "expired":
            raise SandboxTimeout(tomb[1], sandbox_id=sandbox_id)
        if tomb is not None and tomb[0] == "lost":
            raise SandboxLost(tomb[1], sandbox_id=sandbox_id, node=self.node)
        if tomb is not None:
            raise SandboxNotFound(tomb[1], sandbox_id=sandbox_id)
        raise SandboxNotFound(f"no sandbox {sandbox_id!r} on node {self.node}", sandbox_id=sandbox_id)

    def live(self, sandbox_id: str, *, allow_paused: bool) -> SandboxRecord:
        """The record of a running (or, if allowed, paused) sandbox; :class:`SandboxStateError` otherwise."""
        record = self.lookup(sandbox_id)
        if record.state == "running" or (allow_paused and record.state == "paused"):
            return record
        if record.state == "lost":  # its leftovers still being destroyed (or that failed): lost all the same
            raise SandboxLost(f"sandbox {sandbox_id} was lost: {record.reason}", sandbox_id=sandbox_id,
                              node=self.node)
        raise SandboxStateError(f"sandbox {sandbox_id} is {record.state}; the operation needs it running",
                                sandbox_id=sandbox_id, state=record.state)

    def running(self) -> builtins.list[SandboxRecord]:
        """Sandboxes running now and not being destroyed."""
        return [r for r in self._live.values() if r.state == "running" and r.id not in self.destroying]

    def select(self, labels: Mapping[str, str] | None, backend: str | None, state: str | None, after: str | None,
               limit: int | None) -> builtins.list[SandboxRecord]:
        """Records whose labels include ``labels`` (and of that backend / state, if given); with ``after`` or
        ``limit``, the page of them in id order after the id ``after``, at most ``limit`` long."""
        wanted = dict(labels or {})
        found = [
            r
            for r in self._live.values()
            if (backend is None or r.spec.backend == backend)
            and (state is None or r.state == state)
            and all(r.spec.labels.get(k) == v for k, v in wanted.items())
            and (after is None or r.id > after)
        ]
        if after is not None or limit is not None:
            found.sort(key=lambda r: r.id)
            found = found[:limit]
        return found

    def info(self, record: SandboxRecord, *, pooled: bool = False) -> SandboxInfo:
        """What a client is told of ``record``."""
        return SandboxInfo(
            id=record.id,
            backend=record.spec.backend,
            image=record.spec.image,
            state=record.state,
            created_at=record.created_at,
            expires_at=record.expires_at,
            labels=dict(record.spec.labels),
            spec=record.spec,
            node=self.node,
            reason=record.reason,
            trajectory=self._trajectory(record),
            pooled=pooled,
        )

    # -- tombstones ------------------------------------------------------------------------------------------

    def tombstone(self, record: SandboxRecord, state: str, message: str) -> None:
        """Remember that ``record`` is gone (``state``: expired, lost or destroyed) and why."""
        # The owning job is kept so that its token is told why the sandbox is gone (not a bare 404).
        job = record.spec.labels.get(JOB_LABEL)
        plain = job is None and message == _plain(record.id, state) and state in _STATES
        self._tombstones[record.id] = _STATES[state] if plain else (state, message, job)
        self._tombstones.move_to_end(record.id)
        while len(self._tombstones) > self._tombstone_limit:
            self._tombstones.popitem(last=False)

    def gone(self, sandbox_id: str) -> bool:
        """Whether ``sandbox_id`` was here and is gone (still remembered)."""
        return sandbox_id in self._tombstones

    def owner_labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The labels of a live sandbox, None if there is none; a sandbox gone lately answers only its owning
        job's label (see :meth:`dsec.daemon.engine.Engine.owner_labels`)."""
        record = self._live.get(sandbox_id)
        if record is not None:
            return dict(record.spec.labels)
        tomb = self._tomb(sandbox_id)
        return None if tomb is None or tomb[2] is None else {JOB_LABEL: tomb[2]}

    def _tomb(self, sandbox_id: str) -> tuple[str, str, str | None] | None:
        tomb = self._tombstones.get(sandbox_id)
        return (tomb, _plain(sandbox_id, tomb), None) if isinstance(tomb, str) else tomb


_STATES = {state: state for state in ("destroyed", "expired", "lost")}
"""The states a tombstone names (one string each, shared by every plain tombstone)."""


def _plain(sandbox_id: str, state: str) -> str:
    """The message of a sandbox gone in ``state`` with nothing more to say."""
    return f"sandbox {sandbox_id} was {state}"
