"""The QEMU backend both ``microvm`` and ``vm`` are: the shared parts composed, and a machine profile.

Owns the lifecycle of a QEMU sandbox (create by template restore or cold boot, pause, hibernation, snapshots,
recovery, orphan sweeps, destroy) and the :class:`~dsec.backends.base.Backend` methods, each delegated to one
part: :class:`~dsec.backends.qemu.machine.MachineHost` (processes, cgroups), :class:`~dsec.backends.qemu.
templates.Templates`, :class:`~dsec.backends.qemu.agent.GuestAgent`, :class:`~dsec.backends.qemu.network.
GuestNetwork`. What differs between machines is the :class:`~dsec.backends.qemu.profile.MachineProfile`'s;
this class must never ask which backend it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dsec.accounts import Identity
from dsec.backends.base import Backend, Check, ImageRef, apply_image_defaults, default_identity
from dsec.backends.qemu.accel import AccelChoice
from dsec.backends.qemu.agent import GuestAgent
from dsec.backends.qemu.machine import Machine, MachineHost
from dsec.backends.qemu.network import GuestNetwork
from dsec.backends.qemu.profile import MachineProfile, MiB, Shape
from dsec.backends.qemu.qmp import qmp
from dsec.backends.qemu.templates import RestoreTooSlow, Templates
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.config import Settings
from dsec.errors import BackendUnavailable, InvalidRequest, SandboxError
from dsec.isolation.files import normalise
from dsec.isolation.network import Policy
from dsec.isolation.procs import start_time
from dsec.models import ExecEvent, ExecRequest, FileEntry, SandboxRecord, SandboxStats
from dsec.models.surface import FileEvent, FileStat

__all__ = ["QemuBackend", "home_tag"]


def home_tag(settings: Settings) -> str:
    """A home's short tag: its cgroups, runtime directories and network namespaces are named by it."""
    return hashlib.sha256(str(settings.home.resolve()).encode()).hexdigest()[:8]


