"""``dsec bench images``: lazy versus eager image start on a realistic ≥ 1 GB image, in one run.

The image (Debian + python3 + gcc/clang/gfortran + scipy/pandas/matplotlib + boost headers) is built once
with mmdebstrap and kept in the node's store as ``bench-large``; ``bench-large-plus`` is the same tree plus
a layer of new files, for the dedup figure. Both are reused by later runs.

Both start paths read the store through the same emulated remote link (a :class:`ThrottledStore` over
the node's directory store: one shared link of ``rate`` bytes/s plus ``latency`` per request), unless the
node's store is already remote (S3), which is then used as is:

- eager (what ``docker pull`` + ``run`` does): fetch every chunk, write the image out and unpack its tree to
  a directory (cp -a from a local mount), then start a container sandbox on it and run the first command;
- lazy cold: an empty node cache, a new lazy mount, the same sandbox and command; bytes fetched are
  counted from the node cache (prefetch off, so the figure is pure on-demand loading);
- second sandbox of the same image on that node versus one on the fully local unpacked directory.

Everything it mounts or starts is removed in ``finally``; what could not be is reported under ``leaks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsec.backends.base import ImageRef
from dsec.bench.container import BenchUnavailable
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.models import ExecRequest, ImageInfo, SandboxSpec

__all__ = ["ImagesBench", "run"]

IMAGE = "bench-large"
PLUS = "bench-large-plus"
PACKAGES = ("python3", "python3-venv", "git", "build-essential", "ca-certificates", "python3-scipy",
            "python3-pandas", "python3-matplotlib", "clang", "gfortran", "libboost-dev")
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class ImagesBench:
    """What ``dsec bench images`` measures and how hard."""

    rate: float = 125e6
    """Emulated store link, bytes/s (1 Gbit/s)."""
    latency: float = 0.002
    """Emulated per-request latency, seconds."""
    samples: int = 7
    """Warm starts measured per path (median reported)."""
    plus_mib: int = 64
    """Size of the second image's own layer."""
    command: str = "python3 -c 'import json, sqlite3, sys; print(sys.version_info[:2])'"
    """The first exec."""

    def scaled(self, factor: float) -> ImagesBench:
        """Sample counts multiplied by ``factor`` (at least 1)."""
        return ImagesBench(self.rate, self.latency, max(1, round(self.samples * factor)), self.plus_mib,
                           self.command)


class _DirImages:
    """A resolver serving one unpacked directory (the eager path's result)."""

    def __init__(self, ref: ImageRef) -> None:
        self.ref = ref

    def resolve(self, name: str) -> ImageRef:
        return self.ref

    def list(self) -> list[ImageInfo]:
        return []

    def get(self, name: str) -> ImageInfo:
        raise NotImplementedError


