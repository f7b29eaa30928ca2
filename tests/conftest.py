"""Shared fixtures: the base image and the ``root`` marker.

Missing prerequisites skip locally and fail under CI (``CI`` set), always naming the fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_support import images_dir
from dsec.backends.base import ImageRef
from dsec.errors import ImageNotFound

IN_CI = bool(os.environ.get("CI"))


def missing(reason: str) -> None:
    """Skip locally, fail in CI: a prerequisite CI must provide is absent."""
    if IN_CI:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)




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


def _host_footprint() -> set[str]:
    """Mounts under /run/dsec, DSec cgroup directories and dsec-init processes on this host."""
    found = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith("/run/dsec/"):
            found.add(f"mount {point}")
    for cg in Path("/sys/fs/cgroup").glob("*/dsec-*"):
        if cg.is_dir() and not cg.parent.is_symlink():
            found.add(f"cgroup {cg}")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                # A zombie holds no resource; it waits for whichever pid 1 adopted it (a sandbox
                # re-adopted across a daemon restart is no longer the new daemon's child).
                if state != "Z" and (proc / "comm").read_text().strip() == "dsec-init":
                    found.add(f"process dsec-init pid {proc.name}")
            except (OSError, IndexError):
                continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_host_leftovers() -> Iterator[None]:
    """The whole run must leave no mount, cgroup or sandbox process behind, even when tests fail."""
    before = _host_footprint()
    yield
    leaked = sorted(_host_footprint() - before)
    assert not leaked, "tests left host resources behind:\n" + "\n".join(leaked[:50])
