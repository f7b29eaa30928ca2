"""The node's image manager: one lazily loaded EROFS mount per image, shared by every sandbox of that image.

For a chunked image, :meth:`NodeImages.resolve` makes sure the node's lazy blob filesystem runs (a FUSE
server process, :mod:`dsec.images.lazyfs`, mounted at ``$DSEC_HOME/lazy/blobs``), fetches the small EROFS
metadata image into the node cache, and mounts it file-backed (mount(2) directly) with the image's lazy
blob as its device at ``$DSEC_HOME/lazy/mnt/<digest>``. It returns an :class:`ImageRef` whose ``rootfs``
is that mount and pins it; :meth:`release` unpins. Unused mounts are kept warm (their page cache is what
makes the next sandbox of the image start like a local one) until :meth:`unmount_idle` or :meth:`aclose`
with ``unmount=True``. On later starts of an image on any node, the chunks its first start read (recorded
in the store under ``access/``) are prefetched in the background.

The FUSE process (:mod:`dsec.images.lazyserver`) outlives the daemon: a restarted daemon adopts it and the
mounts (sandboxes recovered by the engine re-pin theirs); a mount whose server died meanwhile is dead to it as
to the daemon that made it (:meth:`stale`, below). Order matters when tearing down: EROFS mounts first,
the FUSE mount last.

*A mount is checked before it is handed out*: it must still be mounted (its device number, one ``stat``) and
the server it reads through must still run (one poll of its pidfd); :meth:`check` also asks the server for
an answer. A mount that vanished (unmounted by another process) is mounted afresh; a server that died is
started again and every image that read through it is mounted afresh, each at a new path
(``lazy/mnt/<digest>.<n>``): what sandboxes made before that still read through the dead one, and
:meth:`stale` names those paths so that the engine can revive or report them. Another process's
``NodeImages`` (a CLI, a test) never unmounts or stops what a running daemon of the home uses.
This module owns those mounts; it never builds images and never runs sandboxes.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.config import Settings
from dsec.errors import CacheFull, DSecError, ImageCorrupt, SandboxError, StoreUnavailable
from dsec.images.access import AccessRecords, Background
from dsec.images.cache import ChunkCache, Locality, free_reserve
from dsec.images.format import Manifest, sha256
from dsec.images.image_store import ImageStore
from dsec.images.lazyserver import LazyServer, fs_types, umount
from dsec.images.ref import ImageRef
from dsec.models import ImageInfo

__all__ = ["NodeImages"]

log = logging.getLogger(__name__)

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_ERRORS: dict[str, type[DSecError]] = {"ImageCorrupt": ImageCorrupt, "StoreUnavailable": StoreUnavailable,
                                       "CacheFull": CacheFull}
_HUNG_PROBES = 3
"""Deep checks in a row that a live lazy server must fail to answer before it is replaced as hung."""
_DEAD_KEPT = 10_000
"""Paths of dead mounts remembered for :meth:`NodeImages.stale` (a few per server death)."""
_TAG_KEPT_TTLS = 60
"""A tag's answer not looked up again for this many ``tag_ttl`` (at least a minute) is forgotten when idle images
are unmounted: a long-lived node resolves many names once (and images are removed), and while an answer is kept,
so is the parsed manifest of the image it names (up to ~1 MB each)."""
IDLE_LAYERS = 16
"""Snapshot layers (images no tag names: one per snapshot, most restored or forked once) kept mounted while no
sandbox uses them; beyond these the longest idle go at once, not after the warm period: under a load of forks
and restores their mounts, health entries and pinned chunks would otherwise pile up for the whole period."""


def _owned(lock: Path) -> bool:
    """Whether an image manager that owns the home's mounts (a daemon's) holds ``lock``: then another one, a CLI's
    or a test's, leaves the mounts and the lazy server alone."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases the lock if it was taken)
    return False


@dataclass
class _Mount:
    hexdigest: str
    path: Path
    refs: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    dev: int = 0
    """Device number of the EROFS mount (what a ``stat`` of ``path`` shows while it is still there)."""
    server: str | None = None
    """Generation of the lazy server its blob reads through (None: not known, an older daemon's mount)."""
    name: str | None = None
    """The tag it was last resolved by; None: a snapshot layer (pinned by digest), or adopted and not resolved
    since. Kept with the mount: the tag's answer may be forgotten (see ``_TAG_KEPT_TTLS``) while it is mounted."""


def _ref(manifest: Manifest, mount: _Mount) -> ImageRef:
    info = manifest.info
    return ImageRef(name=info.name, rootfs=mount.path, uid_shift=info.uid_shift, config=info.config,
                    digest=mount.hexdigest)


