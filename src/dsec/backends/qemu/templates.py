"""Guests started and saved: cold boots, template snapshots, restores, and the VM's state saved to disk.

Owns ``<home>/<backend>/templates`` (one booted, idle guest per template key: its RAM file and migration
stream) and the QEMU migration streams of snapshots and hibernation; must never leave a half-made template
behind (a failed build removes it; a template whose state cannot be loaded is discarded for the next create
to rebuild, one whose restore was only slow is kept). Clones map a template's RAM copy-on-write
(``x-ignore-shared``) and load only its device state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec.backends.base import ImageRef
from dsec.backends.qemu.accel import AccelChoice
from dsec.backends.qemu.agent import GuestAgent
from dsec.backends.qemu.machine import Machine, MachineHost
from dsec.backends.qemu.network import GuestNetwork
from dsec.backends.qemu.profile import MachineProfile, MiB, Shape
from dsec.backends.qemu.qmp import qmp
from dsec.errors import SandboxError
from dsec.guest.protocol import AgentGone
from dsec.isolation.network import Policy
from dsec.models import SandboxRecord, SandboxSpec

__all__ = ["RestoreTooSlow", "Templates"]


class RestoreTooSlow(SandboxError, TimeoutError):
    """A restore that did not finish in time (a loaded host), as opposed to one whose saved state QEMU or the
    guest could not load: the template it came from is kept."""


class Templates:
    """Boots, restores and saves the guests of one backend."""

    def __init__(self, root: Path, profile: MachineProfile, machines: MachineHost, network: GuestNetwork,
                 agent: GuestAgent, accel: AccelChoice,
                 discard: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        self.dir = root / "templates"
        self.profile = profile
        self.machines = machines
        self.network = network
        self.agent = agent
        self.accel = accel
        self._discard = discard
        """Destroy what a sandbox id left (QEMU, network, files): a template boot's scaffolding."""
        self._locks: dict[str, asyncio.Lock] = {}

    def _command(self, record: SandboxRecord, rundir: Path, disk: Path, shape: Shape, memory: list[str],
                 extra: list[str]) -> list[str]:
        cmd = self.profile.command(rundir, disk, shape, memory, self.accel.accel or "tcg") + extra
        return self.network.command(record, cmd)

    async def cold_boot(self, record: SandboxRecord, rundir: Path, disk: Path, shape: Shape,
                        ram_file: Path | None = None) -> Machine:
        """Boot a guest (its RAM in ``ram_file`` when given, to be saved as a template) until it is ready."""
        memory = ([f"memory-backend-file,id=mem,size={shape.mem_mib}M,mem-path={ram_file},share=on"] if ram_file
                  else [f"memory-backend-memfd,id=mem,size={shape.mem_mib}M"])
        cmd = self._command(record, rundir, disk, shape, memory, [])
        vm = await self.machines.spawn(record, rundir, cmd, shape.vcpus, shape.mem_mib)
        vm.client = await self.machines.connect(vm, self.profile.boot_timeout)
        try:
            await vm.client.wait_ready(self.profile.boot_timeout)
        except AgentGone as e:
            await asyncio.sleep(0.2)  # let the watcher name the cause (panic, power-off)
            raise SandboxError(f"{self.profile.name} sandbox did not boot: {vm.dead or e}") from None
        await self.profile.booted(record, self.agent)
        return vm

    async def restore(self, record: SandboxRecord, rundir: Path, disk: Path, source: Path, shape: Shape,
                      ram_from_template: bool = True) -> None:
        """Start a guest from ``source``'s saved state (a template's RAM mapped copy-on-write, or a snapshot's
        or hibernation's whole stream) and let it run."""
        fd = os.open(source / "state", os.O_RDONLY)
        try:
            if ram_from_template:
                memory = [f"memory-backend-file,id=mem,size={shape.mem_mib}M,mem-path={source / 'ram'},share=off"]
            else:
                memory = [f"memory-backend-memfd,id=mem,size={shape.mem_mib}M"]
            cmd = self._command(record, rundir, disk, shape, memory, ["-incoming", "defer"])
            vm = await self.machines.spawn(record, rundir, cmd, shape.vcpus, shape.mem_mib, pass_fds=(fd,))
            caps = [{"capability": "x-ignore-shared", "state": True}] if ram_from_template else []
            try:
                await qmp(rundir, [("migrate-set-capabilities", {"capabilities": caps}),
                                   ("migrate-incoming", {"uri": f"fd:{fd}"})])
            except SandboxError as e:
                # QEMU can read a bad state and quit before it answers the command that started the load.
                raise await self._restore_failed(vm, source, e) from None
        finally:
            os.close(fd)
        await self._loaded(vm, source)
        try:
            vm.client = await self.machines.connect(vm, 10)
        except SandboxError as e:
            if vm.dead:
                raise
            raise RestoreTooSlow(f"restoring {source.name}: {e}") from None
        await qmp(rundir, [("cont", {})])
        try:
            await vm.client.ping(timeout=self.profile.restore_timeout)
        except TimeoutError:
            raise RestoreTooSlow(f"restoring {source.name}: the guest did not answer within "
                                 f"{self.profile.restore_timeout:g} s of its restore") from None

    async def _loaded(self, vm: Machine, source: Path) -> None:
        """Wait until QEMU has loaded the incoming state (SandboxError naming why it could not, RestoreTooSlow
        when it was still loading at the deadline)."""
        deadline = time.monotonic() + max(30.0, self.profile.restore_timeout)
        while True:
            try:
                status = (await qmp(vm.rundir, [("query-status", {})]))[-1]["status"]
            except SandboxError as e:
                raise await self._restore_failed(vm, source, e) from None
            if status != "inmigrate":
                break
            if vm.dead:
                raise SandboxError(f"restoring {source.name} failed: {vm.dead}")
            if time.monotonic() > deadline:
                raise RestoreTooSlow(f"restoring {source.name}: QEMU was still loading its state after "
                                     f"{max(30.0, self.profile.restore_timeout):g} s")
            await asyncio.sleep(0.005)
        if status not in ("paused", "postmigrate", "prelaunch"):
            raise SandboxError(f"restoring {source.name} left QEMU in state {status!r}")

    @staticmethod
    async def _restore_failed(vm: Machine, source: Path, error: SandboxError) -> SandboxError:
        """The error of a restore whose monitor failed: QEMU quits when it cannot load the state, and its own
        message (qemu.log, once its exit is seen) says why better than the broken monitor connection."""
        if vm.watcher is not None:
            await asyncio.wait({vm.watcher}, timeout=5)
        return SandboxError(f"restoring {source.name} failed: {vm.dead or error}")

    async def save(self, record: SandboxRecord, target: Path, ignore_shared: bool = False) -> None:
        """Stop the VM and write its state to ``target`` (QEMU migration over a passed fd: no spawn), then the
        profile's disk beside it."""
        rundir = Path(record.backend_state["rundir"])
        tmp = target.with_name(f".{target.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            caps = [{"capability": "x-ignore-shared", "state": ignore_shared}]
            await qmp(rundir, [("migrate-set-capabilities", {"capabilities": caps}), ("stop", {})])
            await qmp(rundir, [("getfd", {"fdname": "snap"}), ("migrate", {"uri": "fd:snap"})], fd=fd)
        finally:
            os.close(fd)
        while True:
            info = (await qmp(rundir, [("query-migrate", {})]))[-1]
            if info.get("status") == "completed":
                break
            if info.get("status") in ("failed", "cancelled"):
                tmp.unlink(missing_ok=True)
                raise SandboxError(f"saving the VM failed: {info.get('error-desc', info.get('status'))}")
            await asyncio.sleep(0.01)
        os.replace(tmp, target)
        await self.profile.saved(record, target)

    async def template(self, disk: Path, image: ImageRef, shape: Shape, nic: bool = False) -> Path:
        """Directory with ``ram`` + ``state`` of a booted, idle guest of this shape (made on first use); with
        ``nic``, of a guest with a network device (booted on a tap in a namespace of its own, no veth)."""
        key = self.profile.template_key(disk, shape, self.accel.accel) + ("-nic" if nic else "")
        tdir = self.dir / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if (tdir / "state").exists():
                return tdir
            shutil.rmtree(tdir, ignore_errors=True)
            tdir.mkdir(parents=True)
            self.machines.chown(tdir)
            spec = SandboxSpec(image=image.name, backend=self.profile.name, cpu=shape.vcpus,
                               memory=shape.mem_mib * MiB, disk=shape.disk_bytes)
            rec = SandboxRecord(id=f"tpl-{key}", spec=spec, state="creating", created_at=time.time(),
                                expires_at=time.time() + 600)
            shutil.rmtree(self.machines.run_root / rec.id, ignore_errors=True)
            rundir = self.machines.make_rundir(rec.id, fresh=True)
            try:
                if nic:
                    await self.network.up(rec, Policy("none"))
                boot_disk = await self.profile.sandbox_disk(rec.id, disk, None)
                await self.cold_boot(rec, rundir, boot_disk, shape, ram_file=tdir / "ram")
                await self.save(rec, tdir / "state", ignore_shared=True)
                (tdir / "meta.json").write_text(json.dumps({"image": image.name, "erofs": str(disk),
                                                            "vcpus": shape.vcpus, "memory_mib": shape.mem_mib,
                                                            "nic": nic}))
            except BaseException:
                shutil.rmtree(tdir, ignore_errors=True)
                raise
            finally:
                await self._discard(rec.id, rec.backend_state)
            os.chmod(tdir / "ram", 0o444)
        return tdir

    @staticmethod
    async def discard(template: Path) -> None:
        """Remove a template that could not be restored (corrupt or truncated state): the next create rebuilds
        it. Clones already running keep their open mappings of the old RAM file."""
        trash = template.with_name(f".discarded-{template.name}-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(OSError):
            template.rename(trash)
        await asyncio.to_thread(shutil.rmtree, trash, True)
