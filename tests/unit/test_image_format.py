"""The chunked image format, the directory store and the node chunk cache (no mounts, no root needed)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import ImageCorrupt, InvalidRequest
from dsec.images.blob_store import BlobStore, DirStore, S3Store, ThrottledStore, open_store
from dsec.images.cache import ChunkCache, chunk_key, free_reserve
from dsec.images.format import BLOCK, ChunkIndex, ChunkRef, Manifest, cut_blob, sha256
from dsec.models import ImageInfo


class CountingStore(BlobStore):
    """A DirStore that counts gets and can hand out bad bytes (a fake for the cache's logic)."""

    def __init__(self, root: Path, bad: int = 0, delay: float = 0.0) -> None:
        self.inner = DirStore(root)
        self.url = self.inner.url
        self.gets: Counter[str] = Counter()
        self.bad = bad
        self.delay = delay
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._lock:
            self.gets[key] += 1
            corrupt = self.bad > 0
            self.bad -= 1 if corrupt else 0
        time.sleep(self.delay)
        data = self.inner.get(key)
        return b"X" + data[1:] if corrupt else data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        return self.inner.keys(prefix)


def blocks(*seeds: int, n: int = 40) -> bytes:
    """Deterministic 4 KiB blocks: ``n`` per seed."""
    out = bytearray()
    for seed in seeds:
        for i in range(n):
            out += sha256(f"{seed}-{i}".encode()).encode() * (BLOCK // 71) + b"\0" * (BLOCK % 71)
    return bytes(out)


def test_cut_is_content_defined_so_shared_runs_dedup(tmp_path: Path) -> None:
    base = blocks(1, 2, 3, 4, 5, 6, 7, 8)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(base + blocks(9))
    b.write_bytes(blocks(10, n=7) + base)  # the same run of data, shifted by a non-chunk-aligned amount
    ca, cb = list(cut_blob(a)), list(cut_blob(b))
    assert b"".join(d for _, d in ca) == a.read_bytes()
    assert all(sha256(d) == h for h, d in ca)
    shared = {h for h, _ in ca} & {h for h, _ in cb}
    shared_bytes = sum(len(d) for h, d in ca if h in shared)
    assert shared_bytes > 0.7 * len(base), "a shared run of blocks should mostly dedup"
    assert all(len(d) % BLOCK == 0 for _, d in ca)
    assert max(len(d) for _, d in ca) <= 256 * BLOCK


def manifest_of(chunks: list[tuple[str, bytes]]) -> Manifest:
    info = ImageInfo(name="x", created_at=0, size_bytes=0, files=0, source="t", uid_shift=0)
    return Manifest(info=info, meta_digest=sha256(b"m"), meta_size=1,
                    chunks=[ChunkRef(digest=h, size=len(d)) for h, d in chunks])


def test_manifest_digest_is_verified_and_index_maps_offsets() -> None:
    m = manifest_of([(sha256(b"a" * 8192), b"a" * 8192), (sha256(b"b" * 4096), b"b" * 4096)])
    data = m.canonical()
    assert Manifest.parse(data, m.digest) == m
    tampered = data.replace(b'"size":4096', b'"size":8192')
    with pytest.raises(ImageCorrupt, match="corrupt"):
        Manifest.parse(tampered, m.digest)
    with pytest.raises(ImageCorrupt, match="cannot be parsed"):
        Manifest.parse(b"{not json", None)
    index = ChunkIndex(m)
    assert index.locate(0) == (0, 0) and index.locate(8191) == (0, 8191) and index.locate(8192) == (1, 0)
    assert m.blob_size == 12288 and index.start(1) == 8192


def test_an_unlabelled_image_keeps_the_manifest_digest_it_had_before_images_had_labels() -> None:
    m = manifest_of([(sha256(b"a" * 4096), b"a" * 4096)])
    assert b"labels" not in m.canonical() and Manifest.parse(m.canonical(), m.digest) == m
    labelled = m.model_copy(deep=True)
    labelled.info.config.labels["dsec.e2b.sudo"] = "true"
    assert b'"labels":{"dsec.e2b.sudo":"true"}' in labelled.canonical() and labelled.digest != m.digest
    assert Manifest.parse(labelled.canonical(), labelled.digest).info.config.labels == {"dsec.e2b.sudo": "true"}


def test_dir_store_is_atomic_and_validates_keys(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "s")
    store.put("chunks/sha256/ab/x", b"1")
    store.put("chunks/sha256/ab/x", b"22")
    assert store.get("chunks/sha256/ab/x") == b"22" and store.has("chunks/sha256/ab/x")
    assert [(k, s) for k, s, _ in store.keys("chunks/")] == [("chunks/sha256/ab/x", 2)]
    assert not [p for p in (tmp_path / "s").rglob(".tmp-*")]
    with pytest.raises(KeyError):
        store.get("chunks/none")
    for bad in ("", "/abs", "a/../b", "a//b", "."):
        with pytest.raises(InvalidRequest, match="invalid store key"):
            store.get(bad)
    store.delete("chunks/sha256/ab/x")
    store.delete("chunks/sha256/ab/x")  # absent: no error
    assert not store.has("chunks/sha256/ab/x")
    assert isinstance(open_store(f"file://{tmp_path}"), DirStore)
    with pytest.raises(InvalidRequest, match="absolute path"):
        open_store("relative/dir")
    with pytest.raises(InvalidRequest, match="names no bucket"):
        open_store("s3:///prefix")


def put_chunk(store: BlobStore, data: bytes) -> str:
    digest = sha256(data)
    store.put(chunk_key(digest), data)
    return digest


def test_corrupt_chunk_is_refetched_once(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s", bad=1)
    digest = put_chunk(store, b"good bytes" * 100)
    cache = ChunkCache(tmp_path / "c", store)
    assert cache.ensure(digest).read_bytes() == b"good bytes" * 100
    assert store.gets[chunk_key(digest)] == 2


def test_chunk_corrupt_twice_is_never_served(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s", bad=2)
    digest = put_chunk(store, b"good bytes" * 100)
    cache = ChunkCache(tmp_path / "c", store)
    with pytest.raises(ImageCorrupt, match="does not match its digest after a re-fetch") as exc:
        cache.ensure(digest)
    assert exc.value.detail["digest"] == digest
    assert not cache.has(digest) and store.gets[chunk_key(digest)] == 2
    assert cache.ensure(digest).read_bytes() == b"good bytes" * 100  # the store healed: fetched again


def test_missing_chunk_and_bad_digest_are_clear(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", DirStore(tmp_path / "s"))
    with pytest.raises(ImageCorrupt, match="missing from the image store"):
        cache.ensure(sha256(b"never stored"))
    with pytest.raises(ImageCorrupt, match="invalid digest"):
        cache.ensure("md5:abc")


def test_concurrent_first_reads_fetch_once(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s", delay=0.2)
    digest = put_chunk(store, os.urandom(65536))
    cache = ChunkCache(tmp_path / "c", store)
    results: list[bytes] = []

    def read() -> None:
        results.append(ChunkCache(tmp_path / "c", store).ensure(digest).read_bytes())  # separate instances too

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert store.gets[chunk_key(digest)] == 1
    assert cache.has(digest)


def test_lru_eviction_spares_pinned_images(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "s")
    data = [bytes([i]) * 10000 for i in range(4)]
    digests = [put_chunk(store, d) for d in data]
    cache = ChunkCache(tmp_path / "c", store)
    pinned = manifest_of([(digests[0], data[0])])
    cache.pin(cache.put_manifest(pinned))
    for i, d in enumerate(digests):
        os.utime(cache.ensure(d), (1000 + i, 1000 + i))  # d0 oldest, d3 newest
    os.utime(cache.path(digests[2]), (5000, 5000))  # d2 used most recently
    freed = cache.evict(target=20000)
    assert freed == 20000
    assert [cache.has(d) for d in digests] == [True, False, True, False]  # d0 pinned, d2 recent
    cache.unpin(pinned.digest.removeprefix("sha256:"))
    cache.evict(target=0)
    assert cache.usage() == 0


def test_cache_limit_is_enforced_on_fetch(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "s")
    digests = [put_chunk(store, bytes([i]) * 10000) for i in range(5)]
    cache = ChunkCache(tmp_path / "c", store, limit=25000)
    for d in digests:
        cache.ensure(d)
        time.sleep(0.01)
    assert cache.usage() <= 25000
    assert cache.has(digests[-1])


def test_throttled_store_url(tmp_path: Path) -> None:
    store = open_store(f"{tmp_path}?rate=1e6&latency=0.01")
    assert isinstance(store, ThrottledStore) and store.rate == 1e6 and store.latency == 0.01
    store.put("a/b", b"x" * 10)
    assert store.get("a/b") == b"x" * 10 and store.url.startswith(f"file://{tmp_path}?rate=")
    assert isinstance(open_store(store.url), ThrottledStore)  # the URL round-trips (the FUSE server reopens it)
    with pytest.raises(InvalidRequest, match="rate=BYTES_PER_S"):
        open_store(f"{tmp_path}?speed=fast")
    with pytest.raises(InvalidRequest, match="rate > 0"):
        open_store(f"{tmp_path}?rate=0")


def test_an_s3_store_url_keeps_its_endpoint_and_region() -> None:
    """The lazy server process reopens the store from its URL: a region dropped there made it sign for
    us-east-1 against an endpoint of another region (every chunk read failing while manifests worked)."""
    url = "s3://bucket/images?endpoint=http://127.0.0.1:8333&region=eu-west-3"
    store = open_store(url)
    assert isinstance(store, S3Store) and store.region == "eu-west-3"
    again = open_store(store.url)
    assert isinstance(again, S3Store) and again.region == "eu-west-3" and again.url == store.url
    assert again._s3.meta.endpoint_url == "http://127.0.0.1:8333" and again._s3.meta.region_name == "eu-west-3"
    plain = open_store("s3://bucket")
    assert isinstance(plain, S3Store) and plain.url == "s3://bucket/" and plain.region == "us-east-1"
    assert plain._s3.meta.config.read_timeout == 10


def test_an_s3_store_url_keeps_its_timeout_and_refuses_a_bad_one() -> None:
    store = open_store("s3://bucket/images?endpoint=http://127.0.0.1:8333&timeout=2.5")
    assert isinstance(store, S3Store) and store.url == "s3://bucket/images/?endpoint=http://127.0.0.1:8333&timeout=2.5"
    again = open_store(store.url)
    assert isinstance(again, S3Store) and again.url == store.url
    assert (again._s3.meta.config.connect_timeout, again._s3.meta.config.read_timeout) == (2.5, 2.5)
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(InvalidRequest, match=f"timeout={bad} is not a number of seconds"):
            open_store(f"s3://bucket?timeout={bad}")


def test_the_free_space_reserve_is_read_with_its_default_and_refused_when_malformed() -> None:
    GiB = 1 << 30
    assert free_reserve(None, 200 * GiB) == 10 * GiB  # 5%
    assert free_reserve("", 8 * GiB) == 1 * GiB  # at least 1 GiB ...
    assert free_reserve(None, 2 * GiB) == 2 * GiB // 5  # ... but never more than a fifth of the disk
    assert free_reserve("10%", 100 * GiB) == 10 * GiB and free_reserve("0", 100 * GiB) == 0
    assert free_reserve(" 4096 ", GiB) == 4096
    for bad in ("lots", "-1", "100%", "-5%", "1.5"):
        with pytest.raises(InvalidRequest, match="DSEC_IMAGE_CACHE_MIN_FREE") as err:
            free_reserve(bad, GiB)
        assert repr(bad) in str(err.value)


def test_a_cached_chunk_cut_short_or_evicted_under_a_read_is_fetched_again(tmp_path: Path) -> None:
    """A host crash can leave a chunk's file short under its final name (written, renamed, data not yet on
    disk): served as it is, every byte after it would shift. The read fetches it again instead."""
    store = DirStore(tmp_path / "s")
    data = os.urandom(20000)
    digest = put_chunk(store, data)
    cache = ChunkCache(tmp_path / "c", store)
    assert cache.read(digest, len(data), 100, 50) == data[100:150]
    path = cache.path(digest)
    os.truncate(path, 120)  # what the crash left
    assert cache.read(digest, len(data), 100, 5000) == data[100:5100]
    assert path.stat().st_size == len(data)
    path.unlink()  # evicted by another process between two reads
    assert cache.read(digest, len(data), 19990, 10) == data[19990:]
    with pytest.raises(ImageCorrupt, match="could not be read in full"):
        cache.read(digest, len(data) + 1, 0, 10)  # a manifest that disagrees with the chunk's bytes


def test_a_read_error_is_told_to_every_create_since_it_and_to_none_before(tmp_path: Path) -> None:
    from dsec.errors import StoreUnavailable

    cache = ChunkCache(tmp_path / "c", DirStore(tmp_path / "s"), errors=tmp_path / "errors")
    digest = "cd" * 32
    before = time.time()
    cache.record_error(digest, StoreUnavailable("the store\tis down\nhard"))
    # Every create of a batch that began before it is told (not only the first to ask) ...
    for _ in range(3):
        assert cache.read_error(digest, since=before) == ("StoreUnavailable", "the store is down hard")
    # ... and a create that began after it is not: an old fault is not blamed for a new failure.
    assert cache.read_error(digest, since=time.time() + 1) is None
    # A record written by an older lazy server (no time, in the cache's own errors/) still reads.
    (tmp_path / "c" / "errors").mkdir(exist_ok=True)
    (tmp_path / "errors" / digest).unlink()
    (tmp_path / "c" / "errors" / digest).write_text("CacheFull\tthe cache is full\n")
    assert cache.read_error(digest, since=time.time() - 5) == ("CacheFull", "the cache is full")  # by its mtime
    assert cache.read_error(digest, since=time.time() + 5) is None
    assert cache.take_error(digest) == ("CacheFull", "the cache is full") and cache.read_error(digest) is None


def test_a_killed_writers_temporary_chunk_is_swept_by_the_next_walk(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "s")
    digest = put_chunk(store, b"x" * 5000)
    cache = ChunkCache(tmp_path / "c", store)
    cache.ensure(digest)
    folder = cache.path(digest).parent
    old, fresh = folder / ".tmp-dead-0001", folder / ".tmp-live-0002"
    old.write_bytes(b"y" * 100)
    fresh.write_bytes(b"z" * 100)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert cache.usage() == 5000  # neither counts as cached
    assert not old.exists() and fresh.exists(), "only a leftover older than any write in progress goes"


def test_a_cache_limit_does_not_walk_the_cache_for_every_chunk_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(tmp_path / "s")
    digests = [put_chunk(store, bytes([i % 256]) * 4096 + i.to_bytes(4, "big")) for i in range(60)]
    cache = ChunkCache(tmp_path / "c", store, limit=40 * 4100)
    walks = 0
    entries = cache._entries

    def counted() -> list[tuple[float, int, Path]]:
        nonlocal walks
        walks += 1
        return entries()

    monkeypatch.setattr(cache, "_entries", counted)
    for d in digests:
        cache.ensure(d)
    assert cache.usage() <= 40 * 4100 and cache.has(digests[-1])  # the limit still holds
    assert walks <= 10, f"{walks} walks of the cache for 60 chunks written"


def test_what_the_node_reports_cached_lists_only_chunk_directories_that_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(tmp_path / "s")
    data = [bytes([i]) * (4096 * (i + 1)) for i in range(3)]
    digests = [put_chunk(store, d) for d in data]
    manifest = manifest_of([*zip(digests, data, strict=True), (digests[0], data[0])])  # a chunk used twice counts once
    ours, servers = ChunkCache(tmp_path / "c", store), ChunkCache(tmp_path / "c", store)  # the lazy server's writes
    assert ours.cached_bytes(manifest) == 0
    servers.ensure(digests[0])
    assert ours.cached_bytes(manifest) == len(data[0])
    settled = time.time() - 60
    for d in digests:
        servers.path(d).parent.mkdir(exist_ok=True)
        os.utime(servers.path(d).parent, (settled, settled))
    listed: list[str] = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(str(path)) or listdir(path))
    assert ours.cached_bytes(manifest) == len(data[0])
    listed.clear()
    assert ours.cached_bytes(manifest) == len(data[0]) and listed == [], "nothing changed: nothing listed"
    servers.ensure(digests[1])
    assert ours.cached_bytes(manifest) == len(data[0]) + len(data[1])
    assert listed == [str(servers.path(digests[1]).parent)], "only the directory written to is listed again"
    # A chunk written within the same tick of the filesystem's clock leaves the directory's mtime as it was: one
    # changed that recently is never trusted.
    folder = servers.path(digests[2]).parent
    recent = time.time_ns()
    os.utime(folder, ns=(recent, recent))
    assert ours.cached_bytes(manifest) == len(data[0]) + len(data[1])
    servers.ensure(digests[2])
    os.utime(folder, ns=(recent, recent))
    assert ours.cached_bytes(manifest) == sum(len(d) for d in data)
    servers.path(digests[1]).with_name(".tmp-w-1").write_bytes(b"partial")  # a write in progress is no chunk
    servers.evict(target=0)
    assert ours.cached_bytes(manifest) == 0


def test_the_cache_forgets_touches_older_than_the_touch_period(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reads a new snapshot layer's chunks for every restore (thousands an hour, each chunk once): what it
    remembers of when it last touched a chunk stays about what it touched within the period."""
    import types

    from dsec.images import cache as cache_mod

    clock = [1000.0]
    monkeypatch.setattr(cache_mod, "_TOUCHED_KEPT", 8)
    monkeypatch.setattr(cache_mod, "time", types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic))
    store = DirStore(tmp_path / "s")
    cache = ChunkCache(tmp_path / "c", store)
    first = [put_chunk(store, f"first {i}".encode()) for i in range(30)]
    then = [put_chunk(store, f"then {i}".encode()) for i in range(30)]
    for digest in first:
        cache.ensure(digest)  # fetched
        cache.ensure(digest)  # read again: touched
    assert set(cache._touched) == set(first)  # all within the period: none forgotten
    clock[0] += cache_mod._TOUCH_EVERY + 1
    for digest in then:
        cache.ensure(digest)
        cache.ensure(digest)
    assert set(cache._touched) == set(then)  # the first ones' touches were a period old: forgotten
    assert cache.ensure(first[0]).read_bytes() == b"first 0" and first[0] in cache._touched  # and touched anew


def test_a_node_remembers_a_bounded_number_of_saved_access_records(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.images import access as access_mod

    monkeypatch.setattr(access_mod, "_SAVED_KEPT", 4)
    store = CountingStore(tmp_path / "s")
    asked: list[str] = []
    monkeypatch.setattr(store, "has", lambda key: asked.append(key) or store.inner.has(key))
    cache = ChunkCache(tmp_path / "c", store)
    records = access_mod.AccessRecords(store, cache)
    layers = [sha256(f"layer {i}".encode())[7:] for i in range(10)]
    for hexdigest in layers:
        (cache.root / "access" / hexdigest).write_text("3 1 3 2\n")
        records.save(hexdigest)
    assert all(store.inner.get(f"access/{h}") == b"[3, 1, 2]" for h in layers) and len(asked) == 10
    assert [records.saved(h) for h in layers] == [False] * 6 + [True] * 4  # the latest four remembered
    records.save(layers[-1])
    assert len(asked) == 10  # remembered: the store is not asked again
    records.save(layers[0])
    assert len(asked) == 11 and records.saved(layers[0])  # forgotten: asked again (it holds it: not re-sent)


def test_a_prefetch_whose_cache_is_gone_stops_without_an_unhandled_error(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A prefetch thread still running when its cache directory goes (a node's home removed under it) stops with
    a warning: an exception escaping it would be an unhandled thread error."""
    from dsec.images import access as access_mod

    store = CountingStore(tmp_path / "s")
    cache = ChunkCache(tmp_path / "c", store)
    records = access_mod.AccessRecords(store, cache)
    digests = []
    for i in range(2):
        data = f"chunk {i}".encode()
        digests.append(sha256(data))
        store.inner.put(chunk_key(digests[-1]), data)
    shutil.rmtree(cache.root)
    with caplog.at_level(logging.WARNING, logger="dsec.images.access"):
        records._fetch(digests)
    assert any("prefetch stopped" in r.getMessage() for r in caplog.records), caplog.records
