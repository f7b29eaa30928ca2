"""Shared fixtures: the base image and the ``root`` marker.

Missing prerequisites skip locally and fail under CI (``CI`` set), always naming the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.backends.base import ImageRef
from dsec.errors import ImageNotFound

IN_CI = bool(os.environ.get("CI"))


def missing(reason: str) -> None:
    """Skip locally, fail in CI: a prerequisite CI must provide is absent."""
    if IN_CI:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def images_dir() -> Path:
    """The image store tests use: ``DSEC_IMAGES``, else ``/var/lib/dsec/images``."""
    return Path(os.environ.get("DSEC_IMAGES") or "/var/lib/dsec/images")


@pytest.fixture(scope="session")
def debian_python_image() -> ImageRef:
    """The ``debian-python`` image from the store (built by ``scripts/setup``)."""
    from dsec.images.store import ImageStore

    try:
        return ImageStore(images_dir()).resolve("debian-python")
    except ImageNotFound:
        missing(f"image debian-python not in {images_dir()}: run ./scripts/setup "
                "(or `dsec image build debian-python`)")
        raise  # unreachable: missing() always raises


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        missing("needs root (run the tests as root: sudo ./scripts/test)")
