"""``dsec bench trajectory``: the trajectory log, checkpoints and forks, through a real daemon and the SDK.

Measured in one run, against a private daemon (same setup as the container suite):

- fast-forward: a re-opened trajectory replays ``ff_calls`` logged execs (cached calls per second, the
  SDK answering from its copy of the log), and the same replay with every call matched by the daemon;
- logging overhead on the exec round trip: ``exec true`` p50 on a trajectory-bound sandbox against the
  same call on a plain sandbox, samples interleaved so drift hits both alike;
- snapshot and restore of a sandbox that changed ``changed_mb`` MB of files (peer: ``cp -a`` of the
  same files, the floor of any copy-based checkpoint); a snapshot is chunked into the image store, a
  restore stacks it as a read-only layer (copies nothing);
- fork(8) (peers: 8 parallel ``cp -a`` of the files, and 8 fresh creates from the image, which copy
  nothing).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsec import AsyncSandbox, Client
from dsec.backends.container import ContainerBackend
from dsec.bench.container import IMAGE, _cleanup_backend, _daemon, _leaks, _private_settings, preflight
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.images.image_store import ImageStore

__all__ = ["TrajectoryBench", "run"]


@dataclass(frozen=True)
class TrajectoryBench:
    """Sample counts and sizes of one trajectory suite run."""

    ff_calls: int = 2000
    exec_n: int = 300
    changed_mb: int = 100
    fork_n: int = 8
    daemon: str = "process"

    def scaled(self, factor: float) -> TrajectoryBench:
        """Every count multiplied by ``factor`` (at least a few samples each); sizes kept."""
        return TrajectoryBench(ff_calls=max(50, int(self.ff_calls * factor)),
                               exec_n=max(20, int(self.exec_n * factor)), changed_mb=self.changed_mb,
                               fork_n=self.fork_n, daemon=self.daemon)


async def _timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await action()
    return time.perf_counter() - started, result


async def _fast_forward(cfg: TrajectoryBench, client: Client, results: dict[str, Any]) -> None:
    name = f"bench/ff-{time.time_ns()}"
    sb = await AsyncSandbox.create(image=IMAGE, trajectory=name, client=client)
    try:
        for i in range(cfg.ff_calls):
            await sb.exec(["true", str(i)])
        again = await AsyncSandbox.create(image=IMAGE, trajectory=name, client=client)
        started = time.perf_counter()
        for i in range(cfg.ff_calls):
            await again.exec(["true", str(i)])
        sdk_s = time.perf_counter() - started
        assert again._cursor is not None and again._cursor.served == cfg.ff_calls
        daemon_side = await AsyncSandbox.create(image=IMAGE, trajectory=name, client=client)
        daemon_side._cursor.logged = 0  # type: ignore[union-attr]  # no local copy: the daemon matches each
        started = time.perf_counter()
        for i in range(cfg.ff_calls):
            await daemon_side.exec(["true", str(i)])
        daemon_s = time.perf_counter() - started
        results["fast_forward"] = {"calls": cfg.ff_calls, "sdk_per_s": cfg.ff_calls / sdk_s,
                                   "daemon_per_s": cfg.ff_calls / daemon_s}
    finally:
        await sb.close()


async def _overhead(cfg: TrajectoryBench, client: Client, lat: dict[str, Any]) -> None:
    plain = await AsyncSandbox.create(image=IMAGE, client=client)
    logged = await AsyncSandbox.create(image=IMAGE, trajectory=f"bench/exec-{time.time_ns()}", client=client)
    try:
        for sb in (plain, logged):
            for _ in range(10):  # warm both paths
                await sb.exec("true")
        a: list[float] = []
        b: list[float] = []
        for _ in range(cfg.exec_n):
            a.append((await _timed(lambda: plain.exec("true")))[0])
            b.append((await _timed(lambda: logged.exec("true")))[0])
        lat["exec_true_plain"] = summarize(a)
        lat["exec_true_trajectory"] = summarize(b)
    finally:
        await plain.close()
        await logged.close()


async def _checkpoints(cfg: TrajectoryBench, client: Client, settings: Settings, results: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(image=IMAGE, client=client, disk="8Gi")
    restored: AsyncSandbox | None = None
    snap: str | None = None
    kids: list[AsyncSandbox] = []
    fresh: list[AsyncSandbox] = []
    try:
        # 100 files of 1 MB of incompressible data: what an agent's build or pip install leaves behind.
        made = await sb.exec(f"mkdir -p /workspace/data && for i in $(seq {cfg.changed_mb}); do "
                             "head -c 1000000 /dev/urandom > /workspace/data/f$i; done", timeout=600)
        if made.exit_code != 0:
            raise RuntimeError(f"could not write the changed files: {made.stderr.decode(errors='replace')}")
        snapshot_s, snap = await _timed(sb.snapshot)
        restore_s, restored = await _timed(lambda: AsyncSandbox.create(snapshot=snap, client=client))
        assert restored is not None
        check = await restored.exec("ls /workspace/data | wc -l")
        if check.stdout.strip() != str(cfg.changed_mb).encode():
            raise RuntimeError(f"the restored sandbox lacks the changed files: {check.stdout!r}")
        fork_s, kids = await _timed(lambda: sb.fork(cfg.fork_n))
        started = time.perf_counter()
        fresh = list(await asyncio.gather(*(AsyncSandbox.create(image=IMAGE, client=client)
                                            for _ in range(cfg.fork_n))))
        creates_s = time.perf_counter() - started
        # The sandbox's writable layer as the home's mount holder sees it (the host sees only the mount point).
        backend = ContainerBackend(settings)
        holder = int((backend.root / "mntns.pid").read_text().split()[0])
        upper = Path(f"/proc/{holder}/root{backend.bundles}/{sb.id}/disk/upper/workspace/data")
        with tempfile.TemporaryDirectory(dir=settings.home) as scratch:
            started = time.perf_counter()
            await asyncio.to_thread(subprocess.run, ["cp", "-a", str(upper), scratch], check=True)
            cp_s = time.perf_counter() - started
        with tempfile.TemporaryDirectory(dir=settings.home) as scratch:
            started = time.perf_counter()
            copies = [await asyncio.create_subprocess_exec("cp", "-a", str(upper), f"{scratch}/{i}")
                      for i in range(cfg.fork_n)]
            await asyncio.gather(*(c.wait() for c in copies))
            cp_n_s = time.perf_counter() - started
        results["checkpoints"] = {"changed_mb": cfg.changed_mb, "snapshot_s": snapshot_s, "restore_s": restore_s,
                                  "cp_a_s": cp_s, "cp_a_n_s": cp_n_s, "fork_s": fork_s, "fork_n": cfg.fork_n,
                                  "fresh_creates_s": creates_s}
    finally:
        for other in (*kids, *fresh, *([restored] if restored is not None else [])):
            await other.close()
        await sb.close()
        if snap is not None:  # its random data is this run's alone: take its chunks out of the store now
            await asyncio.to_thread(ImageStore(settings.images, settings.snapshot_store).remove_snapshot, snap, True)


async def run(cfg: TrajectoryBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything; ``progress`` is told each phase as it starts."""
    node = node or Settings()
    preflight(node)
    # Snapshots go where they go in production, the image store (lazily mounted from there); the bench
    # purges its snapshot's chunks (random data no one else has) at the end.
    settings = _private_settings(node)
    suite = Suite(name="trajectory")
    results: dict[str, Any] = {"config": asdict(cfg), "home": str(settings.home)}
    try:
        with _daemon(settings, cfg.daemon):
            client = Client(url=f"unix://{settings.socket_path}")
            try:
                progress(f"exec true x{cfg.exec_n} with and without a trajectory, interleaved")
                await _overhead(cfg, client, suite.latencies)
                progress(f"log {cfg.ff_calls} calls, then fast-forward through them")
                await _fast_forward(cfg, client, results)
                progress(f"snapshot/restore of {cfg.changed_mb} MB changed, fork({cfg.fork_n})")
                await _checkpoints(cfg, client, settings, results)
            finally:
                await client.aclose()
    finally:
        await _cleanup_backend(settings)
        results["leaks"] = _leaks(settings)
        shutil.rmtree(settings.home, ignore_errors=True)
    suite.extra = results
    suite.rows = _rows(suite)
    return suite


