"""Placement: which node gets each new sandbox, and whether a job may have it now.

Owns capacity accounting (cpu, memory and sandbox slots per backend on every node), the scoring that
picks a node (the least loaded, with a bonus for a node whose cache holds the image, so creates spread
but a warm cache is preferred), per-job quotas
(live sandboxes and creation rate) and admission: when no node has room a request waits in a fair queue
(round-robin over jobs, so one job's burst cannot starve another's) until capacity frees or its
deadline passes. A bulk create is placed in one decision: all of it fits now or none of it is taken.

Pure logic over in-memory state: no I/O, no Ray, no HTTP. The gateway feeds it node and sandbox facts.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from dsec.errors import BackendUnavailable, DSecError, InvalidRequest, QuotaExceeded
from dsec.models import SandboxSpec

__all__ = ["LOCALITY_BONUS", "Capacity", "JobQuota", "NodeSlot", "Placement", "Placer"]

LOCALITY_BONUS = 0.25
"""A node whose cache holds the image wins over one up to this much less loaded (load is 0..1)."""


@dataclass
class Capacity:
    """What a node offers: cores, bytes of memory and live sandboxes per backend."""

    cpu: float
    memory: int
    slots: dict[str, int]
    """Backend name -> live sandboxes it may hold (a backend absent here does not run on the node)."""


@dataclass
class NodeSlot:
    """One node as placement sees it: its capacity, what is placed on it, and the images it caches."""

    name: str
    capacity: Capacity
    alive: bool = True
    images: set[str] = field(default_factory=set)
    cpu: float = 0.0
    memory: int = 0
    live: dict[str, int] = field(default_factory=dict)

    def fits(self, spec: SandboxSpec, count: int = 1) -> int:
        """How many of ``count`` sandboxes of ``spec`` still fit here (0 when dead or full)."""
        if not self.alive:
            return 0
        slots = self.capacity.slots.get(spec.backend, 0) - self.live.get(spec.backend, 0)
        by_cpu = int((self.capacity.cpu - self.cpu + 1e-9) // spec.cpu)
        by_mem = (self.capacity.memory - self.memory) // spec.memory
        return max(0, min(count, slots, by_cpu, by_mem))

    def take(self, spec: SandboxSpec, count: int = 1) -> None:
        """Account ``count`` sandboxes of ``spec`` as placed here."""
        self.cpu += spec.cpu * count
        self.memory += spec.memory * count
        self.live[spec.backend] = self.live.get(spec.backend, 0) + count

    def give_back(self, spec: SandboxSpec) -> None:
        """One sandbox of ``spec`` left this node."""
        self.cpu = max(0.0, self.cpu - spec.cpu)
        self.memory = max(0, self.memory - spec.memory)
        self.live[spec.backend] = max(0, self.live.get(spec.backend, 0) - 1)

    def load(self) -> float:
        """Fraction of the scarcest resource in use (0 = idle, 1 = full)."""
        slots = sum(self.capacity.slots.values()) or 1
        return max(self.cpu / self.capacity.cpu if self.capacity.cpu else 1.0,
                   self.memory / self.capacity.memory if self.capacity.memory else 1.0,
                   sum(self.live.values()) / slots)


@dataclass(frozen=True)
class JobQuota:
    """Limits of one job (a job is a token): live sandboxes and creations per second (burst = one second)."""

    max_live: int | None = None
    max_rate: float | None = None


@dataclass
class _Job:
    quota: JobQuota
    live: int = 0
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        if self.quota.max_rate is not None:
            self.tokens = min(self.quota.max_rate, self.tokens + (now - self.stamp) * self.quota.max_rate)
        self.stamp = now


@dataclass(frozen=True)
class Placement:
    """The outcome of one decision: node name -> how many sandboxes go there."""

    counts: dict[str, int]

    def nodes(self) -> list[str]:
        """One node name per sandbox, in placement order."""
        return [name for name, n in self.counts.items() for _ in range(n)]


@dataclass(eq=False)
class _Waiter:
    spec: SandboxSpec
    count: int
    job: str
    future: asyncio.Future[Placement]


class Placer:
    """Nodes, jobs and the admission queue; every method runs on the gateway's event loop."""

    def __init__(self, default_quota: JobQuota | None = None) -> None:
        self.nodes: dict[str, NodeSlot] = {}
        self.quotas: dict[str, JobQuota] = {}
        self.default_quota = default_quota or JobQuota()
        self.queued = 0
        """Decisions that had to wait in the admission queue (a counter)."""
        self._jobs: dict[str, _Job] = {}
        # job -> waiters (FIFO within a job); jobs are served round-robin.
        self._waiting: collections.OrderedDict[str, collections.deque[_Waiter]] = collections.OrderedDict()

    # -- facts ------------------------------------------------------------------------------------------

    def set_node(self, name: str, capacity: Capacity, images: set[str] | None = None, *,
                 usable: bool = True) -> NodeSlot:
        """Add a node or refresh its capacity and image list (its placed load is kept). ``usable=False``:
        known (its sandboxes can be accounted) but nothing is placed there yet."""
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = NodeSlot(name, capacity)
        node.capacity, node.alive = capacity, usable
        if images is not None:
            node.images = set(images)
        if usable:
            self.wake()
        return node

    def mark_dead(self, name: str) -> None:
        """Nothing more is placed on the node until :meth:`set_node` makes it usable again: it is gone (its
        sandboxes are the gateway's to mark lost), or it takes no creates for now (its daemon is stopping)."""
        if name in self.nodes:
            self.nodes[name].alive = False

    def job(self, name: str) -> _Job:
        entry = self._jobs.get(name)
        if entry is None:
            quota = self.quotas.get(name, self.default_quota)
            entry = self._jobs[name] = _Job(quota, tokens=quota.max_rate or 0.0)
        return entry

    def adopt(self, job: str, node: str, spec: SandboxSpec) -> None:
        """Account an existing sandbox (gateway restart: rebuilt from the state database)."""
        self.job(job).live += 1
        if node in self.nodes:
            self.nodes[node].take(spec)

    def release(self, job: str, node: str | None, spec: SandboxSpec) -> None:
        """A sandbox was destroyed or lost: free its capacity and its job's live count, wake waiters."""
        entry = self.job(job)
        entry.live = max(0, entry.live - 1)
        if node is not None and node in self.nodes:
            self.nodes[node].give_back(spec)
        self.wake()

    def refund(self, job: str, count: int) -> None:
        """``count`` placed sandboxes no node took (given back with :meth:`release`): they do not count
        against the job's creation rate, so placing them again is not refused by it."""
        entry = self.job(job)
        if entry.quota.max_rate is not None:
            entry.tokens = min(entry.quota.max_rate, entry.tokens + count)

    # -- decisions --------------------------------------------------------------------------------------

    def _check_quota(self, job: str, count: int) -> None:
        entry = self.job(job)
        quota = entry.quota
        if quota.max_live is not None and entry.live + count > quota.max_live:
            raise QuotaExceeded(
                f"job {job!r} would have {entry.live + count} live sandboxes; its quota is {quota.max_live}",
                job=job, live=entry.live, requested=count, max_live=quota.max_live)
        if quota.max_rate is not None:
            entry.refill(time.monotonic())
            if count > entry.tokens:
                raise QuotaExceeded(
                    f"job {job!r} may create {quota.max_rate:g} sandboxes per second; asked for {count} "
                    f"with {int(entry.tokens)} left now", job=job, max_rate=quota.max_rate, requested=count)

    def try_place(self, spec: SandboxSpec, count: int, job: str) -> Placement | None:
        """Place ``count`` sandboxes now, all or none; None when the cluster has no room for all of them.

        Raises QuotaExceeded (the job's limits) or BackendUnavailable (no live node runs the backend).
        """
        if count < 1:
            raise InvalidRequest(f"count must be at least 1, got {count}")
        self._check_quota(job, count)
        live = [n for n in self.nodes.values() if n.alive]
        if not any(n.capacity.slots.get(spec.backend, 0) > 0 for n in live):
            raise BackendUnavailable(f"no live node runs the {spec.backend!r} backend "
                                     f"({len(live)} live node(s))", backend=spec.backend)
        if sum(n.fits(spec, count) for n in live) < count:
            return None
        counts: dict[str, int] = {}
        # Greedy water-filling: each sandbox goes to the best node for it now, so a batch spreads
        # across equal nodes and prefers those whose cache already holds the image while they are not
        # much busier than the rest (locality must not pile a whole job onto one node).
        for _ in range(count):
            best = min((n for n in live if n.fits(spec)),
                       key=lambda n: (n.load() - (LOCALITY_BONUS if spec.image in n.images else 0.0), n.name))
            best.take(spec)
            counts[best.name] = counts.get(best.name, 0) + 1
        entry = self.job(job)
        entry.live += count
        if entry.quota.max_rate is not None:
            entry.tokens -= count
        return Placement(counts)

    async def place(self, spec: SandboxSpec, count: int, job: str, wait: float) -> Placement:
        """Place now, or queue fairly for up to ``wait`` seconds; QuotaExceeded when the wait runs out."""
        if not self._waiting:
            placed = self.try_place(spec, count, job)
            if placed is not None:
                return placed
        else:
            self._check_quota(job, count)  # a request the quota refuses is refused now, not after a wait
        self.queued += 1
        waiter = _Waiter(spec, count, job, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(job, collections.deque()).append(waiter)
        self.wake()
        future = waiter.future
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait)
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                return future.result()  # placed just as the wait ran out
            free = sum(n.fits(spec, 1 << 30) for n in self.nodes.values())
            raise QuotaExceeded(
                f"the cluster has room for {free} more {spec.backend} sandbox(es) of this size; "
                f"{count} waited {wait:g} s in the admission queue", requested=count, free=free, job=job) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                for node, n in future.result().counts.items():  # the caller left: give the room back
                    for _ in range(n):
                        self.release(job, node, spec)
            raise
        finally:
            self._drop(waiter)

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.job)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[waiter.job]
        if not waiter.future.done():
            waiter.future.cancel()

    def wake(self) -> None:
        """Serve the queue: round-robin over jobs, each job's oldest request first, until a full round
        places nothing (a job whose head request does not fit yet keeps its turn for the next call)."""
        progress = True
        while progress and self._waiting:
            progress = False
            for job in list(self._waiting):
                queue = self._waiting.get(job)
                if not queue:
                    self._waiting.pop(job, None)
                    continue
                head = queue[0]
                if head.future.done():
                    queue.popleft()
                    progress = True
                    continue
                try:
                    placed = self.try_place(head.spec, head.count, head.job)
                except DSecError as exc:
                    queue.popleft()
                    head.future.set_exception(exc)
                    progress = True
                    continue
                if placed is None:
                    continue
                queue.popleft()
                head.future.set_result(placed)
                progress = True
                if not queue:
                    self._waiting.pop(job, None)
                else:
                    self._waiting.move_to_end(job)

    def statistics(self) -> dict[str, object]:
        """Nodes, their load and the queue length (for /metrics and tests)."""
        return {
            "nodes": {n.name: {"alive": n.alive, "load": round(n.load(), 3), "live": dict(n.live)}
                      for n in self.nodes.values()},
            "waiting": sum(len(q) for q in self._waiting.values()),
            "queued": self.queued,
        }
