"""The microvm backend's EROFS copy of an image root: one file per image content, shared by every home."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.backends.base import ImageRef
from dsec.backends.microvm import MicroVMBackend
from dsec.config import Settings

pytestmark = pytest.mark.root


def tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("guest\n")
    return root


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="mkfs.erofs is not installed")
async def test_a_chunked_image_is_built_once_for_every_home(tmp_path: Path) -> None:
    guest = tmp_path / "guest"
    (guest / "rootfs").mkdir(parents=True)
    one = MicroVMBackend(Settings(home=tmp_path / "home1"), guest_dir=guest)
    two = MicroVMBackend(Settings(home=tmp_path / "home2"), guest_dir=guest)
    # The same image content mounted at two places (each home mounts its images under its own path).
    a = ImageRef(name="img", rootfs=tree(tmp_path / "mnt1"), digest="ab" * 32)
    b = ImageRef(name="img", rootfs=tree(tmp_path / "mnt2"), digest="ab" * 32)
    first = await one.profile.base_disk(a)
    inode = first.stat().st_ino
    assert await two.profile.base_disk(b) == first and first.stat().st_ino == inode  # not built again
    # Other content, or a directory image (named by its path), gets a file of its own.
    other = await two.profile.base_disk(ImageRef(name="img", rootfs=a.rootfs, digest="cd" * 32))
    plain = await two.profile.base_disk(ImageRef(name="img", rootfs=b.rootfs))
    assert len({first, other, plain}) == 3
    assert sorted(p.name for p in (guest / "rootfs").iterdir()) == sorted(p.name for p in (first, other, plain))
