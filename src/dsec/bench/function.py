"""The ``function`` suite: DSec's function backend against a bare process and a one-shot bwrap.

Two DSec figures, both honest about what they include: *through the SDK* (a real daemon in its own
process, reached over its unix socket with the public SDK, so HTTP and JSON are in every call) and
*at the backend* (the :class:`~dsec.backends.function.FunctionBackend` driven in this process, the
floor the daemon adds to). The peers run the same ``true`` in the same run: ``subprocess.run`` of
``/bin/true`` on the host (no isolation at all) and ``bwrap --unshare-all`` over the same image root
(a fresh sandbox per call, what a user would otherwise script). Throughputs use the same number of
concurrent workers for every contender. ``sb.call`` and ``sb.map`` (forked from the sandbox's Python
zygote) are measured through the SDK, with the CPU each call costs by side (the map on a sandbox given the
node's cores, and on one of the default single CPU, whose quota bounds it), and so is a neighbour's exec
latency while a grader's ``sb.map`` keeps the node busy. SandboxFusion's ``/run_code`` is measured against
a bare ``python3 -c`` (:mod:`dsec.bench.fusion`). Everything the suite creates lives in a private
``DSEC_HOME`` and is removed in ``finally``; what could not be removed is reported under ``leaks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsec import AsyncSandbox, Client
from dsec.backends.function import FunctionBackend
from dsec.bench import fusion
from dsec.bench.container import (
    BenchUnavailable,
    _cleanup_backend,
    _daemon,
    _private_settings,
    _sustain,
    _Timer,
    cpu_per_cycle,
)
from dsec.bench.cpu import CpuWindow, daemon_pid
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.models import ExecRequest
from dsec.testing.conformance import new_record

__all__ = ["PHASES", "FunctionBench", "run", "threads_rate"]

IMAGE = "debian-python"
PHASES = ("run-code",)
"""The phase ``--phase`` can run alone."""


@dataclass(frozen=True)
class FunctionBench:
    """Sample counts and durations; the defaults run the suite in ~1 min on a 2-core machine."""

    warmup: int = 20
    exec_n: int = 300
    call_n: int = 100
    map_n: int = 1500
    """Calls of the ``sb.map`` throughput phase."""
    neighbour_n: int = 100
    """Execs of a neighbour sandbox per condition (alone; while a grader's map runs)."""
    sustained_seconds: float = 8.0
    concurrency: int = 4
    peer_n: int = 100
    daemon: str = "process"
    """``"process"``: ``dsec up`` as users run it; ``"thread"``: in this process (shares its GIL)."""
    phases: tuple[str, ...] = ()
    """Run only these (``run-code``: SandboxFusion's ``/run_code`` and its peer); empty: everything."""

    def scaled(self, factor: float) -> FunctionBench:
        """Every count and duration times ``factor`` (at least 1 sample; ``DSEC_BENCH_SCALE``)."""
        def n(v: int) -> int:
            return max(1, round(v * factor))
        return replace(self, warmup=n(self.warmup), exec_n=n(self.exec_n), call_n=n(self.call_n),
                       map_n=n(self.map_n), neighbour_n=n(self.neighbour_n), peer_n=n(self.peer_n),
                       sustained_seconds=max(0.5, self.sustained_seconds * factor))


def preflight(settings: Settings) -> Path | None:
    """The image's root directory for the bwrap peer when it is a legacy directory image, None when it is
    stored chunked (mounted for the peer later); :class:`BenchUnavailable` naming what is missing."""
    from dsec.images.image_store import ImageStore

    if os.geteuid() != 0:
        raise BenchUnavailable("the function suite needs root (namespaces, mounts, cgroups)")
    reason = FunctionBackend(settings).available()
    if reason != "ok":
        raise BenchUnavailable(f"function backend unavailable: {reason}")
    root = settings.images / IMAGE / "rootfs"
    if (settings.images / IMAGE / "image.json").is_file() and root.is_dir():
        return root
    if not ImageStore(settings.images, settings.image_store).exists(IMAGE):
        raise BenchUnavailable(f"image {IMAGE!r} is not in the store at {settings.images}: "
                               f"run ./scripts/setup or `dsec image build {IMAGE}`")
    return None


def threads_rate(one: Callable[[], bool], concurrency: int, seconds: float) -> dict[str, Any]:
    """``one()`` back to back in ``concurrency`` threads for ``seconds`` (it returns whether it succeeded); runs
    per second."""
    ok = 0
    failures = 0
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        nonlocal ok, failures
        while time.perf_counter() < deadline:
            good = one()
            with lock:
                ok += good
                failures += not good

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return {"ok": ok, "failures": failures, "seconds": elapsed, "rate": ok / elapsed, "concurrency": concurrency}


def _threads_rate(argv: list[str], concurrency: int, seconds: float) -> dict[str, Any]:
    """``subprocess.run(argv)`` back to back in ``concurrency`` threads for ``seconds``; runs per second, and the
    CPU each run cost (``cpu_ms``: this process's own and that of the children it reaped), the figure to set
    DSec's CPU per exec against on a node where rates follow other people's load."""
    def one() -> bool:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False).returncode == 0

    before = os.times()
    rate = threads_rate(one, concurrency, seconds)
    after = os.times()
    spent = sum(b - a for a, b in zip(before[:4], after[:4], strict=True))
    return {**rate, "cpu_ms": spent * 1e3 / max(rate["ok"] + rate["failures"], 1)}


