"""``dsec bench``: benchmarks of DSec against peers measured in the same run on the same machine.

Benchmarks are not tests: they print a table and write JSON, and nothing asserts a timing. Ratios
against the peers are the figures that count on noisy machines. Each suite is a module with an async
``run(config) -> Suite``; :data:`SUITES` lists them and ``dsec bench`` with no suite runs them all.

``DSEC_BENCH_SCALE`` multiplies every sample count and duration (``0.1`` for a quick look).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from dsec.bench.container import BenchUnavailable, ContainerBench
from dsec.bench.container import run as run_container
from dsec.bench.function import FunctionBench
from dsec.bench.function import run as run_function
from dsec.bench.images import ImagesBench
from dsec.bench.images import run as run_images
from dsec.bench.report import Suite, default_json_path, render_latencies, render_table, to_json, write_json
from dsec.bench.trajectory import TrajectoryBench
from dsec.bench.trajectory import run as run_trajectory

__all__ = ["SUITES", "main"]

SUITES = ("container", "function", "trajectory", "microvm", "images", "cluster")
"""Every suite ``dsec bench`` knows, in the order a full run measures them."""


def _scale() -> float:
    raw = os.environ.get("DSEC_BENCH_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise BenchUnavailable(f"DSEC_BENCH_SCALE must be a number, got {raw!r}") from None
    if value <= 0:
        raise BenchUnavailable(f"DSEC_BENCH_SCALE must be > 0, got {raw!r}")
    return value


def main(suite: str | None, json_path: Path | None, config: ContainerBench | FunctionBench | None = None,
         console: Console | None = None) -> int:
    """Run ``suite`` (every suite when None), print the tables, write the JSON; the exit status.

    The JSON goes to ``json_path`` or ``bench/results/<suite>-<timestamp>.json``. Exit 2 when a
    prerequisite is missing (the message names it), 1 when the run itself failed.
    """
    # Wide enough for the table even when piped (rich falls back to 80 columns without a terminal).
    out = console or Console(width=None if sys.stdout.isatty() else 140)
    err = Console(stderr=True)
    names = SUITES if suite is None else (suite,)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        err.print(f"error: unknown bench suite {unknown[0]!r}; known: {', '.join(SUITES)}")
        return 2
    started = time.time()
    results: list[Suite] = []
    try:
        scale = _scale()
        for name in names:
            out.print(f"[bold]dsec bench {name}[/bold]")
            progress = lambda m: out.print(f"  · {m}")  # noqa: E731
            if name == "cluster":
                from dsec.bench.cluster import ClusterBench
                from dsec.bench.cluster import run as run_cluster

                result = run_cluster(ClusterBench().scaled(scale), progress=progress)
            elif name == "images":
                result = asyncio.run(run_images(ImagesBench().scaled(scale), progress=progress))
            elif name == "trajectory":
                result = asyncio.run(run_trajectory(TrajectoryBench().scaled(scale), progress=progress))
            elif name == "microvm":
                from dsec.bench.microvm import run as run_microvm

                result = asyncio.run(run_microvm(samples=max(2, round(5 * scale)), idle_vms=max(2, round(8 * scale)),
                                                 progress=progress))
                out.print(f"accelerator: {result.extra.get('accelerator')}")
            elif name == "function":
                fcfg = config if isinstance(config, FunctionBench) else FunctionBench().scaled(scale)
                result = asyncio.run(run_function(fcfg, progress=progress))
            else:
                ccfg = config if isinstance(config, ContainerBench) else ContainerBench().scaled(scale)
                result = asyncio.run(run_container(ccfg, progress=progress))
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
    except BenchUnavailable as exc:
        err.print(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        err.print("interrupted (cleaned up)")
        return 130
    except Exception as exc:
        err.print(f"error: the benchmark failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        if results:
            path = json_path or default_json_path(names[0] if len(names) == 1 else "all", started)
            write_json(path, to_json(results, started))
            out.print(f"results written to {path}")
    return 0


if __name__ == "__main__":  # python -m dsec.bench [suite] [json]
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None,
                  Path(sys.argv[2]) if len(sys.argv) > 2 else None))
