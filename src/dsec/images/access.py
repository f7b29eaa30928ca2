"""Access records and prefetch: which chunks of an image a node read first, kept in the store, and replayed.

Owns the store's ``access/<digest>`` records (the chunk order a node's first start of an image read, uploaded
once), the background threads that fetch that order into the node's chunk cache on a later start, and the
images' one background worker (work a caller must not wait for: an unpin that would block on a mount in
progress, an upload to a store that hangs). It must never mount, unmount or evict anything.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from dsec.errors import DSecError
from dsec.images.blob_store import BlobStore
from dsec.images.cache import ChunkCache
from dsec.images.format import Manifest

__all__ = ["AccessRecords", "Background"]

log = logging.getLogger("dsec.images")
_SAVED_KEPT = 1024
"""Images whose saved access record a node remembers (one it forgot costs a question to the store)."""


class Background:
    """One thread that runs queued work in order, started when there is work and gone when idle: a burst of
    destroys during a mount, or a store that hangs, queues work instead of threads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread (its exceptions are logged)."""
        with self._lock:
            self._jobs.append((fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                fn, args = self._jobs.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("images: background %s failed", getattr(fn, "__name__", fn))


class AccessRecords:
    """The access records of one node's images and the prefetch threads that replay them."""

    def __init__(self, blobs: BlobStore, cache: ChunkCache) -> None:
        self.blobs, self.cache = blobs, cache
        self._saved: dict[str, None] = {}  # images whose access record the store has (the latest, in order)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def saved(self, hexdigest: str) -> bool:
        """The store is known to hold the record of this image (no need to ask it again)."""
        return hexdigest in self._saved

    def save(self, hexdigest: str) -> None:
        """Upload the chunk order this node read, if the store has no record for the image yet (asked once
        per image and daemon once it is there)."""
        if hexdigest in self._saved:
            return
        key = f"access/{hexdigest}"
        order = self.cache.access(hexdigest)
        if not order:
            return
        try:
            if not self.blobs.has(key):
                self.blobs.put(key, json.dumps(order).encode())
            self._saved[hexdigest] = None
            if len(self._saved) > _SAVED_KEPT:  # a snapshot layer's, most of them: mounted once, never again
                self._saved.pop(next(iter(self._saved)), None)
        except DSecError as exc:
            log.warning("could not save the access record of image %s: %s", hexdigest[:12], exc)

    def prefetch(self, manifest: Manifest, hexdigest: str) -> None:
        """Fetch, in the background, the chunks the image's record names, in its order (nothing without one)."""
        try:
            raw = self.blobs.get(f"access/{hexdigest}")
            order = [int(i) for i in json.loads(raw)]
        except (KeyError, ValueError, TypeError, DSecError):
            return
        digests = [manifest.chunks[i].digest for i in order if 0 <= i < len(manifest.chunks)]
        t = threading.Thread(target=self._fetch, args=(digests,), daemon=True, name=f"prefetch-{hexdigest[:8]}")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _fetch(self, digests: list[str]) -> None:
        for digest in digests:
            if self._stop.is_set():
                return
            try:
                self.cache.ensure(digest)
            except (DSecError, OSError) as exc:  # (the cache gone or unwritable: reads will say so, not this thread)
                log.warning("prefetch stopped: %s", exc)
                return

    def stop(self, within: float = 30.0) -> None:
        """Stop prefetching: each thread ends after the chunk it is fetching (waited for up to ``within`` s)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=within)
        self._threads.clear()
