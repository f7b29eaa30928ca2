"""Placement: which node gets each new sandbox, and whether a job may have it now.

Owns capacity accounting (cpu, memory and sandbox slots per backend on every node), the rule that picks
a node (the least loaded, with a bonus for a node whose cache holds the image, so creates spread but a
warm cache is preferred), per-job quotas (live sandboxes, a creation rate with a burst) and admission:
when no node has room a request waits in a fair queue (round-robin over jobs, so one job's burst cannot
starve another's) until capacity frees or its deadline passes. A bulk create is placed in one decision:
all of it fits now or none of it is taken.

No decision scans the nodes once per sandbox: one sandbox comes off a load index in O(log nodes), a
batch is placed by a water-level search in O(nodes · log) (both in :mod:`dsec.cluster.spread`, both
equal to the greedy fill). The queue is served only when free capacity grows, at most once per turn of
the event loop, and a waiting request larger than the free slots of its backend is passed over without
a search.

Pure logic over in-memory state: no I/O, no Ray, no HTTP. The gateway feeds it node and sandbox facts.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dsec.cluster.spread import LoadIndex, water_fill
from dsec.errors import BackendUnavailable, DSecError, InvalidRequest, QuotaExceeded
from dsec.models import SandboxSpec

__all__ = ["LOCALITY_BONUS", "Capacity", "JobQuota", "NodeSlot", "Placement", "Placer", "Shaped"]

LOCALITY_BONUS = 0.25
"""A node whose cache holds the image wins over one up to this much less loaded (load is 0..1)."""

_ONE_BY_ONE = 8
"""Batches up to this size are taken from the load index one sandbox at a time (cheaper than a fill)."""


class Shaped(Protocol):
    """What placement reads of a spec: a :class:`~dsec.models.SandboxSpec`, or the gateway's narrow shape."""

    @property
    def backend(self) -> str: ...
    @property
    def cpu(self) -> float: ...
    @property
    def memory(self) -> int: ...
    @property
    def image(self) -> str | None: ...


@dataclass
class Capacity:
    """What a node offers: cores, bytes of memory and live sandboxes per backend."""

    cpu: float
    memory: int
    slots: dict[str, int]
    """Backend name -> live sandboxes it may hold (a backend absent here does not run on the node)."""


