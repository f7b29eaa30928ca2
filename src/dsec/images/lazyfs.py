"""The node's lazy blob filesystem: a FUSE server exposing each mounted image's blob as one read-only file.

Run as its own process (``python -m dsec.images.lazyfs``), started and adopted by
:class:`~dsec.images.node.NodeImages`: pyfuse3 wants trio while the daemon runs asyncio, and a separate
process keeps serving the lower layers of live sandboxes while the daemon restarts.

The mount shows one file per image, named by its manifest's hex digest (the manifest must be in the
node cache's ``manifests/``). A read maps its range onto the manifest's chunks and serves each one from
the :class:`~dsec.images.cache.ChunkCache`, which fetches, verifies and stores it on first use. A chunk
that cannot be had (store unreachable, corrupt twice, cache full) fails the read with ``EIO`` and its
reason is recorded (``--errors``, the daemon's ``lazy/errors/``) for the daemon to report; wrong bytes
are never returned. A blob is known (its manifest parsed, an inode given) from the kernel's first lookup of it
until the kernel forgets it and no file of it is open: the server outlives daemon restarts, and a node looks up
one blob per snapshot layer it mounts. On its way out it unmounts its own mount only: a server replaced while it still
served (its mount detached, a new server mounted on the same path) must not take its successor's down,
which libfuse's unmount by path did. This module never mounts EROFS and never writes to the store.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import os
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from dsec.errors import DSecError
from dsec.images.blob_store import open_store
from dsec.images.cache import ChunkCache
from dsec.images.format import ChunkIndex, Manifest

__all__ = ["LazyFS", "main"]

log = logging.getLogger("dsec.lazyfs")
_TIMEOUT = 3600.0


@dataclass
class _Blob:
    inode: int
    hexdigest: str
    manifest: Manifest
    index: ChunkIndex
    read: set[int] = field(default_factory=set)
    lookups: int = 0
    """The kernel's lookup count: entries replied (lookup, readdir) less those it forgot."""
    opens: int = 0


