"""The ``pools`` suite: warm-pool creates, throughput over many live sandboxes, burst admission, density
and busy neighbours, with ``podman run`` measured in the same run.

Like the container suite it drives a private daemon (its own ``DSEC_HOME``) through the public SDK, so
every figure includes the HTTP API, and it removes everything it made in ``finally`` (what could not be
removed is reported under ``leaks``). The pool is declared through the API (``Client.declare_pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from dsec import AsyncSandbox, Client
from dsec.bench.container import (
    IMAGE,
    _cleanup_backend,
    _daemon,
    _leaks,
    _podman_cycle,
    _private_settings,
    _sustain,
    _Timer,
    cpu_per_cycle,
    preflight,
)
from dsec.bench.cpu import CpuWindow, daemon_pid
from dsec.bench.peers import mount_overlay, podman_argv, umount
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.isolation import affinity
from dsec.isolation.procs import mem_available, meminfo
from dsec.models import PoolConfig

__all__ = ["PHASES", "PoolBench", "run"]

PHASES = ("create", "sustained", "exec", "neighbours", "burst", "podman")
"""The suite's phases, in the order they run (``dsec bench pools --phase NAME`` runs only some)."""

MEMORY = "256Mi"
"""The shape every sandbox of the suite has (the pool's)."""


@dataclass(frozen=True)
class PoolBench:
    """Sample counts and sizes; the defaults take a few minutes on a 2-core machine."""

    pool_max: int = 32
    create_n: int = 100
    sustained_seconds: float = 10.0
    concurrency: int = 4
    live_n: int = 100
    exec_seconds: float = 5.0
    exec_workers: int = 16
    burst_n: int = 1000
    """Sandboxes of the burst (one ``create_many``); they also give the density figure."""
    neighbours: int = 8
    """Sandboxes of the busy-neighbour phase; half of them run a CPU hog."""
    neighbour_execs: int = 120
    """Execs of the busy-neighbour phase per condition (neighbours idle, neighbours hogging a CPU each)."""
    neighbour_rounds: int = 6
    """Alternations of the two conditions: the host's drift over the phase (other work on a shared machine)
    falls on both sides alike instead of on whichever was measured second."""
    podman_seconds: float = 5.0
    phases: tuple[str, ...] = ()
    """Phases to run (see :data:`PHASES`); empty: all of them."""

    def wants(self, phase: str) -> bool:
        """Whether ``phase`` is part of this run."""
        return not self.phases or phase in self.phases

    def scaled(self, factor: float) -> PoolBench:
        """Every count and duration times ``factor`` (``--quick`` / ``DSEC_BENCH_SCALE``)."""
        def n(v: int, floor: int = 1) -> int:
            return max(floor, round(v * factor))
        return replace(self, pool_max=n(self.pool_max, 4), create_n=n(self.create_n, 5),
                       sustained_seconds=max(1.0, self.sustained_seconds * factor), live_n=n(self.live_n, 4),
                       exec_seconds=max(1.0, self.exec_seconds * factor), burst_n=n(self.burst_n, 4),
                       neighbour_execs=n(self.neighbour_execs, 10),
                       podman_seconds=max(1.0, self.podman_seconds * factor))


_BURST_CHUNK = 250
"""Sandboxes per ``create_many`` request of a burst above 1,000."""
_BURST_MEMORY_FLOOR = 3 << 30
"""A burst above 1,000 stops creating when MemAvailable falls under this (bytes): past it the kernel reclaims
so hard that the node is no longer a measurement (kswapd at half a core at 1.7 GiB in a 9,200-sandbox run)."""

