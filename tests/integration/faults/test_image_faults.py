"""Image faults on real mounts: corrupt chunks, a store that dies mid-read, a full cache disk, missing
images, and two imports of one image at once. Each fault must give a clear error, never wrong bytes,
and leave no mount or process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_support import leftovers, mounts_under, short_home, sweep
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import CacheFull, ImageCorrupt, ImageNotFound, StoreUnavailable
from dsec.images.blob_store import DirStore
from dsec.images.cache import ChunkCache, chunk_key, free_reserve
from dsec.images.format import ChunkRef, Manifest, sha256
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages
from dsec.models import ExecRequest, ImageInfo, SandboxSpec
from dsec.testing.fake import FakeBackend
from image_support import make_tree, seaweedfs

pytestmark = [pytest.mark.root]

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture
def home() -> Iterator[Path]:
    path = short_home("dsec-imgf-")
    try:
        yield path
    finally:
        asyncio.run(sweep(path, path / "images"))
        shutil.rmtree(path, ignore_errors=True)


def node_for(home: Path, store: ImageStore) -> NodeImages:
    return NodeImages(Settings(home=home, images_dir=store.root), store)


def data_chunks(store: ImageStore, name: str, data: bytes) -> list[str]:
    """Digests of the chunks holding ``data`` (found by content)."""
    found = []
    for chunk in store.manifest(name).chunks:
        body = store.blobs.get(chunk_key(chunk.digest))
        if body[:4096] in data:
            found.append(chunk.digest)
    return found


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``3m``, ``64k``) at ``path`` for the duration: a disk that fills."""
    path.mkdir()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
        pytest.fail(f"tmpfs mount failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield path
    finally:
        assert _libc.umount2(str(path).encode(), 0) == 0


def fill(disk: Path) -> int:
    """Write a filler file until ``disk`` is full; the errno that stopped it."""
    with pytest.raises(OSError) as full, open(disk / "filler", "wb") as f:
        while True:
            f.write(b"x" * 4096)
            f.flush()
    return full.value.errno or 0


def chunk_store(root: Path, count: int) -> tuple[DirStore, list[bytes], list[str]]:
    """A store holding ``count`` random 1 MiB chunks; the chunks and their digests."""
    store = DirStore(root)
    chunks = [os.urandom(MiB) for _ in range(count)]
    digests = [sha256(c) for c in chunks]
    for digest, data in zip(digests, chunks, strict=True):
        store.put(chunk_key(digest), data)
    return store, chunks, digests


def test_a_corrupt_chunk_is_never_served(home: Path, tmp_path: Path) -> None:
    store = ImageStore(home / "images")
    data = make_tree(tmp_path / "src", big=4 * MiB)
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    victim = data_chunks(store, "img", data)[3]
    path = store.blobs.root / chunk_key(victim)  # type: ignore[attr-defined]
    bad = bytearray(path.read_bytes())
    bad[100] ^= 0xFF
    path.write_bytes(bytes(bad))
    node = node_for(home, store)
    try:
        ref = node.resolve("img")
        assert (ref.rootfs / "etc" / "hello").read_text().startswith("hello")  # other chunks are fine
        with pytest.raises(OSError) as exc:
            (ref.rootfs / "data" / "big.bin").read_bytes()
        assert exc.value.errno == errno.EIO
        cause = node.explain(ref)
        assert isinstance(cause, ImageCorrupt)
        assert victim in cause.message and "does not match its digest after a re-fetch" in cause.message
        assert not node.cache.has(victim), "a corrupt chunk reached the cache"
    finally:
        node.aclose_sync(unmount=True)
    assert mounts_under(str(home)) == []


def test_a_store_that_dies_mid_read_fails_cleanly(home: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(home=home, images_dir=home / "images")
    with seaweedfs(monkeypatch) as weed:
        store = ImageStore(home / "images", weed.url())
        data = make_tree(tmp_path / "src", big=24 * MiB)
        store.import_dir("img", tmp_path / "src", uid_shift=settings.uid_shift)
        store.import_dir("other", tmp_path / "src", uid_shift=0)
        node = NodeImages(settings, store)
        engine = Engine(settings, {"container": ContainerBackend(settings)}, node)

        async def run() -> None:
            await engine.start()
            try:
                ref = await asyncio.to_thread(node.resolve, "img")
                with open(ref.rootfs / "data" / "big.bin", "rb") as f:
                    assert f.read(MiB) == data[:MiB]
                    weed.kill()  # the store goes away in the middle of reading the file
                    with pytest.raises(OSError) as exc:
                        f.seek(20 * MiB)
                        f.read(MiB)
                assert exc.value.errno == errno.EIO
                cause = node.explain(ref)
                assert isinstance(cause, StoreUnavailable) and weed.endpoint.split("//")[1] in cause.message
                node.release(ref)

                # a sandbox of an image this node has not mounted yet: creation fails with the cause
                with pytest.raises(StoreUnavailable, match="image store"):
                    await engine.create(SandboxSpec(image="other", backend="container"))
                assert await engine.list() == []
                # a sandbox on the mounted image still starts; reading uncached files fails, never hangs
                info = await engine.create(SandboxSpec(image="img", backend="container"))
                result = await engine.exec(info.id, ExecRequest(command=["/bin/busybox", "true"], timeout=30))
                assert result.exit_code != 0
                await engine.destroy(info.id)
                left = leftovers(home)
                left.pop("shared")  # the backend's, while it runs
                assert not any(left.values()), left
            finally:
                await engine.destroy_all()
                await engine.aclose()
                await node.aclose(unmount=True)

        asyncio.run(run())
    assert mounts_under(str(home)) == [], "a mount is stuck after the store died"


def test_a_full_cache_disk_is_reported(home: Path, tmp_path: Path) -> None:
    store = ImageStore(home / "images")
    make_tree(tmp_path / "src", big=8 * MiB)
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    with small_disk(home / "image-cache", "3m"):
        node = node_for(home, store)
        try:
            ref = node.resolve("img")
            assert (ref.rootfs / "etc" / "hello").read_text().startswith("hello")
            with pytest.raises(OSError) as exc:
                (ref.rootfs / "data" / "big.bin").read_bytes()
            assert exc.value.errno == errno.EIO
            cause = node.explain(ref)
            assert isinstance(cause, CacheFull) and "is full" in cause.message
        finally:
            node.aclose_sync(unmount=True)


def test_a_read_error_is_recorded_whole_when_the_cache_disk_is_full(home: Path, tmp_path: Path) -> None:
    """The record that explains an EIO lives off the cache disk; where it cannot be written, none is
    left rather than an empty one (which read as a DSecError with no message)."""
    store = ImageStore(home / "images")
    with small_disk(home / "full-cache", "64k") as cache_dir:
        apart = ChunkCache(cache_dir, store.blobs, errors=tmp_path / "errors")
        inside = ChunkCache(cache_dir, store.blobs)
        assert fill(cache_dir) == errno.ENOSPC
        digest = "ab" * 32
        apart.record_error(digest, CacheFull("the node image cache is full"))
        assert apart.take_error(digest) == ("CacheFull", "the node image cache is full")
        assert apart.take_error(digest) is None  # taken
        inside.record_error(digest, CacheFull("the node image cache is full"))
        assert inside.take_error(digest) is None
        assert [p.name for p in (cache_dir / "errors").iterdir()] == []  # no half-written record left


def test_the_cache_keeps_its_disk_free_space_reserve_and_spares_pinned_images(home: Path) -> None:
    """The cache shares its disk with the node's records and logs: past the reserve it evicts least recently
    used chunks (never those of a mounted image) so that the disk keeps ``min_free`` bytes free."""
    with small_disk(home / "small-disk", "16m") as disk:
        store, chunks, digests = chunk_store(home / "chunks-store", 14)
        reserve = free_reserve("6291456", 16 * MiB)
        assert reserve == 6 * MiB and free_reserve("25%", 16 * MiB) == 4 * MiB
        cache = ChunkCache(disk / "cache", store, min_free=reserve)
        image = _manifest_of(digests[:2], chunks[:2])  # a mounted image: the first two chunks
        cache.pin(cache.put_manifest(image))
        for i, digest in enumerate(digests):
            os.utime(cache.ensure(digest), (1000 + i, 1000 + i))  # older first
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            assert free >= reserve - MiB, f"after chunk {i}: {free} bytes free, reserve {reserve}"
        assert cache.has(digests[0]) and cache.has(digests[1]), "a chunk of a mounted image was evicted"
        assert cache.has(digests[-1]), "the chunk just fetched was evicted"
        assert not all(cache.has(d) for d in digests[2:]), "nothing was evicted: the disk never got short"


def test_a_manifest_written_to_a_full_cache_disk_evicts_first(home: Path) -> None:
    """A new image's manifest (about 1 MB for a big image) goes through the cache's eviction like a chunk: on a
    full disk it makes room from unused chunks instead of failing the mount with a raw ENOSPC."""
    with small_disk(home / "full-disk", "4m") as disk:
        store, _chunks, digests = chunk_store(home / "chunks-store", 3)
        cache = ChunkCache(disk / "cache", store)
        for digest in digests:
            cache.ensure(digest)
        fill(disk)
        big = _manifest_of([sha256(str(i).encode()) for i in range(12000)], [b"x"] * 12000)
        assert len(big.canonical()) > 512 * 1024
        cache.put_manifest(big)
        assert cache.manifest(big.digest[7:]) == big
        assert not all(cache.has(d) for d in digests), "the room came from nowhere: nothing tested"


def test_a_pin_on_a_disk_out_of_inodes_evicts_first_then_reports_cache_full(home: Path) -> None:
    """Mounting an image pins it with an empty file: with no inode left that was a raw OSError. It now makes
    room from unused chunks, and says CacheFull when every chunk belongs to a mounted image."""
    with small_disk(home / "few-inodes", "8m,nr_inodes=32") as disk:
        store, chunks, digests = chunk_store(home / "chunks-store", 3)
        cache = ChunkCache(disk / "cache", store)
        for i, digest in enumerate(digests):
            os.utime(cache.ensure(digest), (1000 + i, 1000 + i))  # chunk 0 the least recently used
        mounted = cache.put_manifest(_manifest_of(digests[1:], chunks[1:]))
        other = cache.put_manifest(_manifest_of(digests[1:2], chunks[1:2]))
        assert _fill_inodes(disk) == errno.ENOSPC
        cache.pin(mounted)
        assert not cache.has(digests[0]) and cache.has(digests[1]) and cache.has(digests[2])
        assert _fill_inodes(disk) == errno.ENOSPC
        with pytest.raises(CacheFull, match="free disk space \\(or inodes\\)"):
            cache.pin(other)
        assert cache.has(digests[1]) and cache.has(digests[2]), "a chunk of the mounted image was evicted"


def _fill_inodes(disk: Path) -> int:
    """Create empty files on ``disk`` until no inode is left; the errno that stopped it."""
    filler = disk / "inodes"
    filler.mkdir(exist_ok=True)
    with pytest.raises(OSError) as full:
        for i in range(100_000):
            (filler / f"{i}-{time.monotonic_ns()}").touch()
    return full.value.errno or 0


def _manifest_of(digests: list[str], chunks: list[bytes]) -> Manifest:
    info = ImageInfo(name="pinned", created_at=0.0, size_bytes=0, files=0, source="test", uid_shift=0)
    return Manifest(info=info, meta_digest=sha256(b"m"), meta_size=1,
                    chunks=[ChunkRef(digest=d, size=len(c)) for d, c in zip(digests, chunks, strict=True)])


def test_a_missing_image_is_reported_by_the_engine(home: Path) -> None:
    store = ImageStore(home / "images")
    settings = Settings(home=home, images_dir=store.root)

    async def run() -> None:
        engine = Engine(settings, {"container": FakeBackend()}, NodeImages(settings, store))
        await engine.start()
        try:
            with pytest.raises(ImageNotFound, match="'nope' not found"):
                await engine.create(SandboxSpec(image="nope", backend="container"))
            assert await engine.list() == []
        finally:
            await engine.aclose()

    asyncio.run(run())
    assert not (home / "lazy" / "blobs").exists() or not (home / "lazy" / "blobs").is_mount()


def test_two_processes_importing_one_image_at_once(home: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, big=8 * MiB)
    code = ("import sys; from dsec.images.image_store import ImageStore\n"
            "try:\n    ImageStore(sys.argv[1]).import_dir('img', sys.argv[2], uid_shift=0)\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(home / "images"), str(src)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [(p.wait(120), p.communicate()[0]) for p in procs]
    assert sorted(rc for rc, _ in outputs) == [0, 3], outputs
    assert any("already exists" in out for _, out in outputs)
    store = ImageStore(home / "images")
    node = node_for(home, store)
    try:
        assert (node.resolve("img").rootfs / "data" / "big.bin").stat().st_size == 8 * MiB
    finally:
        node.aclose_sync(unmount=True)
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".tmp-")] == []
