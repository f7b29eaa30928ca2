"""``dsec bench``: benchmarks of DSec against peers measured in the same run on the same machine.

Benchmarks are not tests: they print a table and write JSON, and nothing asserts a timing. Ratios
against the peers are the figures that count on noisy machines. Each suite is a module with an async
``run(config) -> Suite``; :data:`SUITES` lists them and ``dsec bench`` with no suite runs them all.

``DSEC_BENCH_SCALE`` multiplies every sample count and duration (``--quick``: times 0.1). A full run
ends with one summary table of every suite's rows (targets, peers of the same run, ratios).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec.bench.cluster import ClusterBench
from dsec.bench.cluster_sim import ClusterSimBench
from dsec.bench.container import BenchUnavailable, ContainerBench
from dsec.bench.container import run as run_container
from dsec.bench.function import FunctionBench
from dsec.bench.function import run as run_function
from dsec.bench.images import ImagesBench
from dsec.bench.images import run as run_images
from dsec.bench.pools import PoolBench
from dsec.bench.pools import run as run_pools
from dsec.bench.report import (
    Suite,
    default_json_path,
    render_latencies,
    render_summary,
    render_table,
    to_json,
    write_json,
)
from dsec.bench.soak import SoakBench
from dsec.bench.surface import SurfaceBench
from dsec.bench.trajectory import TrajectoryBench
from dsec.bench.trajectory import run as run_trajectory

__all__ = ["ON_DEMAND", "QUICK_SCALE", "SUITES", "main"]

SUITES = ("startup", "container", "function", "pools", "trajectory", "surface", "microvm", "vm", "images", "builds",
          "inspect", "cluster", "e2b", "cluster-sim")
"""Every suite a full ``dsec bench`` runs, in order."""
ON_DEMAND = ("soak",)
"""Suites run only when named (``dsec bench soak --minutes N``): long, and they kill the node's parts."""

QUICK_SCALE = 0.1
"""``--quick``: every sample count and duration times this (on top of ``DSEC_BENCH_SCALE``)."""

Config = ContainerBench | FunctionBench | PoolBench | ClusterBench | ClusterSimBench | SurfaceBench | SoakBench


