"""Exporting a DSec image as an OCI image layout, so an OCI builder can start ``FROM`` it.

Owns the reverse of an import: a resolved image's root (owners shifted by its ``uid_shift``) becomes one
uncompressed layer with the image's own owners (``uid - uid_shift``), modes, hard links, symlinks, mtimes
and the xattrs an import keeps (``user.*``, ``security.capability``), plus an OCI config carrying its
``ImageConfig`` (env, working directory, user, entrypoint, cmd) and the labels asked for. The layout is
written whole into a directory the caller owns. It never writes into the image store and never reads a
path outside the root it is given (the walk does not follow symlinks).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dsec.errors import InvalidRequest
from dsec.models import ImageConfig

__all__ = ["LAYER_TYPE", "export_layout"]

LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
_CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
_KEPT_XATTRS = ("user.", "security.capability")
_ID_LIMIT = 65536


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, raw: IO[bytes], advance: Callable[[int], None]) -> None:
        self.raw, self.advance = raw, advance
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.advance(len(data))
        return self.raw.write(data)

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _xattrs(path: str) -> dict[str, str]:
    """The xattrs an import keeps, as PAX records (binary values survive through surrogateescape)."""
    found: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return found
    for name in names:
        if name.startswith(_KEPT_XATTRS):
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            found["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")
    return found


def _owner(value: int, shift: int, path: str) -> int:
    own = value - shift
    if not 0 <= own < _ID_LIMIT:
        raise InvalidRequest(f"cannot export {path}: owner id {value} is outside the image's range "
                             f"{shift}..{shift + _ID_LIMIT - 1} (uid_shift {shift})", path=path)
    return own


def _add_tree(tar: tarfile.TarFile, root: Path, shift: int) -> None:
    """Every entry under ``root`` (root itself as ``./``), owners unshifted; sockets and devices are left out
    (an import never stores them: a sandbox's ``/dev`` is its own)."""
    _add_entry(tar, root, str(root), shift)
    for top, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()  # a symlink to a directory is listed here; os.walk does not descend into it
        for name in [*sorted(files), *dirs]:
            _add_entry(tar, root, os.path.join(top, name), shift)


def _add_entry(tar: tarfile.TarFile, root: Path, path: str, shift: int) -> None:
    st = os.lstat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return
    rel = os.path.relpath(path, root)
    info = tar.gettarinfo(path, arcname="./" if rel == "." else rel)
    info.uid, info.gid = _owner(st.st_uid, shift, rel), _owner(st.st_gid, shift, rel)
    info.uname = info.gname = ""
    info.pax_headers = _xattrs(path)
    if info.isreg():
        with open(path, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def _config(config: ImageConfig, diff_id: str, labels: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in config.env.items()], "Labels": {**config.labels, **labels}}
    if config.workdir:
        body["WorkingDir"] = config.workdir
    if config.user:
        body["User"] = config.user
    if config.entrypoint is not None:
        body["Entrypoint"] = config.entrypoint
    if config.cmd is not None:
        body["Cmd"] = config.cmd
    # Builders count a config's non-empty history entries against its layers: one entry for the one layer.
    return {"architecture": "amd64", "os": "linux", "config": body,
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "dsec image export", "comment": "the DSec image's root as one layer"}]}


def _put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest[7:]).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def export_layout(rootfs: Path, uid_shift: int, config: ImageConfig, layout: Path, ref_name: str,
                  labels: dict[str, str] | None = None,
                  advance: Callable[[int], None] = lambda n: None) -> str:
    """Write the image rooted at ``rootfs`` as an OCI layout in the new directory ``layout``, its manifest
    annotated ``org.opencontainers.image.ref.name=ref_name``; returns the manifest's digest. ``advance``
    is told the layer bytes written."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    scratch = blobs / "layer.partial"
    with open(scratch, "wb") as raw:
        out = _HashingWriter(raw, advance)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            _add_tree(tar, rootfs, uid_shift)
    diff_id = out.digest()
    os.rename(scratch, blobs / diff_id[7:])
    layer = {"mediaType": LAYER_TYPE, "digest": diff_id, "size": out.size}
    cfg = _put_blob(layout, json.dumps(_config(config, diff_id, labels or {}), sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": _MANIFEST_TYPE,
                "config": {"mediaType": _CONFIG_TYPE, **cfg}, "layers": [layer]}
    desc = _put_blob(layout, json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": _MANIFEST_TYPE, **desc, "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"org.opencontainers.image.ref.name": ref_name}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return str(desc["digest"])