def _timed(argv: list[str], n: int, warmup: int) -> list[float]:
    samples = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return samples


async def _sdk(cfg: FunctionBench, client: Client, results: dict[str, Any], daemon: int | None) -> None:
    lat = results["latencies"]
    sandbox = await AsyncSandbox.create(image=IMAGE, backend="function", client=client)
    try:
        samples = []
        for i in range(cfg.warmup + cfg.exec_n):
            t0 = time.perf_counter()
            r = await sandbox.exec(["true"])
            if r.exit_code != 0:
                raise RuntimeError(f"exec true exited {r.exit_code}: {r.stderr!r}")
            if i >= cfg.warmup:
                samples.append(time.perf_counter() - t0)
        lat["sdk_exec_true"] = summarize(samples)

        async def one() -> None:
            r = await sandbox.exec(["true"])
            if r.exit_code != 0:
                raise RuntimeError(f"exec true exited {r.exit_code}")

        results["sdk_sustained"] = await _sustain(one, cfg.concurrency, cfg.sustained_seconds, daemon)
        await _calls(cfg, sandbox, client, results, daemon)
    finally:
        await sandbox.close()


async def _calls(cfg: FunctionBench, sandbox: AsyncSandbox, client: Client, results: dict[str, Any],
                 daemon: int | None) -> None:
    """sb.call latency, sb.map throughput (with its CPU per call by side), and a neighbour's exec latency alone
    and while the map keeps the node busy."""
    calls = []
    for i in range(2 + cfg.call_n):
        t0 = time.perf_counter()
        # a lambda travels by value: the image has no dsec to import a module-level function from
        if await sandbox.call(lambda x: x * x, i) != i * i:
            raise RuntimeError("sb.call returned a wrong value")
        if i >= 2:
            calls.append(time.perf_counter() - t0)
    results["latencies"]["sdk_call"] = summarize(calls)
    results["sdk_map_cpu1"] = await _map_rate(cfg, sandbox, daemon)
    # F6 is the node's rate: a grader given the node's cores (a sandbox's quota is 1 CPU by default).
    node_wide = await AsyncSandbox.create(image=IMAGE, backend="function", client=client, cpu=float(_node_cpus()))
    try:
        await node_wide.call(lambda x: x * x, 0)
        results["sdk_map"] = await _map_rate(cfg, node_wide, daemon)
    finally:
        await node_wide.close()
    neighbour = await AsyncSandbox.create(image=IMAGE, backend="function", client=client)
    try:
        await neighbour.exec(["true"])

        async def sample(into: list[float]) -> None:
            for _ in range(cfg.neighbour_n):
                t0 = time.perf_counter()
                await neighbour.exec(["true"])
                into.append(time.perf_counter() - t0)

        alone: list[float] = []
        loaded: list[float] = []
        await sample(alone)
        grader = asyncio.create_task(sandbox.map(lambda x: sum(i * i for i in range(200_000)) + x,
                                                 range(10 * cfg.map_n), concurrency=cfg.concurrency))
        try:
            await asyncio.sleep(1.0)
            await sample(loaded)
        finally:
            grader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await grader
        a, b = summarize(alone), summarize(loaded)
        results["neighbour"] = {"alone": asdict(a), "loaded": asdict(b), "rise": b.p50 / a.p50 - 1}
    finally:
        await neighbour.close()


