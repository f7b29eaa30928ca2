"""The image store: named images kept as chunked EROFS images in a :class:`~dsec.images.blob_store.BlobStore`.

Layout of the blob store (``$DSEC_IMAGE_STORE``, default the directory ``<root>/store``)::

    chunks/sha256/<hh>/<hex>   blob chunks and metadata images, content-addressed (shared by every image)
    manifests/sha256/<hex>     one :class:`~dsec.images.format.Manifest` per image version
    tags/<name>                the manifest digest image <name> currently names
    snapshots/<id>             a sandbox snapshot: JSON with its layers (manifest digests, top first) and metadata

and of the local ``root``::

    .lock-<name>               flock taken by imports and removals of <name>
    .tmp-<name>-*              an import in progress (removed on failure, swept by the next import)
    <name>/rootfs, image.json  a legacy (pre-chunked) image: still readable, converted by ``adopt_legacy``

An import copies (or moves) the tree, shifts its owners by ``uid_shift``, builds the EROFS image, uploads
the chunks the store lacks, then the metadata, the manifest, and last the tag: a reader never sees a tag
whose objects are missing. This module owns naming, import, removal and store garbage collection. It never
mounts anything (:mod:`dsec.images.node` does), never runs sandboxes and never modifies a source directory.
"""

from __future__ import annotations

import builtins
import contextlib
import difflib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.errors import DSecError, ImageCorrupt, ImageNotFound, InvalidRequest, NotSupported
from dsec.images.blob_store import BlobStore, DirStore, open_store
from dsec.images.cache import chunk_key
from dsec.images.format import ChunkRef, Manifest, build_erofs, cut_blob, sha256
from dsec.images.ref import ImageRef
from dsec.models import ImageConfig, ImageInfo

__all__ = ["DEFAULT_PATH", "GcResult", "ImageStats", "ImageStore", "validate_name"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""``PATH`` given to images whose config does not set one."""

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_CAP_XATTR = "security.capability"
_UID_COUNT = 65536
_UPLOADS = 8
"""Chunk uploads in flight at once."""
_DONE: Future[None] = Future()
_DONE.set_result(None)
_GC_GRACE = 3600.0
"""Objects younger than this are never collected: an import elsewhere may be about to tag them."""

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)`` for long work (bytes)."""


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise :class:`InvalidRequest`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid image name {name!r}: use 1-128 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            name=str(name),
        )
    return name


@dataclass(frozen=True)
class ImageStats:
    """What ``dsec image inspect`` reports about one image's storage."""

    digest: str
    blob_bytes: int
    meta_bytes: int
    chunks: int
    unique_bytes: int
    """Bytes of distinct chunks this image uses."""
    shared_bytes: int
    """Of those, bytes other images in the store use too (stored once)."""


@dataclass(frozen=True)
class GcResult:
    """What ``ImageStore.gc`` removed."""

    chunks: int
    manifests: int
    bytes: int