class QemuBackend(Backend):
    """QEMU guests restored from per-template snapshots; exec and files through the guest agent."""

    reads_image = False  # the guest boots a disk made from the image once, at its first create
    pristine_execs: bool = True
    """The guest agent can run a command on the image's untouched root (where the profile allows)."""
    network_device: bool = True
    """Sandboxes with a network policy get a NIC (see :mod:`dsec.isolation.network`)."""

    def __init__(self, settings: Settings, profile: MachineProfile, accel: str | None, fast_start: bool,
                 qemu_user: str | None, hibernate_on_pause: bool) -> None:
        self.settings = settings
        self.profile = profile
        self.root = settings.home / profile.name
        self.tag = home_tag(settings)
        # Network namespaces dsvm-<net_tag>-<id>, runtime directories /run/dsec-vm/<net_tag> (Unix socket paths
        # must fit in 108 bytes: not under DSEC_HOME): each backend's orphan sweep removes every one of its tag
        # no record of its own claims, so the microvm and vm backends of one home must not share a tag.
        self.net_tag = self.tag if profile.name == "microvm" else f"{self.tag}.{profile.name}"
        self.accel_choice = AccelChoice(profile.name, accel)
        self.fast_start = fast_start
        self.fast_start_failures = 0
        """Creates that fell back to a cold boot because the template restore failed."""
        # Idle RL sandboxes can be paused for minutes: saving them to disk frees their RAM for others.
        self.hibernate_on_pause = hibernate_on_pause
        self.machines = MachineHost(profile.name, self.tag, Path("/run/dsec-vm") / self.net_tag, qemu_user,
                                    settings.sandbox_cpu_idle)
        # A table of its own ("dsec_<tag>_microvm"): the container backend's orphan sweep must not see these.
        self.network = GuestNetwork(profile.name, self.net_tag, f"{self.tag}_{profile.name}", profile.nic_device)
        self.agent = GuestAgent(self.machines, profile)
        self.templates = Templates(self.root, profile, self.machines, self.network, self.agent, self.accel_choice,
                                   self.destroy_id)
        self.started = False

    @property
    def accel(self) -> str | None:
        """``"kvm"`` or ``"tcg"`` once decided (forced, or by the host's shared decision)."""
        return self.accel_choice.accel

    @accel.setter
    def accel(self, value: str | None) -> None:
        self.accel_choice.accel = value

    @property
    def accel_reason(self) -> str:
        return self.accel_choice.reason

    @accel_reason.setter
    def accel_reason(self, value: str) -> None:
        self.accel_choice.reason = value

    def available(self) -> str:
        return self.profile.available()

    async def start(self) -> None:
        reason = self.available()
        if reason != "ok":
            raise BackendUnavailable(f"{self.name} backend: {reason}")
        self.accel_choice.begin(await self.profile.start())
        for d in (self.root / "templates", self.root / "snapshots"):
            d.mkdir(parents=True, exist_ok=True)
        self.machines.run_root.mkdir(parents=True, exist_ok=True, mode=0o711)
        self.started = True

    async def aclose(self) -> None:
        await self.network.networks.aclose()
        await self.machines.detach_all()
        self.started = False
        self.profile.close()

    def release_host(self, live: set[str]) -> list[str]:
        """The QEMUs of template boots and of creates the dead daemon left unfinished are ended; with no live
        sandbox, the rest goes too."""
        if not live and not self.network.networks.network.indexes():
            self.network.networks.network.drop_table()
        return self.machines.release_host(live)

    def pending(self) -> str | None:
        return self.accel_choice.pending()

    async def wait_accelerator(self) -> str:
        """KVM or TCG for this backend's guests, waiting (bounded) for the host's decision if it is pending."""
        return await self.accel_choice.wait()

    def components(self) -> dict[str, Check]:
        return self.accel_choice.components()

    def resolve_image(self, name: str) -> ImageRef | None:
        return self.profile.resolve_image(name)

    def shape(self, record: SandboxRecord) -> Shape:
        """The guest's size from ``record``'s spec (InvalidRequest for one this backend cannot give)."""
        spec = record.spec
        if spec.memory < self.profile.min_memory:
            raise InvalidRequest(f"memory={spec.memory} is too small for a {self.name} sandbox "
                                 f"(at least {self.profile.min_memory // MiB}Mi)")
        if record.spec.network != "none" and not self.network_device:
            raise InvalidRequest(f"network={spec.network!r} is not available on the {self.name} backend: only 'none'")
        if spec.allow_privilege_escalation and self.profile.confines(record):
            raise InvalidRequest(f"allow_privilege_escalation=True is not available on this {self.name} sandbox: its "
                                 "guest agent confines every command with no_new_privs (a vm does not when it has no "
                                 "protected or hidden paths); use user='root'")
        vcpus = max(1, math.ceil(spec.cpu))
        if vcpus > (os.cpu_count() or 1) * 4:
            raise InvalidRequest(f"cpu={spec.cpu} asks for more vCPUs than this host can run")
        shape = Shape(vcpus, self.profile.guest_mib(spec.memory), spec.disk)
        self.profile.check_shape(record, shape)
        return shape

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        try:
            await self._create(record, image)
        except BaseException:
            await self.destroy_id(record.id, record.backend_state)
            raise

    async def _begin(self, record: SandboxRecord, image: ImageRef, shape: Shape) -> Path:
        """The record's state before its guest starts; returns the image's base disk."""
        await self.wait_accelerator()
        disk = await self.profile.base_disk(image)
        apply_image_defaults(record, image)
        record.backend_state = {"image_env": dict(image.config.env), "accel": self.accel, "erofs": str(disk),
                                **await self.profile.image_user(image, record.spec.user)}
        return disk

    async def _create(self, record: SandboxRecord, image: ImageRef) -> None:
        if not self.started:
            raise BackendUnavailable(f"{self.name} backend is not started")
        shape = self.shape(record)
        base = await self._begin(record, image, shape)
        policy = Policy.parse(record.spec.network)
        rundir = self.machines.make_rundir(record.id, fresh=True)
        nic = policy.mode != "none"
        if nic:  # namespace, tap, veth and rules before the guest runs a single instruction
            await self.network.up(record, policy)
        if self.fast_start and await self._from_template(record, image, rundir, base, shape, nic):
            return
        disk = await self.profile.sandbox_disk(record.id, base, None)
        record.backend_state["erofs"] = str(disk)
        await self.templates.cold_boot(record, rundir, disk, shape)
        record.backend_state["start"] = "boot"
        await self.agent.prepare(record)

    async def _from_template(self, record: SandboxRecord, image: ImageRef, rundir: Path, base: Path, shape: Shape,
                             nic: bool) -> bool:
        """Restore the sandbox from its template; False (after cleaning up) when that failed."""
        template = await self.templates.template(base, image, shape, nic=nic)
        try:
            disk = await self.profile.sandbox_disk(record.id, base, template)
            record.backend_state["erofs"] = str(disk)
            await self.templates.restore(record, rundir, disk, template, shape)
            record.backend_state["start"] = "restore"
        except SandboxError as e:
            # Cold boot is the fallback; say so in the record rather than hide it.
            record.backend_state["restore_error"] = str(e)
            await self.machines.kill(record.id, record.backend_state)
            for f in rundir.iterdir():
                f.unlink()
            self.fast_start_failures += 1
            if not isinstance(e, RestoreTooSlow):  # a slow restore (a loaded host) says nothing of the template
                await self.templates.discard(template)
            return False
        await self.agent.prepare(record)
        return True

    async def reveal(self, record: SandboxRecord) -> None:
        if not self.profile.confines(record):
            await super().reveal(record)
        await self.agent.reveal(record)

    async def destroy(self, record: SandboxRecord) -> None:
        await self.destroy_id(record.id, record.backend_state)

    async def destroy_id(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """Remove everything of ``sandbox_id``: its QEMU, network and files (a sandbox, a template's boot, an
        orphan)."""
        await self.machines.kill(sandbox_id, state)
        self.network.networks.forget(state)
        try:
            await asyncio.to_thread(self.network.down, sandbox_id, state)
        finally:  # the files go even if the network's removal failed (the orphan sweep retries it)
            await asyncio.to_thread(shutil.rmtree, self.machines.run_root / sandbox_id, True)
            await asyncio.to_thread(shutil.rmtree, self.root / "hibernated" / sandbox_id, True)
            await asyncio.to_thread(shutil.rmtree, self.profile.sandbox_files / sandbox_id, True)
            if not self.started:  # closed meanwhile: its close could not remove the run directory
                self.machines.remove_run_root()

    async def recover(self, record: SandboxRecord) -> bool:
        if record.backend_state.get("hibernated"):
            record.state = "paused"
            if not (Path(record.backend_state["hibernated"]) / "state").is_file():
                return False
            if record.backend_state.get("netns") and not self.network.namespace(record.id).exists():
                return False  # the host rebooted: the NIC's namespace is gone
            await self.network.networks.recover(record.backend_state, record.spec.network)  # its namespace stayed
            return True
        pid = record.backend_state.get("qemu_pid")
        rundir = record.backend_state.get("rundir")
        if not pid or not rundir or start_time(pid) != record.backend_state.get("qemu_start"):
            return False
        vm = Machine(pid=pid, proc=None, rundir=Path(rundir))
        self.machines.adopt(record.id, vm)
        try:
            vm.client = await self.machines.connect(vm, 5)
            await vm.client.ping(timeout=10)
            status = (await qmp(vm.rundir, [("query-status", {})]))[-1]["status"]
        except (SandboxError, OSError):
            return False
        if status == "paused":
            record.state = "paused"
        await self.network.networks.recover(record.backend_state, record.spec.network)
        return True

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        found = self.machines.leftovers()
        if self.profile.sandbox_files.is_dir():
            found.update(p.name for p in self.profile.sandbox_files.iterdir() if p.name.startswith(("sb-", "tpl-")))
        found.update(await self.network.namespaces())
        orphans = sorted(found - known)
        for sandbox_id in orphans:
            await self.destroy_id(sandbox_id, self.machines.orphan_state(sandbox_id))
        await self.network.networks.sweep()  # chains of sandboxes no recovered record claims (recover() runs first)
        return orphans

    def alive(self, record: SandboxRecord) -> bool:
        return self.machines.alive(record)

    def lost(self, record: SandboxRecord) -> str | None:
        return self.machines.lost(record)

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        cg = self.machines.cgroups(record.id)
        return SandboxStats(memory_bytes=cg.memory_usage(), memory_peak_bytes=cg.memory_peak(),
                            cpu_seconds=cg.cpu_seconds(), pids=cg.pids_current())

    async def set_network(self, record: SandboxRecord, network: str | list[str]) -> None:
        await self.network.set_policy(record, network)

    # -- pause, hibernation, snapshots ---------------------------------------------------------------------

    async def pause(self, record: SandboxRecord) -> None:
        """Stop the vCPUs (QMP ``stop``); with ``hibernate_on_pause`` also save the VM and release its RAM."""
        if self.hibernate_on_pause:
            await self.hibernate(record)
            return
        await qmp(self.machines.get(record).rundir, [("stop", {})])

    async def resume(self, record: SandboxRecord) -> None:
        if record.backend_state.get("hibernated"):
            await self._wake(record)
            return
        await qmp(self.machines.get(record).rundir, [("cont", {})])

    async def hibernate(self, record: SandboxRecord) -> None:
        """Save the whole VM to disk and end its QEMU, giving its memory back to the host; resume restores it
        (same identity, processes and files). Already hibernated: nothing to do."""
        if record.backend_state.get("hibernated"):
            return
        self.machines.get(record)
        target = self.root / "hibernated" / record.id
        target.mkdir(parents=True, exist_ok=True)
        try:
            await self.templates.save(record, target / "state")
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            with contextlib.suppress(SandboxError):
                await qmp(Path(record.backend_state["rundir"]), [("cont", {})])
            raise
        await self.machines.kill(record.id, record.backend_state)
        for f in (self.machines.run_root / record.id).iterdir():
            f.unlink()
        record.backend_state.update(hibernated=str(target), qemu_pid=None, qemu_start=None)

    async def _wake(self, record: SandboxRecord) -> None:
        target = Path(record.backend_state["hibernated"])
        if not (target / "state").is_file():
            raise SandboxError(f"sandbox {record.id} cannot wake: its saved state {target / 'state'} is missing")
        shape = self.shape(record)
        await self.wait_accelerator()
        rundir = self.machines.make_rundir(record.id)
        try:
            await self.templates.restore(record, rundir, Path(record.backend_state["erofs"]), target, shape,
                                         ram_from_template=False)
        except BaseException:
            await self.machines.kill(record.id, record.backend_state)
            raise
        record.backend_state.pop("hibernated")
        shutil.rmtree(target, ignore_errors=True)

    async def snapshot(self, record: SandboxRecord, target: Path) -> None:
        """Save the whole VM (RAM, devices, the writable layer) into ``target``: ``state`` (a QEMU migration
        stream) and ``vm.json`` (its shape). A running VM runs on afterwards; a paused one stays so."""
        vm = self.machines.get(record)
        status = (await qmp(vm.rundir, [("query-status", {})]))[-1]["status"]
        vcpus, mem_mib, disk_bytes = self.shape(record)
        try:
            await self.templates.save(record, target / "state")
            (target / "vm.json").write_text(json.dumps({"vcpus": vcpus, "memory_mib": mem_mib, "disk": disk_bytes,
                                                        "memory": record.spec.memory, "accel": self.accel,
                                                        "nic": bool(record.backend_state.get("netns"))}))
        finally:
            if status == "running":
                with contextlib.suppress(SandboxError):
                    await qmp(vm.rundir, [("cont", {})])

    async def restore(self, record: SandboxRecord, image: ImageRef, layers: list[Path]) -> None:
        """Create ``record`` from a :meth:`snapshot` (one layer: ``state`` and ``vm.json``): the VM's shape
        (vCPUs, memory, disk) is the snapshot's, whatever the spec asked; the clone gets a fresh identity."""
        if len(layers) != 1:
            raise SandboxError(f"a {self.name} snapshot is one layer, got {len(layers)}: not a {self.name} snapshot")
        source = layers[0]
        shape, memory, nic = self._snapshot_shape(source)
        policy = Policy.parse(record.spec.network)
        if policy.mode != "none" and not nic:
            raise InvalidRequest(f"snapshot {source.name} was taken of a sandbox without a network device "
                                 f"(network='none'): its clones cannot have network={record.spec.network!r}")
        record.spec.cpu, record.spec.memory, record.spec.disk = float(shape.vcpus), memory, shape.disk_bytes
        self.shape(record)
        base = await self._begin(record, image, shape)
        record.backend_state["start"] = "snapshot"
        rundir = self.machines.make_rundir(record.id, fresh=True)
        try:
            if nic:  # the snapshot's VM has a NIC: its clone too (with no veth while its policy is none)
                await self.network.up(record, policy)
            disk = await self.profile.sandbox_disk(record.id, base, source)
            record.backend_state["erofs"] = str(disk)
            await self.templates.restore(record, rundir, disk, source, shape, ram_from_template=False)
            await self.agent.prepare(record)
        except BaseException:
            await self.destroy_id(record.id, record.backend_state)
            raise

    def _snapshot_shape(self, source: Path) -> tuple[Shape, int, bool]:
        """The shape a snapshot was taken with, its sandbox's ``memory`` (its guest's RAM when older than that
        record) and whether its VM had a NIC."""
        try:
            shape = json.loads((source / "vm.json").read_text())
            saved = Shape(int(shape["vcpus"]), int(shape["memory_mib"]), int(shape["disk"]))
            memory = int(shape.get("memory", saved.mem_mib * MiB))
            nic = bool(shape.get("nic", False))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SandboxError(f"snapshot {source.name} is not a readable {self.name} snapshot: {e}") from None
        if not (source / "state").is_file():
            raise SandboxError(f"snapshot {source.name} is incomplete: its state file is missing")
        return saved, memory, nic

    # -- commands and files, through the guest agent ---------------------------------------------------------

    def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                    ) -> AsyncIterator[ExecEvent]:
        return self.agent.exec_stream(record, request, user=user)

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        return await self.agent.start_process(record, spec, sink, user)

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        return await self.agent.surface.open_port(record, port)

    # Files as root keep the agent's own READ/WRITE/LIST (a write is atomic: temp file + rename); as another
    # user, and every other file operation, go through FS requests (guest/surface.py, agent_files.c).

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        async with self.agent.surface.files(record, user) as files:
            if not _as_root(record, user):
                return await files.read(normalise(path), max_bytes)
            return await self.agent.client(record).read(normalise(path), max_bytes)

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        path = normalise(path)
        if path == "/":
            raise InvalidRequest("cannot write to '/'", path=path)
        async with self.agent.surface.files(record, user) as files:
            if not _as_root(record, user):
                await files.write(path, data, mode)
                return
            await self.agent.client(record).write(path, data, mode)

    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        async with self.agent.surface.files(record, user) as files:
            if not _as_root(record, user):
                return await files.list(normalise(path))
            return await self.agent.client(record).list(normalise(path))

    async def stat_file(self, record: SandboxRecord, path: str, user: Identity | None = None) -> FileStat:
        async with self.agent.surface.files(record, user) as files:
            return await files.stat(normalise(path))

    async def make_dir(self, record: SandboxRecord, path: str, parents: bool, mode: int,
                       user: Identity | None = None) -> FileStat:
        async with self.agent.surface.files(record, user) as files:
            return await files.mkdir(normalise(path), parents, mode)

    async def remove_file(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> None:
        async with self.agent.surface.files(record, user) as files:
            await files.remove(normalise(path), recursive)

    async def rename_file(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                          user: Identity | None = None) -> FileStat:
        async with self.agent.surface.files(record, user) as files:
            return await files.rename(normalise(source), normalise(destination), overwrite)

    async def chmod_file(self, record: SandboxRecord, path: str, mode: int, user: Identity | None = None
                         ) -> FileStat:
        async with self.agent.surface.files(record, user) as files:
            return await files.chmod(normalise(path), mode)

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        async with self.agent.surface.files(record, user) as files:
            return await files.chown(normalise(path), owner)

    async def watch_files(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> AsyncIterator[FileEvent]:
        return await self.agent.surface.watch(record, normalise(path), recursive, user)


def _as_root(record: SandboxRecord, user: Identity | None) -> bool:
    """Whether a file call acts as the guest's root (the agent's own credentials)."""
    identity = user or default_identity(record)
    return identity.is_root and identity.gid == 0 and not identity.groups