@dataclass(eq=False)
class NodeSlot:
    """One node as placement sees it: its capacity, what is placed on it, and the images it caches.
    Changed only through the :class:`Placer` (its index follows every change)."""

    name: str
    capacity: Capacity
    alive: bool = True
    images: set[str] = field(default_factory=set)
    cpu: float = 0.0
    memory: int = 0
    live: dict[str, int] = field(default_factory=dict)
    total: int = 0
    """Live sandboxes of every backend."""
    version: int = 0
    """Bumped at every change (the load index's entries name the version they saw)."""

    def free(self, backend: str) -> int:
        """Free slots of ``backend`` (0 when the node does not run it)."""
        return max(0, self.capacity.slots.get(backend, 0) - self.live.get(backend, 0))

    def fits(self, spec: SandboxSpec, count: int = 1) -> int:
        """How many of ``count`` sandboxes of ``spec`` still fit here (0 when dead or full)."""
        if not self.alive:
            return 0
        by_cpu = int((self.capacity.cpu - self.cpu + 1e-9) // spec.cpu)
        by_mem = (self.capacity.memory - self.memory) // spec.memory if spec.memory else count
        return max(0, min(count, self.free(spec.backend), by_cpu, by_mem))

    def load(self) -> float:
        """Fraction of the scarcest resource in use (0 = idle, 1 = full)."""
        slots = sum(self.capacity.slots.values()) or 1
        return max(self.cpu / self.capacity.cpu if self.capacity.cpu else 1.0,
                   self.memory / self.capacity.memory if self.capacity.memory else 1.0,
                   self.total / slots)

    def score(self, image: str | None) -> float:
        """Its load, less the locality bonus when its cache holds ``image``: the lowest wins."""
        return self.load() - (LOCALITY_BONUS if image is not None and image in self.images else 0.0)

    def rank(self, image: str | None) -> tuple[float, float, str]:
        """The order of nodes for a sandbox of ``image``: score, then load (two loads a rounding apart can
        share a score), then name."""
        load = self.load()
        return load - (LOCALITY_BONUS if image is not None and image in self.images else 0.0), load, self.name


@dataclass(frozen=True)
class JobQuota:
    """Limits of one job (a job is a token): live sandboxes, and creations per second with a burst."""

    max_live: int | None = None
    max_rate: float | None = None
    burst: int | None = None
    """Creations the rate bucket holds after idling (one batch may take them all). Default: ``max_live``
    when set (a job may create its whole quota in one batch), else one second of ``max_rate``."""

    @property
    def bucket(self) -> float:
        """The rate bucket's size (meaningful with ``max_rate``)."""
        if self.burst is not None:
            return float(self.burst)
        return float(max(self.max_rate or 0.0, self.max_live or 0))


@dataclass
class _Job:
    quota: JobQuota
    live: int = 0
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        if self.quota.max_rate is not None:
            self.tokens = min(self.quota.bucket, self.tokens + (now - self.stamp) * self.quota.max_rate)
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
        self.served = 0
        """Times the admission queue was served (a counter: it runs only when capacity grew)."""
        self._jobs: dict[str, _Job] = {}
        # job -> waiters (FIFO within a job); jobs are served round-robin.
        self._waiting: collections.OrderedDict[str, collections.deque[_Waiter]] = collections.OrderedDict()
        self._index = LoadIndex()
        self._free: collections.Counter[str] = collections.Counter()
        """Backend -> free slots over the usable nodes (a request larger than this cannot fit)."""
        self._runs: dict[str, set[str]] = collections.defaultdict(set)
        """Backend -> usable nodes that run it."""
        self._wake_due = False
        self.local_rate = True
        """Rate buckets refill by themselves; False: only what is added to them (a replica draws its tokens
        from the jobs' buckets shared in the database)."""

    # -- facts ------------------------------------------------------------------------------------------

    def set_node(self, name: str, capacity: Capacity, images: Iterable[str] | None = None, *,
                 usable: bool = True) -> NodeSlot:
        """Add a node or refresh its capacity and image list (its placed load is kept). ``usable=False``:
        known (its sandboxes can be accounted) but nothing is placed there yet."""
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = NodeSlot(name, capacity, alive=False)
        elif node.alive == usable and node.capacity == capacity and (images is None or set(images) == node.images):
            return node  # a membership poll that changes nothing costs nothing
        grew = usable and (not node.alive or capacity.cpu > node.capacity.cpu
                           or capacity.memory > node.capacity.memory
                           or any(n > node.capacity.slots.get(b, 0) for b, n in capacity.slots.items()))
        self._leave(node)
        node.capacity, node.alive = capacity, usable
        if images is not None:
            self._set_images(node, set(images))
        self._enter(node)
        if grew:
            self._wake_soon()
        return node

    def mark_dead(self, name: str) -> None:
        """Nothing more is placed on the node until :meth:`set_node` makes it usable again: it is gone (its
        sandboxes are the gateway's to mark lost), or it takes no creates for now (its daemon is stopping)."""
        node = self.nodes.get(name)
        if node is not None and node.alive:
            self._leave(node)
            node.alive = False
            self._enter(node)

    def forget(self, name: str) -> None:
        """Drop node ``name`` altogether (its cell went to another gateway replica): its room leaves the
        counters, its entries the index. Its sandboxes' job counts are the caller's to release."""
        node = self.nodes.pop(name, None)
        if node is not None:
            self._leave(node)
            node.alive = False
            for key in ["b:" + b for b in node.capacity.slots] + ["i:" + i for i in node.images]:
                self._index.discard(key, name)

    def set_images(self, name: str, images: Iterable[str]) -> None:
        """The images ``name``'s cache holds now (what its ``/v1/health`` or events say)."""
        node = self.nodes.get(name)
        if node is not None:
            self._set_images(node, set(images))

    def add_image(self, name: str, image: str) -> None:
        """``name``'s cache holds ``image`` (a sandbox of it was placed there)."""
        node = self.nodes.get(name)
        if node is not None and image not in node.images:
            node.images.add(image)
            if node.alive:
                self._index.add("i:" + image, node.load(), node.name, node.version)

    def _set_images(self, node: NodeSlot, images: set[str]) -> None:
        for image in node.images - images:
            self._index.discard("i:" + image, node.name)
        added = images - node.images
        node.images = images
        if node.alive:
            for image in added:
                self._index.add("i:" + image, node.load(), node.name, node.version)

    def _leave(self, node: NodeSlot) -> None:
        """Before a change of ``node``: its free room leaves the counters."""
        if node.alive:
            for backend in node.capacity.slots:
                self._free[backend] -= node.free(backend)
                self._runs[backend].discard(node.name)

    def _enter(self, node: NodeSlot) -> None:
        """After a change of ``node``: its free room joins the counters, its entries the index."""
        node.version += 1
        if not node.alive:
            return
        load = node.load()
        for backend, slots in node.capacity.slots.items():
            if slots > 0:
                self._runs[backend].add(node.name)
                self._free[backend] += node.free(backend)
                if node.free(backend):
                    self._index.add("b:" + backend, load, node.name, node.version)
        for image in node.images:
            self._index.add("i:" + image, load, node.name, node.version)

    @staticmethod
    def _apply(node: NodeSlot, spec: Shaped, count: int) -> None:
        """``count`` more (or, negative, fewer) sandboxes of ``spec`` on ``node``: its numbers only."""
        node.cpu = max(0.0, node.cpu + spec.cpu * count)
        node.memory = max(0, node.memory + spec.memory * count)
        count = max(count, -node.live.get(spec.backend, 0))
        node.live[spec.backend] = node.live.get(spec.backend, 0) + count
        node.total += count

    def _take(self, node: NodeSlot, spec: SandboxSpec, count: int) -> None:
        """``count`` sandboxes of ``spec`` placed on a node they fit (its load rose: the index catches up
        lazily, when its entry reaches the top)."""
        self._free[spec.backend] -= count
        self._apply(node, spec, count)
        node.version += 1

    def _give_back(self, node: NodeSlot, spec: Shaped, count: int = 1) -> None:
        self._leave(node)
        self._apply(node, spec, -count)
        self._enter(node)

    def job(self, name: str) -> _Job:
        entry = self._jobs.get(name)
        if entry is None:
            quota = self.quotas.get(name, self.default_quota)
            full = quota.bucket if quota.max_rate is not None and self.local_rate else 0.0
            entry = self._jobs[name] = _Job(quota, tokens=full)
        return entry

    def adopt(self, job: str, node: str, spec: Shaped, count: int = 1) -> None:
        """Account ``count`` existing sandboxes (a gateway restart rebuilds them from the state database)."""
        self.job(job).live += count
        slot = self.nodes.get(node)
        if slot is not None:
            self._leave(slot)
            self._apply(slot, spec, count)
            self._enter(slot)

    def release(self, job: str, node: str | None, spec: Shaped, count: int = 1) -> None:
        """``count`` sandboxes were destroyed or lost: free their capacity and their job's live count, and
        serve waiters."""
        entry = self.job(job)
        entry.live = max(0, entry.live - count)
        if node is not None and node in self.nodes:
            self._give_back(self.nodes[node], spec, count)
        self._wake_soon()

    def refund(self, job: str, count: int) -> None:
        """``count`` placed sandboxes no node took (given back with :meth:`release`): they do not count
        against the job's creation rate, so placing them again is not refused by it."""
        entry = self.job(job)
        if entry.quota.max_rate is not None:
            entry.tokens = min(entry.quota.bucket, entry.tokens + count)

    # -- decisions --------------------------------------------------------------------------------------

    def _check_quota(self, job: str, count: int) -> None:
        entry = self.job(job)
        quota = entry.quota
        if quota.max_live is not None and entry.live + count > quota.max_live:
            raise QuotaExceeded(
                f"job {job!r} would have {entry.live + count} live sandboxes; its quota is {quota.max_live}",
                job=job, live=entry.live, requested=count, max_live=quota.max_live)
        if quota.max_rate is not None:
            if count > quota.bucket:
                raise QuotaExceeded(
                    f"job {job!r} may create {quota.max_rate:g} sandboxes per second and asked for {count} at "
                    f"once; its burst is {quota.bucket:g} (creations the rate bucket holds): split the batch or "
                    f"raise 'burst' in the jobs file", job=job, max_rate=quota.max_rate, burst=quota.bucket,
                    requested=count)
            if self.local_rate:
                entry.refill(time.monotonic())
            if count > entry.tokens:
                raise QuotaExceeded(
                    f"job {job!r} may create {quota.max_rate:g} sandboxes per second; asked for {count} "
                    f"with {int(entry.tokens)} left now", job=job, max_rate=quota.max_rate, requested=count)

    def _current(self, key: str) -> Callable[[str], tuple[float, int] | None]:
        """For the load index: a node's (load, version) under ``key`` now, None once it left it."""
        backend = key[2:] if key.startswith("b:") else None

        def current(name: str) -> tuple[float, int] | None:
            node = self.nodes.get(name)
            if node is None or not node.alive:
                return None
            if backend is not None and not node.free(backend):
                return None
            if backend is None and key[2:] not in node.images:
                return None
            return node.load(), node.version
        return current

    def best(self, spec: SandboxSpec) -> NodeSlot | None:
        """The node the next sandbox of ``spec`` goes to: the fitting node of the lowest :meth:`NodeSlot.rank`."""
        def fits(name: str) -> bool:
            return self.nodes[name].fits(spec) > 0

        key = "b:" + spec.backend
        found = [self._index.best(key, self._current(key), fits)]
        if spec.image is not None:
            key = "i:" + spec.image
            found.append(self._index.best(key, self._current(key), fits))
        nodes = [self.nodes[name] for name in found if name is not None]
        return min(nodes, key=lambda n: n.rank(spec.image)) if nodes else None

    def try_place(self, spec: SandboxSpec, count: int, job: str) -> Placement | None:
        """Place ``count`` sandboxes now, all or none; None when the cluster has no room for all of them.

        Raises QuotaExceeded (the job's limits) or BackendUnavailable (no live node runs the backend).
        """
        if count < 1:
            raise InvalidRequest(f"count must be at least 1, got {count}")
        self._check_quota(job, count)
        if not self._runs.get(spec.backend):
            live = sum(1 for n in self.nodes.values() if n.alive)
            raise BackendUnavailable(f"no live node runs the {spec.backend!r} backend ({live} live node(s))",
                                     backend=spec.backend)
        if count > self._free[spec.backend]:
            return None
        counts = self._one_by_one(spec, count) if count <= _ONE_BY_ONE else self._fill(spec, count)
        if counts is None:
            return None
        entry = self.job(job)
        entry.live += count
        if entry.quota.max_rate is not None:
            entry.tokens -= count
        return Placement(counts)

    def _one_by_one(self, spec: SandboxSpec, count: int) -> dict[str, int] | None:
        counts: dict[str, int] = {}
        for _ in range(count):
            node = self.best(spec)
            if node is None:
                for name, n in counts.items():  # all or none: give back what this decision took
                    for _ in range(n):
                        self._give_back(self.nodes[name], spec)
                return None
            self._take(node, spec, 1)
            counts[node.name] = counts.get(node.name, 0) + 1
        return counts

    def _fill(self, spec: SandboxSpec, count: int) -> dict[str, int] | None:
        """A batch by the water-level search, over arrays of the nodes that run its backend."""
        nodes = [self.nodes[name] for name in self._runs[spec.backend]]
        n = len(nodes)
        cap_cpu = np.fromiter((x.capacity.cpu for x in nodes), np.float64, n)
        cap_mem = np.fromiter((x.capacity.memory for x in nodes), np.float64, n)
        slots = np.fromiter((sum(x.capacity.slots.values()) or 1 for x in nodes), np.float64, n)
        cpu = np.fromiter((x.cpu for x in nodes), np.float64, n)
        mem = np.fromiter((x.memory for x in nodes), np.float64, n)
        total = np.fromiter((x.total for x in nodes), np.float64, n)
        free = np.fromiter((x.free(spec.backend) for x in nodes), np.int64, n)
        fit = np.minimum(free, np.floor((cap_cpu - cpu + 1e-9) / spec.cpu)).astype(np.int64)
        if spec.memory:
            fit = np.minimum(fit, np.floor((cap_mem - mem) / spec.memory).astype(np.int64))
        fit = np.clip(fit, 0, count)
        if int(fit.sum()) < count:
            return None
        keep = np.nonzero(fit)[0]
        image = spec.image
        bonus = np.fromiter((LOCALITY_BONUS if image is not None and image in nodes[i].images else 0.0
                             for i in keep), np.float64, keep.size)
        used = np.stack([cpu / cap_cpu, mem / cap_mem, total / slots], axis=1)[keep]
        step = np.stack([spec.cpu / cap_cpu, spec.memory / cap_mem, 1 / slots], axis=1)[keep]
        counts = water_fill([nodes[i].name for i in keep], fit[keep], used, step, bonus, count)
        for name, taken in counts.items():
            self._take(self.nodes[name], spec, taken)
        return counts

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

    def _wake_soon(self) -> None:
        """Capacity grew: serve the queue once this turn of the event loop is over (many releases in one
        turn cost one pass)."""
        if not self._waiting or self._wake_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.wake()
            return
        self._wake_due = True
        loop.call_soon(self.wake)

    def wake(self) -> None:
        """Serve the queue: round-robin over jobs, each job's oldest request first, until a full round
        places nothing (a job whose head request does not fit yet keeps its turn for the next call)."""
        self._wake_due = False
        self.served += 1
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
                if head.count > self._free[head.spec.backend] and self._runs.get(head.spec.backend):
                    continue  # cannot fit: no search
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
            "served": self.served,
        }
