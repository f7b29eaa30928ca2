"""What makes one QEMU backend differ from another: its machine profile.

Owns the :class:`MachineProfile` protocol (the machine's command line, its disks, its boot, the confinement of
its commands) and :class:`Shape`; must never hold state of a running sandbox: the shared parts
(:mod:`~dsec.backends.qemu.machine`, :mod:`~dsec.backends.qemu.templates`, :mod:`~dsec.backends.qemu.agent`)
run the machines and call the profile where the two backends differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from dsec.backends.base import ImageRef
from dsec.models import SandboxRecord

if TYPE_CHECKING:
    from dsec.backends.qemu.agent import GuestAgent

__all__ = ["MachineProfile", "MiB", "Shape"]

MiB = 1024 * 1024


class Shape(NamedTuple):
    """A guest's size: vCPUs, memory in MiB, the writable disk in bytes."""

    vcpus: int
    mem_mib: int
    disk_bytes: int


class MachineProfile(Protocol):
    """A QEMU machine and the guest on it (``-M microvm`` with DSec's initramfs, ``-M q35`` with systemd)."""

    name: str
    """The backend's name (``"microvm"``, ``"vm"``)."""
    boot_timeout: float
    """Seconds a cold boot may take until the guest is ready."""
    restore_timeout: float
    """Seconds a restored guest may take to load its state (at least 30) and for its agent to answer."""
    min_memory: int
    """The least ``memory`` a sandbox may ask for."""
    nic_device: str
    """QEMU device of a networked guest's NIC."""
    sandbox_files: Path
    """Per-sandbox host files (disk overlays), one directory per sandbox id."""

    def available(self) -> str:
        """``"ok"``, or what this host lacks for the machine."""

    async def start(self) -> Path | None:
        """Prepare what every guest boots from; returns a kernel to probe KVM with (None: none at hand)."""

    def close(self) -> None:
        """Remove what :meth:`start` made that no sandbox still uses."""

    def check_shape(self, record: SandboxRecord, shape: Shape) -> None:
        """Refuse (InvalidRequest) a shape this machine or host cannot give, beyond the shared checks."""

    def guest_mib(self, memory: int) -> int:
        """The guest's RAM in MiB for a sandbox of ``memory`` bytes (its commands never get more than that)."""

    def resolve_image(self, name: str) -> ImageRef | None:
        """An image of the machine's own kind by ``name`` (None: the store's image is used)."""

    async def base_disk(self, image: ImageRef) -> Path:
        """The image as the read-only disk the guest boots (made and cached on first use)."""

    async def image_user(self, image: ImageRef, user: str | None) -> dict[str, Any]:
        """The sandbox's default user, as ``backend_state`` entries."""

    def template_key(self, disk: Path, shape: Shape, accel: str | None) -> str:
        """What a template of this disk and shape is named by (everything a restore must match)."""

    def command(self, rundir: Path, disk: Path, shape: Shape, memory: list[str], accel: str) -> list[str]:
        """QEMU's command line (``-object`` ``memory`` is the guest RAM's backend), with its sockets in
        ``rundir``: ``console.sock``, ``agent.sock``, ``qmp.sock``, and ``qemu.pid``."""

    async def sandbox_disk(self, sandbox_id: str, base: Path, saved: Path | None) -> Path:
        """The disk a sandbox's QEMU opens; ``saved`` is the template or snapshot it is restored from."""

    async def saved(self, record: SandboxRecord, target: Path) -> None:
        """Called once the stopped VM's state is written to ``target`` (for the disk that goes with it)."""

    async def booted(self, record: SandboxRecord, agent: GuestAgent) -> None:
        """Called when a cold boot's agent is ready: wait for the guest to settle before it is used or saved."""

    async def prepared(self, record: SandboxRecord, agent: GuestAgent) -> None:
        """Called after a new sandbox got its identity and confinement (a clock, a disk's growth)."""

    def confines(self, record: SandboxRecord) -> bool:
        """Whether ``record``'s commands run confined by the agent."""

    def confine_extra(self, record: SandboxRecord) -> list[tuple[str, str]]:
        """More of the commands' confinement than protected and hidden paths."""

    def pristine_refusal(self, record: SandboxRecord) -> str | None:
        """Why ``record`` cannot run pristine execs (None: it can)."""
