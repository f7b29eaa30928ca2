"""Importing OCI and docker images: ``docker save`` archives, OCI image layouts, and the import pipeline.

Owns the image formats (manifests, indexes, configs, media types), digest verification (every blob
read is hashed and checked against the digest that names it: a manifest's descriptors, a docker
archive's config name and ``rootfs.diff_ids``), layer decompression (gzip, zstd, plain; sniffed by magic
bytes, not trusted from media types), platform choice in a multi-arch index (linux/amd64), and the
pipeline every source shares: flatten the layers (:mod:`dsec.images.layers`) into a temporary directory
on the store's filesystem, then hand it to :meth:`ImageStore.import_dir` with ``move=True``.

Two imports of the same name are serialised by a lock file per name: the second waits for the first and
then fails with "already exists" (or replaces it with ``replace=True``); neither sees a half-written
image. Registries are :mod:`dsec.images.registry`'s business; this module never opens a socket.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

import zstandard

from dsec.errors import InvalidRequest
from dsec.images.image_store import ImageStore, validate_name
from dsec.images.layers import Flattener, FlattenStats
from dsec.models import ImageConfig, ImageInfo

__all__ = [
    "INDEX_TYPES",
    "MANIFEST_TYPES",
    "DockerArchive",
    "ImageSource",
    "Layer",
    "OciLayout",
    "Progress",
    "check_digest",
    "image_config",
    "import_image",
    "open_source",
    "pick_manifest",
]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
PLATFORM = ("linux", "amd64")
"""The platform picked from a multi-arch index (the only one this project's hosts run)."""

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ = 1 << 20
_MAX_JSON = 16 << 20  # manifests and configs are kilobytes; refuse to buffer anything absurd


class Progress(Protocol):
    """Where long work reports progress (the CLI draws rich bars; the default draws nothing)."""

    def task(self, description: str, total: int | None) -> Callable[[int], None]:
        """Start a task of ``total`` units (bytes); return the function that advances it."""


class _Silent:
    def task(self, description: str, total: int | None) -> Callable[[int], None]:
        return lambda n: None


def check_digest(digest: object, what: str) -> str:
    """``digest`` if it is ``sha256:<64 hex>``; otherwise a clear :class:`InvalidRequest`."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidRequest(f"{what}: unsupported or malformed digest {digest!r} (expected sha256:<64 hex>)")
    return digest


def _mismatch(what: str, want: str, got: str) -> InvalidRequest:
    return InvalidRequest(f"{what}: digest mismatch: expected {want}, content is {got} (corrupt, truncated or "
                          "tampered image)", expected=want, actual=got)


class _Hashing:
    """A reader that hashes (and counts) what passes through it; ``peek`` looks ahead without consuming."""

    def __init__(self, raw: IO[bytes], advance: Callable[[int], None] | None = None) -> None:
        self._raw = raw
        self._buf = b""
        self._advance = advance
        self.sha = hashlib.sha256()
        self.size = 0

    def peek(self, n: int) -> bytes:
        while len(self._buf) < n:
            more = self._raw.read(n - len(self._buf))
            if not more:
                break
            self._buf += more
        return self._buf[:n]

    def read(self, n: int = -1) -> bytes:
        if self._buf:
            data, self._buf = (self._buf, b"") if n < 0 or n >= len(self._buf) else (self._buf[:n], self._buf[n:])
        else:
            data = self._raw.read(n)
        self.sha.update(data)
        self.size += len(data)
        if self._advance is not None and data:
            self._advance(len(data))
        return data

    def drain(self) -> None:
        while self.read(_READ):
            pass

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _decompressed(head: bytes, raw: _Hashing) -> IO[bytes] | None:
    """A decompressing reader over ``raw`` when its magic says gzip or zstd; None for a plain tar."""
    if head.startswith(_GZIP_MAGIC):
        return cast("IO[bytes]", gzip.GzipFile(fileobj=cast("IO[bytes]", raw), mode="rb"))
    if head.startswith(_ZSTD_MAGIC):
        reader: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(cast("IO[bytes]", raw), read_across_frames=True)
        return reader
    return None


@dataclass(frozen=True)
class Layer:
    """One layer as a manifest names it."""

    digest: str | None
    """Digest of the blob as stored (compressed); None when the format does not name it (old docker save)."""
    size: int | None
    """Stored size in bytes, when known."""
    diff_id: str | None
    """Digest of the uncompressed tar (the config's ``rootfs.diff_ids``), when known."""
    path: str = ""
    """Where the blob is in an archive (docker save); unused for layouts and registries."""


def apply_layer(flat: Flattener, raw_stream: IO[bytes], layer: Layer, label: str, advance: Callable[[int], None]
                ) -> None:
    """Decompress, flatten and verify one layer; a digest mismatch raises after the whole layer was read."""
    raw = _Hashing(raw_stream, advance)
    head = raw.peek(4)
    inner = _decompressed(head, raw)
    plain = _Hashing(inner) if inner is not None else raw
    try:
        with tarfile.open(fileobj=plain, mode="r|", bufsize=_READ) as tar:  # type: ignore[call-overload]
            flat.apply(tar, label)
        plain.drain()  # tar padding after the end-of-archive blocks also counts towards the digests
        raw.drain()
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as exc:
        raise InvalidRequest(f"layer {label} is truncated or corrupt: {exc}", layer=label) from exc
    if layer.digest is not None and raw.digest() != layer.digest:
        raise _mismatch(f"layer {label}", layer.digest, raw.digest())
    if layer.size is not None and raw.size != layer.size:
        raise InvalidRequest(f"layer {label}: size mismatch: manifest says {layer.size} bytes, read {raw.size}",
                             layer=label)
    if layer.diff_id is not None and plain.digest() != layer.diff_id:
        raise _mismatch(f"layer {label} (uncompressed, config rootfs.diff_ids)", layer.diff_id, plain.digest())


def image_config(config: dict[str, Any]) -> ImageConfig:
    """Sandbox defaults from an OCI/docker image config: ``Env``, ``WorkingDir``, ``User``, ``Entrypoint``, ``Cmd``,
    ``Labels``."""
    c = config.get("config") or {}
    if not isinstance(c, dict):
        raise InvalidRequest("image config: 'config' is not an object")
    env: dict[str, str] = {}
    for item in c.get("Env") or []:
        if isinstance(item, str) and "=" in item and "\0" not in item:
            key, value = item.split("=", 1)
            if key:
                env[key] = value

    def argv(v: Any) -> list[str] | None:
        return [str(a) for a in v] if isinstance(v, list) else None

    workdir = c.get("WorkingDir") or None
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        workdir = None  # relative or junk: the OCI spec only defines absolute paths
    user = c.get("User") or None
    found = c.get("Labels")
    labels = {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
    return ImageConfig(env=env, workdir=workdir, user=str(user) if user else None,
                       entrypoint=argv(c.get("Entrypoint")), cmd=argv(c.get("Cmd")), labels=labels)


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"{what} is not a JSON object")
    return doc


def pick_manifest(index: dict[str, Any], what: str, tag: str | None = None) -> dict[str, Any]:
    """The manifest descriptor to use from an index: by ``tag`` (ref.name annotation), else linux/amd64."""
    listed = index.get("manifests")
    if not isinstance(listed, list) or not listed or not all(isinstance(m, dict) for m in listed):
        raise InvalidRequest(f"{what}: the index lists no manifests")
    manifests: list[dict[str, Any]] = listed
    if tag is not None:
        named = [m for m in manifests
                 if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag]
        if not named:
            tags = sorted({str((m.get("annotations") or {}).get("org.opencontainers.image.ref.name"))
                           for m in manifests})
            raise InvalidRequest(f"{what}: no image tagged {tag!r} (tags: {', '.join(tags)})", tag=tag)
        manifests = named
    if len(manifests) == 1 and "platform" not in manifests[0]:
        return manifests[0]
    for m in manifests:
        p = m.get("platform") or {}
        if (p.get("os"), p.get("architecture")) == PLATFORM:
            return m
    if len(manifests) == 1:
        return manifests[0]
    found = sorted(f"{(m.get('platform') or {}).get('os')}/{(m.get('platform') or {}).get('architecture')}"
                   for m in manifests)
    raise InvalidRequest(f"{what}: no {'/'.join(PLATFORM)} image among {', '.join(found)}")


# ----------------------------------------------------------------------------- sources


class ImageSource(abc.ABC):
    """Somewhere an image's manifest, config and layers can be read from."""

    description: str
    """What ``ImageInfo.source`` records (``oci-layout:/path``, ``registry:host/repo:tag``...)."""

    @abc.abstractmethod
    def load(self) -> tuple[dict[str, Any], list[Layer]]:
        """The verified config JSON and the layers, bottom first."""

    @abc.abstractmethod
    def open_layer(self, layer: Layer) -> IO[bytes]:
        """The stored (possibly compressed) bytes of ``layer``; verified by the caller while read."""

    def close(self) -> None:
        """Release open files."""


class _Files(abc.ABC):
    """The files of an archive or a directory, by relative path."""

    @abc.abstractmethod
    def open(self, path: str) -> IO[bytes]: ...

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def size(self, path: str) -> int: ...

    def read(self, path: str, what: str) -> bytes:
        if not self.exists(path):
            raise InvalidRequest(f"{what} is missing ({path})")
        with self.open(path) as fh:
            data = fh.read(_MAX_JSON + 1)
        if len(data) > _MAX_JSON:
            raise InvalidRequest(f"{what} ({path}) is larger than {_MAX_JSON} bytes")
        return data

    def close(self) -> None:
        pass


class _DirFiles(_Files):
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, path: str) -> Path:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise InvalidRequest(f"{self.root}: path {path!r} escapes the image directory")
        return self.root.joinpath(*parts)

    def open(self, path: str) -> IO[bytes]:
        return open(self._path(path), "rb")

    def exists(self, path: str) -> bool:
        return self._path(path).is_file()

    def size(self, path: str) -> int:
        return self._path(path).stat().st_size


class _TarFiles(_Files):
    def __init__(self, path: Path) -> None:
        try:
            self.tar = tarfile.open(path, "r:*")  # noqa: SIM115 (closed by close())
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise InvalidRequest(f"{path} is not a readable tar archive: {exc}", path=str(path)) from None
        try:
            self.members = {m.name.removeprefix("./").lstrip("/"): m for m in self.tar.getmembers() if m.isfile()}
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            self.tar.close()
            raise InvalidRequest(f"{path} is not a readable tar archive (truncated or corrupt?): {exc}",
                                 path=str(path)) from None

    def open(self, path: str) -> IO[bytes]:
        fh = self.tar.extractfile(self.members[path])
        assert fh is not None
        return fh

    def exists(self, path: str) -> bool:
        return path in self.members

    def size(self, path: str) -> int:
        return self.members[path].size

    def close(self) -> None:
        self.tar.close()


class OciLayout(ImageSource):
    """An OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) in a directory or a tar."""

    def __init__(self, files: _Files, where: str, tag: str | None = None) -> None:
        self.files = files
        self.tag = tag
        self.description = f"oci-layout:{where}" + (f":{tag}" if tag else "")

    def _blob(self, digest: str, what: str) -> bytes:
        check_digest(digest, what)
        data = self.files.read("blobs/sha256/" + digest.split(":", 1)[1], what)
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest:
            raise _mismatch(what, digest, got)
        return data

    def load(self) -> tuple[dict[str, Any], list[Layer]]:
        where = self.description
        layout = _load_json(self.files.read("oci-layout", f"{where}: oci-layout"), f"{where}: oci-layout")
        if layout.get("imageLayoutVersion") != "1.0.0":
            raise InvalidRequest(f"{where}: unsupported imageLayoutVersion {layout.get('imageLayoutVersion')!r}")
        desc = pick_manifest(_load_json(self.files.read("index.json", f"{where}: index.json"),
                                        f"{where}: index.json"), where, self.tag)
        for _ in range(4):  # an index may point at a nested (multi-arch) index
            digest = check_digest(desc.get("digest"), f"{where}: manifest descriptor")
            doc = _load_json(self._blob(digest, f"{where}: manifest {digest}"), f"{where}: manifest {digest}")
            if doc.get("mediaType") in INDEX_TYPES or desc.get("mediaType") in INDEX_TYPES:
                desc = pick_manifest(doc, where)
                continue
            return parse_manifest(doc, where, lambda d, w: self._blob(d, w))
        raise InvalidRequest(f"{where}: indexes nested too deeply")

    def open_layer(self, layer: Layer) -> IO[bytes]:
        assert layer.digest is not None
        path = "blobs/sha256/" + layer.digest.split(":", 1)[1]
        if not self.files.exists(path):
            raise InvalidRequest(f"{self.description}: layer blob {layer.digest} is missing")
        return self.files.open(path)

    def close(self) -> None:
        self.files.close()


def parse_manifest(doc: dict[str, Any], where: str, fetch: Callable[[str, str], bytes]
                   ) -> tuple[dict[str, Any], list[Layer]]:
    """Config (fetched by digest through ``fetch``, which verifies it) and layers of an image manifest."""
    media = doc.get("mediaType")
    if media is not None and media not in MANIFEST_TYPES:
        raise InvalidRequest(f"{where}: unsupported manifest media type {media!r}")
    cdesc = doc.get("config")
    layers = doc.get("layers")
    if not isinstance(cdesc, dict) or not isinstance(layers, list):
        raise InvalidRequest(f"{where}: the manifest has no config or layers")
    cdigest = check_digest(cdesc.get("digest"), f"{where}: config descriptor")
    config = _load_json(fetch(cdigest, f"{where}: config {cdigest}"), f"{where}: config")
    diff_ids = _diff_ids(config, len(layers), where)
    out = []
    for i, ldesc in enumerate(layers):
        if not isinstance(ldesc, dict):
            raise InvalidRequest(f"{where}: layer descriptor {i} is not an object")
        size = ldesc.get("size")
        out.append(Layer(digest=check_digest(ldesc.get("digest"), f"{where}: layer {i}"),
                         size=size if isinstance(size, int) else None, diff_id=diff_ids[i]))
    return config, out


def _diff_ids(config: dict[str, Any], count: int, where: str) -> list[str]:
    rootfs = config.get("rootfs") or {}
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or len(ids) != count:
        raise InvalidRequest(f"{where}: the config's rootfs.diff_ids do not match the {count} layers")
    return [check_digest(d, f"{where}: rootfs.diff_ids") for d in ids]


class DockerArchive(ImageSource):
    """A ``docker save`` archive (``manifest.json`` + ``<id>.json`` config + ``<id>/layer.tar``)."""

    def __init__(self, files: _Files, where: str, tag: str | None = None) -> None:
        self.files = files
        self.tag = tag
        self.description = f"docker-archive:{where}" + (f":{tag}" if tag else "")

    def load(self) -> tuple[dict[str, Any], list[Layer]]:
        where = self.description
        try:
            entries = json.loads(self.files.read("manifest.json", f"{where}: manifest.json"))
        except ValueError as exc:
            raise InvalidRequest(f"{where}: manifest.json is not valid JSON: {exc}") from None
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise InvalidRequest(f"{where}: manifest.json lists no images")
        entry = entries[0]
        if self.tag is not None:
            match = [e for e in entries
                     if {self.tag, f"{self.tag}:latest"} & {str(t) for t in e.get("RepoTags") or []}]
            if not match:
                tags = sorted(str(t) for e in entries for t in e.get("RepoTags") or [])
                raise InvalidRequest(f"{where}: no image tagged {self.tag!r} (tags: {', '.join(tags)})")
            entry = match[0]
        elif len(entries) > 1:
            tags = sorted(str(t) for e in entries for t in e.get("RepoTags") or [])
            raise InvalidRequest(f"{where} holds {len(entries)} images: name one with SOURCE:TAG "
                                 f"(tags: {', '.join(tags)})")
        cpath, lpaths = entry.get("Config"), entry.get("Layers")
        if not isinstance(cpath, str) or not isinstance(lpaths, list) or not all(isinstance(p, str) for p in lpaths):
            raise InvalidRequest(f"{where}: manifest.json has no Config or Layers")
        data = self.files.read(cpath, f"{where}: config {cpath}")
        # The config's file name is its digest (``<hex>.json`` or ``blobs/sha256/<hex>``): check it.
        stem = cpath.rsplit("/", 1)[-1].removesuffix(".json")
        got = hashlib.sha256(data).hexdigest()
        if re.fullmatch(r"[0-9a-f]{64}", stem) and stem != got:
            raise _mismatch(f"{where}: config {cpath}", f"sha256:{stem}", f"sha256:{got}")
        config = _load_json(data, f"{where}: config")
        diff_ids = _diff_ids(config, len(lpaths), where)
        for p in lpaths:
            if not self.files.exists(p):
                raise InvalidRequest(f"{where}: layer {p} is missing (truncated archive?)")
        return config, [Layer(digest=None, size=self.files.size(p), diff_id=d, path=p)
                        for p, d in zip(lpaths, diff_ids, strict=True)]

    def open_layer(self, layer: Layer) -> IO[bytes]:
        return self.files.open(layer.path)

    def close(self) -> None:
        self.files.close()


def open_source(path: Path, tag: str | None = None) -> ImageSource | None:
    """An archive or layout at ``path``, detected by its contents; None for a plain root directory."""
    if path.is_dir():
        files: _Files = _DirFiles(path)
    elif path.is_file():
        files = _TarFiles(path)
    else:
        raise InvalidRequest(f"cannot import {path}: no such file or directory", path=str(path))
    where = str(path.resolve())
    if files.exists("oci-layout"):
        return OciLayout(files, where, tag)
    if files.exists("manifest.json"):
        return DockerArchive(files, where, tag)
    files.close()
    if path.is_dir():
        return None
    raise InvalidRequest(f"{path} is a tar archive but neither a docker-save archive (no manifest.json) nor an "
                         "OCI image layout (no oci-layout)", path=str(path))


# ----------------------------------------------------------------------------- the pipeline


@contextlib.contextmanager
def _import_lock(store: ImageStore, name: str) -> Iterator[None]:
    """Serialise imports of one name across processes (a flock held for the whole download + flatten)."""
    store.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(store.root / f".importlock-{name}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # leftovers of an import of this name that was killed: ours to remove while we hold the lock
        prefix = f".import-{name}-"
        for old in store.root.glob(prefix + "*"):
            if "-" not in old.name[len(prefix):]:
                shutil.rmtree(old, ignore_errors=True)
        yield
    finally:
        os.close(fd)


def import_image(store: ImageStore, name: str, source: ImageSource, uid_shift: int, replace: bool = False,
                 progress: Progress | None = None) -> tuple[ImageInfo, FlattenStats]:
    """Flatten ``source`` into the store as image ``name`` (see the module docstring); nothing left on failure."""
    progress = progress or _Silent()
    try:
        validate_name(name)
        with _import_lock(store, name):
            if store.exists(name) and not replace:
                raise InvalidRequest(f"image {name!r} already exists (remove it or pass --replace)", image=name)
            work = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=store.root))
            try:
                rootfs = work / "rootfs"
                rootfs.mkdir(mode=0o755)
                config, layers = source.load()
                with Flattener(rootfs) as flat:
                    for i, layer in enumerate(layers, 1):
                        label = layer.digest or layer.diff_id or layer.path
                        short = (layer.digest or layer.diff_id or "sha256:?")[7:19]
                        advance = progress.task(f"layer {i}/{len(layers)} {short}", layer.size)
                        with source.open_layer(layer) as stream:
                            apply_layer(flat, stream, layer, f"{i}/{len(layers)} ({label})", advance)
                    stats = flat.stats
                info = store.import_dir(name, rootfs, uid_shift=uid_shift, source=source.description,
                                        config=image_config(config), replace=replace, move=True)
                return info, stats
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        source.close()