class LazyFS(pyfuse3.Operations):
    """pyfuse3 operations over the manifests of a :class:`ChunkCache`."""

    def __init__(self, cache: ChunkCache, fetchers: int = 16) -> None:
        super().__init__()
        self.cache = cache
        self._by_name: dict[str, _Blob] = {}
        self._by_inode: dict[int, _Blob] = {}
        self._next_inode = pyfuse3.ROOT_INODE + 1
        self._limiter = trio.CapacityLimiter(fetchers)

    def _blob(self, hexdigest: str) -> _Blob:
        blob = self._by_name.get(hexdigest)
        if blob is None:
            manifest = self.cache.manifest(hexdigest)  # verified against its name
            blob = _Blob(self._next_inode, hexdigest, manifest, ChunkIndex(manifest))
            self._next_inode += 1
            self._by_name[hexdigest] = blob
            self._by_inode[blob.inode] = blob
        return blob

    def _attr(self, inode: int) -> Any:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.entry_timeout = _TIMEOUT
        attr.attr_timeout = _TIMEOUT
        attr.st_uid = attr.st_gid = 0
        if inode == pyfuse3.ROOT_INODE:
            attr.st_mode = stat.S_IFDIR | 0o555
            attr.st_nlink = 2
            attr.st_size = 0
        else:
            blob = self._by_inode[inode]
            attr.st_mode = stat.S_IFREG | 0o444
            attr.st_nlink = 1
            attr.st_size = blob.manifest.blob_size
            attr.st_blksize = 4096
            attr.st_blocks = (attr.st_size + 511) // 512
        return attr

    def _unref(self, blob: _Blob) -> None:
        """Let ``blob`` go once the kernel holds no reference to it (an open file of it, as an EROFS mount's
        device is, always holds one: its forget may still arrive before its release)."""
        if blob.lookups <= 0 and blob.opens <= 0 and self._by_inode.get(blob.inode) is blob:
            del self._by_inode[blob.inode]
            if self._by_name.get(blob.hexdigest) is blob:
                del self._by_name[blob.hexdigest]

    def known(self) -> int:
        """Blobs the server holds (each with its parsed manifest and chunk index)."""
        return len(self._by_inode)

    async def forget(self, inode_list: Any) -> None:
        for inode, nlookup in inode_list:  # (must not raise)
            blob = self._by_inode.get(inode)
            if blob is not None:
                blob.lookups -= nlookup
                self._unref(blob)

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        if inode != pyfuse3.ROOT_INODE and inode not in self._by_inode:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        try:
            blob = self._blob(os.fsdecode(name))
        except (OSError, DSecError):
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        blob.lookups += 1
        return self._attr(blob.inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for blob in sorted(self._by_inode.values(), key=lambda b: b.inode):
            if blob.inode <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, blob.hexdigest.encode(), self._attr(blob.inode), blob.inode):
                return
            blob.lookups += 1  # a readdirplus entry is a lookup to the kernel

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        blob = self._by_inode.get(inode)
        if blob is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        blob.opens += 1
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        blob = self._by_inode[fh]
        end = min(off + size, blob.manifest.blob_size)
        out = bytearray()
        pos = off
        try:
            while pos < end:
                i, inner = blob.index.locate(pos)
                chunk = blob.manifest.chunks[i]
                take = min(chunk.size - inner, end - pos)
                out += await trio.to_thread.run_sync(self.cache.read, chunk.digest, chunk.size, inner, take,
                                                     limiter=self._limiter)
                if i not in blob.read:
                    blob.read.add(i)
                    # A prefetch hint: a full cache disk must not fail the read (nor hide why others failed).
                    with contextlib.suppress(OSError), open(self.cache.root / "access" / blob.hexdigest, "a") as f:
                        f.write(f"{i}\n")
                pos += take
        except DSecError as exc:
            log.error("image %s: read at %d failed: %s", blob.hexdigest[:12], pos, exc.message)
            self.cache.record_error(blob.hexdigest, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as exc:
            log.error("image %s: read at %d failed: %s", blob.hexdigest[:12], pos, exc)
            self.cache.record_error(blob.hexdigest, DSecError(f"reading the node cache failed: {exc}"))
            raise pyfuse3.FUSEError(errno.EIO) from None
        return bytes(out)

    async def release(self, fh: int) -> None:
        blob = self._by_inode.get(fh)
        if blob is not None:
            blob.opens -= 1
            self._unref(blob)

    async def releasedir(self, fh: int) -> None:
        return None


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    pyfuse3.terminate()
                    return

        nursery.start_soon(stop_on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def _mount_id(mountpoint: str) -> str | None:
    """The device (``major:minor``) of the mount on top of ``mountpoint`` in this process's mount table: a FUSE
    connection's own number, read without a request to the server (a ``stat`` there would wait for it)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == mountpoint:
                found = fields[2]  # later lines are mounted over earlier ones
    return found


def _unmount_own(mountpoint: str, own: str | None) -> None:
    if own is not None and _mount_id(mountpoint) == own:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(os.fsencode(mountpoint), 2) != 0:  # MNT_DETACH: EROFS mounts may still hold a file
            log.warning("unmounting %s failed: %s", mountpoint, os.strerror(ctypes.get_errno()))


def main(argv: list[str] | None = None) -> int:
    """Mount the lazy filesystem and serve it until unmounted or signalled."""
    parser = argparse.ArgumentParser(prog="python -m dsec.images.lazyfs", description=__doc__)
    parser.add_argument("--mountpoint", required=True, type=Path)
    parser.add_argument("--cache", required=True, type=Path, help="node chunk cache directory")
    parser.add_argument("--store", required=True, help="image store URL")
    parser.add_argument("--limit", type=int, default=None, help="cache size limit in bytes")
    parser.add_argument("--min-free", type=int, default=0, help="bytes kept free on the cache's disk by evicting")
    parser.add_argument("--errors", type=Path, default=None,
                        help="where read errors are recorded for the daemon (default: <cache>/errors)")
    parser.add_argument("--ready-fd", type=int, default=None, help="write one byte here once mounted")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lazyfs %(levelname)s %(message)s")
    cache = ChunkCache(args.cache, open_store(args.store), limit=args.limit, errors=args.errors,
                       min_free=args.min_free)
    ops = LazyFS(cache)
    options = set(pyfuse3.default_options) | {"fsname=dsec-lazy", "ro", "allow_other"}
    mountpoint = os.path.realpath(args.mountpoint)  # before the mount: a stat there would wait for this server
    pyfuse3.init(ops, str(args.mountpoint), options)
    own = _mount_id(mountpoint)
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    try:
        trio.run(_serve)
    finally:
        _unmount_own(mountpoint, own)
        pyfuse3.close(unmount=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
