"""Snapshot storage: a directory of snapshots keyed by id, under the image store by default.

A snapshot is a directory holding whatever its backend wrote (the container backend: ``upper.tar``, the
overlay's writable layer) and ``meta.json`` (image, backend, spec, size). Snapshots are published by an
atomic rename, so a daemon sharing the store (another state directory, another node on a shared mount)
sees a whole snapshot or none. This is deliberately small: the content-addressed chunk store of the
image issue can replace it behind the same four methods.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from dsec.errors import InvalidRequest, NotFound

__all__ = ["SnapshotStore"]

_ID_RE = re.compile(r"^snap-[0-9a-f]{16}$")


class SnapshotStore:
    """Snapshots as directories ``<root>/<id>/`` (``meta.json`` + backend files)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def begin(self) -> tuple[str, Path]:
        """A new snapshot id and the private directory to fill before :meth:`publish`."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        snap_id = "snap-" + secrets.token_hex(8)
        work = self.root / f".tmp-{snap_id}"
        work.mkdir(mode=0o700)
        return snap_id, work

    def publish(self, snap_id: str, work: Path, meta: dict[str, Any]) -> None:
        """Write ``meta.json`` and make the snapshot visible atomically."""
        size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
        meta = {**meta, "id": snap_id, "created_at": time.time(), "size_bytes": size}
        (work / "meta.json").write_text(json.dumps(meta))
        os.replace(work, self.root / snap_id)

    def abort(self, work: Path) -> None:
        """Drop an unpublished snapshot directory."""
        shutil.rmtree(work, ignore_errors=True)

    def path(self, snap_id: str) -> Path:
        """The directory of a published snapshot; raises :class:`~dsec.errors.NotFound`."""
        if not _ID_RE.match(snap_id):
            raise InvalidRequest(f"not a snapshot id: {snap_id!r} (expected snap-<16 hex digits>)")
        path = self.root / snap_id
        if not (path / "meta.json").is_file():
            raise NotFound(f"snapshot {snap_id!r} not found in {self.root}", snapshot=snap_id)
        return path

    def meta(self, snap_id: str) -> dict[str, Any]:
        """The snapshot's metadata (image, backend, spec, size_bytes, created_at)."""
        data: dict[str, Any] = json.loads((self.path(snap_id) / "meta.json").read_text())
        return data

    def remove(self, snap_id: str) -> None:
        """Delete a snapshot (absent is fine)."""
        if _ID_RE.match(snap_id):
            shutil.rmtree(self.root / snap_id, ignore_errors=True)
