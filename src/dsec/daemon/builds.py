"""Dockerfile builds served by the daemon: a blocking build in a worker thread, streamed as events.

Owns the bridge between :func:`dsec.images.dockerfile.build_dockerfile` (blocking: buildah, the export of
base images, the import) and the event loop: each output line becomes an ``output`` event as it is printed,
the stored image a ``done`` event, a failure one ``error`` event. Closing the stream (the client hung up)
cancels the build: buildah is stopped and nothing is stored. It never runs a build on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import IO, Any

from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.errors import DSecError, NotSupported
from dsec.images.image_store import ImageStore
from dsec.models import ImageBuildEvent, ImageBuildRequest, ImageInfo

__all__ = ["build_events"]

log = logging.getLogger(__name__)


class _StoreBases:
    """Base images of a store read as directories (a node without lazy mounts): nothing to release."""

    def __init__(self, store: ImageStore) -> None:
        self.store = store

    def resolve(self, name: str) -> ImageRef:
        return self.store.resolve(name)

    def release(self, ref: ImageRef) -> None:
        pass


def _store_and_bases(images: Any) -> tuple[ImageStore, Any]:
    store = getattr(images, "store", images)
    if not isinstance(store, ImageStore):
        raise NotSupported("this node's image store cannot build images")
    bases = images if hasattr(images, "release") and hasattr(images, "resolve") else _StoreBases(store)
    return store, bases


async def build_events(images: Any, settings: Settings, request: ImageBuildRequest,
                       context: IO[bytes]) -> AsyncIterator[ImageBuildEvent]:
    """Build ``request`` from the tar ``context`` into the node's store; its output lines, then ``done``."""
    from dsec.images.dockerfile import build_dockerfile

    store, bases = _store_and_bases(images)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ImageBuildEvent | None] = asyncio.Queue()
    cancel = threading.Event()

    def emit(line: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ImageBuildEvent(type="output", line=line))

    def run() -> ImageInfo:
        try:
            return build_dockerfile(store, bases, request, context, settings, output=emit, cancel=cancel)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        while (event := await queue.get()) is not None:
            yield event
        try:
            info = await task
        except DSecError as exc:
            yield ImageBuildEvent(type="error", error=exc.to_payload()["error"])
            return
        except Exception as exc:
            log.exception("image build %s failed", request.name)
            err = DSecError(f"building image {request.name!r} failed: {type(exc).__name__}: {exc}")
            yield ImageBuildEvent(type="error", error=err.to_payload()["error"])
            return
        yield ImageBuildEvent(type="done", image=info)
    finally:
        if not task.done():
            cancel.set()
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
