"""The ``container`` suite: DSec's container backend against runc, bwrap, podman and a bare process.

DSec is driven exactly as users drive it: a real daemon (its own process by default, with the real
:class:`~dsec.backends.container.ContainerBackend`) reached through the public SDK over its unix
socket, so every figure includes the HTTP API. The daemon lives in a private temporary ``DSEC_HOME``
under /var/tmp: the bench never sees or touches the sandboxes of a daemon already running on the
node. Every sandbox, mount, cgroup and runc container it makes is removed in ``finally``; what could
not be removed is reported under ``leaks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsec import AsyncSandbox, Client
from dsec.bench.cpu import CpuWindow, daemon_pid
from dsec.bench.peers import RuncPeer, mount_overlay, podman_argv, time_command, umount
from dsec.bench.report import Row, Suite, Summary, summarize
from dsec.config import Settings
from dsec.isolation.binaries import HELPERS, binary_path, ensure_init
from dsec.isolation.procs import mem_available

__all__ = ["BenchUnavailable", "ContainerBench", "run"]

IMAGE = "debian-python"


class BenchUnavailable(RuntimeError):
    """A prerequisite of the suite is missing (root, runc, the image); the message names the fix."""


@dataclass(frozen=True)
class ContainerBench:
    """Sample counts and durations; the defaults run the suite in ~1-2 min on a 2-core machine."""

    warmup: int = 3
    create_n: int = 30
    exec_n: int = 200
    runc_exec_n: int = 30
    runc_run_n: int = 20
    true_n: int = 50
    bwrap_n: int = 30
    podman_n: int = 10
    sustained_seconds: float = 10.0
    podman_sustained_seconds: float = 5.0
    concurrency: int = 4
    idle_k: int = 50
    batch_n: int = 20
    batch_reps: int = 3
    settle_seconds: float = 3.0
    """Pause before the peers, so they too are measured on a node not busy tearing down sandboxes."""
    daemon: str = "process"
    """``"process"``: ``dsec up`` as users run it; ``"thread"``: in this process (shares its GIL)."""

    def scaled(self, factor: float) -> ContainerBench:
        """Every count and duration times ``factor`` (at least 1 sample; ``DSEC_BENCH_SCALE``)."""
        def n(v: int) -> int:
            return max(1, round(v * factor))
        return replace(
            self, warmup=n(self.warmup), create_n=n(self.create_n), exec_n=n(self.exec_n),
            runc_exec_n=n(self.runc_exec_n), runc_run_n=n(self.runc_run_n), true_n=n(self.true_n),
            bwrap_n=n(self.bwrap_n), podman_n=n(self.podman_n),
            sustained_seconds=max(0.5, self.sustained_seconds * factor),
            settle_seconds=self.settle_seconds * factor,
            podman_sustained_seconds=max(0.5, self.podman_sustained_seconds * factor),
            idle_k=n(self.idle_k), batch_n=n(self.batch_n), batch_reps=n(self.batch_reps),
        )


def _ms(seconds: float) -> float:
    return seconds * 1000


def preflight(settings: Settings) -> tuple[str, Path | None]:
    """runc's path and the image root (None: mount the chunked image), or :class:`BenchUnavailable`."""
    if os.geteuid() != 0:
        raise BenchUnavailable("the container suite needs root (namespaces, overlay mounts, cgroups)")
    runc = shutil.which("runc")
    if runc is None:
        raise BenchUnavailable("runc not found: apt-get install runc")
    from dsec.images.image_store import ImageStore

    root = settings.images / IMAGE / "rootfs"
    if (settings.images / IMAGE / "image.json").is_file() and root.is_dir():
        return runc, root  # a legacy directory image: the runc peer can use it as is
    if not ImageStore(settings.images, settings.image_store).exists(IMAGE):
        raise BenchUnavailable(f"image {IMAGE!r} is not in the store at {settings.images}: "
                               f"run ./scripts/setup or `dsec image build {IMAGE}`")
    return runc, None


def _private_settings(node: Settings) -> Settings:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/var/tmp"))
    os.chmod(home, 0o755)  # the container's shifted root must traverse to the init binary
    # Reuse the node's built helpers (same source digest and libc) instead of compiling them per run.
    (home / "bin").mkdir()
    for source, name in HELPERS:
        built = binary_path(source, name, node.home / "bin", musl=True)
        if built.is_file():
            shutil.copy2(built, home / "bin" / built.name)
    return Settings(home=home, images_dir=node.images, node="bench")


