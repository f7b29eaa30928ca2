"""The wire models of images: their config, pull and build requests, build events and listings.

Owns ``ImageConfig``, ``ImagePullRequest``, ``ImageInfo``, ``ImageBuildRequest`` and ``ImageBuildEvent``.
Must never touch the image store (``dsec.images``); no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from dsec.models.common import Model


class ImageConfig(Model):
    """Defaults an image gives its sandboxes."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment (``PATH`` etc.)."""
    workdir: str | None = None
    """Working directory."""
    user: str | None = None
    """User to run as (``uid[:gid]``)."""
    entrypoint: list[str] | None = None
    """OCI entrypoint (kept for reference)."""
    cmd: list[str] | None = None
    """OCI cmd (kept for reference)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """OCI labels (``LABEL`` in a Dockerfile); DSec reads only its own ``dsec.*`` keys (``dsec.e2b.sudo``:
    docs/integrations/e2b.md)."""


class ImagePullRequest(Model):
    """Pull an image from an OCI registry into the node's store."""

    reference: str = Field(min_length=1, max_length=1024)
    """``[host[:port]/]repo[:tag][@sha256:...]``."""
    name: str | None = None
    """Name in the store (default: the repository's last part, plus ``-TAG``)."""
    insecure: bool = False
    """Plain HTTP (a registry on loopback without TLS)."""
    username: str | None = None
    """Registry user (basic or token auth)."""
    password: str | None = Field(None, repr=False)
    """Registry password; never logged or stored."""
    replace: bool = False
    """Replace an existing image of that name."""


class ImageInfo(Model):
    """An image in the node's store."""

    name: str
    """Name used by ``Sandbox.create(image=...)``."""
    created_at: float
    """Import time (Unix seconds)."""
    size_bytes: int
    """Bytes of file data."""
    files: int
    """Number of filesystem entries."""
    source: str
    """Where it came from (``dir:/path``, ``mmdebstrap:...``)."""
    uid_shift: int
    """Host uid that the image's uid 0 is stored as (user-namespace shift)."""
    config: ImageConfig = Field(default_factory=ImageConfig)
    """Sandbox defaults."""


class ImageBuildRequest(Model):
    """Build an image from a Dockerfile into the node's store (the build context travels beside it)."""

    name: str = Field(min_length=1, max_length=128)
    """Name in the store."""
    dockerfile: str = "Dockerfile"
    """The Dockerfile's path inside the context (ignored when ``dockerfile_text`` is given)."""
    dockerfile_text: str | None = Field(None, max_length=1024 * 1024)
    """The Dockerfile itself, for one that lives outside the context (``docker build -f ../Dockerfile``)."""
    build_args: dict[str, str] = Field(default_factory=dict)
    """``ARG`` values (``--build-arg K=V``)."""
    target: str | None = None
    """The stage to build (``--target``); default the last."""
    network: Literal["private", "none"] = "private"
    """``RUN`` steps' network: a private one with outbound access and no route to the host's loopback, or
    none at all."""
    no_cache: bool = False
    """Build every step again instead of reusing the layer cache."""
    insecure: bool = False
    """Pull ``FROM`` images over plain HTTP / without TLS verification (a registry on loopback)."""
    username: str | None = None
    """Registry user for ``FROM`` images of a registry that needs one."""
    password: str | None = Field(None, repr=False)
    """Registry password; never logged, stored, or put on a command line."""
    replace: bool = False
    """Replace an existing image of that name."""

    @field_validator("build_args")
    @classmethod
    def _args(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"build arg {key!r} is not a valid ARG name")
        return v


class ImageBuildEvent(Model):
    """One item of a streamed build: the builder's output lines, then exactly one ``done`` (or ``error``)."""

    type: Literal["output", "done", "error"]
    """Kind of event."""
    line: str | None = None
    """A line of the builder's output (``output``)."""
    image: ImageInfo | None = None
    """The image as stored (``done``)."""
    error: dict[str, Any] | None = None
    """Error payload (as in HTTP errors) for ``error``."""
