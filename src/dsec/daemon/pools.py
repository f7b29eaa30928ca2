"""Warm pools: sandboxes created ahead of demand and handed out by ``create``.

Owns pool declarations, the shape a spec must have to be served from a pool (:func:`pool_key`), the
ready queues, the demand-based target size and the background refill. Pool members are made and
discarded through the engine's :class:`PoolHost` interface (the same create path as any sandbox, so
records, image pins, admission and cleanup after a daemon crash are shared); this module never calls
a backend and never decides what a claim applies to the claimed sandbox (the engine does).

Sizing: a pool aims for as many ready sandboxes as it was asked for in the last ``DEMAND_WINDOW``
seconds, never fewer than its ``min`` nor more than its ``max``; surplus members are destroyed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from dsec.daemon.admission import Deferred
from dsec.daemon.metrics import Metrics
from dsec.errors import DaemonStopping
from dsec.models import PoolConfig, PoolStatistics, SandboxRecord, SandboxSpec

__all__ = ["DEMAND_WINDOW", "POOL_LABEL", "REFILL_DELAY", "PoolHost", "Pools", "pool_key"]

log = logging.getLogger(__name__)

POOL_LABEL = "dsec.pool"
"""Label a pool member carries until it is claimed (how a restarted daemon recognises and drains it)."""
DEMAND_WINDOW = 30.0
"""Seconds of claims (hits and misses) a pool's target follows."""
_FILL_PARALLELISM = 8
"""Members one pool creates at once: a refill must not crowd out the creates of users."""
_DEFER_RETRY = 0.25
"""Seconds a pool waits after the node deferred its refill (busy with users' creates)."""
FILL_CLOSE_WAIT = 30.0
"""Seconds a closing engine waits for pool creates in flight before it cancels them."""
REFILL_DELAY = 0.05
"""Seconds a pool with more than half its target ready waits after a claim before refilling: a refill
(runtime processes, mounts) started at once competes for the CPU with the claim's own answer and with
the claims right behind it. A pool at half its target or below refills at once."""
_MEMBER_TIMEOUT = 30 * 86400.0
"""A member's wall-clock timeout until it is claimed (the claim sets the real one)."""


def pool_key(image: str, backend: str, cpu: float, memory: int, disk: int, pids: int, workdir: str | None,
             network: str | list[str] = "none") -> str:
    """The shape two specs must share to be served by the same pool. Of the network, only whether there is a
    device: a sandbox made with ``none`` has none (and no per-sandbox sysfs listing one), which a policy
    applied at the claim cannot give it; any other policy is applied to a member made with a device."""
    # cpu in full (shortest round-trip repr): 1 and 1.0000001 are two shapes (a microVM gets ceil(cpu) vCPUs).
    cores = repr(float(cpu)).removesuffix(".0")
    device = "none" if network == "none" else "device"
    return (f"{image}:{backend}:cpu={cores},memory={memory},disk={disk},pids={pids},workdir={workdir or ''},"
            f"net={device}")


def key_of_spec(spec: SandboxSpec) -> str | None:
    """The pool shape of ``spec``, or None when it can never come from a pool (trajectory, snapshot,
    protected/hidden paths, which are mounted when the sandbox is made, or ``landlock=False``: members are
    made confined, with ``/proc`` and ``/dev`` read-only)."""
    if (spec.trajectory is not None or spec.snapshot is not None or not spec.image or spec.protected or spec.hidden
            or not spec.landlock):
        return None
    return pool_key(spec.image, spec.backend, spec.cpu, spec.memory, spec.disk, spec.pids, spec.workdir,
                    spec.network)


def key_of_config(config: PoolConfig) -> str:
    """The pool shape a :class:`PoolConfig` declares."""
    return pool_key(config.image, config.backend, config.cpu, config.memory, config.disk, config.pids,
                    config.workdir, config.network)


class PoolHost(Protocol):
    """What pools need of the engine."""

    async def create_member(self, spec: SandboxSpec) -> SandboxRecord:
        """Create a sandbox that no client sees until it is claimed."""
        ...

    async def discard_member(self, record: SandboxRecord) -> None:
        """Destroy an unclaimed member."""
        ...

    def member_usable(self, record: SandboxRecord) -> bool:
        """Whether a claim would hand ``record`` out now (alive, of the image version its tag names); never
        waits (a trim asks it of every member)."""
        ...


@dataclass
class _Pool:
    config: PoolConfig
    key: str
    ready: deque[SandboxRecord] = field(default_factory=deque)
    filling: set[asyncio.Task[None]] = field(default_factory=set)
    claims: deque[float] = field(default_factory=deque)
    last_claim: float = float("-inf")
    hits: int = 0
    misses: int = 0
    created: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None

    def member_spec(self) -> SandboxSpec:
        c = self.config
        return SandboxSpec(image=c.image, backend=c.backend, cpu=c.cpu, memory=c.memory, disk=c.disk, pids=c.pids,
                           workdir=c.workdir, network=c.network, timeout=_MEMBER_TIMEOUT, labels={POOL_LABEL: self.key})

    def deferred(self, now: float) -> bool:
        """Whether a refill waits (a claim in the last ``REFILL_DELAY`` s, more than half the target ready)."""
        return now - self.last_claim < REFILL_DELAY and 2 * len(self.ready) > self.target(now)

    def target(self, now: float) -> int:
        while self.claims and self.claims[0] < now - DEMAND_WINDOW:
            self.claims.popleft()
        return max(self.config.min, min(self.config.max, len(self.claims)))

    def statistics(self, now: float) -> PoolStatistics:
        return PoolStatistics(config=self.config, ready=len(self.ready), filling=len(self.filling),
                              target=self.target(now), hits=self.hits, misses=self.misses, created=self.created,
                              failures=self.failures, last_error=self.last_error)


