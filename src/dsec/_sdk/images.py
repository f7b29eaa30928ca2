"""Building images from the SDK: a Dockerfile and its context sent to the node, its output streamed back.

Owns what the SDK adds to the node API's ``build_image`` and ``pull_image``: packing the context directory
as a tar (in a worker thread, into a temporary file), deciding whether the Dockerfile travels inside the
context or beside it, and reading the event stream into output lines and the stored image. It must
never interpret a Dockerfile (the node's builder does, ``.dockerignore`` included) nor spell a route.
"""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from dsec.api.operations import close_stream
from dsec.errors import DSecError, InvalidRequest
from dsec.models import ImageBuildRequest, ImageInfo, ImagePullRequest

from .client import Client

__all__ = ["build_image", "pull_image"]


def _pack(context: Path) -> IO[bytes]:
    """The context directory as a tar in a temporary file, rewound (symlinks as links, never followed)."""
    spool = tempfile.TemporaryFile()  # noqa: SIM115 (returned open)
    try:
        with tarfile.open(fileobj=spool, mode="w") as tar:
            tar.add(context, arcname=".", recursive=True)
    except OSError as exc:
        spool.close()
        raise InvalidRequest(f"cannot pack the build context {context}: {exc}", path=str(context)) from None
    spool.seek(0)
    return spool


def _request(context: Path, dockerfile: str | os.PathLike[str] | None, fields: dict[str, object]
             ) -> ImageBuildRequest:
    """The request; a Dockerfile outside the context travels as text, one inside it by its path."""
    path = Path(dockerfile) if dockerfile is not None else context / "Dockerfile"
    path = path.resolve()
    if not path.is_file():
        raise InvalidRequest(f"no Dockerfile at {path}", path=str(path))
    if path.is_relative_to(context):
        return ImageBuildRequest.model_validate({**fields, "dockerfile": str(path.relative_to(context))})
    return ImageBuildRequest.model_validate({**fields, "dockerfile_text": path.read_text()})


async def build_image(client: Client, context: str | os.PathLike[str], dockerfile: str | os.PathLike[str] | None,
                      fields: dict[str, object], output: Callable[[str], None] | None) -> ImageInfo:
    """Build the image of ``fields`` (an :class:`ImageBuildRequest`'s, but the Dockerfile) on the client's node
    (see :meth:`dsec.AsyncSandbox.build_image`)."""
    name = fields["name"]
    root = Path(context).resolve()
    if not root.is_dir():
        raise InvalidRequest(f"build context {root} is not a directory", path=str(root))
    request = _request(root, dockerfile, fields)
    tar = await asyncio.to_thread(_pack, root)
    try:
        events = client.api.build_image(request, tar)
        try:
            async for event in events:  # an ``error`` event is raised by the client
                if event.type == "output" and output is not None and event.line is not None:
                    output(event.line)
                elif event.type == "done" and event.image is not None:
                    return event.image
        finally:
            await close_stream(events)
    finally:
        tar.close()
    raise DSecError(f"the node's build stream for {name!r} ended without a result")



async def pull_image(client: Client, reference: str, *, name: str | None = None, insecure: bool = False,
                     username: str | None = None, password: str | None = None, replace: bool = False) -> ImageInfo:
    """Pull ``reference`` into the client's node's store (see :meth:`dsec.AsyncSandbox.pull_image`)."""
    request = ImagePullRequest(reference=reference, name=name, insecure=insecure, username=username,
                               password=password, replace=replace)
    return await client.api.pull_image(request)
