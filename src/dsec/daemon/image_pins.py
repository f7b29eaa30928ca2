"""The image versions and snapshot layers each sandbox sits on, pinned in the node's image store while it lives.

Owns the engine's :class:`ImageResolver` contract (and :class:`NoImages`, its stand-in when the store cannot
be used), the ``sandbox id -> image`` and ``-> snapshot layers`` pins, the pinning of either in a worker
thread that survives its caller's cancellation, and the pool's view of which image version a tag names now.
Must never create or destroy sandboxes: the engine says when a sandbox starts and stops holding its pins.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from dsec.backends.base import Backend, ImageRef
from dsec.config import Settings
from dsec.errors import DSecError, ImageNotFound
from dsec.models import ImageInfo, SandboxRecord
from dsec.trajectory.snapshots import SnapshotStore

__all__ = ["ImagePins", "ImageResolver", "NoImages", "pinning", "snapshot_store"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


async def pinning(fn: Callable[[], _T], undo: Callable[[_T], None]) -> _T:
    """``fn()`` (which pins something: an image mount, snapshot layers) in a worker thread. A caller cancelled
    meanwhile cannot stop the thread: what it pinned is given back by ``undo`` once it returns."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def late(done: asyncio.Future[_T]) -> None:
            if not done.cancelled() and done.exception() is None:
                undo(done.result())

        task.add_done_callback(late)
        raise


class ImageResolver(Protocol):
    """What the engine needs of an image source (``dsec.images.node.NodeImages`` implements it).

    ``resolve`` may block (it can mount an image and fetch its metadata): the engine calls it in a thread.
    Resolvers that pin images also offer ``release(ref)`` and ``explain(ref, since)`` (see ``NodeImages``).
    """

    def resolve(self, name: str) -> ImageRef:
        """The image's root and defaults; raises :class:`~dsec.errors.ImageNotFound`."""
        ...

    def list(self) -> builtins.list[ImageInfo]:
        """Every image in the store."""
        ...

    def get(self, name: str) -> ImageInfo:
        """One image; raises :class:`~dsec.errors.ImageNotFound`."""
        ...


