"""The ``microvm`` backend: one QEMU ``-M microvm`` guest per sandbox, driven through a guest agent.

Create: restore a per-(image, vCPUs, memory, disk) template snapshot (guest RAM mapped copy-on-write
from the template's RAM file, device state from a ~60 KB migration stream), then give the clone a
fresh identity (hostname, machine id, RNG seed) through the agent. The first create of a template
cold-boots it once and snapshots it; if a restore fails, the sandbox cold-boots instead.
Exec and files: :class:`dsec.guest.protocol.AgentClient` over virtio-serial. Root filesystem: the
image as a cached EROFS file on a read-only virtio-blk disk, under a tmpfs overlay in the guest
(sized by ``disk``; it lives in guest RAM, so a VM snapshot captures it). Each QEMU runs in the
sandbox's cgroups, as an unprivileged user, under QEMU's seccomp sandbox. ``network="none"`` (the default):
no network device at all. Any other policy: a virtio-net NIC on a tap in the sandbox's own network
namespace, QEMU started inside it, the policy enforced by the container backend's code outside the guest
(:mod:`dsec.isolation.network`); such sandboxes restore from a template of their own (booted with the NIC).

This module owns the microvm machine profile (its command line, DSec's initramfs, the image's EROFS disk)
and must never hold QEMU processes itself: :class:`~dsec.backends.qemu.backend.QemuBackend` composes the
shared parts that do (:mod:`dsec.backends.qemu`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from dsec.backends.base import ImageRef
from dsec.backends.qemu.accel import accel_arg
from dsec.backends.qemu.agent import GuestAgent
from dsec.backends.qemu.backend import QemuBackend
from dsec.backends.qemu.profile import MiB, Shape
from dsec.config import Settings
from dsec.errors import BackendUnavailable, NotSupported, SandboxError
from dsec.guest.accel import QEMU
from dsec.guest.initramfs import build_initramfs
from dsec.guest.kernel import GuestKernel, default_guest_dir, find_kernel
from dsec.images.users import resolve_user
from dsec.isolation.idmap import unshifted_view
from dsec.models import SandboxRecord

__all__ = ["MicroVMBackend", "MicroVMProfile"]

log = logging.getLogger(__name__)

_BOOT_TIMEOUT = 60.0
# TCG cannot calibrate the TSC on -M microvm without these (see PLATFORM.md); harmless under KVM. reboot=t:
# a panic (panic=-1) restarts by triple fault, which QEMU (-no-reboot) turns into its exit at once; the default
# order tries ACPI and the keyboard controller first, which -M microvm lacks, and under KVM a panicked guest
# can hang there, so the host would never learn of it.
_CMDLINE = "console=ttyS0 panic=-1 oops=panic reboot=t tsc_early_khz=2000000 tsc=reliable quiet loglevel=4"


class MicroVMProfile:
    """``-M microvm`` booting DSec's kernel and initramfs over the image as an EROFS disk."""

    name = "microvm"
    nic_device = "virtio-net-device"
    """On ``-M microvm``: virtio-mmio; its MAC is :data:`~dsec.isolation.network.GUEST_MAC`."""
    min_memory = 128 * MiB

    def __init__(self, settings: Settings, guest_dir: Path) -> None:
        self.guest_dir = guest_dir
        self.sandbox_files = settings.home / self.name / "sandboxes"
        self.boot_timeout = float(os.environ.get("DSEC_MICROVM_BOOT_TIMEOUT") or _BOOT_TIMEOUT)
        """Seconds a cold boot may take until the agent answers (``DSEC_MICROVM_BOOT_TIMEOUT``; a host whose
        cores are oversubscribed boots TCG guests several times slower)."""
        self.restore_timeout = float(os.environ.get("DSEC_MICROVM_RESTORE_TIMEOUT") or 20.0)
        """Seconds a restored guest may take to load its state (at least 30) and for its agent to answer
        (``DSEC_MICROVM_RESTORE_TIMEOUT``)."""
        self.kernel: GuestKernel | None = None
        self.initramfs: Path | None = None
        self._disk_lock = asyncio.Lock()

    def available(self) -> str:
        if os.geteuid() != 0:
            return "needs root (cgroups, QEMU as an unprivileged user)"
        if shutil.which(QEMU) is None:
            return f"{QEMU} not found: apt-get install qemu-system-x86"
        if shutil.which("mkfs.erofs") is None:
            return "mkfs.erofs not found: apt-get install erofs-utils"
        try:
            find_kernel(self.guest_dir)
        except BackendUnavailable as e:
            return str(e)
        return "ok"

    async def start(self) -> Path | None:
        self.kernel = find_kernel(self.guest_dir)
        self.initramfs = await asyncio.to_thread(build_initramfs, self.kernel, self.guest_dir / "build")
        (self.guest_dir / "rootfs").mkdir(parents=True, exist_ok=True)
        return self.kernel.vmlinuz

    def close(self) -> None:
        pass

    def check_shape(self, record: SandboxRecord, shape: Shape) -> None:
        pass

    def guest_mib(self, memory: int) -> int:
        """The guest's RAM is ``memory``: the agent is its init and its commands are its only other processes."""
        return memory // MiB

    def resolve_image(self, name: str) -> ImageRef | None:
        return None

    async def base_disk(self, image: ImageRef) -> Path:
        """The image's root as a cached EROFS file (rebuilt when the image directory changes)."""
        # "owners-v2": built with the image's real owners. A chunked image is named by its content, so every
        # home of the node shares one file per image version; a directory image by its path and inode.
        if image.digest is not None:
            source = f"owners-v2:digest:{image.digest}"
        else:
            st = image.rootfs.stat()
            source = f"owners-v2:{image.rootfs.resolve()}:{st.st_mtime_ns}:{st.st_ino}"
        key = hashlib.sha256(source.encode()).hexdigest()[:16]
        target = self.guest_dir / "rootfs" / f"{image.name}-{key}.erofs"
        async with self._disk_lock:
            if not target.exists():
                tmp = target.with_name(f".{target.name}.{os.getpid()}")
                proc = await asyncio.to_thread(_mkfs_unshifted, image, tmp)
                if proc.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    raise SandboxError(f"mkfs.erofs of image {image.name} failed: {proc.stderr.strip()[-300:]}")
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
        return target

    async def image_user(self, image: ImageRef, user: str | None) -> dict[str, Any]:
        """The sandbox's default user (``user``, else the image's ``User``), resolved in the image's own
        /etc/passwd: execs run as it, as in a container."""
        identity = await asyncio.to_thread(resolve_user, image.rootfs, user or image.config.user)
        return {"user": [identity.uid, identity.gid], "home": identity.home, "user_groups": list(identity.groups),
                "user_name": identity.name, "user_spec": user}

    def template_key(self, disk: Path, shape: Shape, accel: str | None) -> str:
        return hashlib.sha256(f"{disk.name}:{shape.vcpus}:{shape.mem_mib}:{shape.disk_bytes}:{accel}:"
                              f"{self.initramfs}:{_CMDLINE}".encode()).hexdigest()[:16]

    def command(self, rundir: Path, disk: Path, shape: Shape, memory: list[str], accel: str) -> list[str]:
        if self.kernel is None or self.initramfs is None:
            raise BackendUnavailable("microvm backend is not started")
        return [
            QEMU, "-M", "microvm,pit=on,pic=on,rtc=on,isa-serial=on,memory-backend=mem",
            "-accel", accel_arg(accel), "-cpu", "host" if accel == "kvm" else "max",
            "-smp", str(shape.vcpus), "-m", f"{shape.mem_mib}M", "-object", ",".join(memory),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
            "-kernel", str(self.kernel.vmlinuz), "-initrd", str(self.initramfs),
            "-append", f"{_CMDLINE} dsec.disk={shape.disk_bytes}",
            "-chardev", f"socket,id=con,path={rundir / 'console.sock'},server=on,wait=off", "-serial", "chardev:con",
            "-drive", f"id=root,file={disk},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={rundir / 'agent.sock'},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=dsec.agent",
            "-qmp", f"unix:{rundir / 'qmp.sock'},server=on,wait=off",
            "-pidfile", str(rundir / "qemu.pid"),
        ]

    async def sandbox_disk(self, sandbox_id: str, base: Path, saved: Path | None) -> Path:
        """The shared read-only EROFS image (the writable layer is in guest RAM)."""
        return base

    async def saved(self, record: SandboxRecord, target: Path) -> None:
        pass  # the writable layer is in guest RAM: the migration stream holds it

    async def booted(self, record: SandboxRecord, agent: GuestAgent) -> None:
        pass  # the agent answers READY once the guest's init is done

    async def prepared(self, record: SandboxRecord, agent: GuestAgent) -> None:
        pass

    def confines(self, record: SandboxRecord) -> bool:
        """Every microvm's commands are confined (own mount namespace, capabilities that undo protections
        dropped, no_new_privs), which makes ``protected=`` and ``hidden=`` hold against guest root."""
        return True

    def confine_extra(self, record: SandboxRecord) -> list[tuple[str, str]]:
        return []

    def pristine_refusal(self, record: SandboxRecord) -> str | None:
        return None  # the image's untouched root is the read-only EROFS disk


