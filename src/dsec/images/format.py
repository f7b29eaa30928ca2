"""The stored image format: an EROFS metadata image plus its data blob cut into content-addressed chunks.

An image is built with ``mkfs.erofs --chunksize=C --blobdev=BLOB META TREE``: ``META`` holds inodes,
directories, inline data and, for every file chunk, the 4 KiB block of ``BLOB`` that holds it. File data
in ``BLOB`` is block-aligned and identical file chunks are already stored once by mkfs. ``BLOB`` is then cut
into chunks at content-defined block boundaries (a cut after each 4 KiB block whose digest matches a mask,
within a minimum and maximum size), so the same run of files yields the same chunks in every image that
contains it, wherever it lies in the blob: shared bases dedup across images and layers.

A :class:`Manifest` lists the chunks in blob order (digest and length), the metadata image's digest and
the image's :class:`~dsec.models.ImageInfo`. Its own digest is the sha256 of its canonical JSON; tags name a
manifest digest. This module owns the format and its verification; it never touches a store or a mount.
"""

from __future__ import annotations

import bisect
import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dsec.errors import BackendUnavailable, DSecError, ImageCorrupt
from dsec.models import ImageInfo

__all__ = [
    "BLOCK",
    "FORMAT_VERSION",
    "ChunkRef",
    "Manifest",
    "build_erofs",
    "cut_blob",
    "sha256",
]

FORMAT_VERSION = 1
BLOCK = 4096
_EROFS_CHUNK = 1 << 20
"""mkfs ``--chunksize``: the EROFS chunk index granularity (identical 1 MiB file chunks dedup inside mkfs)."""
_MIN_CHUNK = 16 * BLOCK
_MAX_CHUNK = 256 * BLOCK
_CUT_MASK = 0x1F
"""A cut after a block whose digest's low bits are zero: 1 in 32 blocks, ~128 KiB average chunks."""


def sha256(data: bytes | memoryview) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


class ChunkRef(BaseModel):
    """One chunk of the blob, in blob order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str
    """``sha256:<hex>`` of the chunk's bytes."""
    size: int = Field(gt=0)
    """Bytes."""


class Manifest(BaseModel):
    """Everything needed to mount an image: its metadata image and its blob's chunks."""

    model_config = ConfigDict(extra="forbid")

    version: int = FORMAT_VERSION
    info: ImageInfo
    """Name, size, source and sandbox defaults."""
    meta_digest: str
    """Digest of the EROFS metadata image."""
    meta_size: int
    """Bytes of the metadata image."""
    chunks: list[ChunkRef]
    """The blob, in order."""

    def canonical(self) -> bytes:
        """The bytes whose sha256 is :attr:`digest` (stored as is). An image without labels leaves the key out:
        its digest is the one it had before images had labels, so the stores and caches made then stay valid."""
        unlabelled = {"info": {"config": {"labels"}}} if not self.info.config.labels else None
        return self.model_dump_json(exclude=unlabelled).encode()

    @property
    def digest(self) -> str:
        """The manifest's own digest."""
        return sha256(self.canonical())

    @property
    def blob_size(self) -> int:
        """Bytes of the blob (a multiple of 4 KiB)."""
        return sum(c.size for c in self.chunks)

    def offsets(self) -> list[int]:
        """Start offset of every chunk in the blob."""
        out, pos = [], 0
        for c in self.chunks:
            out.append(pos)
            pos += c.size
        return out

    @classmethod
    def parse(cls, data: bytes, digest: str | None = None) -> Manifest:
        """Parse stored manifest bytes, checking them against ``digest`` when given."""
        if digest is not None and sha256(data) != digest:
            raise ImageCorrupt(f"manifest {digest} is corrupt (its bytes hash to {sha256(data)})", digest=digest)
        try:
            manifest = cls.model_validate_json(data)
        except ValueError as exc:
            raise ImageCorrupt(f"manifest {digest or '?'} cannot be parsed: {exc}", digest=digest) from exc
        if manifest.version != FORMAT_VERSION:
            raise ImageCorrupt(f"manifest {digest or '?'} has format version {manifest.version}, "
                              f"this DSec reads {FORMAT_VERSION}", digest=digest)
        return manifest


@dataclass(frozen=True)
class ChunkIndex:
    """Offset -> chunk lookups over a manifest."""

    manifest: Manifest

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", self.manifest.offsets())

    def locate(self, offset: int) -> tuple[int, int]:
        """(chunk index, offset inside that chunk) of blob byte ``offset``."""
        starts: list[int] = self.__dict__["_starts"]
        i = bisect.bisect_right(starts, offset) - 1
        return i, offset - starts[i]

    def start(self, index: int) -> int:
        """Blob offset where chunk ``index`` starts."""
        starts: list[int] = self.__dict__["_starts"]
        return starts[index]


def build_erofs(tree: Path, meta: Path, blob: Path) -> None:
    """Make the EROFS metadata image ``meta`` and data blob ``blob`` of directory ``tree`` (owners kept)."""
    exe = shutil.which("mkfs.erofs")
    if exe is None:
        raise BackendUnavailable("mkfs.erofs is not installed: `apt-get install erofs-utils`", package="erofs-utils")
    argv = [exe, "--quiet", f"--chunksize={_EROFS_CHUNK}", f"--blobdev={blob}", str(meta), str(tree)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DSecError(f"mkfs.erofs failed (exit {proc.returncode}) on {tree}: {proc.stderr.strip()[-2000:]}",
                        command=argv)
    size = blob.stat().st_size if blob.exists() else 0
    if size % BLOCK:
        raise DSecError(f"mkfs.erofs wrote a blob of {size} bytes, not a multiple of {BLOCK}")


def cut_blob(blob: Path) -> Iterator[tuple[str, bytes]]:
    """Yield ``(digest, bytes)`` for the content-defined chunks of ``blob``, in order."""
    buf = bytearray()
    with blob.open("rb") as f:
        while True:
            block = f.read(BLOCK)
            if not block:
                break
            buf += block
            cut = hashlib.sha256(block).digest()[-1] & _CUT_MASK == 0
            if (cut and len(buf) >= _MIN_CHUNK) or len(buf) >= _MAX_CHUNK:
                data = bytes(buf)
                yield sha256(data), data
                buf.clear()
    if buf:
        data = bytes(buf)
        yield sha256(data), data