class NoImages:
    """Stand-in when the image store cannot be loaded: every lookup says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def resolve(self, name: str) -> ImageRef:
        raise ImageNotFound(f"image {name!r} not found: {self.reason}")

    def list(self) -> builtins.list[ImageInfo]:
        return []

    def get(self, name: str) -> ImageInfo:
        raise ImageNotFound(f"image {name!r} not found: {self.reason}")


def snapshot_store(settings: Settings, images: object) -> SnapshotStore:
    """Snapshots in the node's image store, mounted lazily through its image manager; in another store
    (``DSEC_SNAPSHOT_STORE``), or without the image manager, mounted whole (:class:`EagerLayers`)."""
    from dsec.images.image_store import ImageStore
    from dsec.images.node import NodeImages

    scratch = settings.home / "snapshot-work"
    if isinstance(images, NodeImages) and settings.snapshot_store == settings.image_store:
        return SnapshotStore(images.store, scratch, images)
    return SnapshotStore(ImageStore(settings.images, settings.snapshot_store), scratch)


class ImagePins:
    """Pins of ``images`` (the store) and ``snapshots`` (snapshot layers), per sandbox."""

    def __init__(self, images: ImageResolver, snapshots: SnapshotStore) -> None:
        self.images = images
        self.snapshots = snapshots
        self._refs: dict[str, ImageRef] = {}
        self._layers: dict[str, builtins.list[Path]] = {}
        self._tag_refreshes: dict[str, asyncio.Task[None]] = {}

    # -- resolving ---------------------------------------------------------------------------------------

    def resolve(self, backend: Backend, name: str) -> ImageRef:
        """The backend's own image ``name`` if it has such images (``vm``), else the store's. Blocking."""
        return backend.resolve_image(name) or self.images.resolve(name)

    def repin(self, backend: Backend, record: SandboxRecord) -> ImageRef:
        """Pin again the image version a re-adopted sandbox was made of (by digest: its tag may have moved
        while no daemon ran, and resolving the name would pin the new version, leaving the sandbox's own
        mount unpinned: idle for the reaper, its chunks evictable). Blocking."""
        pin = getattr(self.images, "pin_manifest", None)
        assert record.spec.image is not None
        if record.image_digest and pin is not None and type(backend).resolve_image is Backend.resolve_image:
            root: Path = pin("sha256:" + record.image_digest)
            return ImageRef(name=record.spec.image, rootfs=root, digest=record.image_digest)
        return self.resolve(backend, record.spec.image)

    def resolve_warm(self, backend: Backend, name: str) -> ImageRef | None:
        """:meth:`resolve` without a worker-thread hop when the store's image is mounted and its tag fresh
        (most creates); None otherwise."""
        warm = getattr(self.images, "resolve_warm", None)
        if warm is None or type(backend).resolve_image is not Backend.resolve_image:
            return None
        found: ImageRef | None = warm(name)
        return found

    def known_digest(self, backend: Backend, name: str) -> str | None:
        """The digest (hex) image ``name`` resolved to when last looked up (None: unknown: a backend's own
        images, a directory image, never looked up). Never waits for the store: an answer older than the
        tag's time to live is refreshed in the background (one lookup per image at a time), and the claims
        until it lands use the older answer."""
        if type(backend).resolve_image is not Backend.resolve_image:
            return None
        known = getattr(self.images, "known_digest", None)
        if known is None:
            return None
        digest, fresh = known(name)
        if not fresh and name not in self._tag_refreshes:
            task = asyncio.create_task(self._refresh_tag(name), name=f"dsec-tag-{name}")
            self._tag_refreshes[name] = task
            task.add_done_callback(lambda _t: self._tag_refreshes.pop(name, None))
        return digest  # type: ignore[no-any-return]

    async def _refresh_tag(self, name: str) -> None:
        try:
            await asyncio.to_thread(self.images.current_digest, name)  # type: ignore[attr-defined]
        except DSecError as exc:  # a warm node keeps serving the images it has
            log.debug("image %s: cannot look its tag up (%s); pool members served as they are", name, exc)

    def explain(self, image: ImageRef, since: float) -> DSecError | None:
        """The image-loading error (store down, corrupt chunk, cache full) behind a create that failed, if the
        lazy filesystem recorded one since the create began (``since``, wall clock)."""
        explain = getattr(self.images, "explain", None)
        return explain(image, since) if explain is not None else None

    def stale(self, root: Path) -> str | None:
        """Why the image mount or snapshot layer at ``root`` is dead (None: alive, or the store cannot tell)."""
        stale = getattr(self.images, "stale", None)
        return stale(root) if stale is not None else None

    # -- holding -----------------------------------------------------------------------------------------

    def hold(self, sandbox_id: str, image: ImageRef | None = None, layers: builtins.list[Path] | None = None
             ) -> None:
        """Record that ``sandbox_id`` sits on ``image`` and ``layers`` (already pinned)."""
        if image is not None:
            self._refs[sandbox_id] = image
        if layers is not None:
            self._layers[sandbox_id] = layers

    def image_of(self, sandbox_id: str) -> ImageRef | None:
        return self._refs.get(sandbox_id)

    def layers_of(self, sandbox_id: str) -> builtins.list[Path]:
        return self._layers.get(sandbox_id, [])

    def roots(self, sandbox_id: str) -> builtins.list[Path]:
        """The image mount and snapshot layers a sandbox was made on."""
        ref = self._refs.get(sandbox_id)
        return ([ref.rootfs] if ref is not None else []) + self._layers.get(sandbox_id, [])

    def release_sandbox(self, sandbox_id: str) -> None:
        """Give back everything ``sandbox_id`` held."""
        ref = self._refs.pop(sandbox_id, None)
        if ref is not None:
            self.release(ref)
        self.snapshots.close(self._layers.pop(sandbox_id, []))

    def release(self, ref: ImageRef) -> None:
        """Give back one pin of ``ref``."""
        release = getattr(self.images, "release", None)
        if release is not None:
            release(ref)

    def aclose(self) -> None:
        """Stop the tag lookups in flight (their threads end on their own)."""
        for task in list(self._tag_refreshes.values()):
            task.cancel()