def _ensure_images(node: Settings, cfg: ImagesBench, progress: Callable[[str], None]) -> None:
    from dsec.images.build import mmdebstrap_command
    from dsec.images.image_store import ImageStore

    store = ImageStore(node.images, node.image_store)
    if store.exists(IMAGE) and store.exists(PLUS):
        return
    work = Path(tempfile.mkdtemp(prefix=".bench-build-", dir=node.images))
    try:
        tree = work / "rootfs"
        progress(f"building {IMAGE} with mmdebstrap (once; kept in the store for later runs)")
        argv = mmdebstrap_command(PACKAGES, "bookworm", tree)
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BenchUnavailable(f"mmdebstrap failed building {IMAGE}: {proc.stderr[-1500:]}")
        progress(f"importing {IMAGE}")
        store.import_dir(IMAGE, tree, uid_shift=node.uid_shift, source="bench:" + ",".join(PACKAGES),
                         replace=True)
        extra = tree / "opt" / "project"
        extra.mkdir(parents=True)
        for i in range(cfg.plus_mib):
            (extra / f"blob-{i:03d}.bin").write_bytes(os.urandom(1 << 20))
        (tree / "etc" / "motd").write_text("bench-large-plus\n")
        progress(f"importing {PLUS} ({IMAGE} + {cfg.plus_mib} MiB of new files)")
        store.import_dir(PLUS, tree, uid_shift=node.uid_shift, source=f"bench:{IMAGE}+{cfg.plus_mib}MiB",
                         replace=True, move=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _start(engine: Any, image: str, command: str) -> tuple[float, str]:
    """Create a sandbox and run ``command``; seconds to the first exec's return, and the sandbox id."""
    started = time.monotonic()
    info = await engine.create(SandboxSpec(image=image, backend="container"))
    result = await engine.exec(info.id, ExecRequest(command=command, timeout=120))
    elapsed = time.monotonic() - started
    if result.exit_code != 0:
        raise RuntimeError(f"first exec failed ({result.exit_code}): {result.stderr[-500:]!r}")
    return elapsed, info.id


async def _warm_starts(engine: Any, image: str, cfg: ImagesBench, n: int) -> list[float]:
    times = []
    for _ in range(n):
        elapsed, sandbox = await _start(engine, image, cfg.command)
        times.append(elapsed)
        await engine.destroy(sandbox)
    return times


def _eager_pull(store: Any, name: str, dest: Path, threads: int = 8) -> int:
    """Fetch every chunk of ``name`` through ``store``, write the image out, unpack its tree into
    ``dest/rootfs``; returns bytes fetched."""
    from dsec.images.cache import chunk_key

    manifest = store.manifest(name)
    blob, meta, mnt = dest / "blob", dest / "meta.erofs", dest / "mnt"
    mnt.mkdir(parents=True)
    meta.write_bytes(store.blobs.get(chunk_key(manifest.meta_digest)))
    offsets = manifest.offsets()
    fd = os.open(blob, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, manifest.blob_size)

        def one(i: int) -> int:
            data = store.blobs.get(chunk_key(manifest.chunks[i].digest))
            os.pwrite(fd, data, offsets[i])
            return len(data)

        with ThreadPoolExecutor(threads) as pool:
            fetched = sum(pool.map(one, range(len(manifest.chunks))))
    finally:
        os.close(fd)
    if _libc.mount(str(meta).encode(), str(mnt).encode(), b"erofs", 1, f"device={blob}".encode()) != 0:
        raise RuntimeError(f"mounting the pulled image failed: {os.strerror(ctypes.get_errno())}")
    try:
        subprocess.run(["cp", "-a", "--", f"{mnt}/.", str(dest / "rootfs")], check=True)
    finally:
        _libc.umount2(str(mnt).encode(), 0)
    blob.unlink()
    return int(fetched + manifest.meta_size)


async def run(cfg: ImagesBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything; ``progress`` is told each phase as it starts."""
    from dsec.backends.container import ContainerBackend
    from dsec.daemon.engine import Engine
    from dsec.images.blob_store import DirStore, ThrottledStore
    from dsec.images.image_store import ImageStore
    from dsec.images.node import NodeImages

    node = node or Settings()
    if os.geteuid() != 0 or shutil.which("runc") is None:
        raise BenchUnavailable("the images suite needs root and runc (container sandboxes, mounts)")
    await asyncio.to_thread(_ensure_images, node, cfg, progress)
    base = ImageStore(node.images, node.image_store)
    if isinstance(base.blobs, DirStore):
        remote = ImageStore(node.images, ThrottledStore(base.blobs, cfg.rate, cfg.latency))
        served = f"local directory store behind an emulated link ({cfg.rate / 1e6:g} MB/s, {cfg.latency * 1e3:g} ms)"
    else:
        remote, served = base, f"the node's remote store {base.blobs.url}"
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-img-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    suite = Suite(name="images")
    results: dict[str, Any] = {"config": asdict(cfg), "store": served, "skipped": {}}
    lazy_settings = Settings(home=work / "lazy", images_dir=node.images, node="bench")
    eager_settings = Settings(home=work / "eager", images_dir=node.images, node="bench")
    images = NodeImages(lazy_settings, remote, prefetch=False)
    lazy = Engine(lazy_settings, {"container": ContainerBackend(lazy_settings)}, images)
    eager: Engine | None = None
    try:
        manifest = base.manifest(IMAGE)
        image_bytes = manifest.info.size_bytes
        results["image_bytes"] = image_bytes
        await lazy.start()
        progress(f"lazy cold start of {IMAGE} ({image_bytes / 2**30:.2f} GiB) on an empty node cache")
        lazy_cold, first = await _start(lazy, IMAGE, cfg.command)
        fetched = images.cache.usage() + manifest.meta_size
        await lazy.destroy(first)

        progress("eager pull + unpack + start")
        dest = work / "eager" / "pulled"
        t0 = time.monotonic()
        eager_fetched = await asyncio.to_thread(_eager_pull, remote, IMAGE, dest)
        ref = ImageRef(name=IMAGE, rootfs=dest / "rootfs", uid_shift=manifest.info.uid_shift,
                       config=manifest.info.config)
        eager = Engine(eager_settings, {"container": ContainerBackend(eager_settings)}, _DirImages(ref))
        await eager.start()
        start_s, sandbox = await _start(eager, IMAGE, cfg.command)
        eager_total = time.monotonic() - t0
        await eager.destroy(sandbox)
        await asyncio.to_thread(os.sync)  # the unpacked tree's writeback must not land in the next figures
        progress(f"second sandbox on the lazy node vs on the fully local image, interleaved x{cfg.samples}")
        lazy_warm, local_warm = [], []
        for _ in range(cfg.samples):
            lazy_warm += await _warm_starts(lazy, IMAGE, cfg, 1)
            local_warm += await _warm_starts(eager, IMAGE, cfg, 1)
        suite.latencies.update(second_start_lazy=summarize(lazy_warm), start_local_image=summarize(local_warm))

        stats_a, stats_b = base.stats(IMAGE), base.stats(PLUS)
        logical = stats_a.blob_bytes + stats_b.blob_bytes
        stored = len({c.digest for m in (manifest, base.manifest(PLUS)) for c in m.chunks})
        stored_bytes = sum({c.digest: c.size for m in (manifest, base.manifest(PLUS)) for c in m.chunks}.values())
        results.update(lazy_cold_s=lazy_cold, lazy_fetched_bytes=fetched, eager_s=eager_total,
                       eager_fetched_bytes=eager_fetched, eager_start_s=start_s, lazy_warm_s=lazy_warm,
                       local_warm_s=local_warm, dedup_logical_bytes=logical, dedup_stored_bytes=stored_bytes,
                       dedup_chunks=stored)
    finally:
        progress("cleanup")
        for engine in (lazy, eager):
            if engine is not None:
                with contextlib.suppress(Exception):
                    await engine.destroy_all()
                with contextlib.suppress(Exception):
                    await engine.aclose()
        with contextlib.suppress(Exception):
            await images.aclose(unmount=True)
        from dsec.backends.container import ContainerBackend as _CB

        for settings in (lazy_settings, eager_settings):
            with contextlib.suppress(Exception):
                await _CB(settings).cleanup_orphans(set())
        results["leaks"] = [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines()
                            if str(work) in line]
        shutil.rmtree(work, ignore_errors=True)
    suite.extra = results
    suite.rows = _rows(results)
    return suite


def _rows(r: dict[str, Any]) -> list[Row]:
    image = r["image_bytes"]
    lazy_warm, local_warm = statistics.median(r["lazy_warm_s"]), statistics.median(r["local_warm_s"])
    fetched_pct = 100 * r["lazy_fetched_bytes"] / image
    return [
        Row("image size", "MiB", image / 2**20, note="file data of bench-large"),
        Row("cold start → first exec", "s", r["lazy_cold_s"], r["eager_s"], "eager pull+unpack+start",
            target="≤ 25% of eager", passed=r["lazy_cold_s"] <= 0.25 * r["eager_s"]),
        Row("fetched before first exec", "MiB", r["lazy_fetched_bytes"] / 2**20, r["eager_fetched_bytes"] / 2**20,
            "eager pull", target="≤ 10% of image", passed=fetched_pct <= 10, note=f"{fetched_pct:.1f}% of the image"),
        Row("2nd sandbox, same node (p50)", "ms", lazy_warm * 1e3, local_warm * 1e3, "fully local image",
            target="≤ 1.2x local", passed=lazy_warm <= 1.2 * local_warm),
        Row("dedup: stored / logical", "MiB", r["dedup_stored_bytes"] / 2**20, r["dedup_logical_bytes"] / 2**20,
            "both images' blobs", better="lower",
            note=f"ratio {r['dedup_logical_bytes'] / r['dedup_stored_bytes']:.2f}x (bench-large + 64 MiB layer)"),
    ]
