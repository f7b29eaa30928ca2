"""Prometheus metrics of one engine, in a registry of its own.

Owns metric names, labels and buckets. A registry per engine (not the process-global default) because
tests and embedders build many engines in one process and must not see each other's counts. This module
never decides anything: the engine calls it on every path.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dsec.isolation.procs import meminfo

__all__ = ["CONTENT_TYPE", "Metrics", "host_load"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# 1 ms .. 10 min: an `echo` and a full test suite must both land in a meaningful bucket.
EXEC_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
CREATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The engine's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.live = Gauge("dsec_sandboxes_live", "Sandboxes alive now", ["backend"], registry=r)
        self.created = Counter("dsec_sandboxes_created", "Sandboxes created", ["backend"], registry=r)
        self.failed = Counter(
            "dsec_sandboxes_failed", "Sandbox creations that failed", ["backend", "reason"], registry=r
        )
        self.create_seconds = Histogram(
            "dsec_create_seconds", "Time to create a sandbox", ["backend"], buckets=CREATE_BUCKETS, registry=r
        )
        self.exec_seconds = Histogram(
            "dsec_exec_seconds", "Wall time of execs", ["backend"], buckets=EXEC_BUCKETS, registry=r
        )
        self.execs = Counter("dsec_exec", "Execs by outcome", ["backend", "outcome"], registry=r)
        self.limit_hits = Counter(
            "dsec_limit_hits", "Execs ended by a limit", ["backend", "limit"], registry=r
        )
        self.expired = Counter(
            "dsec_sandboxes_expired", "Sandboxes destroyed at their timeout", ["backend"], registry=r
        )
        self.lost = Counter(
            "dsec_sandboxes_lost", "Sandboxes that died on their own (or whose image mount died) and could not be "
            "revived, by the component that failed", ["backend", "component"], registry=r
        )
        self.teardown_failures = Counter(
            "dsec_teardown_failures", "Background teardowns of destroyed pooled sandboxes that failed (the record "
            "is kept and the next start retries)", ["backend"], registry=r
        )

        self.pool_ready = Gauge("dsec_pool_ready", "Warm-pool sandboxes ready to be claimed", ["pool"], registry=r)
        self.pool_target = Gauge("dsec_pool_target", "Ready sandboxes a warm pool aims for", ["pool"], registry=r)
        self.pool_claims = Counter(
            "dsec_pool_claims", "Creates of a pooled shape, by outcome (hit, miss)", ["pool", "outcome"], registry=r
        )
        self.admission_seconds = Histogram(
            "dsec_admission_queue_seconds", "Time a create waited for admission (not part of dsec_create_seconds)",
            ["backend"], buckets=(0.0, *CREATE_BUCKETS), registry=r,
        )

        self._exec_children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def exec_done(self, backend: str, outcome: str, seconds: float) -> None:
        """Count one exec (or call) and observe its wall time: the hot path's two samples, their labelled
        children looked up once per (backend, outcome) rather than at every exec."""
        children = self._exec_children.get((backend, outcome))
        if children is None:
            children = self._exec_children[(backend, outcome)] = (
                self.execs.labels(backend, outcome), self.exec_seconds.labels(backend))
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0.0 when never set); for tests and ``statistics()``."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def totals(self) -> dict[str, float]:
        """Every sample name -> its value summed over all labels (``dsec_exec_seconds_sum``, ...)."""
        found: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sample ``name`` summed per value of ``label``."""
        found: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name:
                    key = sample.labels.get(label, "")
                    found[key] = found.get(key, 0.0) + sample.value
        return found

    def failures(self) -> dict[str, int]:
        """Failed creations by reason, and ``limit:<name>`` for commands ended by a limit."""
        out = {k: int(v) for k, v in self.by_label("dsec_sandboxes_failed_total", "reason").items() if v}
        out.update({f"limit:{k}": int(v) for k, v in self.by_label("dsec_limit_hits_total", "limit").items() if v})
        return out


def host_load() -> dict[str, Any]:
    """The host's load averages, CPU count and memory in use (from /proc; empty fields when unreadable)."""
    out: dict[str, Any] = {"cpus": os.cpu_count() or 0}
    try:
        out["load"] = list(os.getloadavg())
    except OSError:
        out["load"] = []
    try:
        info = meminfo("MemTotal", "MemAvailable")
        out["memory_total_bytes"] = info["MemTotal"]
        out["memory_used_bytes"] = info["MemTotal"] - info["MemAvailable"]
    except (OSError, ValueError, RuntimeError):
        pass
    return out