class Pools:
    """Every warm pool of one engine, and the task that keeps them filled."""

    def __init__(self, host: PoolHost, metrics: Metrics, *, interval: float = 0.1) -> None:
        # The refill task sleeps until an event (a declaration, a claim, a member made or failed) or until
        # time alone changes something (demand leaving the window, a back-off ending); ``interval`` is the
        # least time between two such timed passes, never a polling period: an idle node's pools cost nothing.
        self._host = host
        self._metrics = metrics
        self.interval = interval
        self._pools: dict[str, _Pool] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._trimming: set[asyncio.Task[None]] = set()  # surplus members being destroyed (aclose waits)
        self.passes = 0
        """Refill passes the background task has made (an idle node makes none)."""

    def declare(self, config: PoolConfig) -> PoolStatistics:
        """Add a pool, or change an existing pool's bounds (its shape is its identity)."""
        key = key_of_config(config)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(config=config, key=key)
            log.info("pool %s declared (min %d, max %d)", key, config.min, config.max)
        else:
            pool.config = config
        self._wake.set()
        return pool.statistics(time.monotonic())

    def statistics(self) -> list[PoolStatistics]:
        """Every pool now."""
        now = time.monotonic()
        return [p.statistics(now) for p in self._pools.values()]

    def has_ready(self, spec: SandboxSpec) -> bool:
        """Whether a pool of ``spec``'s shape has a member ready now."""
        key = key_of_spec(spec)
        pool = self._pools.get(key) if key is not None else None
        return pool is not None and bool(pool.ready)

    def take(self, spec: SandboxSpec, usable: Callable[[SandboxRecord], bool] = lambda _r: True
             ) -> tuple[SandboxRecord | None, list[SandboxRecord]]:
        """A ready member for ``spec`` (counted as demand either way), or None: create it fresh. Members
        ``usable`` refuses on the way (dead, or of an image version the tag no longer names) are taken out
        and returned second, for the caller to destroy."""
        key = key_of_spec(spec)
        pool = self._pools.get(key) if key is not None else None
        if pool is None:
            return None, []
        now = time.monotonic()
        pool.claims.append(now)
        pool.last_claim = now
        unusable: list[SandboxRecord] = []
        while pool.ready and not usable(pool.ready[0]):
            unusable.append(pool.ready.popleft())
        if not pool.ready:
            self._wake.set()
            pool.misses += 1
            self._metrics.pool_claims.labels(key, "miss").inc()
            self._metrics.pool_ready.labels(key).set(0)
            return None, unusable
        pool.hits += 1
        self._metrics.pool_claims.labels(key, "hit").inc()
        record = pool.ready.popleft()
        self._metrics.pool_ready.labels(key).set(len(pool.ready))
        if pool.deferred(now):  # refilled off the request path: after the claims pause
            asyncio.get_running_loop().call_later(REFILL_DELAY, self._wake.set)
        else:
            self._wake.set()
        return record, unusable

    def start(self) -> None:
        """Start the refill task."""
        if self._task is None:
            self._task = asyncio.create_task(self._refill_forever(), name="dsec-pools")

    def drain(self) -> None:
        """Start no more refills: the daemon is stopping (the engine refuses creates, claims included)."""
        self._draining = True

    async def aclose(self) -> int:
        """Stop refilling and destroy every unclaimed member (a pool does not outlive its daemon)."""
        if self._task is not None:
            # Asked to stop rather than cancelled inside its wait: a cancel landing in asyncio.wait_for
            # while the wake-up event fires could leave the task "cancelling" forever (seen on 3.11).
            task, self._task = self._task, None
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 10.0)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Fills in flight finish and discard their member themselves (the task is gone): a cancelled create
        # leaves its backend's worker thread running past the undo (a leaked cgroup seen in CI). Cancel only
        # what is still running after FILL_CLOSE_WAIT.
        fills = [t for p in self._pools.values() for t in p.filling]
        if fills:
            _, running = await asyncio.wait(fills, timeout=FILL_CLOSE_WAIT)
            for task in running:
                task.cancel()
            await asyncio.gather(*fills, return_exceptions=True)
        if self._trimming:  # surplus members already out of ``ready``: not to be left for the next start
            await asyncio.gather(*list(self._trimming), return_exceptions=True)
        members = [r for p in self._pools.values() for r in p.ready]
        for pool in self._pools.values():
            pool.ready.clear()
            self._metrics.pool_ready.labels(pool.key).set(0)
        results = await asyncio.gather(*(self._host.discard_member(r) for r in members), return_exceptions=True)
        for record, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                log.error("pool member %s: destroy failed: %s", record.id, result)
        return len(members)

    async def wait_filled(self, timeout: float = 60.0) -> None:
        """Wait until every pool has its target of ready members (for tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if all(len(p.ready) >= p.target(now) for p in self._pools.values()):
                return
            if now >= deadline:
                raise TimeoutError(f"pools not filled within {timeout:g} s: {self.statistics()}")
            await asyncio.sleep(0.02)

    async def _refill_forever(self) -> None:
        timeout: float | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            if self._task is None:  # aclose() asked us to stop
                return
            self.passes += 1
            try:
                await self.refill()
            except Exception:
                log.exception("pool refill pass failed")
            timeout = self.next_timed_pass(time.monotonic())

    def next_timed_pass(self, now: float) -> float | None:
        """Seconds until time alone changes what a refill pass would do, at least ``interval``: the oldest
        claim leaving a pool's demand window, a back-off ending, a deferred refill coming due. None: nothing
        changes until an event wakes the task."""
        due: list[float] = []
        for pool in self._pools.values():
            if pool.claims:
                due.append(pool.claims[0] + DEMAND_WINDOW)
            if pool.retry_at > now:
                due.append(pool.retry_at)
            if pool.deferred(now):
                due.append(pool.last_claim + REFILL_DELAY)
        return max(self.interval, min(due) - now) if due else None

    async def refill(self) -> None:
        """One pass: start creates where a pool is short, destroy members above the target."""
        if self._draining:
            return
        now = time.monotonic()
        for pool in list(self._pools.values()):
            target = pool.target(now)
            self._metrics.pool_target.labels(pool.key).set(target)
            surplus = len(pool.ready) - target
            if surplus > 0 and not pool.filling:
                doomed = self._doomed(pool, surplus)
                self._metrics.pool_ready.labels(pool.key).set(len(pool.ready))
                # In the background: a long trim must not hold up the refill of the other pools.
                for record in doomed:
                    task = asyncio.create_task(self._host.discard_member(record), name=f"dsec-trim-{record.id}")
                    self._trimming.add(task)
                    task.add_done_callback(self._trimming.discard)
                continue
            if now < pool.retry_at or pool.deferred(now):
                continue
            missing = target - len(pool.ready) - len(pool.filling)
            for _ in range(max(0, min(missing, _FILL_PARALLELISM - len(pool.filling)))):
                task = asyncio.create_task(self._fill_one(pool))
                pool.filling.add(task)
                task.add_done_callback(pool.filling.discard)

    def _doomed(self, pool: _Pool, surplus: int) -> list[SandboxRecord]:
        """Take ``surplus`` members out of ``pool`` to trim: those no claim would hand out first (dead, or of an
        image version a re-import replaced: before, a trim removed the newest, new version's members and kept
        the old ones for the claims to destroy), then the newest (the oldest are warmest)."""
        unusable: list[SandboxRecord] = []
        for record in list(pool.ready):  # asked only until enough are found (each refused one is logged)
            if len(unusable) == surplus:
                break
            if not self._host.member_usable(record):
                unusable.append(record)
        for record in unusable:
            pool.ready.remove(record)
        return unusable + [pool.ready.pop() for _ in range(surplus - len(unusable))]

    async def _fill_one(self, pool: _Pool) -> None:
        try:
            await self._make_member(pool)
        finally:
            # Out of ``filling`` before the wake-up: a pass that ran first (the task's done-callbacks come
            # after the woken refill task) would count this finished fill as running and start no new one.
            task = asyncio.current_task()
            if task is not None:
                pool.filling.discard(task)
            self._wake.set()

    async def _make_member(self, pool: _Pool) -> None:
        try:
            record = await self._host.create_member(pool.member_spec())
        except asyncio.CancelledError:
            raise
        except DaemonStopping:
            return  # refused by the daemon stopping: not a failure of the pool's image or shape
        except Deferred as why:  # the node is busy with users' creates: not a failure either; soon again
            pool.retry_at = time.monotonic() + _DEFER_RETRY
            log.debug("pool %s: refill deferred: %s", pool.key, why)
            return
        except Exception as exc:
            pool.failures += 1
            pool.consecutive_failures += 1
            pool.last_error = f"{type(exc).__name__}: {exc}"
            # Back off (0.5 s doubling to 30 s): a broken image must not turn into a create storm.
            pool.retry_at = time.monotonic() + min(30.0, 0.5 * 2 ** (pool.consecutive_failures - 1))
            log.warning("pool %s: refill failed: %s", pool.key, pool.last_error)
            return  # the wake-up's pass schedules the retry once the back-off ends
        pool.consecutive_failures = 0
        pool.created += 1
        if self._pools.get(pool.key) is not pool or self._task is None:
            await self._host.discard_member(record)  # closed while it was being made
            return
        pool.ready.append(record)
        self._metrics.pool_ready.labels(pool.key).set(len(pool.ready))