def _rows(suite: Suite) -> list[Row]:
    lat, extra = suite.latencies, suite.extra
    ff, cp = extra["fast_forward"], extra["checkpoints"]
    plain, logged = lat["exec_true_plain"].p50 * 1000, lat["exec_true_trajectory"].p50 * 1000
    overhead = (logged - plain) / plain * 100
    return [
        Row("fast-forward, SDK (cached calls)", "/s", ff["sdk_per_s"], ff["daemon_per_s"],
            "each call matched by the daemon", better="higher", target="≥ 5000/s",
            passed=ff["sdk_per_s"] >= 5000),
        Row("exec true p50, trajectory-bound", "ms", logged, plain, "same call, no trajectory",
            target="≤ +10%", passed=overhead <= 10, note=f"logging overhead {overhead:+.1f}%"),
        Row(f"snapshot, {cp['changed_mb']} MB changed", "s", cp["snapshot_s"], cp["cp_a_s"], "cp -a of the files"),
        Row(f"restore, {cp['changed_mb']} MB changed", "s", cp["restore_s"], cp["cp_a_s"], "cp -a of the files"),
        Row(f"fork({cp['fork_n']}), {cp['changed_mb']} MB changed", "s", cp["fork_s"], cp["cp_a_n_s"],
            f"{cp['fork_n']} parallel cp -a of the files"),
        Row(f"{cp['fork_n']} fresh creates (no state copied)", "s", cp["fresh_creates_s"],
            note="for scale: what fork adds is the copying"),
    ]
