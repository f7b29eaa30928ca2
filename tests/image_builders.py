"""Builders of real image archives for the import tests: layer tars, OCI layouts and ``docker save`` archives.

Everything is written with ``tarfile`` and ``json`` the way docker, buildkit and skopeo write them, so the
importer is tested against the formats themselves, not against a fake reader.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
               "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
               None: "application/vnd.oci.image.layer.v1.tar"}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Entry:
    """One tar entry: ``kind`` is file, dir, symlink, hardlink, fifo or chr."""

    name: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    xattrs: dict[str, str] = field(default_factory=dict)
    mtime: int = 1_700_000_000


def f(name: str, data: bytes | str = b"", **kw: Any) -> Entry:
    return Entry(name, "file", data.encode() if isinstance(data, str) else data, **kw)


def d(name: str, mode: int = 0o755, **kw: Any) -> Entry:
    return Entry(name, "dir", mode=mode, **kw)


def sym(name: str, target: str, **kw: Any) -> Entry:
    return Entry(name, "symlink", link=target, mode=0o777, **kw)


def hard(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", link=target)


def layer_tar(entries: list[Entry]) -> bytes:
    """An uncompressed layer tar (PAX format, so xattrs travel as SCHILY.xattr.* records)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, e.mtime
            info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            content = None
            if e.kind == "file":
                info.size = len(e.data)
                content = io.BytesIO(e.data)
            elif e.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.link
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.link
            elif e.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif e.kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            tar.addfile(info, content)
    return buf.getvalue()


