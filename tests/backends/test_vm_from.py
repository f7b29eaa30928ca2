"""The vm backend on any DSec image: ``image="debian-python", backend="vm"`` boots a disk derived from the image on
its first use (as ``dsec image build-vm NAME --from IMAGE`` builds one: the image's files and owners, its own apt
adding the kernel, systemd and the agent), kept per image content, and refused with a reason for an image that
cannot boot.

The builds download Debian packages through the host's apt sources and a boot is a minute or more under TCG: one
derived disk and one boot (plus one explicit build, checked without booting) for the whole file.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

import dsec
from conftest import missing
from container_support import daemon_process, images_dir, short_home
from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.demo import rollout
from dsec.errors import DSecError, InvalidRequest
from dsec.guest.vmderive import derive_vm_image, derived_state, image_backends, source_identity
from dsec.guest.vmimage import build_vm_image
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

SOURCE = "debian-python"
"""The base image ./scripts/setup imports (python3, git, build-essential; stored with shifted owners)."""


@pytest.fixture(scope="module")
def source() -> Iterator[ImageRef]:
    """The image's root as the vm backend reads it: a chunked image (as ./scripts/setup stores it now) mounted
    lazily by the node's images, released after."""
    home = short_home("dsec-vmsrc-")  # never the default home: a daemon there owns its mounts
    images = NodeImages(Settings(home=home, images_dir=images_dir()), prefetch=False)
    try:
        ref = images.resolve(SOURCE)
    except DSecError as e:
        images.aclose_sync(unmount=True)
        shutil.rmtree(home, ignore_errors=True)
        missing(f"{SOURCE}: {e}")
        raise
    try:
        yield ref
    finally:
        images.release(ref)
        images.aclose_sync(unmount=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def vm_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-vmfrom-", dir="/tmp"))
    path.chmod(0o755)  # QEMU runs as nobody and opens the image's disk under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fake_debian(root: Path, machine: int | None = None) -> ImageRef:
    """A tree with an apt-get and a dpkg (ELF headers for ``machine``, e.g. 183 = aarch64, when given)."""
    (root / "usr/bin").mkdir(parents=True)
    for tool in ("apt-get", "dpkg"):
        head = b"" if machine is None else b"\x7fELF\x02\x01\x01" + bytes(11) + machine.to_bytes(2, "little")
        (root / "usr/bin" / tool).write_bytes(head + bytes(64))
    return ImageRef(name=root.name, rootfs=root)


def test_images_that_cannot_boot_are_refused_naming_them(vm_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    (bare / "bin").mkdir(parents=True)
    with pytest.raises(InvalidRequest, match=r"image 'bare' cannot boot as a vm: it has no /usr/bin/apt-get"):
        build_vm_image("bare-vm", source=ImageRef(name="bare", rootfs=bare), vm_dir=vm_dir)
    with pytest.raises(InvalidRequest, match=r"image 'bare' cannot boot as a vm: it has no /usr/bin/apt-get"):
        derive_vm_image(ImageRef(name="bare", rootfs=bare), vm_dir)
    # kept: the image's content cannot change under its identity, and `dsec image ls` says why
    assert derived_state(source_identity(ImageRef(name="bare", rootfs=bare)), vm_dir) == \
        "cannot boot: no /usr/bin/apt-get"
    arm = fake_debian(tmp_path / "arm", machine=183)
    with pytest.raises(InvalidRequest, match=r"image 'arm' cannot boot here: its binaries are for aarch64, this host "
                                             r"runs x86_64 guests"):
        derive_vm_image(arm, vm_dir)
    with pytest.raises(InvalidRequest, match="invalid Debian package name 'no spaces'"):
        build_vm_image("bad-pkg", packages=["no spaces"], source=fake_debian(tmp_path / "plain"), vm_dir=vm_dir)
    assert list((vm_dir / "images").iterdir()) == []  # the build directory went away
    assert not list((vm_dir / "derived").glob("*/"))  # nothing was built for the refused ones


def _stat(raw: Path, path: str) -> str:
    """``UID:GID MODE`` of ``path`` in the ext4 filesystem ``raw`` (debugfs: no mount, no boot), or ``missing``."""
    proc = subprocess.run(["debugfs", "-R", f"stat {path}", str(raw)], capture_output=True, text=True, check=False)
    if "File not found by ext2_lookup" in proc.stdout + proc.stderr:
        return "missing"
    owners = re.search(r"User:\s+(\d+)\s+Group:\s+(\d+)", proc.stdout)
    mode = re.search(r"Mode:\s+(\d+)", proc.stdout)
    assert owners and mode, proc.stdout + proc.stderr
    return f"{owners[1]}:{owners[2]} {int(mode[1], 8) & 0o7777:o}"


def test_build_vm_from_an_image_keeps_its_files_owners_and_adds_the_packages(source: ImageRef, vm_dir: Path,
                                                                            tmp_path: Path) -> None:
    img = build_vm_image("from-python", packages=["sudo"], source=source, vm_dir=vm_dir, disk_bytes=3 * 1024**3)
    assert img.meta["from"] == SOURCE and img.meta["digest"] == source.digest and not img.desktop
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(img.disk), str(raw)], check=True)
    # real owners (the store keeps them shifted by 100000 for user namespaces), set-id bits kept; the extra
    # package installed; the image's own files (gcc from build-essential)
    assert _stat(raw, "/etc/shadow") == "0:42 640"
    assert _stat(raw, "/usr/bin/chage") == "0:42 2755"
    assert _stat(raw, "/usr/bin/gpasswd") == "0:0 4755"
    assert _stat(raw, "/usr/bin/sudo") == "0:0 4755"
    assert _stat(raw, "/usr/bin/gcc-12").startswith("0:0 ")
    # the build's apt configuration and policy-rc.d did not stay in the image; systemd is its init
    assert _stat(raw, "/run/dsec-apt") == "missing" and _stat(raw, "/usr/sbin/policy-rc.d") == "missing"
    assert _stat(raw, "/lib/systemd/systemd") != "missing"
    os.unlink(raw)