class ImageStore:
    """Named chunked images in a blob store, with local scratch space under ``root`` (see the module docstring)."""

    def __init__(self, root: Path | str, blobs: BlobStore | str | None = None) -> None:
        self.root = Path(root)
        if isinstance(blobs, str):
            blobs = open_store(blobs)
        self.blobs: BlobStore = blobs if blobs is not None else DirStore(self.root / "store")

    # ----------------------------------------------------------------- lookups
    def path(self, name: str) -> Path:
        """Directory of legacy image ``name`` (whether or not it exists)."""
        return self.root / validate_name(name)

    def _legacy(self, name: str) -> ImageInfo | None:
        try:
            return ImageInfo.model_validate_json((self.path(name) / "image.json").read_text())
        except (OSError, ValueError):
            return None

    def tag(self, name: str) -> str | None:
        """The manifest digest image ``name`` names, or None."""
        try:
            digest = self.blobs.get(f"tags/{validate_name(name)}").decode().strip()
        except KeyError:
            return None
        if not digest.startswith("sha256:"):
            raise ImageCorrupt(f"tag {name!r} in {self.blobs.url} is corrupt: {digest[:80]!r}", image=name)
        return digest

    def manifest(self, name: str) -> Manifest:
        """The verified manifest of chunked image ``name``; :class:`ImageNotFound` when it has none."""
        digest = self.tag(name)
        if digest is None:
            raise self._not_found(name)
        return self.manifest_by_digest(digest)

    def manifest_by_digest(self, digest: str) -> Manifest:
        """A manifest by digest, verified (fetched once more on a mismatch)."""
        key = f"manifests/sha256/{digest.removeprefix('sha256:')}"
        for attempt in (1, 2):
            try:
                return Manifest.parse(self.blobs.get(key), digest)
            except KeyError:
                raise ImageCorrupt(f"manifest {digest} is missing from {self.blobs.url}", digest=digest) from None
            except ImageCorrupt:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def exists(self, name: str) -> bool:
        """True when image ``name`` is fully imported."""
        return self.tag(name) is not None or self._legacy(name) is not None

    def get(self, name: str) -> ImageInfo:
        """Metadata of image ``name``; :class:`ImageNotFound` names the images that do exist."""
        validate_name(name)
        if self.tag(name) is not None:
            return self.manifest(name).info
        legacy = self._legacy(name)
        if legacy is None:
            raise self._not_found(name)
        return legacy

    def resolve(self, name: str) -> ImageRef:
        """A legacy image's root directory; chunked images are mounted by :class:`dsec.images.node.NodeImages`."""
        info = self.get(name)
        if self._legacy(name) is None:
            raise NotSupported(f"image {name!r} is stored chunked: it is mounted on a node by "
                               "dsec.images.node.NodeImages, not read as a directory", image=name)
        return ImageRef(name=info.name, rootfs=self.path(name) / "rootfs", uid_shift=info.uid_shift,
                        config=info.config)

    def list(self) -> list[ImageInfo]:
        """Every fully imported image, sorted by name (in-progress imports are not listed)."""
        found: dict[str, ImageInfo] = {}
        for key, _size, _mtime in self.blobs.keys("tags/"):
            name = key.removeprefix("tags/")
            if _NAME_RE.fullmatch(name):
                with contextlib.suppress(DSecError):
                    found[name] = self.get(name)
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.name not in found and _NAME_RE.fullmatch(entry.name):
                    legacy = self._legacy(entry.name)
                    if legacy is not None:
                        found[entry.name] = legacy
        return [found[n] for n in sorted(found)]

    def names(self) -> builtins.list[str]:
        """Names of every fully imported image."""
        return [info.name for info in self.list()]

    def _not_found(self, name: str) -> ImageNotFound:
        names = self.names()
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        if close:  # a typo: the fix is the right name, not a build
            hint = "did you mean " + " or ".join(repr(n) for n in close) + "?"
        elif name == "debian-python":
            hint = "build it with `dsec image build debian-python` (./scripts/setup does)"
        else:
            hint = ("build one with `dsec image build NAME --packages ...`, import a directory or archive with "
                    "`dsec image import NAME SOURCE`, or pull one with `dsec image pull REF`")
        have = f"available: {', '.join(names)}" if names else "the store is empty"
        return ImageNotFound(f"image {name!r} not found in {self.blobs.url} ({have}); {hint}", image=name,
                             available=names, suggestions=close)

    def stats(self, name: str) -> ImageStats:
        """Size, chunk count and bytes shared with other images, for ``dsec image inspect``."""
        manifest = self.manifest(name)
        mine = {c.digest: c.size for c in manifest.chunks}
        others: set[str] = set()
        for other in self.names():
            if other != name and self.tag(other) is not None:
                others.update(c.digest for c in self.manifest(other).chunks)
        return ImageStats(
            digest=manifest.digest, blob_bytes=manifest.blob_size, meta_bytes=manifest.meta_size,
            chunks=len(manifest.chunks), unique_bytes=sum(mine.values()),
            shared_bytes=sum(size for d, size in mine.items() if d in others),
        )

    # ----------------------------------------------------------------- changes
    def import_dir(
        self,
        name: str,
        src: Path | str,
        uid_shift: int,
        source: str | None = None,
        config: ImageConfig | None = None,
        replace: bool = False,
        move: bool = False,
        progress: Progress | None = None,
    ) -> ImageInfo:
        """Import directory ``src`` as image ``name``, shifting every uid/gid by ``uid_shift``.

        The image keeps modes, setuid bits, xattrs, file capabilities, hard links, symlinks and
        special files. Source owners must lie in ``0..65535`` (what a user namespace maps); an
        already-shifted tree is refused rather than shifted twice. Nothing is left behind on failure
        (chunks already uploaded stay for ``gc``). ``move=True`` renames ``src`` into the scratch space
        instead of copying it (``src`` must be on ``root``'s filesystem and is consumed, even on failure).
        """
        validate_name(name)
        src = Path(src)
        if uid_shift < 0:
            raise InvalidRequest(f"uid_shift must be >= 0, got {uid_shift}")
        if not src.is_dir():
            raise InvalidRequest(f"cannot import {src}: not a directory", path=str(src))
        config = (config or ImageConfig()).model_copy(deep=True)
        config.env.setdefault("PATH", DEFAULT_PATH)
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(name):
            self._sweep(name)
            if self.exists(name) and not replace:
                raise InvalidRequest(f"image {name!r} already exists (remove it or pass replace=True)",
                                     image=name)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
            try:
                rootfs = tmp / "rootfs"
                if move:
                    os.rename(src, rootfs)
                else:
                    _copy_tree(src, rootfs)
                files, size = _shift_tree(rootfs, uid_shift)
                info = ImageInfo(
                    name=name, created_at=time.time(), size_bytes=size, files=files,
                    source=source or f"dir:{src.resolve()}", uid_shift=uid_shift, config=config,
                )
                self._publish(info, rootfs, tmp, progress)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return info

    def adopt_legacy(self, name: str, progress: Progress | None = None) -> ImageInfo:
        """Store legacy image ``name`` (a shifted directory) in the chunked format; the directory stays."""
        with self._locked(name):
            legacy = self._legacy(name)
            if legacy is None:
                raise self._not_found(name)
            if self.tag(name) is None:
                tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
                try:
                    self._publish(legacy, self.path(name) / "rootfs", tmp, progress)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            return legacy

    def _publish(self, info: ImageInfo, tree: Path, scratch: Path, progress: Progress | None) -> Manifest:
        manifest = self.upload_tree(info, tree, scratch, progress)
        self.blobs.put(f"tags/{info.name}", manifest.digest.encode() + b"\n")
        return manifest

    def upload_tree(self, info: ImageInfo, tree: Path, scratch: Path, progress: Progress | None = None) -> Manifest:
        """Store directory ``tree`` as an untagged chunked EROFS image (owners, xattrs, device nodes and
        hard links as they are); returns its manifest. ``scratch`` holds the build files (left there)."""
        meta, blob = scratch / "meta.erofs", scratch / "blob"
        build_erofs(tree, meta, blob)
        total = blob.stat().st_size
        chunks: list[ChunkRef] = []
        seen: set[str] = set()
        done = 0
        # Uploads overlap (each is a round trip to S3, or a write and an fsync on a directory store); at most
        # 2 x _UPLOADS chunks are held in memory, and progress is reported in blob order.
        inflight: deque[tuple[Future[None], int]] = deque()

        def settle(limit: int) -> None:
            nonlocal done
            while len(inflight) > limit:
                future, size = inflight.popleft()
                future.result()
                done += size
                if progress is not None:
                    progress("upload", done, total)

        with ThreadPoolExecutor(max_workers=_UPLOADS, thread_name_prefix="dsec-upload") as pool:
            for digest, data in cut_blob(blob):
                chunks.append(ChunkRef(digest=digest, size=len(data)))
                if digest in seen:
                    inflight.append((_DONE, len(data)))
                else:
                    seen.add(digest)
                    inflight.append((pool.submit(self._put_chunk, digest, data), len(data)))
                settle(2 * _UPLOADS)
            settle(0)
        meta_bytes = meta.read_bytes()
        meta_digest = sha256(meta_bytes)
        self.blobs.put(chunk_key(meta_digest), meta_bytes)
        manifest = Manifest(info=info, meta_digest=meta_digest, meta_size=len(meta_bytes), chunks=chunks)
        self.blobs.put(f"manifests/sha256/{manifest.digest.removeprefix('sha256:')}", manifest.canonical())
        return manifest

    def copy_image(self, source: ImageStore, name: str, progress: Progress | None = None) -> Manifest:
        """Copy chunked image ``name`` from ``source`` into this store (chunks it lacks, the metadata image,
        the manifest, then the tag, so a reader never sees a tag whose chunks are missing), e.g. to seed
        a cluster's S3 store from a node's local one. Every chunk is verified against its digest."""
        manifest = source.manifest(name)
        wanted = {c.digest: c.size for c in manifest.chunks}
        wanted[manifest.meta_digest] = manifest.meta_size
        total, done = sum(wanted.values()), 0

        def copy(digest: str) -> None:
            key = chunk_key(digest)
            if self.blobs.has(key):
                return
            try:
                data = source.blobs.get(key)
            except KeyError:
                raise ImageCorrupt(f"chunk {digest} of {name!r} is missing from {source.blobs.url}",
                                   image=name, digest=digest) from None
            if sha256(data) != digest:
                raise ImageCorrupt(f"chunk {digest} of {name!r} in {source.blobs.url} does not match its digest",
                                   image=name, digest=digest)
            self.blobs.put(key, data)

        with ThreadPoolExecutor(max_workers=_UPLOADS, thread_name_prefix="dsec-copy") as pool:
            for digest, future in [(d, pool.submit(copy, d)) for d in wanted]:
                future.result()
                done += wanted[digest]
                if progress is not None:
                    progress("copy", done, total)
        self.blobs.put(f"manifests/sha256/{manifest.digest.removeprefix('sha256:')}", manifest.canonical())
        self.blobs.put(f"tags/{validate_name(name)}", manifest.digest.encode() + b"\n")
        return manifest

    def _put_chunk(self, digest: str, data: bytes) -> None:
        key = chunk_key(digest)
        if not self.blobs.has(key):
            self.blobs.put(key, data)

    # ----------------------------------------------------------------- snapshots
    def put_snapshot(self, snap_id: str, record: dict[str, Any]) -> None:
        """Publish snapshot record ``snapshots/<snap_id>`` (its ``layers`` list manifest digests, which
        :meth:`gc` keeps for as long as the record exists)."""
        self.blobs.put(f"snapshots/{snap_id}", json.dumps(record).encode())

    def snapshot(self, snap_id: str) -> dict[str, Any] | None:
        """The record of snapshot ``snap_id``, or None."""
        try:
            data: dict[str, Any] = json.loads(self.blobs.get(f"snapshots/{snap_id}"))
        except KeyError:
            return None
        except ValueError as exc:
            raise ImageCorrupt(f"snapshot record {snap_id} in {self.blobs.url} is corrupt: {exc}",
                               snapshot=snap_id) from None
        return data

    def snapshot_ids(self) -> builtins.list[str]:
        """Ids of every snapshot record in the store."""
        return sorted(key.removeprefix("snapshots/") for key, _s, _m in self.blobs.keys("snapshots/"))

    def remove_snapshot(self, snap_id: str, purge: bool = False) -> int:
        """Delete a snapshot record (its chunks go at the next :meth:`gc` unless another snapshot or image
        shares them). ``purge`` deletes its layers' chunks and manifests now, except those a tag or another
        snapshot references (no grace period: only for snapshots of data no import can be uploading, such
        as a benchmark's random files). Returns the bytes purged."""
        record = self.snapshot(snap_id) if purge else None
        self.blobs.delete(f"snapshots/{snap_id}")
        if record is None:
            return 0
        keep: set[str] = set()
        for key, _size, _mtime in builtins.list(self.blobs.keys("tags/")):
            digest = self.tag(key.removeprefix("tags/"))
            if digest is not None:
                keep.update(self._objects(digest))
        for other in self.snapshot_ids():
            for digest in (self.snapshot(other) or {}).get("layers", []):
                keep.update(self._objects(digest))
        freed = 0
        for digest in record.get("layers", []):
            for key in self._objects(digest) - keep:
                with contextlib.suppress(KeyError):
                    freed += len(self.blobs.get(key)) if key.startswith("chunks/") else 0
                self.blobs.delete(key)
                keep.add(key)
        return freed

    def _objects(self, digest: str) -> set[str]:
        """Store keys of a manifest and of every chunk it names (empty if the manifest is gone)."""
        try:
            manifest = self.manifest_by_digest(digest)
        except ImageCorrupt:
            return set()
        return {f"manifests/sha256/{digest.removeprefix('sha256:')}", chunk_key(manifest.meta_digest),
                *(chunk_key(c.digest) for c in manifest.chunks)}

    def remove(self, name: str) -> None:
        """Delete image ``name``: its tag (chunks stay until ``gc``) and any legacy directory.

        Nodes that have it mounted keep their mount until it is unused.
        """
        validate_name(name)
        with self._locked(name):
            tagged = self.tag(name) is not None
            target = self.root / name
            if not tagged and not target.is_dir():
                raise self._not_found(name)
            if tagged:
                self.blobs.delete(f"tags/{name}")
            if target.is_dir():
                trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}-", dir=self.root))
                os.rename(target, trash / "image")
                shutil.rmtree(trash, ignore_errors=True)

    def gc(self, grace: float = _GC_GRACE) -> GcResult:
        """Delete chunks and manifests no tag or snapshot references and that are older than ``grace`` seconds."""
        keep_manifests: set[str] = set()
        keep_chunks: set[str] = set()
        for key, _size, _mtime in builtins.list(self.blobs.keys("tags/")):
            digest = self.tag(key.removeprefix("tags/"))
            if digest is None:
                continue
            manifest = self.manifest_by_digest(digest)
            keep_manifests.add(f"manifests/sha256/{digest.removeprefix('sha256:')}")
            keep_chunks.add(chunk_key(manifest.meta_digest))
            keep_chunks.update(chunk_key(c.digest) for c in manifest.chunks)
        for snap_id in self.snapshot_ids():
            for digest in (self.snapshot(snap_id) or {}).get("layers", []):
                keep_manifests.add(f"manifests/sha256/{digest.removeprefix('sha256:')}")
                keep_chunks.update(self._objects(digest))
        cutoff = time.time() - grace
        chunks = manifests = freed = 0
        for prefix, keep in (("manifests/", keep_manifests), ("chunks/", keep_chunks)):
            for key, size, mtime in builtins.list(self.blobs.keys(prefix)):
                if key in keep or mtime > cutoff:
                    continue
                self.blobs.delete(key)
                freed += size
                if prefix == "chunks/":
                    chunks += 1
                else:
                    manifests += 1
        return GcResult(chunks=chunks, manifests=manifests, bytes=freed)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f".lock-{name}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _sweep(self, name: str) -> None:
        """Remove leftovers of an import or removal of ``name`` killed mid-way (caller holds the lock)."""
        for prefix in (f".tmp-{name}-", f".trash-{name}-"):
            for leftover in self.root.glob(f"{prefix}*"):
                # a same-prefixed longer name ("a" vs "a-b") has its own lock: only touch exact matches
                if leftover.name[len(prefix):].count("-") == 0:
                    shutil.rmtree(leftover, ignore_errors=True)


