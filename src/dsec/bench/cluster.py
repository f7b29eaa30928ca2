"""``dsec bench cluster``: the gateway's placement overhead and a burst across a local 3-node Ray cluster.

Measured in one run, on one machine, with the real pieces (``dsec.cluster.local``: Ray head + 3 worker
nodes each with a node daemon, the gateway process, PostgreSQL), all in a private network namespace:

- create latency through the gateway (placement + forward; the state row commits after the answer) versus a create sent
  straight to one node daemon (the single-node path), interleaved; the difference is the overhead;
- the placement decision alone (``Placer.try_place``) on 160 simulated nodes, in-process;
- a burst of creates (each created then closed) from one client across the 3 nodes: time and failures.

The extrapolation to 160 nodes is written in docs/cluster.md from these figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsec.bench.container import BenchUnavailable
from dsec.bench.report import Row, Suite, summarize

__all__ = ["ClusterBench", "run"]

_SPEC: dict[str, Any] = {"image": "debian-python", "backend": "function", "cpu": 0.1, "memory": "64Mi", "timeout": 900}


@dataclass(frozen=True)
class ClusterBench:
    """Sizes of the cluster benchmark."""

    overhead_n: int = 100
    """Creates through the gateway and straight to a node (each)."""
    burst: int = 2000
    """Creates in the burst."""
    slots: int = 200
    """Function sandboxes each node accepts at once."""
    nodes: int = 3
    images: str = "/var/lib/dsec/images"

    def scaled(self, factor: float) -> ClusterBench:
        """Counts multiplied by ``factor`` (at least a few)."""
        return replace(self, overhead_n=max(5, round(self.overhead_n * factor)),
                       burst=max(20, round(self.burst * factor)))


def _placement_decision_ms(samples: int = 2000, nodes: int = 160) -> list[float]:
    from dsec.cluster.placement import Capacity, Placer
    from dsec.models import SandboxSpec

    placer = Placer()
    for i in range(nodes):
        placer.set_node(f"n{i}", Capacity(cpu=1024, memory=4 * 1024**4, slots={"function": 100_000}))
    spec = SandboxSpec.model_validate(_SPEC)
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        placer.try_place(spec, 1, "bench")
        out.append((time.perf_counter() - start) * 1000)
    return out


async def _measure(cfg: ClusterBench, url: str, token: str, node_url: str, node_token: str,
                   progress: Callable[[str], None]) -> dict[str, Any]:
    import dsec

    via: list[float] = []
    direct: list[float] = []
    async with dsec.Client(url, token) as gw, dsec.Client(node_url, node_token) as node:
        for client in (gw, node):  # warm: image mounted, zygote up, connections open
            for _ in range(3):
                await (await dsec.AsyncSandbox.create(client=client, **_SPEC)).close()
        progress(f"{cfg.overhead_n} creates through the gateway and {cfg.overhead_n} straight to a node")
        for _ in range(cfg.overhead_n):
            for client, samples in ((gw, via), (node, direct)):
                start = time.perf_counter()
                sb = await dsec.AsyncSandbox.create(client=client, **_SPEC)
                samples.append(time.perf_counter() - start)
                await sb.close()
        progress(f"burst of {cfg.burst} creates (each created, then closed) across {cfg.nodes} nodes")
        failures: list[str] = []
        per_node: dict[str, int] = {}

        async def one() -> None:
            try:
                sb = await dsec.AsyncSandbox.create(client=gw, **_SPEC)
            except dsec.DSecError as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            per_node[sb._info.node] = per_node.get(sb._info.node, 0) + 1
            try:
                await sb.close()
            except dsec.DSecError as exc:
                failures.append(f"close: {type(exc).__name__}: {exc}"[:200])

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(cfg.burst)))
        burst_s = time.perf_counter() - start
        metrics = (await gw.api.metrics_text()).decode()
    queued = next((float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("dsec_cluster_admission_queued ")), 0.0)
    return {"via": via, "direct": direct, "burst_s": burst_s, "failures": failures, "per_node": per_node,
            "queued": queued}


def _node_endpoint(dsn: str) -> tuple[str, str]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT url, token FROM dsec_cluster_nodes WHERE alive ORDER BY name LIMIT 1").fetchone()
    if row is None:
        raise BenchUnavailable("no node registered with the gateway")
    return str(row[0]), str(row[1])


def run(cfg: ClusterBench, progress: Callable[[str], None] = lambda _m: None) -> Suite:
    """Start the local cluster, measure, tear it all down (main thread: Ray's node startup sets signal
    handlers; the measuring runs its own event loop in this thread, inside the cluster's namespace)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise BenchUnavailable("ray is not installed: pip install 'dsec[cluster]'") from None
    from dsec.cluster.local import local_cluster, own_netns
    from dsec.testing.postgres import postgres_server

    if not (Path(cfg.images) / "debian-python").exists() and not any(Path(cfg.images).glob("*debian-python*")):
        progress(f"note: debian-python not found directly under {cfg.images}; creates will say if it is missing")
    suite = Suite(name="cluster")
    progress("placement decision on 160 simulated nodes (in-process)")
    decision = _placement_decision_ms()
    with own_netns(), postgres_server() as pg:
        progress(f"starting Ray head + {cfg.nodes} worker nodes, PostgreSQL and the gateway")
        started = time.perf_counter()
        with local_cluster(pg.dsn, cfg.nodes, {"bench": {}}, {"function": cfg.slots, "container": 0},
                           Path(cfg.images), admission_wait=600) as cluster:
            progress(f"cluster up in {time.perf_counter() - started:.1f} s")
            node_url, node_token = _node_endpoint(pg.dsn)
            measured = asyncio.run(_measure(cfg, cluster.gateway.url, cluster.tokens["bench"], node_url,
                                            node_token, progress))
            if measured["failures"]:  # keep the evidence: the homes are deleted at teardown
                measured["logs"] = {home.name: _tail(home / "daemon.log") for home in cluster.node_homes()}
                measured["logs"]["gateway"] = _tail(cluster.gateway.log)
    via, direct = summarize(measured["via"]), summarize(measured["direct"])
    suite.latencies = {"create_via_gateway": via, "create_direct_to_node": direct,
                       "placement_decision_160_nodes": summarize([d / 1000 for d in decision])}
    overhead_ms = (via.p50 - direct.p50) * 1000
    # Each gateway create is paired with the direct create that follows it: the median of the pairs'
    # differences cancels the machine's slow and fast periods that the difference of two p50s keeps.
    paired_ms = statistics.median(v - d for v, d in zip(measured["via"], measured["direct"], strict=True)) * 1000
    burst_rate = cfg.burst / measured["burst_s"]
    suite.rows = [
        Row("create p50, through the gateway", "ms", via.p50 * 1000, direct.p50 * 1000, "straight to the node"),
        Row("placement overhead per create (p50 of paired differences)", "ms", paired_ms, target="≤ 2 ms",
            passed=paired_ms <= 2.0),
        Row("placement overhead per create (difference of the p50s)", "ms", overhead_ms),
        Row("placement decision alone, 160 nodes (p50)", "ms", summarize(decision).p50),
        Row(f"burst of {cfg.burst} creates across {cfg.nodes} nodes", "s", measured["burst_s"]),
        Row("burst rate (create + close)", "/s", burst_rate, better="higher"),
        Row("burst failures", "", float(len(measured["failures"])), target="0",
            passed=not measured["failures"]),
    ]
    suite.extra = {"config": asdict(cfg), "per_node": measured["per_node"], "queued": measured["queued"],
                   "failures": measured["failures"][:20], "failed": len(measured["failures"]),
                   "logs": measured.get("logs", {}), "cores": _cores(), "load_average": list(os.getloadavg())}
    return suite


def _cores() -> int:
    with contextlib.suppress(Exception):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