def _node_cpus() -> int:
    return len(os.sched_getaffinity(0))


async def _map_rate(cfg: FunctionBench, sandbox: AsyncSandbox, daemon: int | None) -> dict[str, Any]:
    """``sb.map`` of ``cfg.map_n`` squares on ``sandbox``: calls per second and the CPU a call cost by side."""
    cpu = CpuWindow(daemon)
    cpu.start()
    t0 = time.perf_counter()
    got = await sandbox.map(lambda x: x * x, range(cfg.map_n), concurrency=cfg.concurrency)
    elapsed = time.perf_counter() - t0
    if got != [i * i for i in range(cfg.map_n)]:
        raise RuntimeError("sb.map returned wrong values")
    info = await sandbox.info()
    return {"calls": cfg.map_n, "seconds": elapsed, "rate": cfg.map_n / elapsed, "concurrency": cfg.concurrency,
            "sandbox_cpu": info.spec.cpu, **(cpu.stop(cfg.map_n) if daemon else {}), "load": os.getloadavg()[0]}


async def _backend(cfg: FunctionBench, settings: Settings, results: dict[str, Any]) -> None:
    from dsec.images.node import NodeImages

    backend = FunctionBackend(settings)
    await backend.start()
    images = NodeImages(settings)
    image = await asyncio.to_thread(images.resolve, IMAGE)
    record = new_record("function", image)
    try:
        await backend.create(record, image)
        request = ExecRequest(command=["true"])
        samples = []
        for i in range(cfg.warmup + cfg.exec_n):
            t0 = time.perf_counter()
            r = await backend.exec(record, request)
            if r.exit_code != 0:
                raise RuntimeError(f"exec true exited {r.exit_code}: {r.stderr!r}")
            if i >= cfg.warmup:
                samples.append(time.perf_counter() - t0)
        results["latencies"]["backend_exec_true"] = summarize(samples)

        async def one() -> None:
            if (await backend.exec(record, request)).exit_code != 0:
                raise RuntimeError("exec true failed")

        results["backend_sustained"] = await _sustain(one, cfg.concurrency, cfg.sustained_seconds)
    finally:
        await backend.destroy(record)
        await backend.aclose()
        await images.aclose(unmount=True)


def _leaks(settings: Settings) -> list[str]:
    from dsec.isolation.cgroups import CgroupSet

    backend = FunctionBackend(settings)
    found = [f"cgroup {d}" for d in CgroupSet.at(f"/{backend.cgroup_parent}").dirs.values() if Path(d).is_dir()]
    if backend.root.is_dir():
        found += [f"sandbox dir {p}" for p in backend.root.glob("sb-*")]
    return found