def _scale() -> float:
    raw = os.environ.get("DSEC_BENCH_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise BenchUnavailable(f"DSEC_BENCH_SCALE must be a number, got {raw!r}") from None
    if value <= 0:
        raise BenchUnavailable(f"DSEC_BENCH_SCALE must be > 0, got {raw!r}")
    return value


def _run_one(name: str, scale: float, config: Config | None, progress: Callable[[str], None],
             idle_vms: int | None = None) -> Suite:
    if name == "cluster":
        from dsec.bench.cluster import run as run_cluster

        return run_cluster(config if isinstance(config, ClusterBench) else ClusterBench().scaled(scale),
                           progress=progress)
    if name == "builds":
        from dsec.bench.builds import run as run_builds

        return run_builds(samples=max(2, round(3 * scale)), progress=progress)
    if name == "inspect":
        from dsec.bench.harnesses import run as run_inspect

        return run_inspect(rounds=max(1, round(2 * scale)), progress=progress)
    if name == "cluster-sim":
        from dsec.bench.cluster_sim import run as run_cluster_sim

        return run_cluster_sim(config if isinstance(config, ClusterSimBench) else ClusterSimBench().scaled(scale),
                               progress=progress)
    if name == "soak":
        from dsec.bench.soak import SoakBench
        from dsec.bench.soak import run as run_soak

        return asyncio.run(run_soak(config if isinstance(config, SoakBench) else SoakBench().scaled(scale),
                                    progress=progress))
    if name == "images":
        return asyncio.run(run_images(ImagesBench().scaled(scale), progress=progress))
    if name == "startup":
        from dsec.bench.startup import run as run_startup

        return _run_lean(run_startup(samples=max(2, round(5 * scale)), progress=progress))
    if name == "e2b":
        from dsec.bench.e2b import E2BBench
        from dsec.bench.e2b import run as run_e2b

        return run_e2b(E2BBench().scaled(scale), progress=progress)
    if name == "surface":
        from dsec.bench.surface import run as run_surface

        scfg = config if isinstance(config, SurfaceBench) else SurfaceBench().scaled(scale)
        return _run_lean(run_surface(scfg, progress=progress))
    if name == "trajectory":
        return asyncio.run(run_trajectory(TrajectoryBench().scaled(scale), progress=progress))
    if name == "microvm":
        from dsec.bench.microvm import run as run_microvm

        return asyncio.run(run_microvm(samples=max(2, round(5 * scale)),
                                       idle_vms=idle_vms or max(2, round(8 * scale)), progress=progress))
    if name == "vm":
        from dsec.bench.vm import run as run_vm

        return asyncio.run(run_vm(samples=max(2, round(3 * scale)), idle_vms=max(2, round(3 * scale)),
                                  progress=progress))
    if name == "function":
        fcfg = config if isinstance(config, FunctionBench) else FunctionBench().scaled(scale)
        return _run_lean(run_function(fcfg, progress=progress))
    if name == "pools":
        pcfg = config if isinstance(config, PoolBench) else PoolBench().scaled(scale)
        return _run_lean(run_pools(pcfg, progress=progress))
    ccfg = config if isinstance(config, ContainerBench) else ContainerBench().scaled(scale)
    return _run_lean(run_container(ccfg, progress=progress))


def _run_lean(work: Coroutine[Any, Any, Suite]) -> Suite:
    """Run an exec-heavy suite's client on the daemon's event loop (uvloop when installed): the client shares
    the node's two cores with the daemon it measures, so its own CPU per call is part of every rate."""
    from dsec.daemon.server import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(work)


def _selected(suite: str | Sequence[str] | None, skip: Sequence[str]) -> tuple[str, ...]:
    wanted = SUITES if not suite else (suite,) if isinstance(suite, str) else tuple(suite)
    unknown = [n for n in (*wanted, *skip) if n not in SUITES + ON_DEMAND]
    if unknown:
        raise BenchUnavailable(f"unknown bench suite {unknown[0]!r}; known: {', '.join(SUITES + ON_DEMAND)}")
    return tuple(n for n in wanted if n not in skip)


def main(suite: str | Sequence[str] | None, json_path: Path | None, config: Config | None = None,
         console: Console | None = None, *, skip: Sequence[str] = (), quick: bool = False,
         idle_vms: int | None = None) -> int:
    """Run ``suite`` (a name, several, or every suite when None) minus ``skip``, print the tables and one
    summary table of every suite, write the JSON; the exit status.

    The JSON goes to ``json_path`` or ``bench/results/<suite>-<timestamp>.json``. Exit 2 when a
    prerequisite is missing or a suite name is unknown (the message names it), 1 when a run failed;
    the other suites still run and are reported.
    """
    # Wide enough for the table even when piped (rich falls back to 80 columns without a terminal).
    out = console or Console(width=None if sys.stdout.isatty() else 140)
    err = Console(stderr=True)
    try:
        names = _selected(suite, skip)
        scale = _scale() * (QUICK_SCALE if quick else 1.0)
    except BenchUnavailable as exc:
        err.print(f"error: {exc}")
        return 2
    started = time.time()
    results: list[Suite] = []
    failed: dict[str, str] = {}
    code = 0
    try:
        for name in names:
            out.print(f"[bold]dsec bench {name}[/bold]")
            progress = lambda m: out.print(f"  · {m}")  # noqa: E731
            try:
                result = _run_one(name, scale, config, progress, idle_vms)
            except BenchUnavailable as exc:
                err.print(f"error: {name}: {exc}")
                failed[name] = str(exc)
                code = max(code, 2) if len(names) == 1 else max(code, 1)
                continue
            except Exception as exc:
                err.print(f"error: the {name} benchmark failed: {type(exc).__name__}: {exc}")
                failed[name] = f"{type(exc).__name__}: {exc}"
                code = 1
                continue
            if name in ("microvm", "vm"):
                out.print(f"accelerator: {result.extra.get('accelerator')}")
            results.append(result)
            out.print(render_table(result))
            out.print(render_latencies(result))
            phases = ", ".join(f"{k} {v:.1f}s" for k, v in result.extra.get("phases_s", {}).items())
            out.print(f"phases: {phases}")
            for peer, why in result.extra.get("skipped", {}).items():
                out.print(f"[yellow]skipped {peer}[/yellow]: {why}")
            leaks = result.extra.get("leaks") or []
            if leaks:
                err.print(f"[red]left behind[/red]: {', '.join(leaks)}")
        if len(names) > 1 and results:
            out.print(render_summary(results, failed))
    except KeyboardInterrupt:
        err.print("interrupted (cleaned up)")
        return 130
    finally:
        if results:
            path = json_path or default_json_path(names[0] if len(names) == 1 else "all", started)
            document = to_json(results, started)
            document["failed"] = failed
            document["scale"] = scale
            write_json(path, document)
            out.print(f"results written to {path}")
    return code


if __name__ == "__main__":  # python -m dsec.bench [suite] [json]
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None,
                  Path(sys.argv[2]) if len(sys.argv) > 2 else None))