def test_any_image_runs_on_vm_and_its_disk_is_derived_once(vm_dir: Path) -> None:
    """`image="debian-python", backend="vm"` through a real daemon: the demo's agent script (the one every backend
    runs) goes from fail to pass; a second create reuses the derived disk."""
    settings = Settings()
    store = ImageStore(settings.images, settings.image_store)
    assert image_backends(store, SOURCE, vm_dir)["vm"] == "on first use"
    with daemon_process("dsec-vmany-", DSEC_VM_DIR=str(vm_dir)) as (url, _), dsec.Client(url) as client:

        async def episode() -> bool:
            async with dsec.Client(url) as aclient:
                return (await rollout("vm", aclient, Console(quiet=True))).ok

        assert asyncio.run(episode()), "the demo rollout did not go from fail to pass on vm"
        assert image_backends(store, SOURCE, vm_dir)["vm"] == "ready"
        [derived] = [d for d in (vm_dir / "derived").iterdir() if d.is_dir()]
        before = (derived / "disk.qcow2").stat()
        with dsec.Sandbox.create(image=SOURCE, backend="vm", client=client) as sb:
            r = sb.exec("readlink /proc/1/exe; python3 -c 'print(6 * 7)'; stat -c '%U:%G %a' /etc/shadow")
            init, answer, owners, mode = r.stdout.decode().split()
            assert init.endswith("/systemd") and (answer, owners, mode) == ("42", "root:shadow", "640"), r
        after = (derived / "disk.qcow2").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "the disk was rebuilt"


def test_a_dead_builds_directory_is_removed_but_never_through_a_mount(tmp_path: Path) -> None:
    from dsec.guest import vmderive

    stale = tmp_path / ".build-x-1"
    (stale / "tree").mkdir(parents=True)
    precious = tmp_path / "image-root"
    precious.mkdir()
    (precious / "file").write_text("the image's")
    subprocess.run(["mount", "--bind", "-o", "ro", str(precious), str(stale / "tree")], check=True)
    try:
        vmderive._remove_stale(stale)
        assert (precious / "file").read_text() == "the image's" and stale.is_dir()
    finally:
        subprocess.run(["umount", str(stale / "tree")], check=True)
    vmderive._remove_stale(stale)
    assert not stale.exists() and (precious / "file").exists()