@contextlib.contextmanager
def _daemon(settings: Settings, mode: str) -> Iterator[None]:
    """A daemon on ``settings``' socket for the duration; stopped (sandboxes destroyed) on exit. A daemon with
    housekeeping CPUs runs as a process of its own whatever ``mode`` says: pinned, it pins every thread of the
    process it runs in, and so would pin the bench's client and its peers."""
    from dsec.daemon import server

    if mode == "process" or settings.control_cpus:
        server.up(settings, timeout=60)
        try:
            yield
        finally:
            server.down(settings, destroy=True)
        return
    daemon = server.Daemon(settings)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(daemon.run())
        except BaseException as exc:  # reported to the bench thread below
            errors.append(exc)
            daemon.started.set()

    thread = threading.Thread(target=serve, name="dsec-bench-daemon", daemon=True)
    thread.start()
    daemon.started.wait(60)
    if errors:
        raise errors[0]
    try:
        yield
    finally:
        daemon.stop()
        thread.join(60)


class _Timer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(time.perf_counter() - t0, 3)


class _Run:
    """One run of the suite against one daemon; ``live`` holds sandboxes to destroy on failure."""

    def __init__(self, cfg: ContainerBench, client: Client) -> None:
        self.cfg = cfg
        self.client = client
        self.live: dict[str, AsyncSandbox] = {}

    async def create(self) -> AsyncSandbox:
        sandbox = await AsyncSandbox.create(image=IMAGE, client=self.client)
        self.live[sandbox.id] = sandbox
        return sandbox

    async def destroy(self, sandbox: AsyncSandbox) -> None:
        await sandbox.close()
        self.live.pop(sandbox.id, None)

    async def destroy_all(self) -> None:
        for sandbox in list(self.live.values()):
            with contextlib.suppress(Exception):
                await self.destroy(sandbox)

    @contextlib.asynccontextmanager
    async def one(self) -> AsyncIterator[AsyncSandbox]:
        sandbox = await self.create()
        try:
            yield sandbox
        finally:
            await self.destroy(sandbox)

    async def create_latency(self) -> tuple[list[float], list[float]]:
        creates: list[float] = []
        destroys: list[float] = []
        for i in range(self.cfg.warmup + self.cfg.create_n):
            t0 = time.perf_counter()
            sandbox = await self.create()
            t1 = time.perf_counter()
            await self.destroy(sandbox)
            t2 = time.perf_counter()
            if i >= self.cfg.warmup:
                creates.append(t1 - t0)
                destroys.append(t2 - t1)
        return creates, destroys

    async def exec_latency(self, sandbox: AsyncSandbox) -> list[float]:
        samples: list[float] = []
        for i in range(self.cfg.warmup * 5 + self.cfg.exec_n):
            t0 = time.perf_counter()
            result = await sandbox.exec(["true"])
            elapsed = time.perf_counter() - t0
            if result.exit_code != 0:
                raise RuntimeError(f"exec true exited {result.exit_code}")
            if i >= self.cfg.warmup * 5:
                samples.append(elapsed)
        return samples

    async def sustained(self, daemon: int | None = None) -> dict[str, Any]:
        """C4; with ``daemon`` (the pid of a daemon process) also the CPU per cycle of this client, the daemon and
        everything under it (runtime, inits, exec helper, commands), which holds up under load where rates do
        not."""
        async def cycle() -> None:
            async with self.one() as sandbox:
                result = await sandbox.exec(["true"])
                if result.exit_code != 0:
                    raise RuntimeError(f"exec true exited {result.exit_code}")

        return await _sustain(cycle, self.cfg.concurrency, self.cfg.sustained_seconds, daemon)

    async def idle_memory(self) -> dict[str, Any]:
        k = self.cfg.idle_k
        await asyncio.sleep(0.5)
        before = mem_available()
        sandboxes: list[AsyncSandbox] = []
        try:
            for start in range(0, k, 10):
                batch = await AsyncSandbox.create_many(min(10, k - start), image=IMAGE, client=self.client)
                sandboxes += batch
                self.live.update((s.id, s) for s in batch)
            await asyncio.sleep(1.0)  # let the inits settle and the page cache account
            after = mem_available()
            charged = sum([(await s.stats()).memory_bytes for s in sandboxes])
        finally:
            for sandbox in sandboxes:
                await self.destroy(sandbox)
        return {"k": k, "host_bytes_per_sandbox": (before - after) / k,
                "cgroup_bytes_per_sandbox": charged / k}

    async def batch(self) -> list[float]:
        samples: list[float] = []
        for _ in range(self.cfg.batch_reps):
            t0 = time.perf_counter()
            batch = await AsyncSandbox.create_many(self.cfg.batch_n, image=IMAGE, client=self.client)
            samples.append(time.perf_counter() - t0)
            self.live.update((s.id, s) for s in batch)
            for sandbox in batch:
                await self.destroy(sandbox)
        return samples


