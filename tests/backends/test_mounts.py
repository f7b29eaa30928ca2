"""Detached sandbox mounts and the mount holder (dsec.isolation.mounts), with real mounts and namespaces."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_support import mounts_under, pid_alive
from dsec.errors import SandboxError
from dsec.isolation.binaries import ensure_rtshim
from dsec.isolation.mounts import MountHolder, attach, clone_tree, overlay_mount, sysfs_mount, tmpfs_mount

pytestmark = [pytest.mark.root]


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[MountHolder]:
    h = MountHolder(ensure_rtshim(tmp_path / "bin"), tmp_path / "mntns.pid", "t" + tmp_path.name[-7:])
    h.start()
    try:
        yield h
    finally:
        h.close(stop=True)
    assert not pid_alive(h.pid or 0)


def test_mounts_live_in_the_holder_only(holder: MountHolder, tmp_path: Path) -> None:
    (tmp_path / "lower").mkdir()
    (tmp_path / "lower" / "image-file").write_text("from the image")
    target = tmp_path / "root"
    target.mkdir()
    disk = tmpfs_mount(1 << 20)
    try:
        os.mkdir(f"/proc/self/fd/{disk}/upper")
        os.mkdir(f"/proc/self/fd/{disk}/work")
        root = overlay_mount([str(tmp_path / "lower")], f"/proc/self/fd/{disk}/upper", f"/proc/self/fd/{disk}/work")
        try:
            Path(f"/proc/self/fd/{root}/new").write_text("written")
            holder.run(attach, root, str(target))
        finally:
            os.close(root)
    finally:
        os.close(disk)
    assert not mounts_under(str(target)), "the overlay landed in the host's mount table"
    assert not any(target.iterdir())
    view = Path(holder.view(str(target)))
    assert (view / "image-file").read_text() == "from the image" and (view / "new").read_text() == "written"
    held = [line for line in Path(f"/proc/{holder.pid}/mountinfo").read_text().splitlines()
            if line.split()[4] == str(target)]
    assert len(held) == 1 and " - overlay overlay " in held[0] and "nosuid" in held[0].split()[5], held
    clone = holder.run(clone_tree, str(target))
    try:
        assert Path(f"/proc/self/fd/{clone}/new").read_text() == "written"
    finally:
        os.close(clone)
    holder.umount(str(target), str(tmp_path / "never-mounted"))
    assert not any(view.iterdir()) if view.exists() else True
    assert not [line for line in Path(f"/proc/{holder.pid}/mountinfo").read_text().splitlines()
                if line.split()[4] == str(target)]


def test_read_only_clone_refuses_writes(holder: MountHolder, tmp_path: Path) -> None:
    (tmp_path / "image").mkdir()
    ro = clone_tree(str(tmp_path / "image"), readonly=True)
    try:
        with pytest.raises(OSError, match="Read-only"):
            Path(f"/proc/self/fd/{ro}/x").write_text("no")
    finally:
        os.close(ro)


def test_bad_layers_name_the_cause(tmp_path: Path) -> None:
    disk = tmpfs_mount(1 << 20)
    try:
        upper, work = f"/proc/self/fd/{disk}/upper", f"/proc/self/fd/{disk}/work"
        os.mkdir(upper)
        os.mkdir(work)
        with pytest.raises(SandboxError, match=r"lowerdir\+=/no/such/layer"):
            overlay_mount(["/no/such/layer"], upper, work)
        with pytest.raises(SandboxError, match="longer than the kernel's 255-byte"):
            overlay_mount(["/" + "x" * 300], upper, work)
    finally:
        os.close(disk)
    with pytest.raises(SandboxError, match="cloning the mounts at /no/such/image"):
        clone_tree("/no/such/image")
    with pytest.raises(SandboxError, match="option size=-1"):
        tmpfs_mount(-1)


def test_holder_is_adopted_and_a_stale_pidfile_is_not(tmp_path: Path) -> None:
    shim = ensure_rtshim(tmp_path / "bin")
    pidfile = tmp_path / "mntns.pid"
    pidfile.write_text(f"{os.getpid()} 1\n")  # a live process that is no holder: never adopted (nor killed)
    first = MountHolder(shim, pidfile, "tadopt1")
    first.start()
    try:
        assert first.pid != os.getpid()
        first.close(stop=False)  # a daemon going away with sandboxes left: the holder stays
        assert pid_alive(int(pidfile.read_text().split()[0]))
        second = MountHolder(shim, pidfile, "tadopt1")
        second.start()
        assert second.pid == int(pidfile.read_text().split()[0])
        second.close(stop=True)
        assert not pidfile.exists()
        other = MountHolder(shim, pidfile, "tadopt2")
        other.start()  # another home's tag never adopts it
        other.close(stop=True)
    finally:
        first.close(stop=True)
    assert pid_alive(os.getpid())


def test_the_node_sysfs_lists_no_network_device_when_returned() -> None:
    """Its network namespace ended with the thread that made it; the kernel drops that namespace's loopback from
    the listing a moment later (CI46 once started a sandbox that still saw it)."""
    for _ in range(20):
        fd = sysfs_mount()
        try:
            assert os.listdir(f"/proc/self/fd/{fd}/class/net") == []
            assert os.listdir(f"/proc/self/fd/{fd}/class")  # a real sysfs, not an empty directory
        finally:
            os.close(fd)