def _copy_tree(src: Path, dst: Path) -> None:
    """``cp -a`` keeps hard links, xattrs, special files and sparse files; reflinks when it can."""
    cp = shutil.which("cp") or "/bin/cp"
    proc = subprocess.run([cp, "-a", "--reflink=auto", "-T", "--", str(src), str(dst)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DSecError(f"copying {src} failed: {proc.stderr.strip()[:2000]}", path=str(src))


def _shift_tree(root: Path, shift: int) -> tuple[int, int]:
    """Add ``shift`` to the owner of every entry under ``root``; return (entries, bytes of file data).

    Each inode is shifted once even when hard-linked several times. ``chown`` clears setuid/setgid
    bits and file capabilities, so both are put back.
    """
    seen: set[int] = set()
    entries = 0
    size = 0
    root_dev = os.lstat(root).st_dev

    def shift_one(path: str) -> None:
        nonlocal size
        st = os.lstat(path)
        if st.st_dev != root_dev:
            raise DSecError(f"{path}: unexpected mount point inside an image copy")
        if st.st_ino in seen:
            return
        seen.add(st.st_ino)
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
        for owner in (st.st_uid, st.st_gid):
            if owner >= _UID_COUNT:
                raise InvalidRequest(
                    f"{path} is owned by uid/gid {owner}, outside 0..{_UID_COUNT - 1} (the ids a user "
                    "namespace maps): is the source already shifted? import an unshifted tree",
                    path=path, owner=owner,
                )
        if shift == 0:
            return
        is_link = stat.S_ISLNK(st.st_mode)
        caps = None if is_link else _get_caps(path)
        os.lchown(path, st.st_uid + shift, st.st_gid + shift)
        if not is_link:
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode))
            if caps is not None:
                os.setxattr(path, _CAP_XATTR, caps, follow_symlinks=False)

    shift_one(str(root))
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False,
                                                onerror=_raise):
        for entry in (*dirnames, *filenames):
            entries += 1
            shift_one(os.path.join(dirpath, entry))
    return entries, size


def _raise(err: OSError) -> None:
    raise err


def _get_caps(path: str) -> bytes | None:
    try:
        return os.getxattr(path, _CAP_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise

