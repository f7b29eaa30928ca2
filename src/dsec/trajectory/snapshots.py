"""Snapshots in the image store: each one a stack of chunked EROFS layers plus a small record.

A backend's snapshot writes a directory tree (the container backend: a copy of the overlay upper, taken
frozen, with whiteouts, ``trusted.overlay.*`` xattrs, owners and hard links as they are; the microvm
backend: its migration state and shape). :meth:`SnapshotStore.publish` stores that tree as an untagged
image of the image store (:meth:`dsec.images.image_store.ImageStore.upload_tree`: content-defined chunks, so
identical content dedups across snapshots and images) and writes the record ``snapshots/<id>``: the
layers (manifest digests, top first), image, backend, spec. A *layered* backend's snapshot of a sandbox
that was itself restored lists its own new layer over the layers it runs on, so a snapshot only stores
what changed since the last one.

Restoring (:meth:`SnapshotStore.open`) mounts every layer through the node's lazy image loader
(:meth:`dsec.images.node.NodeImages.pin_manifest`), read-only and shared: a container restores with the
layers as extra overlay lowers under a fresh upper, so ``fork(n)`` and repeated restores copy nothing.
Any daemon sharing the image store (``DSEC_IMAGE_STORE``: a directory or an S3 bucket) restores any
snapshot. Records are removed by :meth:`remove` (``dsec snapshot rm``; fork's own snapshot when its
last copy is destroyed); their chunks then go with ``dsec image gc``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from dsec.errors import ImageCorrupt, InvalidRequest, NotFound, SandboxError
from dsec.images.cache import chunk_key
from dsec.images.format import sha256
from dsec.images.image_store import ImageStore
from dsec.models import ImageInfo

__all__ = ["SnapshotStore"]

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^snap-[0-9a-f]{16}$")
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class LayerMounter(Protocol):
    """What :class:`SnapshotStore` needs from the node's image manager (``NodeImages``)."""

    def pin_manifest(self, digest: str) -> Path: ...

    def unpin(self, root: Path) -> None: ...


class EagerLayers:
    """A :class:`LayerMounter` for daemons without the lazy image loader (a legacy directory image store,
    tests): a layer's blob is assembled from its chunks into a local file and mounted file-backed, once
    per layer while pinned, and unmounted (files removed) when its last pin goes."""

    def __init__(self, images: ImageStore, root: Path) -> None:
        self.images = images
        self.root = root
        self._lock = threading.Lock()
        self._pins: dict[Path, int] = {}

    def pin_manifest(self, digest: str) -> Path:
        """Mount layer ``digest`` (assembled from its chunks) if needed, pin it and return its root."""
        manifest = self.images.manifest_by_digest(digest)
        base = self.root / digest.removeprefix("sha256:")[:16]
        mnt = base / "mnt"
        with self._lock:
            if mnt not in self._pins and not os.path.ismount(mnt):  # (a restarted daemon finds it mounted)
                mnt.mkdir(parents=True, exist_ok=True)
                meta, blob = base / "meta.erofs", base / "blob"
                meta.write_bytes(self.images.blobs.get(chunk_key(manifest.meta_digest)))
                with blob.open("wb") as f:
                    for chunk in manifest.chunks:
                        data = self.images.blobs.get(chunk_key(chunk.digest))
                        if sha256(data) != chunk.digest:
                            raise ImageCorrupt(f"chunk {chunk.digest} of snapshot layer {digest} is corrupt")
                        f.write(data)
                if _libc.mount(os.fsencode(meta), os.fsencode(mnt), b"erofs", _MS_RDONLY | _MS_NODEV | _MS_NOSUID,
                               f"device={blob}".encode()) != 0:
                    err = ctypes.get_errno()
                    shutil.rmtree(base, ignore_errors=True)
                    raise SandboxError(f"mounting snapshot layer {digest} failed: {os.strerror(err)}")
            self._pins[mnt] = self._pins.get(mnt, 0) + 1
            return mnt

    def sweep(self) -> None:
        """Unmount and remove every layer no one pinned (left mounted by an earlier daemon whose sandboxes
        are gone; a restarted daemon re-pins the layers of the sandboxes it re-adopts first)."""
        if not self.root.is_dir():
            return
        with self._lock:
            for base in self.root.iterdir():
                mnt = base / "mnt"
                if mnt in self._pins:
                    continue
                if os.path.ismount(mnt) and _libc.umount2(os.fsencode(mnt), _MNT_DETACH) != 0:
                    continue
                shutil.rmtree(base, ignore_errors=True)

    def unpin(self, root: Path) -> None:
        """Drop one pin of the layer at ``root``; the last one unmounts it and removes its files."""
        with self._lock:
            left = self._pins.get(root, 0) - 1
            if left > 0:
                self._pins[root] = left
                return
            self._pins.pop(root, None)
            if _libc.umount2(os.fsencode(root), 0) == 0 or not root.exists():
                shutil.rmtree(root.parent, ignore_errors=True)


def check_id(snap_id: str) -> str:
    """``snap_id`` if it is a well-formed snapshot id; :class:`InvalidRequest` otherwise."""
    if not _ID_RE.match(snap_id):
        raise InvalidRequest(f"not a snapshot id: {snap_id!r} (expected snap-<16 hex digits>)")
    return snap_id


class SnapshotStore:
    """Snapshots as layer stacks in ``images`` (see the module docstring); ``scratch`` is node-local."""

    def __init__(self, images: ImageStore, scratch: Path, mounter: LayerMounter | None = None) -> None:
        self.images = images
        self.scratch = scratch
        self.mounter: LayerMounter = mounter if mounter is not None else EagerLayers(images, scratch / "layers")

    def begin(self) -> tuple[str, Path]:
        """A new snapshot id and the empty private directory the backend fills before :meth:`publish`."""
        self.scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        snap_id = "snap-" + secrets.token_hex(8)
        work = self.scratch / f".tmp-{snap_id}"
        (work / "tree").mkdir(mode=0o700, parents=True)
        return snap_id, work

    def publish(self, snap_id: str, work: Path, meta: dict[str, Any], below: list[str] | None = None) -> list[str]:
        """Store ``work/tree`` as a layer over ``below`` (layer digests, top first) and publish the record
        (``meta`` plus ``layers``); returns the layers. The work directory is removed."""
        try:
            tree = work / "tree"
            files, size = _count(tree)
            info = ImageInfo(name=snap_id, created_at=time.time(), size_bytes=size, files=files,
                             source=f"snapshot:{meta.get('source', '?')}", uid_shift=int(meta.get("uid_shift", 0)))
            manifest = self.images.upload_tree(info, tree, work)
            layers = [manifest.digest, *(below or [])]
            record = {**meta, "id": snap_id, "created_at": info.created_at, "size_bytes": size, "layers": layers}
            self.images.put_snapshot(snap_id, record)
            return layers
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def abort(self, work: Path) -> None:
        """Drop an unpublished snapshot's work directory."""
        shutil.rmtree(work, ignore_errors=True)

    def meta(self, snap_id: str) -> dict[str, Any]:
        """The snapshot's record (image, backend, spec, layers, size_bytes, created_at); :class:`NotFound`."""
        record = self.images.snapshot(check_id(snap_id))
        if record is None:
            raise NotFound(f"snapshot {snap_id!r} not found in {self.images.blobs.url}", snapshot=snap_id)
        return record

    def open(self, layers: list[str]) -> list[Path]:
        """Mount (and pin) every layer; returns their roots, top first. Blocking."""
        roots: list[Path] = []
        try:
            for digest in layers:
                roots.append(self.mounter.pin_manifest(digest))
        except BaseException:
            self.close(roots)
            raise
        return roots

    def sweep(self) -> None:
        """Release layer mounts no sandbox uses any more (the lazy loader's idle unmount does this for
        layers mounted through it)."""
        if isinstance(self.mounter, EagerLayers):
            self.mounter.sweep()

    def close(self, roots: list[Path]) -> None:
        """Unpin layers :meth:`open` returned (the mounts stay warm until the node unmounts idle images)."""
        for root in roots:
            self.mounter.unpin(root)

    def list(self) -> list[dict[str, Any]]:
        """Every snapshot record, oldest first."""
        found = [r for r in (self.images.snapshot(i) for i in self.images.snapshot_ids()) if r is not None]
        return sorted(found, key=lambda r: float(r.get("created_at", 0)))

    def remove(self, snap_id: str) -> None:
        """Delete a snapshot's record (absent is fine); sandboxes restored from it keep running."""
        self.images.remove_snapshot(check_id(snap_id))


def _count(tree: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, dirs, names in os.walk(tree):
        for name in names:
            files += 1
            st = os.lstat(os.path.join(dirpath, name))
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
        files += len(dirs)
    return files, size
