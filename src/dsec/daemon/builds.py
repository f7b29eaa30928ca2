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
from dsec.images.store import ImageStore
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


MAX_CONTEXT_BYTES = 8 * 1024**3
"""The largest build context a node accepts (a tar)."""


def parse_request(encoded: str, registry_auth: str | None) -> ImageBuildRequest:
    """The build request of ``POST /v1/images/build``: the model as JSON in the ``request`` query parameter,
    registry credentials in the ``X-Registry-Auth`` header (base64url JSON ``{"username", "password"}``),
    never in a URL that proxies log."""
    import base64
    import json

    import pydantic

    from dsec.errors import InvalidRequest

    try:
        request = ImageBuildRequest.model_validate_json(encoded)
    except pydantic.ValidationError as exc:
        raise InvalidRequest(f"invalid build request: {exc.errors()[0].get('msg')} at "
                             f"{'.'.join(str(p) for p in exc.errors()[0].get('loc', ()))}") from None
    if request.password is not None:
        raise InvalidRequest("send the registry password in the X-Registry-Auth header, not the query")
    if registry_auth:
        try:
            auth = json.loads(base64.urlsafe_b64decode(registry_auth + "=" * (-len(registry_auth) % 4)))
            request = request.model_copy(update={"username": str(auth["username"]),
                                                 "password": str(auth.get("password") or "")})
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest("X-Registry-Auth is not base64url JSON with a username") from None
    return request


async def spool_context(chunks: AsyncIterator[bytes]) -> IO[bytes]:
    """The request body (a tar) in a temporary file, rewound; :class:`InvalidRequest` past the size cap."""
    import tempfile

    from dsec.errors import InvalidRequest

    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=64 * 1024**2)  # noqa: SIM115 (returned open)
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_CONTEXT_BYTES:
            spool.close()
            raise InvalidRequest(f"the build context is larger than {MAX_CONTEXT_BYTES} bytes: add a .dockerignore")
        await asyncio.to_thread(spool.write, chunk) if size > 64 * 1024**2 else spool.write(chunk)
    spool.seek(0)
    return spool


async def event_lines(events: AsyncIterator[ImageBuildEvent], context: IO[bytes]) -> AsyncIterator[bytes]:
    """NDJSON of ``events``; closing (the client hung up) closes the build, which cancels it."""
    try:
        async for event in events:
            yield event.model_dump_json().encode() + b"\n"
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        context.close()