async def run(cfg: FunctionBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything; ``progress`` is told each phase as it starts."""
    from dsec.images.node import NodeImages

    node = node or Settings()
    legacy_root = preflight(node)
    settings = _private_settings(node)
    suite = Suite(name="function")
    timer = _Timer()
    results: dict[str, Any] = {"config": asdict(cfg), "home": str(settings.home), "skipped": {},
                               "latencies": suite.latencies, "sandbox_cpu_idle": settings.sandbox_cpu_idle}
    try:
        if cfg.phases == ("run-code",):
            await _run_code(cfg, settings, results, timer, progress)
            return _finish(suite, results, timer)
        progress(f"starting a private daemon ({cfg.daemon}) in {settings.home}")
        with contextlib.ExitStack() as daemon:
            with timer.phase("daemon start"):
                daemon.enter_context(_daemon(settings, cfg.daemon))
            client = Client(url=f"unix://{settings.socket_path}")
            try:
                progress(f"SDK: exec true x{cfg.exec_n}, sustained {cfg.sustained_seconds:g} s "
                         f"(C={cfg.concurrency}), sb.call x{cfg.call_n}, sb.map x{cfg.map_n}, a neighbour's exec "
                         f"x{cfg.neighbour_n} alone and beside a map")
                with timer.phase("sdk"):
                    await _sdk(cfg, client, results, daemon_pid(settings) if cfg.daemon == "process" else None)
            finally:
                await client.aclose()
        await _run_code(cfg, settings, results, timer, progress)
        progress(f"backend: exec true x{cfg.exec_n}, sustained {cfg.sustained_seconds:g} s")
        with timer.phase("backend"):
            await _backend(cfg, settings, results)
        progress(f"peer: subprocess.run(['true']) x{cfg.peer_n} and sustained")
        with timer.phase("bare"):
            suite.latencies["bare_true"] = summarize(await asyncio.to_thread(_timed, ["/bin/true"], cfg.peer_n, 5))
            results["bare_sustained"] = await asyncio.to_thread(
                _threads_rate, ["/bin/true"], cfg.concurrency, cfg.sustained_seconds)
        # a chunked image: the same lazily mounted root the backend phase used
        image_root = legacy_root or (await asyncio.to_thread(NodeImages(settings).resolve, IMAGE)).rootfs
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            results["skipped"]["bwrap"] = "bwrap not installed (apt-get install bubblewrap)"
        else:
            argv = [bwrap, "--unshare-all", "--ro-bind", str(image_root), "/", "--proc", "/proc",
                    "--dev", "/dev", "/bin/true"]
            progress(f"peer: bwrap --unshare-all x{cfg.peer_n} and sustained")
            with timer.phase("bwrap"):
                suite.latencies["bwrap"] = summarize(await asyncio.to_thread(_timed, argv, cfg.peer_n, 3))
                results["bwrap_sustained"] = await asyncio.to_thread(
                    _threads_rate, argv, cfg.concurrency, cfg.sustained_seconds)
    finally:
        with timer.phase("cleanup"):
            with contextlib.suppress(Exception):
                await FunctionBackend(settings).cleanup_orphans(set())
            with contextlib.suppress(Exception):  # the home's image mounts, then their FUSE server
                await NodeImages(settings).aclose(unmount=True)
            await _cleanup_backend(settings)  # what the node's container side keeps: its mount holder
            results["leaks"] = _leaks(settings)
            shutil.rmtree(settings.home, ignore_errors=True)
    return _finish(suite, results, timer)


async def _run_code(cfg: FunctionBench, settings: Settings, results: dict[str, Any], timer: _Timer,
                    progress: Callable[[str], None]) -> None:
    progress(f"run_code (SandboxFusion's API): print(1) x{cfg.call_n}, sustained {cfg.sustained_seconds:g} s "
             f"(C={cfg.concurrency}), and the bare python3 -c peer")
    with timer.phase("run_code"):
        await fusion.measure(settings, cfg.call_n, cfg.warmup, cfg.concurrency, cfg.sustained_seconds, results)


def _finish(suite: Suite, results: dict[str, Any], timer: _Timer) -> Suite:
    results["phases_s"] = timer.phases
    results.pop("latencies", None)
    suite.extra = results
    suite.rows = _rows(suite)
    return suite


def _rows(suite: Suite) -> list[Row]:
    """The table: DSec figures, their peers, and the issue's targets."""
    lat, ex = suite.latencies, suite.extra
    skipped = ex.get("skipped", {})
    rows: list[Row] = []

    def ms(key: str) -> float | None:
        return lat[key].p50 * 1000 if key in lat else None

    for key, where in (("sdk_exec_true", "SDK+daemon"), ("backend_exec_true", "backend")):
        if key not in lat:
            continue
        p50 = lat[key].p50 * 1000
        rows += [Row(f"exec true p50 ({where})", "ms", p50, ms("bare_true"), "subprocess.run(true)",
                     target="≤ 3 ms", passed=p50 <= 3),
                 Row(f"exec true p50 ({where})", "ms", p50, ms("bwrap"), "bwrap --unshare-all",
                     note=skipped.get("bwrap")),
                 Row(f"exec true p90 ({where})", "ms", lat[key].p90 * 1000),
                 Row(f"exec true p99 ({where})", "ms", lat[key].p99 * 1000)]
    for key, where in (("sdk_sustained", "SDK+daemon"), ("backend_sustained", "backend")):
        if key not in ex:
            continue
        s = ex[key]
        label = f"calls/s ({where}, C={s['concurrency']}, {s['failures']} failed)"
        rows.append(Row(label, "/s", s["rate"], target="≥ 500/s", better="higher",
                        passed=s["rate"] >= 500 and not s["failures"]))
        bare = ex.get("bare_sustained")
        if "cpu_ms_daemon" in s:
            rows.append(_cpu_row(f"CPU per exec ({where})", s, bare, ex))
        if bare:
            row = Row(label, "/s", s["rate"], bare["rate"], "subprocess.run(true)", better="higher",
                      target="≥ 0.5x")
            row.passed = row.ratio is not None and row.ratio >= 0.5
            rows.append(row)
        bw = ex.get("bwrap_sustained")
        row = Row(label, "/s", s["rate"], bw["rate"] if bw else None, "bwrap --unshare-all", better="higher",
                  target="≥ 2x", note=skipped.get("bwrap"))
        row.passed = row.ratio is not None and row.ratio >= 2
        rows.append(row)
    if "sdk_call" in lat:
        p50 = lat["sdk_call"].p50 * 1000
        rows.append(Row("sb.call(lambda x: x * x, i) p50 (SDK+daemon)", "ms", p50, target="≤ 5 ms", passed=p50 <= 5,
                        note="forked from the sandbox's Python zygote"))
    if "sdk_map" in ex:
        m = ex["sdk_map"]
        on = f", cpu={m['sandbox_cpu']:g}" if "sandbox_cpu" in m else ""
        rows.append(Row(f"sb.map throughput (C={m['concurrency']}, {m['calls']} calls{on})", "/s", m["rate"],
                        target="≥ 300/s", better="higher", passed=m["rate"] >= 300))
        if "cpu_ms_daemon" in m:
            rows.append(_cpu_row("CPU per sb.map call", m, None, ex))
    if "sdk_map_cpu1" in ex:
        m = ex["sdk_map_cpu1"]
        rows.append(Row(f"sb.map throughput on a cpu={m['sandbox_cpu']:g} sandbox", "/s", m["rate"],
                        better="higher", note="bounded by the sandbox's CPU quota"))
    if "neighbour" in ex:
        nb = ex["neighbour"]
        rows.append(Row("neighbour's exec p50 rise while a grader's sb.map runs", "%", nb["rise"] * 100,
                        target="≤ 20%", passed=nb["rise"] <= 0.2,
                        note=f"alone {nb['alone']['p50'] * 1000:.2f} ms, beside the map "
                             f"{nb['loaded']['p50'] * 1000:.2f} ms"))
    return rows + fusion.fusion_rows(lat, ex)


def _cpu_row(label: str, s: dict[str, Any], bare: dict[str, Any] | None, ex: dict[str, Any]) -> Row:
    """CPU per call by side, set against a bare ``subprocess.run``'s when given (the peer of F3 in CPU, which
    holds up where the sandboxes' idle CPU class makes rates follow the node's other load)."""
    row = cpu_per_cycle(label, s)
    cls = "sandboxes idle class" if ex.get("sandbox_cpu_idle", True) else "sandboxes normal weight"
    row.note = f"{row.note}; {cls}"
    if bare and "cpu_ms" in bare:
        row.peer, row.peer_name = bare["cpu_ms"], "subprocess.run(true)"
    return row