HOST_LIMITS_ABOVE = 2000
"""Bursts larger than this run their daemon with ``DSEC_HOST_LIMITS=1``."""


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class _Run:
    def __init__(self, cfg: PoolBench, client: Client, daemon_pid: int | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.daemon_pid = daemon_pid
        self.live: dict[str, AsyncSandbox] = {}

    async def create(self) -> AsyncSandbox:
        sandbox = await AsyncSandbox.create(image=IMAGE, memory=MEMORY, client=self.client)
        self.live[sandbox.id] = sandbox
        return sandbox

    async def destroy(self, *sandboxes: AsyncSandbox) -> None:
        async def one(sandbox: AsyncSandbox) -> None:
            await sandbox.close()
            self.live.pop(sandbox.id, None)

        sem = asyncio.Semaphore(32)

        async def bounded(sandbox: AsyncSandbox) -> None:
            async with sem:
                await one(sandbox)

        await asyncio.gather(*(bounded(s) for s in sandboxes))

    async def destroy_all(self) -> None:
        with contextlib.suppress(Exception):
            await self.destroy(*self.live.values())

    async def filled(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = await self.client.statistics()
            pools = stats.pools
            # A quiet node: the pool full and no destroyed sandbox still being torn down behind it.
            if all(p.ready >= p.target and not p.filling for p in pools) and not stats.teardowns:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the pool did not fill within {timeout:g} s: {pools}")

    async def pool_creates(self) -> dict[str, Any]:
        """Sequential creates of the pool's shape; the pool refills between them (as it would between
        an RL job's steps)."""
        creates: list[float] = []
        trips: list[float] = []
        hits = 0
        for _ in range(self.cfg.create_n):
            await self.filled()
            # The in-run peer: the same client's cheapest API round trip (the node's statistics), just before.
            t0 = time.perf_counter()
            await self.client.statistics()
            trips.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sandbox = await self.create()
            creates.append(time.perf_counter() - t0)
            hits += sandbox._info.pooled
            await self.destroy(sandbox)
        return {"latency": summarize(creates), "hits": hits, "n": len(creates),
                "round_trip_p50": summarize(trips).p50}

    async def sustained(self) -> dict[str, Any]:
        await self.filled()

        async def cycle() -> None:
            sandbox = await self.create()
            try:
                result = await sandbox.exec(["true"])
                if result.exit_code != 0:
                    raise RuntimeError(f"exec true exited {result.exit_code}")
            finally:
                await self.destroy(sandbox)

        # The pool's refills run in the daemon during the window, so its CPU per cycle is the whole cycle's,
        # refill included, but for the up to pool_max refills still running when the window closes (~3%).
        return await _sustain(cycle, self.cfg.concurrency, self.cfg.sustained_seconds, self.daemon_pid)

    async def exec_throughput(self) -> dict[str, Any]:
        made = await AsyncSandbox.create_many(self.cfg.live_n, image=IMAGE, memory=MEMORY, client=self.client)
        self.live.update((s.id, s) for s in made)
        done = 0
        failures = 0
        deadline = time.perf_counter() + self.cfg.exec_seconds

        async def worker(offset: int) -> None:
            nonlocal done, failures
            i = offset
            while time.perf_counter() < deadline:
                result = await made[i % len(made)].exec(["true"])
                done += result.exit_code == 0
                failures += result.exit_code != 0
                i += self.cfg.exec_workers

        cpu = CpuWindow(self.daemon_pid)
        cpu.start()
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker(w) for w in range(self.cfg.exec_workers)))
            elapsed = time.perf_counter() - t0
            split = cpu.stop(done + failures)
        finally:
            await self.destroy(*made)
        return {"rate": done / elapsed, "failures": failures, "live": len(made), "workers": self.cfg.exec_workers,
                **split}

    async def burst(self, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
        """One ``create_many(burst_n)`` (admission queues what the node cannot start at once), then every
        sandbox answers an exec while all are alive; memory per idle sandbox from MemAvailable."""
        n = self.cfg.burst_n
        await asyncio.sleep(1.0)
        before = mem_available()
        made: list[AsyncSandbox] = []
        t0 = time.perf_counter()
        error = None
        chunks: list[tuple[int, float, int, int]] = []
        try:
            # The API takes up to 10,000 per request; small requests keep replies small and each well inside
            # the client's read timeout when creates slow down as the node fills up.
            # Up to 1,000: one request (the burst-admission figure is about one create_many).
            chunk = n if n <= 1000 else _BURST_CHUNK
            for start in range(0, n, chunk):
                c0 = time.perf_counter()
                made += await AsyncSandbox.create_many(min(chunk, n - start), image=IMAGE, memory=MEMORY,
                                                       client=self.client)
                mem = meminfo("MemAvailable", "SUnreclaim")
                # (alive, seconds for this request, MiB available, MiB of unreclaimable kernel slab)
                chunks.append((len(made), round(time.perf_counter() - c0, 2), mem["MemAvailable"] >> 20,
                               mem["SUnreclaim"] >> 20))
                self.live.update((s.id, s) for s in made)
                progress(f"burst: {len(made)} alive, the last {min(chunk, n - start)} in {chunks[-1][1]:g} s; "
                         f"{chunks[-1][2]} MiB available, {chunks[-1][3]} MiB unreclaimable slab")
                if len(made) < n and mem["MemAvailable"] < _BURST_MEMORY_FLOOR:
                    # Stop before the node thrashes: the figure is how many fit, and the rest must still be
                    # pinged and destroyed in reasonable time.
                    error = (f"stopped at {len(made)} alive: {mem['MemAvailable'] >> 20} MiB available, under the "
                             f"bench's floor of {_BURST_MEMORY_FLOOR >> 20} MiB")
                    progress(f"burst: {error}")
                    break
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        wall = time.perf_counter() - t0
        answered = 0
        errors: list[str] = []
        sem = asyncio.Semaphore(32)

        async def ping(sandbox: AsyncSandbox) -> None:
            nonlocal answered
            async with sem:
                try:
                    result = await sandbox.exec(["true"])
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    return
                answered += result.exit_code == 0
                if result.exit_code != 0:
                    errors.append(f"exit {result.exit_code}: {result.stderr[:200]!r}")

        p0 = time.perf_counter()
        try:
            await asyncio.gather(*(ping(s) for s in made))
            ping_s = round(time.perf_counter() - p0, 2)
            await asyncio.sleep(1.0)
            after = mem_available()
        finally:
            d0 = time.perf_counter()
            await self.destroy(*made)
        queued = [s._info.queue_seconds for s in made]
        return {"n": n, "created": len(made), "failures": n - len(made), "error": error, "wall_s": wall,
                "chunks": chunks, "ping_s": ping_s, "destroy_s": round(time.perf_counter() - d0, 2),
                "answered": answered, "exec_errors": errors[:5], "queue_s_total": sum(queued),
                "queue_s_max": max(queued, default=0.0),
                "mib_per_sandbox": (before - after) / max(1, len(made)) / 2**20}

    async def neighbours(self) -> dict[str, Any]:
        """Exec latency of quiet sandboxes while the other half is idle and while it runs a CPU hog each, in
        alternating rounds (the hogs started and killed between them). Each condition is sampled a second
        after it begins: after a start, the exec that started a hog keeps its sandbox in the normal CPU class
        for half of that; after a kill, the scheduler's load averages still carry the hogs for a while."""
        k = max(2, self.cfg.neighbours)
        made = await AsyncSandbox.create_many(k, image=IMAGE, memory=MEMORY, client=self.client)
        self.live.update((s.id, s) for s in made)
        quiet, busy = made[: k // 2], made[k // 2:]
        rounds = max(1, self.cfg.neighbour_rounds)
        per_round = max(1, self.cfg.neighbour_execs // rounds)

        async def sample(into: list[float]) -> None:
            for i in range(per_round):
                t0 = time.perf_counter()
                await quiet[i % len(quiet)].exec(["true"])
                into.append(time.perf_counter() - t0)

        alone: list[float] = []
        loaded: list[float] = []
        start = "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! > /tmp/hog.pid"
        try:
            for _ in range(rounds):
                await sample(alone)
                await asyncio.gather(*(s.exec(["sh", "-c", start]) for s in busy))
                await asyncio.sleep(1.0)  # their sandboxes back in the best-effort class (no exec for a while)
                await sample(loaded)
                stopped = await asyncio.gather(*(s.exec(["sh", "-c", "kill $(cat /tmp/hog.pid)"]) for s in busy))
                if any(r.exit_code != 0 for r in stopped):  # the next "alone" round would not be
                    raise RuntimeError(f"a CPU hog could not be stopped: {stopped}")
                await asyncio.sleep(1.0)
        finally:
            await self.destroy(*made)
        a, b = summarize(alone), summarize(loaded)
        return {"alone": a, "loaded": b, "rise": b.p50 / a.p50 - 1, "busy": len(busy), "rounds": rounds,
                "wakeup": await _wakeup_probe()}


async def _wakeup_probe() -> dict[str, Any]:
    """The machine's own cross-CPU wakeup latency, idle and busy (:mod:`dsec.bench.wakeup`), in a fresh
    process since it forks."""
    node = affinity.node_cpus()  # all of the node's CPUs, not only the client's housekeeping ones
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dsec.bench.wakeup", affinity.cpu_list(node),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"skipped": "the wakeup probe took over 60 s"}
    if proc.returncode != 0:
        return {"skipped": f"the wakeup probe failed ({proc.returncode}): {err.decode(errors='replace')[-300:]}"}
    result: dict[str, Any] = json.loads(out)
    return result


async def _podman_rate(cfg: PoolBench, settings: Settings, skipped: dict[str, str]) -> dict[str, Any] | None:
    """``podman run true`` back to back, on the same image, after the daemon is down."""
    from dsec.images.node import NodeImages

    podman = shutil.which("podman")
    if podman is None:
        skipped["podman_run"] = "podman not installed (apt-get install podman)"
        return None
    image_root = (await asyncio.to_thread(NodeImages(settings).resolve, IMAGE)).rootfs
    rootfs = await asyncio.to_thread(mount_overlay, image_root, settings.home / "peers" / "podman")
    try:
        argv = podman_argv(podman, rootfs)
        return await _sustain(lambda: _podman_cycle(argv), cfg.concurrency, cfg.podman_seconds)
    except (OSError, RuntimeError) as exc:
        skipped["podman_run"] = f"cannot run here: {exc}"[:300]
        return None
    finally:
        await asyncio.to_thread(umount, rootfs)


async def run(cfg: PoolBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything; ``progress`` is told each phase as it starts."""
    node = node or Settings()
    preflight(node)
    settings = _private_settings(node)
    suite = Suite(name="pools")
    timer = _Timer()
    results: dict[str, Any] = {"config": asdict(cfg), "home": str(settings.home), "skipped": {}}
    try:
        progress(f"starting a private daemon in {settings.home}")
        # Thousands of sandboxes need more pids, inotify instances and files than a stock host allows:
        # the daemon raises them for its lifetime (DSEC_HOST_LIMITS) and restores them when it stops.
        limits = {"DSEC_HOST_LIMITS": "1"} if cfg.burst_n > HOST_LIMITS_ABOVE else {}
        control = affinity.control_cpus(settings.control_cpus)
        with _env(limits), _daemon(settings, "process"):
            client = Client(url=f"unix://{settings.socket_path}")
            bench = _Run(cfg, client, daemon_pid(settings))
            if control is not None:
                # With housekeeping CPUs (DSEC_CONTROL_CPUS) the client joins the daemon there: it stands for a
                # trainer on another machine, which takes no CPU from the node's sandboxes. Released before podman.
                results["control_cpus"] = affinity.cpu_list(control)
                affinity.pin_control(control)
            try:
                await client.declare_pool(PoolConfig(image=IMAGE, memory=MEMORY, min=cfg.pool_max // 2,
                                                     max=cfg.pool_max))
                if cfg.wants("create"):
                    progress(f"pool creates x{cfg.create_n}")
                    with timer.phase("pool create"):
                        results["pool_create"] = await bench.pool_creates()
                if cfg.wants("sustained"):
                    progress(f"pooled create->exec->destroy, {cfg.concurrency} workers, {cfg.sustained_seconds:g} s")
                    with timer.phase("pooled sustained"):
                        results["sustained"] = await bench.sustained()
                results["statistics"] = (await client.statistics()).model_dump(mode="json")
                # The rest measures plain creates: an empty pool must not hold sandboxes meanwhile.
                await client.declare_pool(PoolConfig(image=IMAGE, memory=MEMORY, min=0, max=0))
                if cfg.wants("exec"):
                    progress(f"exec throughput over {cfg.live_n} live sandboxes, {cfg.exec_seconds:g} s")
                    with timer.phase("exec throughput"):
                        results["exec_throughput"] = await bench.exec_throughput()
                if cfg.wants("neighbours"):
                    progress(f"busy neighbours ({cfg.neighbours} sandboxes, half hogging a CPU)")
                    with timer.phase("neighbours"):
                        results["neighbours"] = await bench.neighbours()
                if cfg.wants("burst"):
                    progress(f"burst: create_many({cfg.burst_n}), then an exec in each")
                    with timer.phase("burst"):
                        results["burst"] = await bench.burst(progress)
                results["admission"] = (await client.statistics()).admission.model_dump(mode="json")
            finally:
                await bench.destroy_all()
                await client.aclose()
                affinity.release()
        if cfg.wants("podman"):
            progress(f"peer: podman run rate, {cfg.podman_seconds:g} s")
            with timer.phase("podman"):
                results["podman"] = await _podman_rate(cfg, settings, results["skipped"])
    finally:
        with timer.phase("cleanup"):
            await _cleanup_backend(settings)
            results["leaks"] = _leaks(settings)
            shutil.rmtree(settings.home, ignore_errors=True)
    results["phases_s"] = timer.phases
    suite.extra = results
    if "pool_create" in results:
        suite.latencies["pool_create"] = results["pool_create"]["latency"]
        results["pool_create"]["latency"] = asdict(results["pool_create"]["latency"])
    for key in ("alone", "loaded"):
        if "neighbours" in results:
            summary = results["neighbours"][key]
            suite.latencies[f"exec_{key}"] = summary
            results["neighbours"][key] = asdict(summary)
    suite.rows = _rows(results)
    return suite


def _rows(ex: dict[str, Any]) -> list[Row]:
    skipped = ex.get("skipped", {})
    rows: list[Row] = []
    if "pool_create" in ex:
        pc = ex["pool_create"]
        p50 = pc["latency"]["p50"] * 1000
        trip = pc.get("round_trip_p50")
        rows.append(Row(f"pool create p50 ({pc['hits']}/{pc['n']} from the pool)", "ms", p50,
                        None if trip is None else trip * 1000, "GET /v1/statistics", target="≤ 5 ms",
                        passed=p50 <= 5))
    if "sustained" in ex:
        s = ex["sustained"]
        pod = ex.get("podman")
        rate = Row(f"pooled create→exec→destroy (C={s['concurrency']}, {s['failures']} failed)", "/s",
                   s["rate"], target="≥ 100/s", better="higher", passed=s["rate"] >= 100 and not s["failures"])
        versus = Row("pooled create→exec→destroy", "/s", s["rate"], pod["rate"] if pod else None, "podman run",
                     better="higher", target="≥ 20x podman run", note=skipped.get("podman_run"))
        versus.passed = versus.ratio is not None and versus.ratio >= 20
        rows += [rate, versus]
        if "cpu_ms_daemon" in s:
            rows.append(cpu_per_cycle("CPU per pooled create→exec→destroy (refills in the window included)", s))
        outside = s["cpu_ms_host"] - s["cpu_ms_client"] - s["cpu_ms_daemon"] if "cpu_ms_host" in s else 0.0
        # Clock ticks (1/100 s) round each of the three figures at both ends of the window: below that, no bound.
        resolution = 6 * 1e3 / os.sysconf("SC_CLK_TCK") / max(s["ok"], 1) if "ok" in s else 0.0
        if outside > resolution:
            # A bound, not a measurement of DSec: the rate the host's CPUs would allow if the bench's client and
            # the daemon's Python cost nothing. The rest of the host is crun, DSec's C helpers (shim, init, exec
            # helper) and the commands, the kernel's work and worker threads, and any other load on the host.
            steal = f"; the hypervisor took {s['cpu_ms_steal']:.1f} ms per cycle" if s.get("cpu_ms_steal") else ""
            rows.append(Row(f"ceiling with a client and daemon that cost nothing ({s['cpus']} CPUs ÷ "
                            f"{outside:.1f} ms of the rest of the host per cycle)", "/s", s["cpus"] * 1e3 / outside,
                            pod["rate"] if pod else None, "podman run", better="higher", target="reported",
                            note=f"crun, DSec's helpers ({s['cpu_ms_helpers']:.1f} ms with crun and the commands), "
                                 f"the kernel, any other load{steal}"))
    if "exec_throughput" in ex:
        t = ex["exec_throughput"]
        rows.append(Row(f"exec rate over {t['live']} live sandboxes ({t['workers']} clients)", "/s", t["rate"],
                        better="higher", target="≥ 1000/s", passed=t["rate"] >= 1000 and not t["failures"]))
        if "cpu_ms_daemon" in t:
            total = t["cpu_ms_client"] + t["cpu_ms_daemon"] + t["cpu_ms_helpers"]
            rows.append(Row(f"CPU per exec: client {t['cpu_ms_client']:.2f} + daemon {t['cpu_ms_daemon']:.2f} + "
                            f"helper and commands {t['cpu_ms_helpers']:.2f} ms", "ms", total, target="< 2 ms",
                            passed=total < 2))
    if "neighbours" in ex:
        nb = ex["neighbours"]
        rows.append(Row(f"exec p50 rise, {nb['busy']} neighbours hogging CPU", "%", nb["rise"] * 100,
                        target="≤ 20%", passed=nb["rise"] <= 0.2))
        wake = nb.get("wakeup") or {}
        if "busy_ms" in wake:
            rows.append(Row(f"this machine: wake a task on a CPU running a SCHED_IDLE hog, p50 (on an idle CPU "
                            f"{wake['idle_ms'][0]:g} ms)", "ms", wake["busy_ms"][0], target="reported",
                            note="not DSec: each exec hop the scheduler puts on a busy CPU "
                            "waits this long (dsec.bench.wakeup)"))
        elif wake:
            rows.append(Row("this machine: wake a task on a busy CPU", "ms", None, note=wake.get("skipped")))
    if "burst" in ex:
        b = ex["burst"]
        rows += [
            Row(f"create_many({b['n']}): failures", "", b["failures"], target="0", passed=b["failures"] == 0,
                note=b["error"]),
            Row(f"create_many({b['n']}) wall", "s", b["wall_s"]),
            Row(f"create_many({b['n']}) queued, max per create", "s", b["queue_s_max"]),
            Row(f"idle sandboxes alive and answering (of {b['n']})", "", b["answered"], better="higher",
                target="≥ 10,000 (full: --burst 10000)", passed=b["answered"] >= 10_000),
            Row("memory per idle sandbox, host", "MiB", b["mib_per_sandbox"], target="reported"),
        ]
    if ex.get("control_cpus"):  # every DSec figure of a run with housekeeping CPUs says so (the machine's does not)
        for row in rows:
            if not row.metric.startswith("this machine"):
                row.metric += f", control path on CPU {ex['control_cpus']}"
    return rows
