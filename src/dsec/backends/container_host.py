"""Host-side steps of a container sandbox's root: its mounts, the node's shared directories, its init's pidfd.

Owns the plain functions the container backend runs in the mount holder's namespace or on the host
(attaching a sandbox's root and disk, /dev, the node's sysfs clone, the masked and private directories)
and reading the runtime's last error. Must never keep state or know about sandbox records: the backend
(:mod:`dsec.backends.container`) decides what to mount where.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from dsec.errors import BackendUnavailable, SandboxError
from dsec.isolation.mounts import attach, clone_tree
from dsec.isolation.procs import start_time

log = logging.getLogger(__name__)



def attach_sandbox(root_fd: int, disk_fd: int, rootfs: str, disk: str, sysfs: tuple[str, int] | None) -> int:
    """In the holder's namespace: the node's sysfs on the detached root's /sys (``sysfs``: its path and device
    there; read-only, and from the sandbox's user namespace a locked mount), the root on ``rootfs``, the disk
    on ``disk``, /dev and /dev/shm from the disk (:func:`mount_dev`); returns a detached clone of the mounted
    root for the runtime shim. A failure part-way leaves mounts that destroy's unmounts remove."""
    if sysfs is not None:
        fd = clone_node_sysfs(*sysfs)
        try:
            attach(fd, "sys", root_fd)
        finally:
            os.close(fd)
    attach(root_fd, rootfs)
    attach(disk_fd, disk)
    mount_dev(disk, rootfs)
    return clone_tree(rootfs)


def mount_dev(disk: str, rootfs: str) -> None:
    """Bind the disk's ``dev`` on the sandbox's /dev and its ``shm`` on /dev/shm (in the holder's namespace).

    Each tmpfs is a superblock, and superblocks cost kernel memory in every memory cgroup of the node (see
    oci.runtime_config); as directories of the sandbox's disk they cost none, and /dev/shm shares the disk's
    size instead of a fixed 64 MiB of its own. The runtime populates /dev (device nodes bound from the host,
    pts, mqueue) and then makes it read-only (oci.runtime_config)."""
    for source, target, noexec in ((f"{disk}/dev", f"{rootfs}/dev", False), (f"{disk}/shm", f"{rootfs}/dev/shm", True)):
        fd = clone_tree(source, noexec=noexec)  # /dev/shm no-exec, as the runtime's own tmpfs there was
        try:
            attach(fd, target)
        finally:
            os.close(fd)


def clone_node_sysfs(path: str, dev: int) -> int:
    """A read-only clone of the node's sysfs (in the holder's namespace), checked to still be the one mounted
    at start: an empty directory there would give a sandbox an empty /sys without a word."""
    if os.stat(path).st_dev != dev:
        raise SandboxError(f"the node's sysfs is no longer mounted on {path} in the mount holder's namespace; "
                           "restart the daemon")
    return clone_tree(path, readonly=True)


def plain_dir(path: str) -> None:
    """Make ``path`` (in a sandbox's root, before the sandbox runs) a real directory: an image's symlink or file
    there is replaced, so that nothing mounted on it can land outside the root."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return
        os.unlink(path)
    os.mkdir(path, 0o555)


def mask_dir(path: Path) -> None:
    """The empty directory bound over the sandboxes' masked directories: made afresh (root's, 0555) unless the
    one there already is exactly that (its parent is root's /run/dsec; anything else there is removed first)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o555 and not os.listdir(path):
            return
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, 0o700)
            shutil.rmtree(path)
        else:
            os.unlink(path)
    os.mkdir(path, 0o555)
    os.chown(path, 0, 0)
    os.chmod(path, 0o555)


def private_dir(path: Path) -> None:
    """Create ``path`` (0700, ours) in a world-writable directory such as /dev/shm, or check that the one there
    is ours: a directory (not a symlink) owned by this user that nobody else can write or read.

    Anything else there was planted (the name is predictable): it is moved aside, so another local user cannot
    keep the backend from starting, and nothing is ever written through it. Moving another user's entry in a
    sticky directory takes root (CAP_FOWNER); without it the backend refuses to start, naming the path.
    """
    for _ in range(3):
        try:
            os.mkdir(path, 0o700)
            return
        except FileExistsError:
            pass
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return
        aside = path.with_name(f"{path.name}.planted-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except OSError as exc:
            raise BackendUnavailable(
                f"container backend: {path} exists but is not a private directory of uid {os.geteuid()} "
                f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}) and cannot be moved aside ({exc}): "
                f"someone else made it; remove it") from None
        log.warning("container backend: %s was not a private directory of uid %d (owner uid %d, mode %s): "
                    "moved aside to %s", path, os.geteuid(), st.st_uid, stat.filemode(st.st_mode), aside)
    raise BackendUnavailable(f"container backend: {path} keeps being planted by someone else; remove its creator")


def pidfd_of(pid: int, started: str | None) -> int | None:
    """A pidfd of ``pid`` if it is still the process that started at ``started`` (the pidfd pins it: checked
    once, no signal sent through it can reach a recycled pid), else None."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return None
    if start_time(pid) != started:
        os.close(fd)
        return None
    return fd


def last_runtime_error(log: Path) -> str | None:
    message = None
    with contextlib.suppress(OSError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if entry.get("level") in ("error", "fatal"):
                    message = entry.get("msg")
    return message