async def _sustain(cycle: Callable[[], Awaitable[None]], concurrency: int, seconds: float,
                   daemon: int | None = None) -> dict[str, Any]:
    """Run ``cycle`` back to back in ``concurrency`` workers for ``seconds``; completed cycles per second, and
    with ``daemon`` (the pid of a daemon process) the CPU per cycle of this client, the daemon and everything
    under it (:class:`~dsec.bench.cpu.CpuWindow`), which holds up under load where rates do not."""
    ok = 0
    failures: list[str] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal ok
        while time.perf_counter() < deadline:
            try:
                await cycle()
                ok += 1
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:200])

    cpu = CpuWindow(daemon)
    cpu.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    result = {"ok": ok, "failures": len(failures), "first_failures": failures[:3], "seconds": elapsed,
              "rate": ok / elapsed, "concurrency": concurrency}
    if daemon is not None:
        result.update(cpu.stop(ok), load=os.getloadavg()[0])
    return result


def cpu_per_cycle(label: str, s: dict[str, Any]) -> Row:
    """The row of a :func:`_sustain` result's CPU per cycle."""
    total = s["cpu_ms_client"] + s["cpu_ms_daemon"] + s["cpu_ms_helpers"]
    host = f"; whole host {s['cpu_ms_host']:.1f} ms" if "cpu_ms_host" in s else ""
    return Row(label, "ms", total, target="reported",
               note=f"client {s['cpu_ms_client']:.1f} + daemon {s['cpu_ms_daemon']:.1f} + under it "
                    f"{s['cpu_ms_helpers']:.1f} ms{host}, load {s['load']:.1f}")


async def _podman_cycle(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"podman run exited {proc.returncode}: {err.decode(errors='replace').strip()}")


def _leaks(settings: Settings, peer: RuncPeer | None = None) -> list[str]:
    """Host resources this run made (its daemon's, and the runc peer's when given) still there after cleanup."""
    from dsec.backends.container import ContainerBackend
    from dsec.isolation.cgroups import CgroupSet
    from dsec.isolation.mounts import running_holder

    backend = ContainerBackend(settings)
    found = [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines()
             if str(backend.mounts) in line or str(settings.home) in line]
    parents = [backend.cgroup_parent] + ([peer.cgroup_parent] if peer is not None else [])
    for parent in parents:
        found += [f"cgroup {d}" for d in CgroupSet.at(f"/{parent}").dirs.values() if Path(d).is_dir()]
    found += [f"runc container {c}" for c in peer.leaked] if peer is not None else []
    holder = running_holder(backend.root / "mntns.pid")
    found += [f"mount holder pid {holder}"] if holder else []
    return found


async def _cleanup_backend(settings: Settings) -> None:
    """Destroy whatever the daemon left (it crashed, or down() failed), then the per-home host dirs."""
    from dsec.backends.container import ContainerBackend
    from dsec.images.node import NodeImages
    from dsec.isolation.cgroups import CgroupSet

    backend = ContainerBackend(settings)
    with contextlib.suppress(Exception):
        await backend.cleanup_orphans(set())
    with contextlib.suppress(Exception):  # image mounts the daemon kept warm, then the FUSE server
        await NodeImages(settings).aclose(unmount=True)
    with contextlib.suppress(Exception):  # the home's mount holder: it outlives a daemon that did not stop cleanly
        await asyncio.to_thread(backend.release_host, set())
    CgroupSet.at(f"/{backend.cgroup_parent}").remove()
    if backend.mounts.is_dir():
        for entry in backend.mounts.iterdir():
            if entry.is_file():
                entry.unlink()  # the init binary copy
        with contextlib.suppress(OSError):
            backend.mounts.rmdir()


