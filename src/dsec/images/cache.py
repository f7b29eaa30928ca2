"""The node's chunk cache: image chunks fetched from the store on first use, verified, kept on local disk.

Layout under ``root``::

    chunks/<hh>/<hex>     a verified chunk (or metadata image), named by its sha256
    manifests/<hex>       manifests of images this node has mounted (verified copies)
    pins/<hex>            present while image <hex> is mounted: its chunks are never evicted
    access/<hex>          chunk indexes image <hex> read on this node, in first-read order
    errors/<hex>          the last fetch error of image <hex> (read by the daemon to explain an EIO); the
                          node keeps this directory elsewhere (``errors=``): a full cache disk is one of
                          the errors it must be able to record
    locks/<hhh>           flock stripes: one fetch of a chunk at a time across threads and processes

Every fetch checks the chunk's digest; a mismatch is fetched once more, and a second mismatch raises
:class:`~dsec.errors.ImageCorrupt`: bad bytes are never written to the cache nor served. Chunks no pinned
image uses are evicted least-recently-used first (by mtime, refreshed when a chunk is used) when the cache
passes ``limit``, when its filesystem's free space falls below ``min_free`` (the cache shares a disk with
the node's records, logs and writable layers, which must not be the ones to run out), or when the disk is
full. :class:`Locality` reads how much of each tagged image the cache holds (placement's image locality).
This module owns the cache directory; it never mounts anything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dsec.errors import CacheFull, DSecError, ImageCorrupt, InvalidRequest
from dsec.images.blob_store import BlobStore
from dsec.images.format import Manifest, sha256

__all__ = ["ChunkCache", "Locality", "chunk_key", "free_reserve"]

log = logging.getLogger(__name__)
_TOUCH_EVERY = 60.0
"""Seconds between two mtime updates of a chunk read again (the LRU clock of eviction)."""
_TOUCHED_KEPT = 4096
"""Chunks whose last touch the cache remembers before it forgets those touched over :data:`_TOUCH_EVERY` ago
(a node reads a new layer's chunks per snapshot it restores: thousands an hour, each seen once)."""
_TMP_STALE = 600.0
"""Seconds after which a chunk's temporary file is a killed writer's leftover (swept by the cache walks)."""
_TALLY_EVERY = 10.0
"""Seconds between two walks of the cache to learn its size while chunks are written under a limit."""
_FRUITLESS_PAUSE = 5.0
"""Seconds a reserve eviction that freed nothing is not tried again."""
_SETTLED_NS = 2_000_000_000
"""A chunk directory whose mtime is younger than this is listed again at the next look: a chunk written in the same
tick of the filesystem's clock as the last listing would leave its mtime unchanged."""


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ImageCorrupt(f"invalid digest {digest!r}", digest=digest)
    return hexpart


def free_reserve(spec: str | None, fs_bytes: int) -> int:
    """Bytes to keep free on a cache filesystem of ``fs_bytes``: ``spec`` is a byte count or ``N%`` of the
    filesystem (``0``: none). By default (None or empty) 5% of it, at least 1 GiB, at most a fifth of it."""
    if not spec:
        return min(max(fs_bytes // 20, 1 << 30), fs_bytes // 5)
    text = spec.strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 <= share < 100:
                raise ValueError
            return int(fs_bytes * share / 100)
        value = int(text)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise InvalidRequest(f"image cache free-space reserve {spec!r} (DSEC_IMAGE_CACHE_MIN_FREE): expected "
                             "bytes or a percentage of the disk below 100, e.g. 10737418240 or 10%") from None


def chunk_key(digest: str) -> str:
    """Store key of a chunk (or metadata image)."""
    h = _hex(digest)
    return f"chunks/sha256/{h[:2]}/{h}"


class ChunkCache:
    """Verified chunks of ``store`` under ``root`` (see the module docstring)."""

    def __init__(self, root: Path | str, store: BlobStore, limit: int | None = None,
                 errors: Path | str | None = None, min_free: int = 0) -> None:
        self.root = Path(root)
        self.store = store
        self.limit = limit
        self.min_free = min_free
        """Bytes the cache keeps free on its filesystem by evicting (0: only a full disk evicts)."""
        self.errors_dir = Path(errors) if errors is not None else self.root / "errors"
        self._touched: dict[str, float] = {}
        self._touched_cap = _TOUCHED_KEPT
        self._fruitless_until = 0.0
        self._tally: tuple[int, float] | None = None  # (bytes cached, when the cache was last walked)
        self._listed: dict[str, tuple[int, frozenset[str]]] = {}  # chunk directory -> (its mtime, its chunks)
        for sub in ("chunks", "manifests", "pins", "access", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.errors_dir.mkdir(parents=True, exist_ok=True)

    # --------------------------------------------------------------------- chunks
    def path(self, digest: str) -> Path:
        """Where chunk ``digest`` is (or would be) cached."""
        h = _hex(digest)
        return self.root / "chunks" / h[:2] / h

    def has(self, digest: str) -> bool:
        """True when the chunk is cached."""
        return self.path(digest).is_file()

    def ensure(self, digest: str) -> Path:
        """The cached chunk's path, fetching and verifying it first if needed (one fetch across processes)."""
        path = self.path(digest)
        if path.is_file():
            self._touch(digest, path)
            return path
        with self._lock(digest):
            if path.is_file():  # another thread or process fetched it while we waited
                return path
            data = self.fetch(digest)
            self._write(path, data)
        return path

    def read(self, digest: str, size: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of chunk ``digest`` (``size`` bytes long), fetched first if needed.

        A cached file of another size is fetched again, once: a host that crashed before a chunk's data
        reached the disk can leave it short under its final name, and a short read would shift every byte
        after it (wrong bytes, never served). So is a chunk evicted between the check and the open."""
        for _attempt in (1, 2):
            path = self.ensure(digest)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if os.fstat(fd).st_size == size:
                    data = os.pread(fd, length, offset)
                    if len(data) == length:
                        return data
            finally:
                os.close(fd)
            log.warning("cached chunk %s is not %d bytes long (cut short by a crash?): fetched again", digest, size)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise ImageCorrupt(f"chunk {digest} could not be read in full from the node cache {self.root} (evicted or "
                           "cut short twice)", digest=digest)

    def fetch(self, digest: str) -> bytes:
        """Chunk ``digest``'s bytes from the store, verified (one re-fetch on a mismatch); not cached."""
        key = chunk_key(digest)
        for attempt in (1, 2):
            try:
                data = self.store.get(key)
            except KeyError:
                raise ImageCorrupt(f"chunk {digest} is missing from the image store {self.store.url} "
                                   "(removed by `dsec image gc`, or the store is incomplete)", digest=digest) from None
            got = sha256(data)
            if got == digest:
                return data
            log.warning("chunk %s from %s hashes to %s (attempt %d)", digest, self.store.url, got, attempt)
        raise ImageCorrupt(f"chunk {digest} from the image store {self.store.url} does not match its digest "
                           f"after a re-fetch (got {got}): the store holds corrupt data; not served",
                           digest=digest, got=got)

    def _with_room(self, write: Callable[[], object], size: int) -> None:
        """Run ``write``; on a full disk (no space or no inode left) evict unused chunks (8 times ``size``, at least
        1 MiB: a few inodes) and run it once more; still full: :class:`CacheFull`."""
        for attempt in (1, 2):
            try:
                write()
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if attempt == 2:
                    raise CacheFull(f"the node image cache {self.root} is full: every cached chunk belongs to a "
                                    "mounted image; free disk space (or inodes) or raise the cache size",
                                    cache=str(self.root)) from exc
                self.evict(target=max(0, self.usage() - max(size * 8, 1 << 20)))

    def _write(self, path: Path, data: bytes) -> None:
        self._with_room(lambda: self._write_once(path, data), len(data))
        if self._tally is not None:
            self._tally = (self._tally[0] + len(data), self._tally[1])
        if self.limit is not None and self._estimated_usage() > self.limit:
            self.evict(target=self.limit - self.limit // 10)  # a tenth below: not one walk per chunk written
        if self.min_free:
            self._keep_free()

    def _estimated_usage(self) -> int:
        """:meth:`usage` without a walk of the cache per chunk written (a stat of every chunk: 100,000 of them
        in a 100 GB cache): walked at most every ``_TALLY_EVERY`` s, this process's writes and evictions
        added in between (another process's are seen at the next walk: the limit is a soft one)."""
        now = time.monotonic()
        if self._tally is None or now - self._tally[1] > _TALLY_EVERY:
            self._tally = (self.usage(), now)
        return self._tally[0]

    def _keep_free(self) -> None:
        """Evict until the filesystem has ``min_free`` bytes free again, and a tenth more so that the next
        writes do not each evict (one statvfs per chunk written; the cache is walked only when short)."""
        st = os.statvfs(self.root)
        short = self.min_free - st.f_bavail * st.f_frsize
        # A walk that found nothing to evict (every chunk pinned, or the disk filled by others) is not
        # repeated for every chunk written: at most every few seconds.
        if short > 0 and time.monotonic() >= self._fruitless_until:
            usage = self.usage()
            freed = self.evict(target=max(0, usage - short - self.min_free // 10))
            log.info("image cache %s: %d bytes free, below the %d kept free: evicted %d bytes", self.root,
                     st.f_bavail * st.f_frsize, self.min_free, freed)
            self._fruitless_until = 0.0 if freed else time.monotonic() + _FRUITLESS_PAUSE

    @staticmethod
    def _write_once(path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def _touch(self, digest: str, path: Path) -> None:
        now = time.time()
        if now - self._touched.get(digest, 0.0) > _TOUCH_EVERY:
            self._touched[digest] = now
            if len(self._touched) > self._touched_cap:
                self._forget_touches(now)
            with contextlib.suppress(OSError):
                os.utime(path)

    def _forget_touches(self, now: float) -> None:
        """Drop the touches old enough that the next read touches again anyway; the bound doubles past what is
        left, so a burst of fresh ones is not walked at every read (a copy: other threads touch meanwhile)."""
        fresh = {d: t for d, t in list(self._touched.items()) if now - t <= _TOUCH_EVERY}
        self._touched = fresh
        self._touched_cap = max(_TOUCHED_KEPT, 2 * len(fresh))

    @contextlib.contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        fd = os.open(self.root / "locks" / _hex(digest)[:3], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ manifests
    def put_manifest(self, manifest: Manifest) -> str:
        """Keep a verified copy of ``manifest`` for the lazy filesystem; returns its hex digest."""
        h = _hex(manifest.digest)
        path = self.root / "manifests" / h
        if not path.is_file():
            self._write(path, manifest.canonical())  # on a full disk: evict, then CacheFull (as for chunks)
        return h

    def manifest(self, hexdigest: str) -> Manifest:
        """A manifest this node keeps, verified."""
        data = (self.root / "manifests" / hexdigest).read_bytes()
        return Manifest.parse(data, "sha256:" + hexdigest)

    # ---------------------------------------------------------------- pins and LRU
    def pin(self, hexdigest: str) -> None:
        """Mark image ``hexdigest`` mounted: its chunks are not evicted. On a disk out of inodes, evicts to make
        one (:class:`CacheFull` if none can be freed)."""
        self._with_room((self.root / "pins" / hexdigest).touch, 0)

    def unpin(self, hexdigest: str) -> None:
        """Undo :meth:`pin`."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / "pins" / hexdigest).unlink()

    def pinned(self) -> set[str]:
        """Digests of every chunk a pinned image uses."""
        keep: set[str] = set()
        for pin in (self.root / "pins").iterdir():
            try:
                keep.update(c.digest for c in self.manifest(pin.name).chunks)
            except (OSError, DSecError):
                continue
        return keep

    def _entries(self) -> list[tuple[float, int, Path]]:
        found = []
        stale = time.time() - _TMP_STALE
        for sub in (self.root / "chunks").iterdir():
            for f in sub.iterdir():
                if f.name.startswith(".tmp-"):  # a write in progress, or the leftover of a killed one
                    with contextlib.suppress(OSError):
                        if f.stat().st_mtime < stale:
                            f.unlink()
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = f.stat()
                    found.append((st.st_mtime, st.st_size, f))
        return found

    def usage(self) -> int:
        """Bytes of cached chunks."""
        return sum(size for _, size, _ in self._entries())

    def evict(self, target: int) -> int:
        """Delete unpinned chunks, least recently used first, until usage <= ``target``; returns bytes freed."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        keep = {_hex(d) for d in self.pinned()}
        freed = 0
        for _, size, path in entries:
            if total - freed <= target:
                break
            if path.name in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                freed += size
        self._tally = (total - freed, time.monotonic())  # walked just now
        return freed

    def cached_bytes(self, manifest: Manifest, listing: dict[str, frozenset[str]] | None = None) -> int:
        """Bytes of ``manifest``'s blob that this node has cached, looked up in ``listing`` (a fresh
        :meth:`listing` when None)."""
        return self.held(self.chunk_names(manifest), self.listing() if listing is None else listing)

    @staticmethod
    def chunk_names(manifest: Manifest) -> tuple[tuple[str, str, int], ...]:
        """``manifest``'s distinct chunks as (directory, file name, size) in the cache: what :meth:`held` looks up
        (worth keeping for a manifest asked about again)."""
        unique = {c.digest: c.size for c in manifest.chunks}
        return tuple((h[:2], h, size) for h, size in ((_hex(d), size) for d, size in unique.items()))

    @staticmethod
    def held(chunks: tuple[tuple[str, str, int], ...], listing: dict[str, frozenset[str]]) -> int:
        """Bytes of ``chunks`` (from :meth:`chunk_names`) that ``listing`` (from :meth:`listing`) holds."""
        return sum(size for sub, name, size in chunks if name in listing.get(sub, ()))

    def listing(self) -> dict[str, frozenset[str]]:
        """The chunks cached, by directory (``chunks/<hh>``): a stat of each directory, and a listing of only those
        whose mtime moved since the last look (a chunk written or evicted, by this process or the lazy server's)
        or that changed too recently for their mtime to be trusted. Temporary files are not chunks."""
        chunks = self.root / "chunks"
        now = time.time_ns()
        listing: dict[str, frozenset[str]] = {}
        seen: set[str] = set()
        with os.scandir(chunks) as entries:
            for entry in entries:
                try:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    mtime = entry.stat(follow_symlinks=False).st_mtime_ns
                    seen.add(entry.name)
                    last = self._listed.get(entry.name)
                    if last is not None and last[0] == mtime:
                        listing[entry.name] = last[1]
                        continue
                    names = frozenset(n for n in os.listdir(entry.path) if not n.startswith(".tmp-"))
                except FileNotFoundError:  # a directory removed under us
                    continue
                listing[entry.name] = names
                if now - mtime >= _SETTLED_NS:
                    self._listed[entry.name] = (mtime, names)
                else:
                    self._listed.pop(entry.name, None)
        for gone in self._listed.keys() - seen:
            del self._listed[gone]
        return listing

    # ------------------------------------------------------------ access records
    def record_error(self, hexdigest: str, error: DSecError) -> None:
        """Remember why a read of image ``hexdigest`` failed (when, type and message, one line).

        Written to a new file and renamed over the old record, so the daemon never reads a half-written
        one: reads of one image fail concurrently (the kernel's readahead), and a record the disk had no
        room for is not left behind empty."""
        line = f"{time.time():.6f}\t{type(error).__name__}\t{' '.join(error.message.split())}\n"
        path = self.errors_dir / hexdigest
        tmp = self.errors_dir / f".tmp-{hexdigest}-{secrets.token_hex(4)}"
        try:
            tmp.write_text(line)
            os.rename(tmp, path)
        except OSError as exc:
            log.warning("could not record the read error of image %s (%s): %s", hexdigest[:12], exc, line.strip())
            with contextlib.suppress(OSError):
                tmp.unlink()

    def read_error(self, hexdigest: str, since: float = 0.0) -> tuple[str, str] | None:
        """The last read error of image ``hexdigest`` recorded at or after ``since`` (wall clock), or None. Left
        in place: every create of a batch that failed on it is told, and a later one is not (too old)."""
        # A lazy filesystem server started by an older daemon (kept warm across upgrades) records under root,
        # without a time.
        for folder in dict.fromkeys((self.errors_dir, self.root / "errors")):
            path = folder / hexdigest
            try:
                fields = path.read_text().rstrip("\n").split("\t", 2)
                written = path.stat().st_mtime
            except FileNotFoundError:
                continue
            try:
                when, kind, message = float(fields[0]), fields[1], fields[2]
            except (ValueError, IndexError):  # the older format: when it was written is the file's own time
                when, kind, message = written, fields[0], fields[1] if len(fields) > 1 else ""
            if kind and when >= since:
                return kind, message
        return None

    def take_error(self, hexdigest: str) -> tuple[str, str] | None:
        """:meth:`read_error` (any age), and the record removed."""
        found = self.read_error(hexdigest)
        for folder in (self.errors_dir, self.root / "errors"):
            (folder / hexdigest).unlink(missing_ok=True)
        return found

    def access(self, hexdigest: str) -> list[int]:
        """Chunk indexes image ``hexdigest`` read on this node, first-read order, without repeats."""
        try:
            text = (self.root / "access" / hexdigest).read_text()
        except FileNotFoundError:
            return []
        seen: dict[int, None] = {}
        for word in text.split():
            with contextlib.suppress(ValueError):
                seen.setdefault(int(word), None)
        return list(seen)


class Locality:
    """How much of each tagged image a node's chunk cache holds: what cluster placement calls image locality."""

    def __init__(self, cache: ChunkCache, meta_dir: Path, manifests: dict[str, Manifest]) -> None:
        self.cache, self.meta_dir = cache, meta_dir
        self.manifests = manifests  # digest -> parsed manifest, shared with the node's image manager
        self._chunk_names: dict[str, tuple[tuple[str, str, int], ...]] = {}  # digest -> ChunkCache.chunk_names
        self._last: tuple[float, dict[str, int]] | None = None

    def read(self, max_age: float = 0.0) -> dict[str, int]:
        """Image name -> bytes of it on this node (cached chunks plus its metadata image), for every image
        this node has resolved of which some chunks are still cached.

        Read from the cache itself (a stat per chunk directory, and a listing of those that changed), so eviction
        shows at the next read; an answer up to ``max_age`` seconds old is reused (a node's health is asked often).
        Blocking.
        """
        last = self._last
        if last is not None and time.monotonic() - last[0] <= max_age:
            return dict(last[1])
        found: dict[str, int] = {}
        tags = self.cache.root / "tags"
        listing: dict[str, frozenset[str]] | None = None
        for tag in sorted(tags.iterdir()) if tags.is_dir() else []:
            if tag.name.startswith("."):  # a record being written
                continue
            try:
                digest = tag.read_text().strip()
                manifest = self.manifests.get(digest) or self.cache.manifest(digest.removeprefix("sha256:"))
            except (OSError, DSecError, ValueError):
                continue
            self.manifests[digest] = manifest
            chunks = self._chunk_names.get(digest)
            if chunks is None:
                chunks = self._chunk_names[digest] = self.cache.chunk_names(manifest)
            if listing is None:
                listing = self.cache.listing()
            held = self.cache.held(chunks, listing)
            if held:
                meta = self.meta_dir / manifest.meta_digest.removeprefix("sha256:")
                found[tag.name] = held + (manifest.meta_size if meta.is_file() else 0)
        self._last = (time.monotonic(), found)
        return dict(found)
