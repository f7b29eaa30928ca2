"""LazyFS's table of blobs: a blob is kept from the kernel's first lookup of it until the kernel forgets it and no
file of it is open (the server outlives daemons; a node looks up one blob per snapshot layer it mounts)."""

from __future__ import annotations

import errno
import os
from typing import Any

import pyfuse3
import pytest
import trio

from dsec.images.format import ChunkRef, Manifest, sha256
from dsec.images.lazyfs import LazyFS
from dsec.models import ImageInfo

ROOT = pyfuse3.ROOT_INODE


def manifest_of(data: bytes) -> Manifest:
    info = ImageInfo(name="x", created_at=0, size_bytes=0, files=0, source="t", uid_shift=0)
    return Manifest(info=info, meta_digest=sha256(b"m"), meta_size=1,
                    chunks=[ChunkRef(digest=sha256(data), size=len(data))])


class Cache:
    """The one ChunkCache call a lookup makes."""

    def __init__(self, *manifests: Manifest) -> None:
        self.manifests = {m.digest[7:]: m for m in manifests}

    def manifest(self, hexdigest: str) -> Manifest:
        try:
            return self.manifests[hexdigest]
        except KeyError:
            raise FileNotFoundError(hexdigest) from None


def run(test: Any) -> None:
    trio.run(test)


def test_a_blob_goes_once_the_kernel_forgot_every_lookup_of_it() -> None:
    image = manifest_of(b"a" * 4096)
    name = image.digest[7:].encode()

    async def main() -> None:
        fs = LazyFS(Cache(image))  # type: ignore[arg-type]
        first = await fs.lookup(ROOT, name)
        again = await fs.lookup(ROOT, name)  # a revalidation: one more reference
        assert first.st_ino == again.st_ino and fs.known() == 1
        await fs.forget([(first.st_ino, 1)])
        assert fs.known() == 1, "the kernel still holds one lookup"
        assert (await fs.getattr(first.st_ino)).st_size == 4096
        await fs.forget([(first.st_ino, 1)])
        assert fs.known() == 0
        with pytest.raises(pyfuse3.FUSEError) as info:
            await fs.getattr(first.st_ino)
        assert info.value.errno == errno.ENOENT
        later = await fs.lookup(ROOT, name)  # looked up afresh: a new inode (never a reused number)
        assert later.st_ino != first.st_ino and fs.known() == 1
        await fs.forget([(later.st_ino, 1), (12345, 3)])  # an inode it never gave: ignored, not raised
        assert fs.known() == 0

    run(main)


def test_a_blob_open_is_kept_after_its_forget_until_its_release() -> None:
    """What an EROFS mount's device is: the kernel holds the file open for as long as it is mounted (its forget
    may still come first: forgets are queued ahead of other requests)."""
    image, other = manifest_of(b"a" * 4096), manifest_of(b"b" * 8192)

    async def main() -> None:
        fs = LazyFS(Cache(image, other))  # type: ignore[arg-type]
        attr = await fs.lookup(ROOT, image.digest[7:].encode())
        handle = await fs.open(attr.st_ino, os.O_RDONLY, None)
        await fs.lookup(ROOT, other.digest[7:].encode())
        await fs.forget([(attr.st_ino, 1)])
        assert fs.known() == 2, "an open blob was dropped"
        assert (await fs.getattr(attr.st_ino)).st_size == 4096
        await fs.release(handle.fh)
        assert fs.known() == 1
        with pytest.raises(pyfuse3.FUSEError):
            await fs.open(attr.st_ino, os.O_RDONLY, None)

    run(main)


def test_a_lookup_of_what_is_not_there_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog's probe (a name that exists nowhere) leaves no entry; a readdirplus entry counts as a lookup."""
    image = manifest_of(b"a" * 4096)

    async def main() -> None:
        fs = LazyFS(Cache(image))  # type: ignore[arg-type]
        with pytest.raises(pyfuse3.FUSEError):
            await fs.lookup(ROOT, b"probe-0123456789abcdef")
        assert fs.known() == 0
        attr = await fs.lookup(ROOT, image.digest[7:].encode())
        listed: list[bytes] = []
        monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, attr, next_id: listed.append(name) or True)
        await fs.readdir(ROOT, 0, None)
        assert listed == [image.digest[7:].encode()]
        await fs.forget([(attr.st_ino, 1)])
        assert fs.known() == 1, "the entry the listing returned is a reference of the kernel's"
        await fs.forget([(attr.st_ino, 1)])
        assert fs.known() == 0

    run(main)