class MicroVMBackend(QemuBackend):
    """QEMU microVMs restored from per-template snapshots; exec and files through the guest agent."""

    name = "microvm"

    def __init__(self, settings: Settings | None = None, guest_dir: Path | None = None,
                 accel: str | None = None, fast_start: bool = True, qemu_user: str | None = "nobody",
                 hibernate_on_pause: bool | None = None) -> None:
        settings = settings or Settings()
        self.profile: MicroVMProfile = MicroVMProfile(settings, guest_dir or default_guest_dir())
        super().__init__(settings, self.profile, accel=accel or os.environ.get("DSEC_MICROVM_ACCEL"),
                         fast_start=fast_start, qemu_user=qemu_user,
                         hibernate_on_pause=(os.environ.get("DSEC_MICROVM_HIBERNATE") == "1"
                                             if hibernate_on_pause is None else hibernate_on_pause))


def _mkfs_unshifted(image: ImageRef, target: Path) -> subprocess.CompletedProcess[str]:
    """mkfs.erofs of the image root with its real owners.

    The store keeps images uid-shifted for user namespaces; a guest has its own kernel and wants the
    image's owners. mkfs.erofs 1.5 has no uid offset, so it reads the tree through an idmapped mount
    that shifts owners back; where the kernel or filesystem cannot idmap, ownership is flattened to
    root (``--all-root``) and a warning says so.
    """
    def mkfs(source: Path, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["mkfs.erofs", "--quiet", "-T0", *flags, str(target), str(source)],
                              capture_output=True, text=True, check=False)

    if not image.uid_shift:
        return mkfs(image.rootfs)
    try:
        with unshifted_view(image.rootfs, image.uid_shift, target.parent) as view:
            return mkfs(view)
    except NotSupported as exc:
        log.warning("image %s: %s; its files are all owned by root in microVMs", image.name, exc)
        return mkfs(image.rootfs, "--all-root")
