"""``dsec image build-vm NAME --from IMAGE``: a VM disk built from a DSec image's root (its files, its owners,
its own apt adding the kernel, systemd and the agent), then booted by the vm backend.

The build downloads Debian packages through the host's apt sources and the boot is minutes under TCG: one
build and one boot for the whole file.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import missing
from container_support import short_home
from dsec.backends.base import ImageRef
from dsec.backends.vm import VMBackend
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest
from dsec.guest.vmimage import build_vm_image, find_vm_image
from dsec.images.node import NodeImages
from dsec.models import ExecRequest
from dsec.testing import sandbox

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

SOURCE = "debian-python"
"""The base image ./scripts/setup imports (python3, git, build-essential; stored with shifted owners)."""


@pytest.fixture(scope="module")
def source() -> Iterator[ImageRef]:
    """The image's root as ``dsec image build-vm --from`` reads it: a chunked image (as ./scripts/setup stores
    it now) mounted lazily by the node's images, released after."""
    images = NodeImages(Settings(), prefetch=False)
    try:
        ref = images.resolve(SOURCE)
    except DSecError as e:
        images.close_idle_sync()
        missing(f"{SOURCE}: {e}")
        raise
    try:
        yield ref
    finally:
        images.release(ref)
        images.close_idle_sync()


@pytest.fixture(scope="module")
def vm_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-vmfrom-", dir="/tmp"))
    path.chmod(0o755)  # QEMU runs as nobody and opens the image's disk under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_refuses_an_image_without_apt(vm_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    (bare / "bin").mkdir(parents=True)
    with pytest.raises(InvalidRequest, match="no /usr/bin/apt-get: build-vm --from needs a Debian-based image"):
        build_vm_image("bare-vm", source=ImageRef(name="bare", rootfs=bare), vm_dir=vm_dir)
    (bare / "usr/bin").mkdir(parents=True)
    for tool in ("apt-get", "dpkg"):
        (bare / "usr/bin" / tool).touch()
    with pytest.raises(InvalidRequest, match="invalid Debian package name 'no spaces'"):
        build_vm_image("bad-pkg", packages=["no spaces"], source=ImageRef(name="bare", rootfs=bare), vm_dir=vm_dir)
    assert list((vm_dir / "images").iterdir()) == []  # the build directory went away


async def test_built_from_an_image_boots_with_its_files_and_owners(source: ImageRef, vm_dir: Path) -> None:
    img = build_vm_image("from-python", packages=["sudo"], source=source, vm_dir=vm_dir, disk_bytes=3 * 1024**3)
    assert img.meta["from"] == SOURCE and not img.desktop
    home = short_home("dsec-fvmf-")
    backend = VMBackend(Settings(home=home), vm_dir=vm_dir)
    await backend.start()
    try:
        image = backend.resolve_image("from-python")
        async with sandbox(backend, image, disk=3 * 1024**3) as sb:
            r = await backend.exec(sb, ExecRequest(command=(
                "readlink /proc/1/exe; gcc --version | head -1; git --version; "
                "stat -c '%U:%G %a' /etc/shadow /usr/bin/chage /usr/bin/gpasswd /root /usr/bin/sudo; "
                "mkdir -p /mnt/r && mount --bind / /mnt/r && test -e /mnt/r/run/dsec-apt; echo apt=$?; "
                "test -e /usr/sbin/policy-rc.d; echo policy=$?; umount /mnt/r")))
            lines = r.stdout.decode().splitlines()
            assert lines[0].endswith("/systemd"), r  # it booted the init apt installed into the image
            assert lines[1].startswith("gcc") and lines[2].startswith("git version"), r  # the image's own files
            # real owners (the store keeps them shifted by 100000 for user namespaces), set-id bits kept; the
            # extra package installed
            assert lines[3:8] == ["root:shadow 640", "root:shadow 2755", "root:root 4755", "root:root 700",
                                  "root:root 4755"], r
            # the build's apt configuration and policy-rc.d did not stay in the image (its /run under the tmpfs)
            assert lines[8:] == ["apt=1", "policy=1"], r
    finally:
        await backend.cleanup_orphans(set())
        await backend.aclose()
        shutil.rmtree(home, ignore_errors=True)
    assert find_vm_image("from-python", vm_dir).disk.is_file()