async def run(cfg: ContainerBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything; ``progress`` is told each phase as it starts."""
    node = node or Settings()
    from dsec.images.node import NodeImages

    runc, legacy_root = preflight(node)
    settings = _private_settings(node)
    # A chunked image is mounted for the peers once the daemon is down (`down --destroy` unmounts
    # the home's images); the peers then run on the same lazily mounted image the daemon used.
    image_root = legacy_root or settings.home / "lazy" / "unmounted"
    suite = Suite(name="container")
    timer = _Timer()
    peer = RuncPeer(runc, image_root, node.uid_shift, node.uid_count,
                    ensure_init(settings.home / "bin"), settings.home / "peers",
                    tag=hashlib.sha256(str(settings.home).encode()).hexdigest()[:8])
    results: dict[str, Any] = {"config": asdict(cfg), "home": str(settings.home), "skipped": {}}
    lat = suite.latencies
    try:
        progress(f"starting a private daemon ({cfg.daemon}) in {settings.home}")
        with contextlib.ExitStack() as daemon:
            with timer.phase("daemon start"):
                daemon.enter_context(_daemon(settings, cfg.daemon))
            client = Client(url=f"unix://{settings.socket_path}")
            bench = _Run(cfg, client)
            try:
                # exec first: right after a burst of destroys the kernel is still tearing down their
                # namespaces in the background, which would be measured as exec latency.
                progress(f"exec true x{cfg.exec_n}")
                with timer.phase("exec"):
                    async with bench.one() as sandbox:
                        lat["exec_true"] = summarize(await bench.exec_latency(sandbox))
                progress(f"create/destroy x{cfg.create_n}")
                with timer.phase("create/destroy"):
                    lat["create"], lat["destroy"] = map(summarize, await bench.create_latency())
                progress(f"sustained create->exec->destroy, {cfg.concurrency} workers, "
                         f"{cfg.sustained_seconds:g} s")
                with timer.phase("sustained"):
                    results["sustained"] = await bench.sustained(
                        daemon_pid(settings) if cfg.daemon == "process" else None)
                progress(f"idle memory, {cfg.idle_k} sandboxes")
                with timer.phase("idle memory"):
                    results["idle_memory"] = await bench.idle_memory()
                progress(f"create_many({cfg.batch_n}) x{cfg.batch_reps}")
                with timer.phase("create_many"):
                    lat["create_many"] = summarize(await bench.batch())
            finally:
                await bench.destroy_all()
                await client.aclose()
        if legacy_root is None:
            image_root = (await asyncio.to_thread(NodeImages(settings).resolve, IMAGE)).rootfs
            peer.image_root = image_root
        await _peers(cfg, peer, image_root, settings, results, timer, progress)
    finally:
        with timer.phase("cleanup"):
            await asyncio.to_thread(peer.close)
            await _cleanup_backend(settings)
            results["leaks"] = _leaks(settings, peer)
            shutil.rmtree(settings.home, ignore_errors=True)
    results["phases_s"] = timer.phases
    suite.latencies.update(results.pop("peer_latencies", {}))
    suite.extra = results
    suite.rows = _rows(suite)
    return suite


async def _peers(cfg: ContainerBench, peer: RuncPeer, image_root: Path, settings: Settings,
                 results: dict[str, Any], timer: _Timer, progress: Callable[[str], None]) -> None:
    """Time every peer; one that cannot run here is recorded under ``skipped`` with the reason."""
    lat: dict[str, Summary] = {}
    skipped: dict[str, str] = results["skipped"]
    results["peer_latencies"] = lat

    async def attempt(key: str, phase: str, measure: Callable[[], Awaitable[None]]) -> None:
        progress(f"peer: {phase}")
        try:
            with timer.phase(phase):
                await measure()
        except (OSError, RuntimeError) as exc:
            skipped[key] = f"cannot run here: {exc}"[:300]

    async def runc_exec() -> None:
        cid = await asyncio.to_thread(peer.start_detached, await asyncio.to_thread(peer.bundle, "peer-exec"))
        lat["runc_exec"] = summarize(await asyncio.to_thread(
            time_command, peer.exec_argv(cid), cfg.runc_exec_n, cfg.warmup))

    async def runc_run() -> None:
        bundle = await asyncio.to_thread(peer.bundle, "peer-run", ["/bin/true"])
        lat["runc_run"] = summarize(await asyncio.to_thread(peer.time_runs, bundle, cfg.runc_run_n))

    async def bare() -> None:
        lat["bare_true"] = summarize(await asyncio.to_thread(time_command, ["/bin/true"], cfg.true_n, 3))

    # Same conditions as DSec's exec figure (measured first, on a quiet node): let the kernel finish
    # tearing down the namespaces of the sandboxes destroyed above.
    await asyncio.sleep(cfg.settle_seconds)
    await attempt("runc_exec", f"runc exec x{cfg.runc_exec_n}", runc_exec)
    await attempt("runc_run", f"runc run x{cfg.runc_run_n}", runc_run)
    await attempt("bare_true", f"/bin/true x{cfg.true_n}", bare)
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        skipped["bwrap"] = "bwrap not installed (apt-get install bubblewrap)"
    else:
        argv = [bwrap, "--unshare-all", "--ro-bind", str(image_root), "/", "--proc", "/proc",
                "--dev", "/dev", "/bin/true"]

        async def run_bwrap() -> None:
            lat["bwrap"] = summarize(await asyncio.to_thread(time_command, argv, cfg.bwrap_n, 3))

        await attempt("bwrap", f"bwrap x{cfg.bwrap_n}", run_bwrap)
    podman = shutil.which("podman")
    if podman is None:
        skipped["podman_run"] = "podman not installed (apt-get install podman)"
        return
    rootfs = await asyncio.to_thread(mount_overlay, image_root, settings.home / "peers" / "podman")
    try:
        pod = podman_argv(podman, rootfs)

        async def podman_run() -> None:
            lat["podman_run"] = summarize(await asyncio.to_thread(time_command, pod, cfg.podman_n, 1))

        async def podman_rate() -> None:
            results["podman_sustained"] = await _sustain(
                lambda: _podman_cycle(pod), cfg.concurrency, cfg.podman_sustained_seconds)

        await attempt("podman_run", f"podman run x{cfg.podman_n}", podman_run)
        if "podman_run" not in skipped:
            await attempt("podman_sustained", f"podman run rate, {cfg.podman_sustained_seconds:g} s",
                          podman_rate)
    finally:
        await asyncio.to_thread(umount, rootfs)


def _rows(suite: Suite) -> list[Row]:
    """The table: DSec figures, their peers, and the issue's targets."""
    lat, ex = suite.latencies, suite.extra
    skipped = ex.get("skipped", {})

    def p50(key: str) -> float | None:
        summary = lat.get(key)
        return _ms(summary.p50) if summary else None

    rows: list[Row] = []
    create, exec_true = lat.get("create"), lat.get("exec_true")
    if create:
        rows.append(Row("create p50", "ms", _ms(create.p50), p50("runc_run"), "runc run (true)",
                        target="≤ 50 ms", passed=_ms(create.p50) <= 50, note=skipped.get("runc_run")))
        rows += [Row("create p90", "ms", _ms(create.p90)), Row("create p99", "ms", _ms(create.p99)),
                 Row("create mean", "ms", _ms(create.mean))]
    if "destroy" in lat:
        rows.append(Row("destroy p50", "ms", _ms(lat["destroy"].p50)))
    if exec_true:
        e50 = _ms(exec_true.p50)
        runc_exec = Row("exec true p50", "ms", e50, p50("runc_exec"), "runc exec", target="≥ 5x runc exec",
                        note=skipped.get("runc_exec"))
        runc_exec.passed = runc_exec.ratio is not None and runc_exec.ratio >= 5
        rows += [Row("exec true p50", "ms", e50, target="≤ 5 ms", passed=e50 <= 5), runc_exec,
                 Row("exec true p90", "ms", _ms(exec_true.p90)),
                 Row("exec true p99", "ms", _ms(exec_true.p99))]
        for key, name in (("bare_true", "bare /bin/true"), ("bwrap", "bwrap --unshare-all"),
                          ("podman_run", "podman run")):
            if key not in lat and key not in skipped:
                continue
            rows.append(Row("exec true p50", "ms", e50, p50(key), name,
                            note=skipped.get(key) if key not in lat else None))
    if "sustained" in ex:
        s = ex["sustained"]
        pod = ex.get("podman_sustained")
        rows.append(Row(
            f"create→exec→destroy rate (C={s['concurrency']}, {s['failures']} failed)", "/s", s["rate"],
            pod["rate"] if pod else None, "podman run", better="higher", target="≥ 50/s",
            passed=s["rate"] >= 50 and not s["failures"],
            note=skipped.get("podman_sustained") or skipped.get("podman_run"),
        ))
    if "cpu_ms_daemon" in ex.get("sustained", {}):
        rows.append(cpu_per_cycle("CPU per create→exec→destroy", ex["sustained"]))
    if "idle_memory" in ex:
        m = ex["idle_memory"]
        rows += [Row(f"memory per idle sandbox, host (K={m['k']})", "MiB",
                     m["host_bytes_per_sandbox"] / 2**20, target="reported"),
                 Row("memory per idle sandbox, cgroup", "MiB", m["cgroup_bytes_per_sandbox"] / 2**20,
                     target="reported")]
    if "create_many" in lat:
        n = ex["config"]["batch_n"]
        rows += [Row(f"create_many({n}) wall p50", "ms", _ms(lat["create_many"].p50)),
                 Row(f"create_many({n}) per sandbox", "ms", _ms(lat["create_many"].p50) / n)]
    return rows