def compress(data: bytes, how: str | None) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def config_json(layers: list[bytes], env: list[str] | None = None, workdir: str | None = None,
                user: str | None = None, cmd: list[str] | None = None) -> bytes:
    """An image config whose rootfs.diff_ids are the digests of the uncompressed ``layers``."""
    cfg: dict[str, Any] = {"Env": env or ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": cmd or ["/bin/sh"]}
    if workdir:
        cfg["WorkingDir"] = workdir
    if user:
        cfg["User"] = user
    doc = {"architecture": "amd64", "os": "linux", "config": cfg,
           "rootfs": {"type": "layers", "diff_ids": [sha(layer) for layer in layers]}}
    return json.dumps(doc).encode()


@dataclass
class Image:
    """An image as blobs: what a layout, an archive or a registry push is written from."""

    layers: list[bytes]
    """Uncompressed layer tars, bottom first."""
    compression: list[str | None]
    config: bytes
    blobs: dict[str, bytes] = field(default_factory=dict)
    manifest: bytes = b""

    @classmethod
    def build(cls, layers: list[list[Entry]], compression: list[str | None] | None = None, **config: Any) -> Image:
        tars = [layer_tar(entries) for entries in layers]
        comp = compression or [None] * len(tars)
        img = cls(layers=tars, compression=comp, config=config_json(tars, **config))
        descs = []
        for tar, how in zip(tars, comp, strict=True):
            blob = compress(tar, how)
            img.blobs[sha(blob)] = blob
            descs.append({"mediaType": LAYER_TYPES[how], "digest": sha(blob), "size": len(blob)})
        img.blobs[sha(img.config)] = img.config
        img.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": sha(img.config), "size": len(img.config)},
            "layers": descs,
        }).encode()
        img.blobs[sha(img.manifest)] = img.manifest
        return img

    def index(self, tag: str = "latest", multiarch: bool = False) -> bytes:
        """index.json: this manifest (for linux/amd64, next to an arm64 decoy when ``multiarch``)."""
        entry = {"mediaType": OCI_MANIFEST, "digest": sha(self.manifest), "size": len(self.manifest),
                 "annotations": {"org.opencontainers.image.ref.name": tag}}
        manifests = [entry]
        if multiarch:
            decoy = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {}, "layers": []}).encode()
            self.blobs[sha(decoy)] = decoy
            entry["platform"] = {"os": "linux", "architecture": "amd64"}
            manifests.insert(0, {"mediaType": OCI_MANIFEST, "digest": sha(decoy), "size": len(decoy),
                                 "platform": {"os": "linux", "architecture": "arm64"},
                                 "annotations": {"org.opencontainers.image.ref.name": tag}})
        return json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}).encode()

    def write_layout(self, root: Path, tag: str = "latest", multiarch: bool = False) -> Path:
        """An OCI image layout directory."""
        index = self.index(tag, multiarch)
        (root / "blobs" / "sha256").mkdir(parents=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (root / "index.json").write_bytes(index)
        for digest, blob in self.blobs.items():
            (root / "blobs" / "sha256" / digest[7:]).write_bytes(blob)
        return root

    def write_docker_archive(self, path: Path, tag: str = "test:latest") -> Path:
        """A classic ``docker save`` archive: ``<id>/layer.tar`` (uncompressed) and ``<hex>.json``."""
        cfg_name = sha(self.config)[7:] + ".json"
        files: dict[str, bytes] = {cfg_name: self.config}
        paths = []
        for i, tar in enumerate(self.layers):
            layer_id = hashlib.sha256(f"layer{i}".encode() + tar).hexdigest()
            files[f"{layer_id}/VERSION"] = b"1.0"
            files[f"{layer_id}/layer.tar"] = tar
            paths.append(f"{layer_id}/layer.tar")
        files["manifest.json"] = json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": paths}]).encode()
        write_tar(path, files)
        return path


def write_tar(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def tar_dir(root: Path, out: Path) -> Path:
    """A tar of a layout directory (``oci-archive``)."""
    with tarfile.open(out, "w") as tar:
        tar.add(root, arcname=".")
    return out


# ----------------------------------------------------------------------------- the sample image


def base_layer() -> list[Entry]:
    return [
        d("etc"),
        f("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"),
        d("bin"),
        f("bin/tool", "#!/bin/sh\necho tool\n", mode=0o4755),
        hard("bin/tool-hard", "bin/tool"),
        d("home"),
        d("home/app", mode=0o750, uid=1000, gid=1000),
        f("home/app/notes", "mine", uid=1000, gid=1001, mode=0o600),
        d("data"),
        f("data/old.txt", "old"),
        f("data/keep.txt", "keep"),
        d("opaq"),
        f("opaq/a", "a"),
        d("opaq/sub"),
        f("opaq/sub/b", "b"),
        d("lib/real", mode=0o755),
        sym("lib64", "lib/real"),
        sym("abs-link", "/etc/passwd"),
        d("gone/dir"),
        f("gone/dir/x", "x"),
        f("swap", "was a file"),
        Entry("run/fifo", "fifo"),
        Entry("dev-null", "chr"),
        f("xattrs", "x", xattrs={"user.dsec": "hello", "trusted.overlay.opaque": "y",
                                 "security.selinux": "system_u:object_r:bin_t:s0"}),
        f("implied/parent/file", "no dir entries before me"),
    ]


def upper_layer() -> list[Entry]:
    return [
        f("data/.wh.old.txt"),
        f(".wh.gone"),
        f("opaq/.wh..wh..opq"),
        f("opaq/c", "c (after the opaque marker)"),
        hard("data/keep-link", "data/keep.txt"),
        f("lib64/added.so", "through a symlinked parent"),
        d("swap"),
        f("swap/inner", "now a directory"),
        f("bin/tool2", "setgid", mode=0o2711, gid=50),
    ]


def top_layer() -> list[Entry]:
    return [f("etc/motd", "hello from layer 3\n"), f("data/keep.txt", "rewritten (link keeps the old inode)")]


def sample_image() -> Image:
    return Image.build([base_layer(), upper_layer(), top_layer()], compression=["gzip", "zstd", None],
                       env=["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY="], workdir="/home/app",
                       user="1000:1000", cmd=["/bin/sh", "-c", "echo hi"])


def check_flattened(root: Path) -> None:
    """Every rule of base + upper + top layers, checked on the imported tree."""
    assert (root / "etc/passwd").read_text().startswith("root:x:0:0")
    tool = os.lstat(root / "bin/tool")
    assert stat.S_IMODE(tool.st_mode) == 0o4755 and tool.st_uid == 0
    assert os.lstat(root / "bin/tool-hard").st_ino == tool.st_ino
    tool2 = os.lstat(root / "bin/tool2")
    assert stat.S_IMODE(tool2.st_mode) == 0o2711 and tool2.st_gid == 50
    app = os.lstat(root / "home/app")
    assert (app.st_uid, app.st_gid, stat.S_IMODE(app.st_mode)) == (1000, 1000, 0o750)
    notes = os.lstat(root / "home/app/notes")
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1001, 0o600)
    assert notes.st_mtime == 1_700_000_000
    # whiteouts: a file and a whole directory
    assert not (root / "data/old.txt").exists() and not (root / "gone").exists()
    assert not (root / "data/.wh.old.txt").exists() and not (root / ".wh.gone").exists()
    # opaque directory: lower children gone, this layer's kept, the marker itself not created
    assert sorted(os.listdir(root / "opaq")) == ["c"]
    # hard link to a file of an earlier layer: same inode as the file at that time
    assert (root / "data/keep-link").read_text() == "keep"
    assert (root / "data/keep.txt").read_text().startswith("rewritten")
    # symlinks kept as links; a file under a symlinked parent lands where the link points, inside the root
    assert os.readlink(root / "lib64") == "lib/real" and os.readlink(root / "abs-link") == "/etc/passwd"
    assert (root / "lib/real/added.so").read_text() == "through a symlinked parent"
    # a file replaced by a directory
    assert (root / "swap").is_dir() and (root / "swap/inner").read_text() == "now a directory"
    # devices and fifos skipped
    assert not (root / "run/fifo").exists() and not (root / "dev-null").exists()
    # xattrs: user.* kept, trusted.* and security labels dropped
    assert os.getxattr(root / "xattrs", "user.dsec") == b"hello"
    assert set(os.listxattr(root / "xattrs")) == {"user.dsec"}
    assert (root / "implied/parent/file").is_file()
    assert (root / "etc/motd").read_text() == "hello from layer 3\n"