class NodeImages:
    """Chunked images mounted on this node (see the module docstring). Thread-safe."""

    def __init__(self, settings: Settings, store: ImageStore | None = None,
                 cache_limit: int | None = None, prefetch: bool = True, tag_ttl: float = 1.0,
                 daemon: bool = False, idle_layers: int = IDLE_LAYERS) -> None:
        self.settings = settings
        self.idle_layers = idle_layers
        self.daemon = daemon
        """This is the home's daemon's image manager: it holds ``lazy/owner.lock`` (shared) while it lives, and
        other managers of the home leave what it mounted alone."""
        self.store = store if store is not None else ImageStore(settings.images, settings.image_store)
        self.base = settings.home / "lazy"
        self.blobs_dir = self.base / "blobs"
        self.mnt_dir = self.base / "mnt"
        self._owner_lock = self.base / "owner.lock"
        self._owner = -1
        if daemon:
            self.base.mkdir(parents=True, exist_ok=True)
            self._owner = os.open(self._owner_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._owner, fcntl.LOCK_SH)
        # Read errors are recorded beside the mounts, not in the cache: when the cache has a disk of its own, a
        # full cache disk is one of them (by default both share DSEC_HOME's disk, kept from filling by min_free).
        self.cache = ChunkCache(settings.home / "image-cache", self.store.blobs, limit=cache_limit,
                                errors=self.base / "errors")
        disk = os.statvfs(self.cache.root)
        self.cache.min_free = free_reserve(settings.image_cache_min_free, disk.f_blocks * disk.f_frsize)
        self.cache_limit = cache_limit
        self.prefetch = prefetch
        self._lock = threading.RLock()
        self._mounts: dict[str, _Mount] = {}
        self.access = AccessRecords(self.store.blobs, self.cache)
        self._later = Background("dsec-images")
        self._made: set[str] = set()  # images this instance mounted itself
        self.server = LazyServer(self.base, settings.home / "log" / "lazyfs.log", self._server_args)
        self._dead: collections.OrderedDict[Path, str] = collections.OrderedDict()  # dead mount -> why
        self._kept_dead: builtins.list[Path] | None = None
        """While a starting daemon recovers (:meth:`keep_dead_mounts`): dead mounts an earlier daemon left, let go
        only once recovery is over."""
        self.remounts = 0
        """Mounts this instance made afresh because theirs had died or vanished."""
        self._healed: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=100)
        # Manifests are immutable (named by digest): parse each once. A 1.5 GiB image's is ~1 MB of JSON. Kept
        # while mounted or named by a tag: an unmounted snapshot layer's goes (a node mounts one per snapshot).
        self._manifests: dict[str, Manifest] = {}
        # name -> (digest, when checked): a burst of creates asks the store once; a re-import (the tag
        # moves) is seen within tag_ttl seconds.
        self.tag_ttl = tag_ttl
        self._tags: dict[str, tuple[str, float]] = {}
        self._tag_files: dict[str, str] = {}
        self.locality = Locality(self.cache, self.base / "meta", self._manifests)

    # ------------------------------------------------------------------ resolver protocol
    def list(self) -> builtins.list[ImageInfo]:
        """Every image in the store."""
        return self.store.list()

    def get(self, name: str) -> ImageInfo:
        """One image; raises :class:`~dsec.errors.ImageNotFound`."""
        return self.store.get(name)

    def resolve(self, name: str) -> ImageRef:
        """Mount image ``name`` if needed, pin it, and return its root. Blocking: call from a thread.

        If the store cannot be reached, an image this node has already mounted (its manifest is cached)
        still resolves: a warm node keeps starting sandboxes of the images it has.
        """
        try:
            manifest = self._manifest(name)
        except StoreUnavailable:
            manifest = self._remembered(name)
            if manifest is None:
                raise
        if manifest is None:
            return self.store.resolve(name)  # a legacy directory image (or ImageNotFound)
        with self._lock:
            mount = self._mount(manifest)
            mount.refs += 1
            mount.name = name
        return _ref(manifest, mount)

    def resolve_warm(self, name: str) -> ImageRef | None:
        """:meth:`resolve` without blocking, for an image this node resolved within ``tag_ttl`` and still has
        mounted (the common create): pinned and returned, or None (call :meth:`resolve` from a thread)."""
        cached = self._tags.get(name)
        if cached is None or time.monotonic() - cached[1] >= self.tag_ttl or self._tag_files.get(name) != cached[0]:
            return None
        manifest = self._manifests.get(cached[0])
        if not self._lock.acquire(blocking=False):  # a mount in progress (seconds): not on the event loop
            return None
        try:
            mount = self._mounts.get(cached[0][7:])
            if manifest is None or mount is None or not self._live(mount):
                return None  # a dead or vanished mount is mounted afresh by resolve(), in a thread
            mount.refs += 1
            mount.name = name
        finally:
            self._lock.release()
        return _ref(manifest, mount)

    def known_digest(self, name: str) -> tuple[str | None, bool]:
        """The digest (hex) tag ``name`` named when last looked up, without I/O, and whether that answer is
        fresh (within ``tag_ttl``); (None, False) when it was never looked up."""
        cached = self._tags.get(name)
        if cached is None:
            return None, False
        return cached[0][7:], time.monotonic() - cached[1] < self.tag_ttl

    def current_digest(self, name: str) -> str | None:
        """The digest (hex) tag ``name`` names now: the known answer while fresh, else asked of the store (and
        kept for ``tag_ttl``). None when the store has no such tag (or the image is a directory). Blocking.
        A store that cannot be reached is not asked again before ``tag_ttl`` passes (the known answer
        stands meanwhile: a warm node keeps serving the images it has)."""
        known, fresh = self.known_digest(name)
        if fresh:
            return known
        try:
            digest = self.store.tag(name)
        except StoreUnavailable:
            if known is not None:
                self._tags[name] = ("sha256:" + known, time.monotonic())
            raise
        if digest is None:
            self._tags.pop(name, None)
            return None
        self._tags[name] = (digest, time.monotonic())
        return digest[7:]

    def _manifest(self, name: str) -> Manifest | None:
        cached = self._tags.get(name)
        if cached is not None and time.monotonic() - cached[1] < self.tag_ttl:
            digest: str | None = cached[0]
        else:
            digest = self.store.tag(name)
            if digest is None:
                self._tags.pop(name, None)
                return None
            self._tags[name] = (digest, time.monotonic())
        assert digest is not None
        manifest = self._manifests.get(digest)
        if manifest is None:
            manifest = self._manifests[digest] = self.store.manifest_by_digest(digest)
        if self._tag_files.get(name) != digest:  # what this node resolved ``name`` to (see cached())
            tags = self.cache.root / "tags"
            tags.mkdir(exist_ok=True)
            tmp = tags / f".tmp-{name}-{os.getpid()}-{threading.get_ident()}"
            try:  # whole or not at all: an empty file left by a full disk read as a tag to nothing
                tmp.write_text(digest)
                os.rename(tmp, tags / name)
                self._tag_files[name] = digest  # (not written: tried again at the next resolve)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("could not record that image %s is %s on this node: %s", name, digest, exc)
        return manifest

    def _remembered(self, name: str) -> Manifest | None:
        """The manifest this node last resolved ``name`` to, if it still has it."""
        try:
            digest = (self.cache.root / "tags" / name).read_text().strip()
            manifest = self._manifests.get(digest) or self.cache.manifest(digest.removeprefix("sha256:"))
            self._manifests[digest] = manifest
            return manifest
        except (OSError, DSecError):
            return None

    def pin_manifest(self, digest: str) -> Path:
        """Mount the (untagged) image with manifest ``digest`` if needed, pin it and return its root: a
        snapshot layer. Blocking. :meth:`unpin` releases it."""
        with self._lock:
            manifest = self._manifests.get(digest)
            if manifest is None:
                try:
                    manifest = self.store.manifest_by_digest(digest)
                except StoreUnavailable:
                    manifest = self.cache.manifest(digest.removeprefix("sha256:"))
                self._manifests[digest] = manifest
            mount = self._mount(manifest)
            mount.refs += 1
            return mount.path

    def release(self, ref: ImageRef) -> None:
        """Unpin an image :meth:`resolve` returned (the mount stays warm)."""
        self.unpin(ref.rootfs)

    def unpin(self, root: Path) -> None:
        """Unpin the mount at ``root`` (from :meth:`resolve` or :meth:`pin_manifest`; it stays warm). Never
        blocks its caller (the daemon's event loop): while a mount in progress holds the lock (a lazy server
        start, a metadata fetch: seconds), the unpin is done by a thread; the access record goes to the store
        from a thread too."""
        if not self._lock.acquire(blocking=False):
            self._later.submit(self._unpin, root)
            return
        try:
            idle = self._unpin_locked(root)
        finally:
            self._lock.release()
        if idle is not None and not self.access.saved(idle):
            self._later.submit(self.access.save, idle)

    def _unpin(self, root: Path) -> None:
        with self._lock:
            idle = self._unpin_locked(root)
        if idle is not None:
            self.access.save(idle)

    def _unpin_locked(self, root: Path) -> str | None:
        """One reference of the mount at ``root`` less; its digest if none is left."""
        for mount in self._mounts.values():
            if mount.path == root and mount.refs > 0:
                mount.refs -= 1
                if mount.refs == 0:
                    mount.idle_since = time.monotonic()
                    return mount.hexdigest
                return None
        return None

    def explain(self, ref: ImageRef, since: float = 0.0) -> DSecError | None:
        """The store or cache error that made reads of ``ref``'s image fail, if the lazy filesystem saw one at or
        after ``since`` (wall clock: a create passes its start, so that a fault of hours ago, which nobody
        read, is not blamed for an unrelated failure)."""
        for mount in builtins.list(self._mounts.values()):  # another thread may mount or unmount meanwhile
            if mount.path == ref.rootfs:
                found = self.cache.read_error(mount.hexdigest, since)
                if found is not None:
                    kind, message = found
                    return _ERRORS.get(kind, DSecError)(f"image {ref.name!r}: {message}", image=ref.name)
        return None

    # ------------------------------------------------------------------ mounts
    def _mount(self, manifest: Manifest) -> _Mount:
        # The digest it was fetched under; hashing the manifest (a dump of its JSON, ~1 MB for a big image) is
        # the fallback only, outside next(): as its default it would be computed on every create.
        known = next((d for d, m in builtins.list(self._manifests.items()) if m is manifest), None)
        hexdigest = (known or manifest.digest)[7:]
        mount = self._mounts.get(hexdigest)
        if mount is not None:
            if self._live(mount):
                return mount
            self._heal()
            mount = self._mounts.get(hexdigest)
            if mount is not None and self._live(mount):
                return mount
            if mount is not None:  # unmounted behind this daemon's back (its server lives on): mount it afresh
                log.warning("image %s: its mount %s vanished; mounting it again", manifest.info.name, mount.path,
                            extra={"component": "images", "image": manifest.info.name})
                self._drop(mount)
                self.remounts += 1
        self.cache.put_manifest(manifest)
        adopted = self._adopt_live(hexdigest)
        if adopted is not None:
            mount = self._mounts[hexdigest] = adopted
            self.cache.pin(hexdigest)
            return mount
        return self._mount_at(manifest, hexdigest, self._free_target(hexdigest))

    def _adopt_live(self, hexdigest: str) -> _Mount | None:
        """The live mount of the image that an earlier instance left (a daemon before a restart), kept as it is:
        the sandboxes a restarted daemon re-adopts sit on it, and a function sandbox's new zygote is started on its
        path meanwhile. It is on ``<digest16>``, or ``<digest16>.<n>`` if it was mounted afresh after a server died;
        dead ones are let go."""
        for name in self._image_mounts():
            if name.split(".")[0] != hexdigest[:16]:
                continue
            point = self.mnt_dir / name
            adopted = self._adopted(hexdigest, point)
            if adopted.server is not None:
                # Its server is known by generation: adopt the running one first (a restarted daemon knows none
                # yet, and took every mount for dead).
                self.server.ensure()
            if self._live(adopted):
                return adopted
            if point in (self._kept_dead or ()):
                continue
            if adopted.server is not None and point not in self._dead:
                # Its server died while no daemon ran: a re-adopted sandbox may sit on it. Remembered like a dead
                # mount of this instance's (never reused; :meth:`stale` names it) so that the engine can revive or
                # report that sandbox, which a mount afresh at the same path would hide.
                why = (f"the lazy image server (pid {adopted.server.split('-')[0]}) it read through died while no "
                       f"daemon ran; image {hexdigest[:12]} was mounted afresh")
                log.warning("image mount %s: %s", point, why, extra={"component": "lazy-server", "error": why})
                self._dead[point] = why
                while len(self._dead) > _DEAD_KEPT:
                    self._dead.popitem(last=False)
                self._healed.append((why, time.time(), time.time()))
            if self._kept_dead is not None and point in self._dead:
                # Recovery may not have reached every sandbox on it yet: a function sandbox's zygote is started
                # on its path (then revived on the fresh mount), which a detached mount would no longer have.
                self._kept_dead.append(point)
                continue
            self._forget_path(point)
        return None

    def keep_dead_mounts(self) -> None:
        """Until :meth:`let_dead_mounts_go`: a dead mount an earlier daemon left (its lazy server died while no
        daemon ran) is remembered (:meth:`stale`) and mounted afresh elsewhere as always, but stays mounted at its
        path: a starting daemon's recovery re-pins its sandboxes one by one, and those not yet recovered still
        need the path (a function sandbox's zygote starts on it before it is revived)."""
        with self._lock:
            self._kept_dead = []

    def let_dead_mounts_go(self) -> builtins.list[Path]:
        """Detach the dead mounts kept since :meth:`keep_dead_mounts` (sandboxes on them keep their own clones);
        their paths. Blocking."""
        with self._lock:
            kept, self._kept_dead = self._kept_dead or [], None
            for point in kept:
                self._forget_path(point)
        return kept

    def _mount_at(self, manifest: Manifest, hexdigest: str, target: Path) -> _Mount:
        """Mount the image (through a running lazy server) at ``target`` and keep it as the image's mount."""
        server = self.server.ensure()
        meta = self._meta(manifest)
        target.mkdir(parents=True, exist_ok=True)
        self.cache.pin(hexdigest)
        blob = self.blobs_dir / hexdigest
        self.cache.take_error(hexdigest)
        rc = _libc.mount(os.fsencode(meta), os.fsencode(target), b"erofs", _MS_RDONLY | _MS_NODEV | _MS_NOSUID,
                         f"device={blob}".encode())
        if rc != 0:
            err = ctypes.get_errno()
            self.cache.unpin(hexdigest)
            with contextlib.suppress(OSError):
                target.rmdir()
            cause = self.explain_digest(hexdigest)
            if cause is not None:
                raise cause
            raise SandboxError(f"mounting image {manifest.info.name!r} (EROFS over {blob}) failed: "
                               f"{os.strerror(err)}", image=manifest.info.name, component="images")
        mount = self._mounts[hexdigest] = _Mount(hexdigest, target, dev=os.stat(target).st_dev, server=server)
        self._record(mount)
        self._made.add(hexdigest)
        if self.prefetch:
            self.access.prefetch(manifest, hexdigest)
        return mount

    def _free_target(self, hexdigest: str) -> Path:
        """A mount point for the image nothing is mounted on: ``<digest16>``, else ``<digest16>.<n>`` (a dead
        mount's path is never used again while sandboxes may still sit on it)."""
        mounted = fs_types()
        for n in range(10_000):
            target = self.mnt_dir / (hexdigest[:16] + (f".{n}" if n else ""))
            if str(target) not in mounted and target not in self._dead:
                return target
        raise SandboxError(f"image {hexdigest[:12]}: no free mount point under {self.mnt_dir}", component="images")

    def _live(self, mount: _Mount) -> bool:
        """Cheap (no request to the server, no read of the mount table): the mount is still there and the
        server it reads through still runs."""
        if mount.server is not None and mount.server != self.server.generation:
            return False
        try:
            return os.stat(mount.path).st_dev == mount.dev
        except OSError:
            return False

    def _record(self, mount: _Mount) -> None:
        """Remember which server the mount reads through, for a daemon that adopts it after a restart."""
        with contextlib.suppress(OSError):
            (self.base / "mounts").mkdir(exist_ok=True)
            (self.base / "mounts" / mount.path.name).write_text(mount.server or "")

    def _adopted(self, hexdigest: str, path: Path) -> _Mount:
        """An EROFS mount at ``path`` that another instance made (an earlier daemon, a CLI)."""
        server: str | None = None
        with contextlib.suppress(OSError):
            server = (self.base / "mounts" / path.name).read_text().strip() or None
        dev = 0
        with contextlib.suppress(OSError):
            dev = os.stat(path).st_dev
        return _Mount(hexdigest, path, dev=dev, server=server)

    def _heal(self) -> builtins.list[str]:
        """Start the lazy server again if it died, and mount afresh (at new paths) every image that read
        through a dead one; the old paths are remembered by :meth:`stale`. Under the lock. Returns the
        names of the mounts made afresh."""
        running = self.server.generation
        serving = running is not None and fs_types().get(str(self.blobs_dir), "").startswith("fuse")
        if serving and all(m.server in (None, running) for m in self._mounts.values()):
            return []
        why = self.server.death() if running is None else (
            f"the lazy image server (pid {self.server.pid()}) lost its mount" if not serving else
            "the lazy image server these images read through is gone")
        log.warning("%s: mounting its images afresh", why, extra={"component": "lazy-server", "error": why})
        began = time.time()
        if running is not None and not serving:
            self.server.stop()
        self.server.ensure()
        done = []
        for mount in builtins.list(self._mounts.values()):
            if mount.server == self.server.generation:
                continue
            self._dead[mount.path] = f"{why}; image {mount.hexdigest[:12]} was mounted afresh"
            while len(self._dead) > _DEAD_KEPT:
                self._dead.popitem(last=False)
            self._drop(mount)
            manifest = self._manifests.get("sha256:" + mount.hexdigest) or self.cache.manifest(mount.hexdigest)
            fresh = self._mount_at(manifest, mount.hexdigest, self._free_target(mount.hexdigest))
            self.remounts += 1
            done.append(fresh.path.name)
        if done:
            log.info("lazy image server %s serves again; mounted afresh: %s", self.server.generation,
                     ", ".join(done), extra={"component": "lazy-server"})
        self._healed.append((why, began, time.time()))
        return done

    def take_healed(self) -> builtins.list[tuple[str, float, float]]:
        """Lazy-server faults repaired since the last call: (what was wrong, when found, when repaired)."""
        done = builtins.list(self._healed)
        self._healed.clear()
        return done

    def _drop(self, mount: _Mount) -> None:
        """Forget a dead or vanished mount (detached if still mounted: sandboxes keep their own clones of it)."""
        self._forget_path(mount.path)
        self._mounts.pop(mount.hexdigest, None)

    def _forget_path(self, path: Path) -> None:
        if fs_types().get(str(path)) == "erofs":
            with contextlib.suppress(OSError):
                umount(path, detach=True)
        with contextlib.suppress(OSError):
            path.rmdir()
        (self.base / "mounts" / path.name).unlink(missing_ok=True)

    def stale(self, root: Path) -> str | None:
        """Why the image mount at ``root`` (what a sandbox was made on) is dead, or None while it serves:
        its lazy server died and the image was mounted afresh elsewhere. Cheap: a dict lookup."""
        return self._dead.get(root)

    def check(self, deep: bool = True) -> dict[str, str | None]:
        """Check the lazy server (``deep``: it must answer a request) and every mount, heal what is dead or
        vanished, and report: component name (``lazy-server``, ``image:<name>``) -> None if fine, else the
        problem. Blocking (a deep check waits up to a few seconds for the server): call from a thread. The lock
        (which creates take) is held only to heal, never while the server is asked."""
        if not self._mounts and self.server.generation is None:
            return {"lazy-server": None}
        report: dict[str, str | None] = {"lazy-server": None}
        problem = self.server.answers() if deep and self.server.alive() else None
        hung = problem is not None and self.server.unanswered >= _HUNG_PROBES
        if problem is not None and not hung:
            report["lazy-server"] = problem  # slow, maybe: replaced only if it stays so
        mounts = builtins.list(self._mounts.values())
        if hung or self.server.generation is None or not all(self._live(m) for m in mounts):
            with self._lock:
                if hung:
                    log.error("%s (%d checks in a row): replacing it", problem, self.server.unanswered,
                              extra={"component": "lazy-server", "error": problem})
                    self.server.stop()
                try:
                    self._heal()
                    for mount in builtins.list(self._mounts.values()):
                        if not self._live(mount):
                            self._drop(mount)
                            manifest = self.cache.manifest(mount.hexdigest)
                            self._mount_at(manifest, mount.hexdigest, self._free_target(mount.hexdigest))
                            self.remounts += 1
                except DSecError as exc:
                    report["lazy-server"] = exc.message
        names = {d[7:]: n for n, (d, _) in builtins.list(self._tags.items())}
        for hexdigest, mount in builtins.list(self._mounts.items()):
            found = self.cache.read_error(hexdigest, time.time() - 60)
            # The name a tag gives it now; else the one it was resolved by, unless that tag now names another.
            name = names.get(hexdigest) or (mount.name if mount.name not in self._tags else None)
            report[f"image:{name or hexdigest[:12]}"] = (
                f"{found[0]}: {found[1]}" if found else None) if self._live(mount) else "not mounted"
        return report

    def explain_digest(self, hexdigest: str) -> DSecError | None:
        """The recorded read error of image ``hexdigest``, as an exception (taken), or None."""
        found = self.cache.take_error(hexdigest)
        if found is None:
            return None
        kind, message = found
        return _ERRORS.get(kind, DSecError)(message)

    def _meta(self, manifest: Manifest) -> Path:
        """The image's EROFS metadata file, kept next to the mounts (a file-backed mount needs a disk
        filesystem under it, which a cache directory on tmpfs is not)."""
        path = self.base / "meta" / manifest.meta_digest.removeprefix("sha256:")
        if path.is_file() and sha256(path.read_bytes()) == manifest.meta_digest:
            return path
        data = self.cache.fetch(manifest.meta_digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            tmp.write_bytes(data)
            os.rename(tmp, path)
        except OSError as exc:  # DSEC_HOME's disk full, say: nothing half-written left, and a named error
            tmp.unlink(missing_ok=True)
            raise SandboxError(f"writing the metadata of image {manifest.info.name!r} to {path.parent} failed: "
                               f"{exc.strerror or exc}", image=manifest.info.name) from exc
        return path

    def idle(self, idle_for: float = 0.0) -> builtins.list[str]:
        """Digests of mounted images no sandbox has used for ``idle_for`` seconds, and of the idle snapshot layers
        beyond the :attr:`idle_layers` used last, however recently (cheap: no I/O)."""
        now = time.monotonic()
        tagged = {digest[7:] for digest, _ in builtins.list(self._tags.values())}
        unused = [(m.idle_since, h, m.name) for h, m in builtins.list(self._mounts.items()) if m.refs == 0]
        layers = sorted((since, h) for since, h, name in unused if name is None and h not in tagged)
        excess = {h for _, h in layers[:max(0, len(layers) - self.idle_layers)]}
        return [h for since, h, _ in unused if now - since >= idle_for or h in excess]

    def unmount_idle(self, idle_for: float = 0.0) -> builtins.list[str]:
        """Unmount every image no sandbox has used for ``idle_for`` seconds, and the snapshot layers beyond
        :attr:`idle_layers` (see :meth:`idle`); returns their digests. One that cannot be unmounted (busy:
        something this manager does not count uses it) is logged and kept, as if used just now: it must not stop
        the others going, nor come first again at every pass."""
        done: builtins.list[str] = []
        with self._lock:
            self._forget_old_tags()
            for hexdigest in self.idle(idle_for):
                mount = self._mounts[hexdigest]
                try:
                    self._unmount(mount)
                except OSError as exc:
                    log.warning("idle image mount %s stays: %s", mount.path, exc,
                                extra={"component": "images", "error": str(exc)})
                    mount.idle_since = time.monotonic()
                    continue
                done.append(hexdigest)
        return done

    def _forget_old_tags(self) -> None:
        """Drop the tag answers not looked up for ``_TAG_KEPT_TTLS`` (see there) and their written-file marks."""
        oldest = time.monotonic() - max(self.tag_ttl * _TAG_KEPT_TTLS, 60.0)
        for name, answer in builtins.list(self._tags.items()):
            if answer[1] < oldest and self._tags.get(name) is answer:
                self._tags.pop(name, None)
        for name in builtins.list(self._tag_files):
            if name not in self._tags:
                self._tag_files.pop(name, None)

    def _unmount(self, mount: _Mount) -> None:
        umount(mount.path)
        with contextlib.suppress(OSError):
            mount.path.rmdir()
        (self.base / "mounts" / mount.path.name).unlink(missing_ok=True)
        self.cache.unpin(mount.hexdigest)
        self._mounts.pop(mount.hexdigest, None)
        self._made.discard(mount.hexdigest)
        digest = "sha256:" + mount.hexdigest
        if all(tagged != digest for tagged, _ in self._tags.values()):  # a snapshot layer's: one of thousands
            self._manifests.pop(digest, None)
        self.access.save(mount.hexdigest)

    def cached(self, max_age: float = 0.0) -> dict[str, int]:
        """Image name -> bytes of it on this node (:meth:`Locality.read`): what cluster placement calls image
        locality. Blocking."""
        return self.locality.read(max_age)

    def mounted(self) -> dict[str, int]:
        """Digest -> pins, of every image this manager has mounted."""
        with self._lock:
            return {h: m.refs for h, m in self._mounts.items()}

    def statistics(self) -> dict[str, int]:
        """Images mounted, sandboxes pinning them, and the chunk cache's size and limit (walks the cache:
        blocking)."""
        with self._lock:
            mounted, pins = len(self._mounts), sum(m.refs for m in self._mounts.values())
        return {"mounted": mounted, "pins": pins, "cache_bytes": self.cache.usage(),
                "cache_limit_bytes": self.cache_limit or 0}

    def adopt(self) -> None:
        """After a daemon restart: take over the mounts an earlier daemon left (unpinned until resolved).

        Found from the mount table, not from the cache, so mounts whose cache files are gone (a home
        removed under them) are still found and can be unmounted.
        """
        with self._lock:
            known = {m.path for m in self._mounts.values()}
            manifests = self.cache.root / "manifests"
            names = [p.name for p in manifests.iterdir()] if manifests.is_dir() else []
            for name in self._image_mounts():
                point = self.mnt_dir / name
                if point in known:
                    continue
                short = name.split(".")[0]
                hexdigest = next((n for n in names if n.startswith(short)), short)
                if hexdigest in self._mounts:  # a dead one of an image mounted afresh since: let go
                    self._forget_path(point)
                    continue
                self._mounts[hexdigest] = self._adopted(hexdigest, point)

    def _image_mounts(self) -> builtins.list[str]:
        """Names (a digest's first 16 hex digits, then ``.<n>`` for a mount made afresh) of the EROFS image
        mounts under ``mnt_dir``, from this process's mount table: any daemon's or CLI's, known to this
        instance or not."""
        prefix = str(self.mnt_dir) + "/"
        return [point[len(prefix):] for point, fs in fs_types().items() if fs == "erofs" and point.startswith(prefix)]

    def foreign_daemon(self) -> bool:
        """Whether a daemon's image manager (another instance, in this process or another) owns the home's
        mounts now."""
        return not self.daemon and _owned(self._owner_lock)

    def _release_ownership(self) -> None:
        if self._owner >= 0:
            os.close(self._owner)
            self._owner = -1

    def drop_stale_pins(self) -> builtins.list[str]:
        """Remove the pins of images that are not mounted (a reboot or a crash left them: pins are files, mounts
        are not), so that their chunks can be evicted again; their digests. Run by a starting daemon."""
        mounted = {name[:16] for name in self._image_mounts()}
        dropped = []
        with self._lock:
            for pin in builtins.list((self.cache.root / "pins").iterdir()):
                if pin.name[:16] not in mounted and pin.name not in self._mounts:
                    self.cache.unpin(pin.name)
                    dropped.append(pin.name)
        if dropped:
            log.info("dropped the pins of %d image(s) no longer mounted: %s", len(dropped),
                     ", ".join(d[:12] for d in dropped))
        return dropped

    def aclose_sync(self, unmount: bool = False) -> None:
        """Stop prefetching; with ``unmount`` also unmount every image and stop the FUSE server."""
        self.access.stop()
        if not unmount:
            self.server.close()
            return
        if self.foreign_daemon():
            log.warning("a daemon serves %s: its image mounts and lazy server are left to it", self.settings.home)
            self.close_own_sync()
            return
        with self._lock:
            self.adopt()
            for mount in builtins.list(self._mounts.values()):
                self._unmount(mount)
            self.server.stop()
        self._release_ownership()

    def close_idle_sync(self) -> None:
        """What a stopping daemon does: stop prefetching, unmount every image no live sandbox uses, and stop
        the FUSE server when nothing is left mounted (mounts under live sandboxes stay for the next daemon).
        Outside the daemon, while a daemon serves the home: only what this instance mounted, as
        :meth:`close_own_sync` (the daemon's mounts look unused here, and its sandboxes' overlays hold clones
        of them, so an unmount would succeed under them and every later create of the image would fail)."""
        if self.foreign_daemon():
            self.close_own_sync()
            return
        self.aclose_sync(unmount=False)
        with self._lock:
            self.adopt()
            self.unmount_idle()
            if not self._mounts:
                self.server.stop()
        self._release_ownership()

    def close_own_sync(self) -> None:
        """What a short-lived user of the node's images (a CLI command) does when done: unmount the images it
        mounted itself that nothing uses, and stop the lazy server only if it started it and no image is
        mounted any more. It never adopts: mounts and a server that a daemon's sandboxes may use are not its
        own (:meth:`close_idle_sync`, a daemon's, takes them all). While a daemon owns the home it leaves even its
        own mounts (the daemon may have taken them over; its own close unmounts them)."""
        self.aclose_sync(unmount=False)
        if self.foreign_daemon():
            return
        with self._lock:
            for hexdigest in builtins.list(self._made):
                mount = self._mounts.get(hexdigest)
                if mount is None or mount.refs:
                    continue
                try:
                    self._unmount(mount)
                except OSError as exc:  # busy: a sandbox mounted over it meanwhile; it stays
                    log.info("image %s stays mounted: %s", hexdigest[:12], exc)
            if self.server.started_here and not self._image_mounts():
                self.server.stop()

    async def close_idle(self) -> None:
        """Async :meth:`close_idle_sync`."""
        import asyncio

        await asyncio.to_thread(self.close_idle_sync)

    async def aclose(self, unmount: bool = False) -> None:
        """Async :meth:`aclose_sync`."""
        import asyncio

        await asyncio.to_thread(self.aclose_sync, unmount)

    # ------------------------------------------------------------------ the lazy server
    @property
    def _pid_file(self) -> Path:
        return self.server.pid_file

    def fuse_pid(self) -> int | None:
        """Pid of this home's running lazy filesystem server, or None (see :meth:`LazyServer.pid`)."""
        return self.server.pid()

    def _server_args(self) -> builtins.list[str]:
        """The lazy server's configuration (its command line after ``-m dsec.images.lazyfs``, but the fd)."""
        args = ["--mountpoint", str(self.blobs_dir), "--cache", str(self.cache.root), "--errors",
                str(self.cache.errors_dir), "--store", self.store.blobs.url]
        if self.cache_limit is not None:
            args += ["--limit", str(self.cache_limit)]
        if self.cache.min_free:
            args += ["--min-free", str(self.cache.min_free)]
        return args
