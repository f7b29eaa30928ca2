"""``ImageRef``: a resolved image, as the image store hands it to backends and guest builders.

Owns nothing but the reference (where the root is, its owners' shift, its defaults, its content identity);
must never resolve or mount an image itself: :mod:`dsec.images.image_store` and :mod:`dsec.images.node` do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsec.models import ImageConfig

__all__ = ["ImageRef"]


@dataclass(frozen=True)
class ImageRef:
    """A resolved image: where its root filesystem is and the defaults it gives sandboxes."""

    name: str
    rootfs: Path
    """Read-only root directory (ownership already shifted by ``uid_shift``)."""
    uid_shift: int = 0
    """Host uid of the image's uid 0."""
    config: ImageConfig = field(default_factory=ImageConfig)
    digest: str | None = None
    """The image's content identity (a chunked image's manifest digest), the same on every node and home;
    None when only its ``rootfs`` path names it (a directory image)."""
