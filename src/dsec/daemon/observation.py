"""What the node tells about itself: its health, its overview for the dashboard, and its counters' history.

Owns the counter samples behind the overview's charts (one every :data:`SAMPLE_SECONDS`, :data:`HISTORY_SECONDS`
of them), the image-cache listing ``/v1/health`` reports, and the assembly of :class:`~dsec.models.NodeInfo`
and :class:`~dsec.models.NodeOverview` from the engine's parts. Must never change what it observes: it
reads records, metrics, pools and the audit trail, and never creates, destroys or pins anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from dsec._version import __version__
from dsec.config import Settings
from dsec.daemon.audit import AuditLog
from dsec.daemon.auth import JOB_LABEL
from dsec.daemon.health import Health
from dsec.daemon.image_pins import ImageResolver
from dsec.daemon.metrics import Metrics, host_load
from dsec.daemon.node_backends import NodeBackends
from dsec.daemon.pools import Pools
from dsec.daemon.records import Records
from dsec.models import ComponentHealth, CounterSample, NodeInfo, NodeLoad, NodeOverview, ids_digest

__all__ = ["HISTORY_SECONDS", "IMAGE_CACHE_REPORT_AGE", "SAMPLE_SECONDS", "Observation"]

log = logging.getLogger(__name__)

IMAGE_CACHE_REPORT_AGE = 5.0
"""Seconds a node's image cache listing in ``/v1/health`` may be old (reading it stats every chunk)."""
SAMPLE_SECONDS = 5.0
"""How often the engine samples its counters for the overview's history."""
HISTORY_SECONDS = 1800.0
"""How far back the overview's history goes."""


class Observation:
    """The node's health and overview, read from the engine's parts; ``stopping()`` says why it drains."""

    def __init__(self, settings: Settings, records: Records, backends: NodeBackends, images: ImageResolver,
                 metrics: Metrics, pools: Pools, audit: AuditLog, components: Health,
                 stopping: Callable[[], str | None]) -> None:
        self.settings = settings
        self.records = records
        self.backends = backends
        self.images = images
        self.metrics = metrics
        self.pools = pools
        self.audit = audit
        self.components = components
        self._stopping = stopping
        # The counters every SAMPLE_SECONDS (by the reaper), so a dashboard opened now can chart the past.
        self.samples: deque[CounterSample] = deque(maxlen=int(HISTORY_SECONDS / SAMPLE_SECONDS))
        self.sampled_at = 0.0

    def counters(self, totals: dict[str, float]) -> CounterSample:
        """The counters of ``totals`` (the metrics' totals) as one sample, now."""
        failures = sum(self.metrics.failures().values())
        return CounterSample(
            at=time.time(), created=int(totals.get("dsec_sandboxes_created_total", 0)),
            create_seconds_sum=totals.get("dsec_create_seconds_sum", 0.0),
            exec_count=int(totals.get("dsec_exec_seconds_count", 0)),
            exec_seconds_sum=totals.get("dsec_exec_seconds_sum", 0.0), failures=failures)

    def sample(self) -> None:
        """Append the counters to the history when ``SAMPLE_SECONDS`` have passed since the last sample."""
        now = time.monotonic()
        if now - self.sampled_at >= SAMPLE_SECONDS:
            self.sampled_at = now
            self.samples.append(self.counters(self.metrics.totals()))

    async def overview(self) -> NodeOverview:
        """The node's counters, load, failures, image cache, pools and audit trail, for the dashboard."""
        by_backend: dict[str, int] = {}
        for r in self.records.values():
            by_backend[r.spec.backend] = by_backend.get(r.spec.backend, 0) + 1
        node = NodeLoad(node=self.settings.node, sandboxes=len(self.records), by_backend=by_backend,
                        **await asyncio.to_thread(host_load))
        totals = self.metrics.totals()
        image_stats = getattr(self.images, "statistics", None)
        return NodeOverview(
            at=time.time(), nodes=[node], created=int(totals.get("dsec_sandboxes_created_total", 0)),
            create_seconds_sum=totals.get("dsec_create_seconds_sum", 0.0),
            execs={k: int(v) for k, v in self.metrics.by_label("dsec_exec_total", "outcome").items()},
            exec_seconds_sum=totals.get("dsec_exec_seconds_sum", 0.0),
            exec_count=int(totals.get("dsec_exec_seconds_count", 0)),
            failures=self.metrics.failures(),
            images=await asyncio.to_thread(image_stats) if image_stats is not None else {},
            pools=self.pools.statistics(), audit=self.audit.statistics(),
            history=[*self.samples, self.counters(totals)],
        )

    async def cached_images(self) -> dict[str, int]:
        """The images this node's chunk cache holds (name -> bytes), as ``health`` and ``node`` events say."""
        cached = getattr(self.images, "cached", None)
        if cached is None:
            return {}
        try:
            return dict(await asyncio.to_thread(cached, IMAGE_CACHE_REPORT_AGE))
        except OSError as exc:  # a cache being swept under us: report none rather than fail health
            log.warning("cannot list the image cache: %s", exc)
            return {}

    async def health(self) -> NodeInfo:
        """Identity, version, backend availability (``ok``, ``pending: <what it waits for>`` or why it cannot be
        used), the live sandbox count, the images cached and whether the daemon is stopping."""
        images = await self.cached_images()
        components = [ComponentHealth(name=c.name, state=c.state, error=c.error, since=c.since, detail=c.detail,
                                      faults=c.faults, last_error=c.last_error)
                      for c in self.components.components()]
        # What a cluster gateway reconciles against (the sandboxes it placed): its count and digest agreeing
        # with the gateway's records spares it a listing.
        placed = [r.id for r in self.records.values() if JOB_LABEL in r.spec.labels]
        return NodeInfo(
            node=self.settings.node, version=__version__, backends=self.backends.states(),
            sandboxes=len(self.records), images=images, stopping=self._stopping(),
            status=self.components.status(), components=components, placed=len(placed), digest=ids_digest(placed),
        )
