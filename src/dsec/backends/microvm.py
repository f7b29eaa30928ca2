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

This module owns the QEMU processes, their runtime directories and cgroups, the template cache and
snapshots, and must leave no QEMU process behind (destroy, recover, cleanup_orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.accounts import ROOT, Identity
from dsec.backends.base import (
    Backend,
    Check,
    ImageRef,
    apply_image_defaults,
    collect_exec,
    default_identity,
    workdir_of,
)
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.config import Settings
from dsec.errors import BackendUnavailable, InvalidRequest, NotSupported, SandboxError
from dsec.guest.accel import QEMU, Accelerator
from dsec.guest.initramfs import build_initramfs
from dsec.guest.kernel import GuestKernel, default_guest_dir, find_kernel
from dsec.guest.protocol import AgentClient, AgentGone, T, parse_exit
from dsec.guest.surface import EXT_PRISTINE, GuestSurface, creds_of
from dsec.images.users import resolve_user
from dsec.isolation.affinity import sandbox_cpus
from dsec.isolation.cgroups import CgroupSet, background_group, cgroup_mode, v2_make
from dsec.isolation.exec_client import check_exec_size
from dsec.isolation.idmap import unshifted_view
from dsec.isolation.network import GUEST_ADDRESS, GUEST_GATEWAY, GUEST_MAC, Policy, SandboxNetworks, TapNamespace
from dsec.isolation.procs import start_time
from dsec.models import ExecEvent, ExecRequest, ExecResult, FileEntry, SandboxRecord, SandboxSpec, SandboxStats
from dsec.models_surface import FileEvent, FileStat

__all__ = ["MicroVMBackend"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_MIN_MEMORY = 128 * MiB
# QEMU's own memory (TCG translation cache, device models) on top of guest RAM, for the cgroup limit.
_QEMU_OVERHEAD = 384 * MiB
# TCG's translation cache: QEMU's default (1 GiB) grows with every code path a long-lived guest runs and
# would end in the cgroup's OOM killer; 128 MiB holds a guest's working set of translated code.
_TCG_TB_MIB = 128


def accel_arg(accel: str) -> str:
    """The ``-accel`` value: KVM as is, TCG with its translation cache bounded (see ``_TCG_TB_MIB``)."""
    return accel if accel == "kvm" else f"{accel},tb-size={_TCG_TB_MIB}"


_BOOT_TIMEOUT = 60.0
# The serial console is read into memory and only its tail kept: the guest controls what it writes, so a
# file would let it fill the host's disk (or /run's RAM).
_CONSOLE_TAIL = 64 * 1024
# QEMU's threads (vCPUs, I/O, RCU...): the spec's pids limit is for guest processes, which the guest kernel
# counts; the host cgroup only needs to stop a runaway QEMU.
_QEMU_PIDS = 256
# TCG cannot calibrate the TSC on -M microvm without these (see PLATFORM.md); harmless under KVM. reboot=t:
# a panic (panic=-1) restarts by triple fault, which QEMU (-no-reboot) turns into its exit at once; the default
# order tries ACPI and the keyboard controller first, which -M microvm lacks, and under KVM the guest at times
# hung there after its panic, so the host never learnt of it.
_CMDLINE = "console=ttyS0 panic=-1 oops=panic reboot=t tsc_early_khz=2000000 tsc=reliable quiet loglevel=4"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A networked guest's NIC backend (the tap of its namespace) and the address its init gives it.
_NIC_NETDEV = ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no"]
_NIC_CMDLINE = f" dsec.net={GUEST_ADDRESS}/30:{GUEST_GATEWAY}"


_DETACHED: dict[int, subprocess.Popen[bytes]] = {}
"""QEMUs this process started whose backend was closed (they keep running for a later ``recover``); kept so
that they are reaped, by whichever backend destroys them, instead of lingering as zombies."""


@dataclass
class _VM:
    """A running QEMU and our connection to its agent."""

    pid: int
    proc: subprocess.Popen[bytes] | None
    rundir: Path
    client: AgentClient | None = None
    watcher: asyncio.Task[None] | None = None
    dead: str | None = None
    console: bytearray = field(default_factory=bytearray)
    """The last :data:`_CONSOLE_TAIL` bytes of the guest's serial console (panic messages land here)."""
    console_task: asyncio.Task[None] | None = None


class MicroVMBackend(Backend):
    """QEMU microVMs restored from per-template snapshots; exec and files through the guest agent."""

    name = "microvm"
    reads_image = False  # the guest's disk is an EROFS file made from the image at its template's build
    boot_timeout: float = float(os.environ.get("DSEC_MICROVM_BOOT_TIMEOUT") or _BOOT_TIMEOUT)
    """Seconds a cold boot may take until the agent answers (``DSEC_MICROVM_BOOT_TIMEOUT``; a host whose
    cores are oversubscribed boots TCG guests several times slower)."""
    restore_timeout: float = float(os.environ.get("DSEC_MICROVM_RESTORE_TIMEOUT") or 20.0)
    """Seconds a restored guest may take to load its state (at least 30) and for its agent to answer
    (``DSEC_MICROVM_RESTORE_TIMEOUT``)."""
    min_memory: int = _MIN_MEMORY
    pristine_execs: bool = True
    """The guest agent can run a command on the image's untouched root (its read-only EROFS disk)."""
    network_device: bool = True
    """Sandboxes with a network policy get a NIC (see :mod:`dsec.isolation.network`)."""
    nic_device = "virtio-net-device"
    """QEMU device of a networked guest's NIC (on ``-M microvm``: virtio-mmio); its MAC is :data:`GUEST_MAC`."""
    confines_commands: bool = True
    """Commands run confined by the guest agent (own mount namespace, capabilities that undo protections
    dropped, no_new_privs), which makes ``protected=`` and ``hidden=`` hold against guest root."""

    def __init__(self, settings: Settings | None = None, guest_dir: Path | None = None,
                 accel: str | None = None, fast_start: bool = True, qemu_user: str | None = "nobody",
                 hibernate_on_pause: bool | None = None) -> None:
        self.settings = settings or Settings()
        self.guest_dir = guest_dir or default_guest_dir()
        self.root = self.settings.home / self.name
        tag = hashlib.sha256(str(self.settings.home.resolve()).encode()).hexdigest()[:8]
        self.tag = tag
        # Below the home's dsec-<tag> cgroup, in a directory of its own: each backend's orphan sweep treats
        # every sb-* cgroup under its parent as its own, so the two backends must never share a parent.
        self.cgroup_parent = f"dsec-{tag}/{self.name}"
        # Unix socket paths must fit in 108 bytes: runtime directories live under /run, not DSEC_HOME.
        self.run_root = Path("/run/dsec-vm") / (tag if self.name == "microvm" else f"{tag}.{self.name}")
        # Network namespaces dsvm-<net_tag>-<id>: each backend's orphan sweep removes every one of its tag that
        # no record of its own claims, so the microvm and vm backends of one home must not share a tag.
        self.net_tag = tag if self.name == "microvm" else f"{tag}.{self.name}"
        self.sandbox_files = self.root / "sandboxes"
        """Per-sandbox host files (the vm backend's disk overlays), one directory per sandbox id."""
        self.accel = accel or os.environ.get("DSEC_MICROVM_ACCEL")
        """``"kvm"`` or ``"tcg"`` once decided (forced, or by the host's shared :class:`Accelerator`)."""
        self.accel_reason = "forced" if self.accel else ""
        self.accelerator: Accelerator | None = None
        """The host's decision this backend waits for (None when ``accel`` was forced or is decided)."""
        self.fast_start = fast_start
        self.fast_start_failures = 0
        """Creates that fell back to a cold boot because the template restore failed."""
        # Idle RL sandboxes can be paused for minutes: saving them to disk frees their RAM for others.
        self.hibernate_on_pause = (os.environ.get("DSEC_MICROVM_HIBERNATE") == "1" if hibernate_on_pause is None
                                   else hibernate_on_pause)
        self.qemu_user = qemu_user
        self._kernel: GuestKernel | None = None
        self._initramfs: Path | None = None
        self._vms: dict[str, _VM] = {}
        self.guest = GuestSurface(self._client, self._why_gone)
        self._started = False
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._erofs_lock = asyncio.Lock()
        # A table of its own ("dsec_<tag>_microvm"): the container backend's orphan sweep must not see these.
        self.networks = SandboxNetworks(f"{tag}_{self.name}")

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

    def _remove_run_root(self) -> None:
        """Remove the run directory (and ``/run/dsec-vm``) when no VM is left in it. Also tried when a VM's
        directory goes after :meth:`aclose` (a template boot or a destroy still finishing then), or the empty
        directory would stay until the next daemon on this home stopped."""
        with contextlib.suppress(OSError):
            self.run_root.rmdir()
            self.run_root.parent.rmdir()

    async def start(self) -> None:
        reason = self.available()
        if reason != "ok":
            raise BackendUnavailable(f"microvm backend: {reason}")
        self._kernel = find_kernel(self.guest_dir)
        self._initramfs = await asyncio.to_thread(build_initramfs, self._kernel, self.guest_dir / "build")
        if self.accel is None:  # decided in the background: the daemon serves meanwhile, creates wait for it
            self.accelerator = Accelerator.shared(self._kernel.vmlinuz)
        for d in (self.root / "templates", self.root / "snapshots", self.guest_dir / "rootfs"):
            d.mkdir(parents=True, exist_ok=True)
        self.run_root.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._started = True

    async def aclose(self) -> None:
        await self.networks.aclose()
        for vm in list(self._vms.values()):
            for task in (vm.watcher, vm.console_task):
                if task is not None:
                    task.cancel()
            if vm.proc is not None and vm.proc.poll() is None:
                _DETACHED[vm.pid] = vm.proc
            if vm.client is not None:
                await vm.client.aclose()
        self._vms.clear()
        self._started = False
        self._remove_run_root()
        for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):
                os.rmdir(d)
            with contextlib.suppress(OSError):  # dsec-<tag> (background_group makes it in every joined hierarchy)
                os.rmdir(Path(d).parent)  # unless the container backend still uses it

    def release_host(self, live: set[str]) -> list[str]:
        """The QEMUs of template boots and of creates the dead daemon left unfinished (a cold boot spins a core
        for a minute or more) are ended: nothing re-adopts them. With no live sandbox, the rest goes too."""
        done = []
        for parent in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):
                for child in Path(parent).iterdir():
                    if child.is_dir() and child.name.startswith(("sb-", "tpl-")) and child.name not in live:
                        cg = self._cgroups(child.name)
                        if cg.pids():
                            done.append(f"ended the QEMU of unfinished {child.name}")
                        for _ in range(200):  # a killed QEMU leaves its cgroup within milliseconds
                            cg.kill_all()
                            if not cg.pids():
                                break
                            time.sleep(0.01)
                        with contextlib.suppress(OSError):
                            cg.remove()
        if live:
            return sorted(set(done))
        if not self.networks.network.indexes():
            self.networks.network.drop_table()
        self._remove_run_root()
        for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):  # only empty ones go: a QEMU just killed keeps its cgroup a moment
                os.rmdir(d)
                os.rmdir(Path(d).parent)
        return sorted(set(done))

    def pending(self) -> str | None:
        return self.accelerator.pending() if self.accel is None and self.accelerator is not None else None

    async def wait_accelerator(self) -> str:
        """KVM or TCG for this backend's guests, waiting (bounded) for the host's decision if it is pending."""
        if self.accel is None:
            if self.accelerator is None:
                raise BackendUnavailable(f"{self.name} backend is not started")
            verdict = await self.accelerator.wait_decided()
            self.accel, self.accel_reason = verdict.accel, verdict.describe()
        return self.accel

    # -- images, templates ----------------------------------------------------------------------------

    async def _erofs(self, image: ImageRef) -> Path:
        """The image's root as a cached EROFS file (rebuilt when the image directory changes)."""
        # "owners-v2": built with the image's real owners (earlier files flattened them to root). A chunked
        # image is named by its content, so every home of the node shares one file per image version; a
        # directory image by its path and inode.
        if image.digest is not None:
            source = f"owners-v2:digest:{image.digest}"
        else:
            st = image.rootfs.stat()
            source = f"owners-v2:{image.rootfs.resolve()}:{st.st_mtime_ns}:{st.st_ino}"
        key = hashlib.sha256(source.encode()).hexdigest()[:16]
        target = self.guest_dir / "rootfs" / f"{image.name}-{key}.erofs"
        async with self._erofs_lock:
            if not target.exists():
                tmp = target.with_name(f".{target.name}.{os.getpid()}")
                proc = await asyncio.to_thread(_mkfs_unshifted, image, tmp)
                if proc.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    raise SandboxError(f"mkfs.erofs of image {image.name} failed: {proc.stderr.strip()[-300:]}")
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
        return target

    def _shape(self, record: SandboxRecord) -> tuple[int, int, int]:
        spec = record.spec
        if spec.memory < self.min_memory:
            raise InvalidRequest(f"memory={spec.memory} is too small for a {self.name} sandbox "
                                 f"(at least {self.min_memory // MiB}Mi)")
        if record.spec.network != "none" and not self.network_device:
            raise InvalidRequest(f"network={spec.network!r} is not available on the {self.name} backend: only 'none'")
        vcpus = max(1, math.ceil(spec.cpu))
        if vcpus > (os.cpu_count() or 1) * 4:
            raise InvalidRequest(f"cpu={spec.cpu} asks for more vCPUs than this host can run")
        return vcpus, spec.memory // MiB, spec.disk

    # -- QEMU -------------------------------------------------------------------------------------------

    def _qemu_cmd(self, rundir: Path, disk: Path, vcpus: int, mem_mib: int, disk_bytes: int,
                  memory: list[str], extra: list[str]) -> list[str]:
        assert self._kernel is not None and self._initramfs is not None
        accel = self.accel or "tcg"
        sandbox = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
        cmd = [
            QEMU, "-M", "microvm,pit=on,pic=on,rtc=on,isa-serial=on,memory-backend=mem",
            "-accel", accel_arg(accel), "-cpu", "host" if accel == "kvm" else "max",
            "-smp", str(vcpus), "-m", f"{mem_mib}M", "-object", ",".join(memory),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-sandbox", sandbox,
            "-kernel", str(self._kernel.vmlinuz), "-initrd", str(self._initramfs),
            "-append", f"{_CMDLINE} dsec.disk={disk_bytes}",
            "-chardev", f"socket,id=con,path={rundir / 'console.sock'},server=on,wait=off", "-serial", "chardev:con",
            "-drive", f"id=root,file={disk},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={rundir / 'agent.sock'},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=dsec.agent",
            "-qmp", f"unix:{rundir / 'qmp.sock'},server=on,wait=off",
            "-pidfile", str(rundir / "qemu.pid"),
        ]
        if self.qemu_user:
            cmd += ["-runas", self.qemu_user]
        return cmd + extra

    def _cgroups(self, sandbox_id: str) -> CgroupSet:
        return CgroupSet.at(f"/{self.cgroup_parent}/{sandbox_id}")

    def _make_cgroups(self, sandbox_id: str, vcpus: int, mem_mib: int) -> CgroupSet:
        cg = self._cgroups(sandbox_id)
        # The top-level group it shares with the container backend's sandboxes, with its CPU class.
        background_group(self.cgroup_parent.split("/", 1)[0], self.settings.sandbox_cpu_idle)
        limit = mem_mib * MiB + _QEMU_OVERHEAD
        if cgroup_mode() == "v2":
            unified = Path(cg.dirs["unified"])
            # With the controllers enabled down to it: a bare mkdir under dsec-<tag>/microvm gave a cgroup
            # without memory.max, and the (then suppressed) writes left QEMU without any limit.
            v2_make(unified)
            for name, value in (("memory.max", str(limit)), ("cpu.max", f"{vcpus * 100000} 100000"),
                                ("pids.max", str(_QEMU_PIDS))):
                (unified / name).write_text(value)
            return cg
        wanted = {"memory": [("memory.limit_in_bytes", str(limit))],
                  "cpu": [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", str(vcpus * 100000))],
                  "pids": [("pids.max", str(_QEMU_PIDS))], "cpuacct": [], "freezer": []}
        dirs: dict[str, str] = {}
        for name, path in cg.dirs.items():
            controllers = set(name.split(","))
            if not controllers & wanted.keys():
                continue
            Path(path).mkdir(parents=True, exist_ok=True)
            dirs[name] = path
            for ctrl in controllers & wanted.keys():
                for fname, value in wanted[ctrl]:
                    (Path(path) / fname).write_text(value)
        return CgroupSet(mode="v1", dirs=dirs)

    async def _spawn(self, record: SandboxRecord, rundir: Path, cmd: list[str], pass_fds: tuple[int, ...] = ()
                     ) -> _VM:
        vcpus, mem_mib, _ = self._shape(record)
        if record.backend_state.get("netns"):
            # QEMU opens the tap in the sandbox's namespace and has no other network (nsenter execs it).
            append = cmd.index("-append") + 1
            nic = ["-device", f"{self.nic_device},netdev=net0,mac={GUEST_MAC}"]
            cmd = self._namespace(record.id).enter(
                [*cmd[:append], cmd[append] + _NIC_CMDLINE, *cmd[append + 1:], *_NIC_NETDEV, *nic])
        cg = await asyncio.to_thread(self._make_cgroups, record.id, vcpus, mem_mib)
        procs = [Path(p) for p in cg.procs_files()]

        cpus = sandbox_cpus()

        def start() -> subprocess.Popen[bytes]:
            # The child joins the sandbox's cgroups before exec: QEMU never runs outside its limits. It leaves the
            # daemon's housekeeping CPUs, if any, for the node's: its vCPU threads inherit the mask.
            def join() -> None:
                for p in procs:
                    p.write_text(str(os.getpid()))
                if cpus is not None:
                    os.sched_setaffinity(0, cpus)
            with open(rundir / "qemu.log", "wb") as log:
                return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        pass_fds=pass_fds, preexec_fn=join, start_new_session=True)

        proc = await asyncio.to_thread(start)
        record.backend_state.update(qemu_pid=proc.pid, qemu_start=start_time(proc.pid), cgroups=cg.dirs,
                                    rundir=str(rundir))
        vm = _VM(pid=proc.pid, proc=proc, rundir=rundir)
        self._adopt(record.id, vm)
        return vm

    def _adopt(self, sandbox_id: str, vm: _VM) -> None:
        self._vms[sandbox_id] = vm
        vm.console_task = asyncio.create_task(self._read_console(vm), name=f"dsec-vm-console-{sandbox_id}")
        vm.watcher = asyncio.create_task(self._watch(sandbox_id, vm), name=f"dsec-vm-{sandbox_id}")

    async def _read_console(self, vm: _VM) -> None:
        """Keep the tail of the guest's serial console until QEMU closes it."""
        deadline = time.monotonic() + 10
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(vm.rundir / "console.sock"))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if vm.dead or time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.01)
        try:
            while data := await reader.read(65536):
                vm.console += data
                if len(vm.console) > _CONSOLE_TAIL:
                    del vm.console[:-_CONSOLE_TAIL]
        except OSError:
            pass
        finally:
            writer.close()

    async def _watch(self, sandbox_id: str, vm: _VM) -> None:
        """Notice QEMU's death at once (pidfd), record why, and fail every waiter on its agent."""
        try:
            fd = os.pidfd_open(vm.pid)
        except OSError:
            fd = -1
        if fd >= 0:
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            loop.add_reader(fd, done.set)
            try:
                await done.wait()
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        code = await asyncio.to_thread(vm.proc.wait) if vm.proc is not None else None
        if vm.console_task is not None:
            await asyncio.wait({vm.console_task}, timeout=2)  # the console's last words, if any
        vm.dead = self._death_reason(vm, code)
        if vm.client is not None:
            vm.client.mark_dead(vm.dead)

    @staticmethod
    def _death_reason(vm: _VM, code: int | None) -> str:
        console = vm.console.decode(errors="replace")
        for line in console.splitlines():
            if "Kernel panic" in line:
                return f"guest kernel panicked: {line.split(']', 1)[-1].strip()[:200]}"
        if "reboot: Power down" in console or "reboot: System halted" in console:
            return "the guest powered off"
        if code is not None and code < 0:
            return f"QEMU was killed by signal {-code} ({signal.Signals(-code).name})"
        log = ""
        with contextlib.suppress(OSError):
            log = (vm.rundir / "qemu.log").read_text(errors="replace").strip()
        return f"QEMU exited with status {code}" + (f": {log[-300:]}" if log else "")

    async def _connect(self, vm: _VM, timeout: float) -> AgentClient:
        deadline = time.monotonic() + timeout
        sock = str(vm.rundir / "agent.sock")
        while True:
            if vm.dead:
                raise SandboxError(f"{self.name} sandbox died while starting: {vm.dead}")
            try:
                return await AgentClient.connect(sock)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise SandboxError(f"QEMU did not open its agent socket within {timeout:.0f}s") from None
                await asyncio.sleep(0.01)

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        try:
            await self._create(record, image)
        except BaseException:
            await self._destroy_id(record.id, record.backend_state)
            raise

    async def _create(self, record: SandboxRecord, image: ImageRef) -> None:
        if not self._started:
            raise BackendUnavailable(f"{self.name} backend is not started")
        await self.wait_accelerator()
        if (record.spec.protected or record.spec.hidden) and not self.confines_commands:
            raise InvalidRequest(f"protected= and hidden= are not available on the {self.name} backend: root of a "
                                 f"full VM keeps every capability (it loads modules, mounts) and could undo them; "
                                 f"use backend='microvm' or 'container'")
        vcpus, mem_mib, disk_bytes = self._shape(record)
        policy = Policy.parse(record.spec.network)
        erofs = await self._erofs(image)
        apply_image_defaults(record, image)
        record.backend_state = {"image_env": dict(image.config.env), "accel": self.accel, "erofs": str(erofs),
                                **await self._image_user(image, record.spec.user)}
        rundir = self.run_root / record.id
        rundir.mkdir(mode=0o711)
        self._chown(rundir)
        nic = policy.mode != "none"
        if nic:  # namespace, tap, veth and rules before the guest runs a single instruction
            await self._network_up(record, policy)
        if self.fast_start:
            template = await self._template(erofs, image, vcpus, mem_mib, disk_bytes, nic=nic)
            try:
                disk = await self._sandbox_disk(record.id, erofs, template)
                record.backend_state["erofs"] = str(disk)
                await self._restore(record, rundir, disk, template, vcpus, mem_mib, disk_bytes)
                record.backend_state["start"] = "restore"
            except SandboxError as e:
                # Cold boot is the fallback; say so in the record rather than hide it.
                record.backend_state["restore_error"] = str(e)
                await self._kill(record.id, record.backend_state)
                for f in rundir.iterdir():
                    f.unlink()
                self.fast_start_failures += 1
                # A template that cannot be restored (corrupt or truncated state) is rebuilt by the next create.
                # Clones already running keep their open mappings of the old RAM file.
                trash = template.with_name(f".discarded-{template.name}-{uuid.uuid4().hex[:8]}")
                with contextlib.suppress(OSError):
                    template.rename(trash)
                await asyncio.to_thread(shutil.rmtree, trash, True)
            else:
                await self._prepare(record)
                return
        disk = await self._sandbox_disk(record.id, erofs, None)
        record.backend_state["erofs"] = str(disk)
        await self._cold_boot(record, rundir, disk, vcpus, mem_mib, disk_bytes)
        record.backend_state["start"] = "boot"
        await self._prepare(record)

    @staticmethod
    async def _image_user(image: ImageRef, user: str | None) -> dict[str, Any]:
        """The sandbox's default user (``user``, else the image's ``User``), resolved in the image's own
        /etc/passwd: execs run as it, as in a container."""
        identity = await asyncio.to_thread(resolve_user, image.rootfs, user or image.config.user)
        return {"user": [identity.uid, identity.gid], "home": identity.home, "user_groups": list(identity.groups),
                "user_name": identity.name, "user_spec": user}

    def _chown(self, path: Path) -> None:
        if self.qemu_user:
            pw = pwd.getpwnam(self.qemu_user)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    async def _cold_boot(self, record: SandboxRecord, rundir: Path, erofs: Path, vcpus: int, mem_mib: int,
                         disk_bytes: int, ram_file: Path | None = None) -> _VM:
        memory = ([f"memory-backend-file,id=mem,size={mem_mib}M,mem-path={ram_file},share=on"] if ram_file
                  else [f"memory-backend-memfd,id=mem,size={mem_mib}M"])
        cmd = self._qemu_cmd(rundir, erofs, vcpus, mem_mib, disk_bytes, memory, [])
        vm = await self._spawn(record, rundir, cmd)
        vm.client = await self._connect(vm, self.boot_timeout)
        try:
            await vm.client.wait_ready(self.boot_timeout)
        except AgentGone as e:
            await asyncio.sleep(0.2)  # let the watcher name the cause (panic, power-off)
            raise SandboxError(f"{self.name} sandbox did not boot: {vm.dead or e}") from None
        return vm

    async def _restore(self, record: SandboxRecord, rundir: Path, erofs: Path, template: Path, vcpus: int,
                       mem_mib: int, disk_bytes: int, ram_from_template: bool = True) -> None:
        state = template / "state"
        fd = os.open(state, os.O_RDONLY)
        try:
            if ram_from_template:
                memory = [f"memory-backend-file,id=mem,size={mem_mib}M,mem-path={template / 'ram'},share=off"]
            else:
                memory = [f"memory-backend-memfd,id=mem,size={mem_mib}M"]
            cmd = self._qemu_cmd(rundir, erofs, vcpus, mem_mib, disk_bytes, memory, ["-incoming", "defer"])
            vm = await self._spawn(record, rundir, cmd, pass_fds=(fd,))
            caps = [{"capability": "x-ignore-shared", "state": True}] if ram_from_template else []
            await self._qmp(rundir, [("migrate-set-capabilities", {"capabilities": caps}),
                                     ("migrate-incoming", {"uri": f"fd:{fd}"})])
        finally:
            os.close(fd)
        deadline = time.monotonic() + max(30.0, self.restore_timeout)
        while True:
            try:
                status = (await self._qmp(rundir, [("query-status", {})]))[-1]["status"]
            except SandboxError as e:
                # QEMU quits when it cannot load the state: its own message (qemu.log) says why.
                if vm.watcher is not None:
                    await asyncio.wait({vm.watcher}, timeout=5)
                raise SandboxError(f"restoring {template.name} failed: {vm.dead or e}") from None
            if status != "inmigrate":
                break
            if vm.dead or time.monotonic() > deadline:
                raise SandboxError(f"restoring {template.name} failed: {vm.dead or 'timed out'}")
            await asyncio.sleep(0.005)
        if status not in ("paused", "postmigrate", "prelaunch"):
            raise SandboxError(f"restoring {template.name} left QEMU in state {status!r}")
        vm.client = await self._connect(vm, 10)
        await self._qmp(rundir, [("cont", {})])
        await vm.client.ping(timeout=self.restore_timeout)

    def _confines(self, record: SandboxRecord) -> bool:
        """Whether ``record``'s commands run confined (microvm: always)."""
        return self.confines_commands

    def _confine_extra(self, record: SandboxRecord) -> list[tuple[str, str]]:
        """More of the commands' confinement than protected and hidden paths (the vm backend's)."""
        return []

    async def _prepare(self, record: SandboxRecord) -> None:
        client = self._client(record)
        await client.identity(record.id[:63], uuid.uuid4().hex, os.urandom(64))
        await self.guest.make_workdir(record, workdir_of(record))
        if self._confines(record):
            try:
                hidden = await client.confine(record.spec.protected, record.spec.hidden,
                                              self._confine_extra(record))
            except InvalidRequest as e:  # a path the image lacks, or one through a symlink: the spec's fault
                raise InvalidRequest(str(e).replace("guest agent refused the request: ", "")) from None
            record.backend_state["hidden"] = hidden  # until reveal()

    async def reveal(self, record: SandboxRecord) -> None:
        """Uncover the hidden paths (the agent unmounts their covers in the commands' mount namespace and
        leaves them read-only)."""
        if not self._confines(record):
            await super().reveal(record)
        if not record.backend_state.get("hidden"):
            return
        try:
            await self._client(record).reveal()
        except AgentGone as e:
            raise SandboxError(f"sandbox {record.id}: {await self._why_gone(record.id, e)}") from None
        record.backend_state["hidden"] = []

    async def _sandbox_disk(self, sandbox_id: str, base: Path, saved: Path | None) -> Path:
        """The disk a sandbox's QEMU opens: here the shared read-only EROFS image (the writable layer is in
        guest RAM). ``saved`` is the template or snapshot directory it is restored from, if any."""
        return base

    async def _saved(self, record: SandboxRecord, target: Path) -> None:
        """Called after :meth:`_save` wrote ``target`` while the VM is still stopped (for disk state)."""

    def _template_key(self, erofs: Path, vcpus: int, mem_mib: int, disk_bytes: int) -> str:
        return hashlib.sha256(f"{erofs.name}:{vcpus}:{mem_mib}:{disk_bytes}:{self.accel}:"
                              f"{self._initramfs}:{_CMDLINE}".encode()).hexdigest()[:16]

    async def _template(self, erofs: Path, image: ImageRef, vcpus: int, mem_mib: int, disk_bytes: int,
                        nic: bool = False) -> Path:
        """Directory with ``ram`` + ``state`` of a booted, idle guest of this shape (made on first use); with
        ``nic``, of a guest with a network device (booted on a tap in a namespace of its own, no veth)."""
        key = self._template_key(erofs, vcpus, mem_mib, disk_bytes) + ("-nic" if nic else "")
        tdir = self.root / "templates" / key
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if (tdir / "state").exists():
                return tdir
            shutil.rmtree(tdir, ignore_errors=True)
            tdir.mkdir(parents=True)
            self._chown(tdir)
            rec = SandboxRecord(id=f"tpl-{key}", spec=record_spec(image, vcpus, mem_mib, disk_bytes),
                                state="creating", created_at=time.time(), expires_at=time.time() + 600)
            rundir = self.run_root / rec.id
            shutil.rmtree(rundir, ignore_errors=True)
            rundir.mkdir(mode=0o711)
            self._chown(rundir)
            try:
                if nic:
                    await self._network_up(rec, Policy("none"))
                disk = await self._sandbox_disk(rec.id, erofs, None)
                await self._cold_boot(rec, rundir, disk, vcpus, mem_mib, disk_bytes, ram_file=tdir / "ram")
                await self._save(rec, tdir / "state", ignore_shared=True)
                (tdir / "meta.json").write_text(json.dumps({"image": image.name, "erofs": str(erofs),
                                                            "vcpus": vcpus, "memory_mib": mem_mib, "nic": nic}))
            except BaseException:
                shutil.rmtree(tdir, ignore_errors=True)
                raise
            finally:
                await self._destroy_id(rec.id, rec.backend_state)
            os.chmod(tdir / "ram", 0o444)
        return tdir

    async def _save(self, record: SandboxRecord, target: Path, ignore_shared: bool = False) -> None:
        """Stop the VM and write its state to ``target`` (QEMU migration over a passed fd: no spawn)."""
        rundir = Path(record.backend_state["rundir"])
        tmp = target.with_name(f".{target.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            caps = [{"capability": "x-ignore-shared", "state": ignore_shared}]
            await self._qmp(rundir, [("migrate-set-capabilities", {"capabilities": caps}), ("stop", {})])
            await self._qmp(rundir, [("getfd", {"fdname": "snap"}), ("migrate", {"uri": "fd:snap"})], fd=fd)
        finally:
            os.close(fd)
        while True:
            info = (await self._qmp(rundir, [("query-migrate", {})]))[-1]
            if info.get("status") == "completed":
                break
            if info.get("status") in ("failed", "cancelled"):
                tmp.unlink(missing_ok=True)
                raise SandboxError(f"saving the VM failed: {info.get('error-desc', info.get('status'))}")
            await asyncio.sleep(0.01)
        os.replace(tmp, target)
        await self._saved(record, target)

    async def _qmp(self, rundir: Path, commands: list[tuple[str, dict[str, Any]]], fd: int | None = None
                   ) -> list[Any]:
        """Run QMP commands on one connection; ``fd`` rides along the first command (for ``getfd``)."""
        try:
            return await self._qmp_once(rundir, commands, fd)
        except (OSError, ValueError, TimeoutError) as e:
            raise SandboxError(f"QEMU's monitor failed ({commands[0][0]}): {e}") from None

    async def _qmp_once(self, rundir: Path, commands: list[tuple[str, dict[str, Any]]], fd: int | None
                        ) -> list[Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(500):
                try:
                    await loop.sock_connect(sock, str(rundir / "qmp.sock"))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.01)
            else:
                raise SandboxError("QEMU's QMP socket did not open")
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
            try:
                await asyncio.wait_for(reader.readline(), 10)
                out = []
                for i, (name, args) in enumerate([("qmp_capabilities", {}), *commands]):
                    data = json.dumps({"execute": name, "arguments": args}).encode() + b"\n"
                    if fd is not None and i == 1:
                        await writer.drain()
                        # a few hundred bytes on an idle socket: sendmsg does not block
                        socket.send_fds(sock, [data], [fd])
                    else:
                        writer.write(data)
                        await writer.drain()
                    while True:
                        line = await asyncio.wait_for(reader.readline(), 30)
                        if not line:
                            raise SandboxError(f"QEMU closed QMP during {name}")
                        reply = json.loads(line)
                        if "event" not in reply:
                            break
                    if "error" in reply:
                        raise SandboxError(f"QMP {name} failed: {reply['error'].get('desc')}")
                    out.append(reply.get("return"))
                return out[1:]
            finally:
                writer.close()
        finally:
            sock.close()

    # -- network ----------------------------------------------------------------------------------------

    def _namespace(self, sandbox_id: str) -> TapNamespace:
        return TapNamespace(self.net_tag, sandbox_id)

    async def _network_up(self, record: SandboxRecord, policy: Policy) -> None:
        """The sandbox's network namespace with the tap its NIC sits on; unless ``policy`` is none, its veth
        pair and rules too (:mod:`dsec.isolation.network`)."""
        namespace = self._namespace(record.id)
        record.backend_state["netns"] = namespace.name
        await asyncio.to_thread(namespace.create)
        if policy.mode != "none":
            await self._network_attach(record, policy)

    async def _network_attach(self, record: SandboxRecord, policy: Policy) -> None:
        namespace = self._namespace(record.id)
        resolver = await self.networks.connect(record.backend_state, namespace.name, policy)
        await asyncio.to_thread(namespace.route_dns, resolver)

    def _network_down(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """Remove the sandbox's rules, veth pair and namespace (blocking; nothing to do without them)."""
        self.networks.release(state)
        self._namespace(sandbox_id).delete()

    async def set_network(self, record: SandboxRecord, network: str | list[str]) -> None:
        """Swap a live sandbox's policy (one nft transaction on the host, as on the container backend).

        A sandbox created with ``network="none"`` has no network device, and a microVM cannot gain one
        while it runs: it is refused, unless the new policy is ``"none"`` too."""
        policy = Policy.parse(network)
        if not record.backend_state.get("netns"):
            if policy.mode == "none":
                return
            raise NotSupported(f"sandbox {record.id} was created with network='none' and has no network device; a "
                               f"{self.name} sandbox cannot gain one while it runs: create it with its set-up policy "
                               f"(e.g. network='allow') and switch to 'none' later")
        if not await self.networks.set_policy(record.backend_state, policy) and policy.mode != "none":
            await self._network_attach(record, policy)

    # -- agent operations ------------------------------------------------------------------------------

    def alive(self, record: SandboxRecord) -> bool:
        vm = self._vms.get(record.id)
        return vm is not None and not vm.dead and vm.client is not None and vm.client.dead_reason is None

    def components(self) -> dict[str, Check]:
        if self.accel is None:
            return {}
        return {"accelerator": Check(None, f"{self.accel}" + (f" ({self.accel_reason})" if self.accel_reason else ""))}

    def lost(self, record: SandboxRecord) -> str | None:
        vm = self._vms.get(record.id)
        if vm is None:
            return f"its {self.name} QEMU is not running"
        return vm.dead or (vm.client.dead_reason if vm.client is not None else None)

    def _vm(self, record: SandboxRecord) -> _VM:
        vm = self._vms.get(record.id)
        if vm is None:
            raise SandboxError(f"sandbox {record.id} is not running (no {self.name} QEMU)")
        if vm.dead:
            raise SandboxError(f"sandbox {record.id} is dead: {vm.dead}")
        return vm

    def _client(self, record: SandboxRecord) -> AgentClient:
        vm = self._vm(record)
        if vm.client is None or vm.client.dead_reason is not None:
            reason = vm.client.dead_reason if vm.client else "not connected"
            raise SandboxError(f"sandbox {record.id}: guest agent unreachable ({reason})")
        return vm.client

    def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                    ) -> AsyncIterator[ExecEvent]:
        return self._exec_stream(record, request, user=user)

    async def _system_exec(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        """Run the backend's own upkeep command in the guest: as root, never confined (a vm's clock, its disk's
        growth), whatever the sandbox's commands may do."""
        return await collect_exec(self._exec_stream(record, request, system=True))

    def _pristine_refusal(self, record: SandboxRecord) -> str | None:
        """Why ``record`` cannot run pristine execs (None: it can)."""
        if self.pristine_execs:
            return None
        return (f"pristine execs are not available on the {self.name} backend (its root disk is the sandbox's "
                f"own, with no untouched copy of the image): use backend='microvm' or 'container'")

    async def _exec_stream(self, record: SandboxRecord, request: ExecRequest, system: bool = False,
                           user: Identity | None = None) -> AsyncIterator[ExecEvent]:
        refusal = self._pristine_refusal(record) if request.pristine else None
        if refusal:
            raise NotSupported(refusal)
        client = self._client(record)
        if system:
            # Unconfined root: nothing of the sandbox's may steer it (a PATH or LD_* of the spec's env, a
            # planted binary in the workdir), so neither the spec's nor the image's environment nor its user.
            env, cwd, identity = {"PATH": _DEFAULT_PATH, "HOME": "/root", **(request.env or {})}, "/", ROOT
        else:
            identity = user or default_identity(record)
            env = {"PATH": _DEFAULT_PATH, "HOME": identity.home if user else record.backend_state.get("home", "/root"),
                   **record.backend_state.get("image_env", {}), **record.spec.env, **(request.env or {})}
            cwd = request.cwd or workdir_of(record)
        check_exec_size(request.argv(), env)
        start = time.monotonic()
        if identity.groups:  # supplementary groups: the extended request
            channel = await client.start_ext(request.argv(), env, cwd, creds_of(identity),
                                             EXT_PRISTINE if request.pristine else 0)
        else:
            channel = await client.start_exec(request.argv(), env, cwd, identity.uid, identity.gid,
                                              pristine=request.pristine, system=system)
        finished = False
        try:
            if request.stdin:
                await client.stdin(channel, request.stdin)
            await client.send(T.STDIN, channel, b"")
            captured = {T.STDOUT: bytearray(), T.STDERR: bytearray()}
            limit = None
            deadline = None if request.timeout is None else start + request.timeout
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 and limit is None:
                    limit = "time"
                    await client.signal(channel, signal.SIGKILL)
                    left = None
                try:
                    frame = await client.next_frame(channel, left if limit is None else 30.0)
                except TimeoutError:
                    if limit is None:
                        continue  # the deadline passed: loop to kill
                    raise SandboxError("the guest agent did not report a killed command's exit") from None
                except AgentGone as e:
                    raise SandboxError(f"sandbox {record.id}: {await self._why_gone(record.id, e)}") from None
                if frame.type in captured:
                    buf = captured[frame.type]
                    room = request.max_output - len(buf)
                    data = frame.payload[:max(room, 0)]
                    if data:
                        buf += data
                        yield ExecEvent(type="stdout" if frame.type == T.STDOUT else "stderr", data=data)
                    if len(frame.payload) > room and limit is None:
                        limit = "output"
                        await client.signal(channel, signal.SIGKILL)
                elif frame.type == T.EXIT:
                    code, sig, oom = parse_exit(frame.payload)
                    finished = True
                    if oom and code != 0 and limit is None:
                        limit = "memory"
                    yield ExecEvent(type="exit", result=ExecResult(
                        exit_code=code, stdout=bytes(captured[T.STDOUT]), stderr=bytes(captured[T.STDERR]),
                        duration_s=time.monotonic() - start, truncated=limit == "output", signal=sig,
                        limit=limit))
                    return
                elif frame.type == T.ERROR:
                    finished = True
                    detail = frame.payload[4:300].decode(errors="replace")
                    raise SandboxError(f"guest agent could not run the command: {detail}")
        finally:
            if not finished:
                await client.signal(channel, signal.SIGKILL)
            client.close_channel(channel)

    async def _why_gone(self, sandbox_id: str, exc: Exception) -> str:
        """Why the agent connection ended: QEMU's fate once the watcher has seen it (panic, power-off...)."""
        vm = self._vms.get(sandbox_id)
        if vm is not None and vm.watcher is not None:
            await asyncio.wait({vm.watcher}, timeout=5)
            if vm.dead:
                return vm.dead
        return str(exc)

    # Files as root keep the agent's own READ/WRITE/LIST (a write is atomic: temp file + rename); as another
    # user, and every other file operation, go through FS requests (guest/surface.py, agent_surface.c).

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        async with self.guest.files(record, user) as files:
            if not _as_root(record, user):
                return await files.read(_normalise(path), max_bytes)
            return await self._client(record).read(_normalise(path), max_bytes)

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        path = _normalise(path)
        if path == "/":
            raise InvalidRequest("cannot write to '/'", path=path)
        async with self.guest.files(record, user) as files:
            if not _as_root(record, user):
                await files.write(path, data, mode)
                return
            await self._client(record).write(path, data, mode)

    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        async with self.guest.files(record, user) as files:
            if not _as_root(record, user):
                return await files.list(_normalise(path))
            return await self._client(record).list(_normalise(path))

    async def stat_file(self, record: SandboxRecord, path: str, user: Identity | None = None) -> FileStat:
        async with self.guest.files(record, user) as files:
            return await files.stat(_normalise(path))

    async def make_dir(self, record: SandboxRecord, path: str, parents: bool, mode: int,
                       user: Identity | None = None) -> FileStat:
        async with self.guest.files(record, user) as files:
            return await files.mkdir(_normalise(path), parents, mode)

    async def remove_file(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> None:
        async with self.guest.files(record, user) as files:
            await files.remove(_normalise(path), recursive)

    async def rename_file(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                          user: Identity | None = None) -> FileStat:
        async with self.guest.files(record, user) as files:
            return await files.rename(_normalise(source), _normalise(destination), overwrite)

    async def chmod_file(self, record: SandboxRecord, path: str, mode: int, user: Identity | None = None
                         ) -> FileStat:
        async with self.guest.files(record, user) as files:
            return await files.chmod(_normalise(path), mode)

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        async with self.guest.files(record, user) as files:
            return await files.chown(_normalise(path), owner)

    async def watch_files(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> AsyncIterator[FileEvent]:
        return await self.guest.watch(record, _normalise(path), recursive, user)

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        identity = user or default_identity(record)
        env = {"PATH": _DEFAULT_PATH, "HOME": identity.home if user else record.backend_state.get("home", "/root"),
               **({"TERM": "xterm-256color"} if spec.pty else {}), **record.backend_state.get("image_env", {}),
               **record.spec.env, **spec.env}
        check_exec_size(spec.argv, env)
        return await self.guest.start(record, spec.argv, env, spec.cwd or workdir_of(record), identity, sink,
                                      spec.pty, spec.pty_stdin, spec.timeout)

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        return await self.guest.open_port(record, port)

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        cg = self._cgroups(record.id)
        return SandboxStats(memory_bytes=cg.memory_usage(), memory_peak_bytes=cg.memory_peak(),
                            cpu_seconds=cg.cpu_seconds(), pids=cg.pids_current())

    async def pause(self, record: SandboxRecord) -> None:
        """Stop the vCPUs (QMP ``stop``); with ``hibernate_on_pause`` also save the VM and release its RAM."""
        if self.hibernate_on_pause:
            await self.hibernate(record)
            return
        vm = self._vm(record)
        await self._qmp(vm.rundir, [("stop", {})])

    async def resume(self, record: SandboxRecord) -> None:
        if record.backend_state.get("hibernated"):
            await self._wake(record)
            return
        vm = self._vm(record)
        await self._qmp(vm.rundir, [("cont", {})])

    async def hibernate(self, record: SandboxRecord) -> None:
        """Save the whole VM to disk and end its QEMU, giving its memory back to the host; resume restores it
        (same identity, processes and files). Already hibernated: nothing to do."""
        if record.backend_state.get("hibernated"):
            return
        self._vm(record)
        target = self.root / "hibernated" / record.id
        target.mkdir(parents=True, exist_ok=True)
        try:
            await self._save(record, target / "state")
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            with contextlib.suppress(SandboxError):
                await self._qmp(Path(record.backend_state["rundir"]), [("cont", {})])
            raise
        await self._kill(record.id, record.backend_state)
        rundir = self.run_root / record.id
        for f in rundir.iterdir():
            f.unlink()
        record.backend_state.update(hibernated=str(target), qemu_pid=None, qemu_start=None)

    async def _wake(self, record: SandboxRecord) -> None:
        target = Path(record.backend_state["hibernated"])
        if not (target / "state").is_file():
            raise SandboxError(f"sandbox {record.id} cannot wake: its saved state {target / 'state'} is missing")
        vcpus, mem_mib, disk_bytes = self._shape(record)
        await self.wait_accelerator()
        rundir = self.run_root / record.id
        rundir.mkdir(mode=0o711, exist_ok=True)
        self._chown(rundir)
        try:
            await self._restore(record, rundir, Path(record.backend_state["erofs"]), target, vcpus, mem_mib,
                                disk_bytes, ram_from_template=False)
        except BaseException:
            await self._kill(record.id, record.backend_state)
            raise
        record.backend_state.pop("hibernated")
        shutil.rmtree(target, ignore_errors=True)

    async def snapshot(self, record: SandboxRecord, target: Path) -> None:
        """Save the whole VM (RAM, devices, the tmpfs writable layer) into ``target``: ``state`` (a QEMU
        migration stream) and ``vm.json`` (its shape). A running VM runs on afterwards; a paused one stays so."""
        vm = self._vm(record)
        status = (await self._qmp(vm.rundir, [("query-status", {})]))[-1]["status"]
        vcpus, mem_mib, disk_bytes = self._shape(record)
        try:
            await self._save(record, target / "state")
            (target / "vm.json").write_text(json.dumps({"vcpus": vcpus, "memory_mib": mem_mib, "disk": disk_bytes,
                                                        "accel": self.accel,
                                                        "nic": bool(record.backend_state.get("netns"))}))
        finally:
            if status == "running":
                with contextlib.suppress(SandboxError):
                    await self._qmp(vm.rundir, [("cont", {})])

    async def restore(self, record: SandboxRecord, image: ImageRef, layers: list[Path]) -> None:
        """Create ``record`` from a :meth:`snapshot` (one layer: ``state`` and ``vm.json``): the VM's shape
        (vCPUs, memory, disk) is the snapshot's, whatever the spec asked; the clone gets a fresh identity."""
        if len(layers) != 1:
            raise SandboxError(f"a microvm snapshot is one layer, got {len(layers)}: not a microvm snapshot")
        source = layers[0]
        try:
            shape = json.loads((source / "vm.json").read_text())
            vcpus, mem_mib, disk_bytes = int(shape["vcpus"]), int(shape["memory_mib"]), int(shape["disk"])
            nic = bool(shape.get("nic", False))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SandboxError(f"snapshot {source.name} is not a readable {self.name} snapshot: {e}") from None
        if not (source / "state").is_file():
            raise SandboxError(f"snapshot {source.name} is incomplete: its state file is missing")
        policy = Policy.parse(record.spec.network)
        if policy.mode != "none" and not nic:
            raise InvalidRequest(f"snapshot {source.name} was taken of a sandbox without a network device "
                                 f"(network='none'): its clones cannot have network={record.spec.network!r}")
        record.spec.cpu, record.spec.memory, record.spec.disk = float(vcpus), mem_mib * MiB, disk_bytes
        self._shape(record)
        await self.wait_accelerator()
        erofs = await self._erofs(image)
        apply_image_defaults(record, image)
        record.backend_state = {"image_env": dict(image.config.env), "accel": self.accel, "start": "snapshot",
                                "erofs": str(erofs), **await self._image_user(image, record.spec.user)}
        rundir = self.run_root / record.id
        rundir.mkdir(mode=0o711)
        self._chown(rundir)
        try:
            if nic:  # the snapshot's VM has a NIC: its clone too (with no veth while its policy is none)
                await self._network_up(record, policy)
            disk = await self._sandbox_disk(record.id, erofs, source)
            record.backend_state["erofs"] = str(disk)
            await self._restore(record, rundir, disk, source, vcpus, mem_mib, disk_bytes, ram_from_template=False)
            await self._prepare(record)
        except BaseException:
            await self._destroy_id(record.id, record.backend_state)
            raise

    async def destroy(self, record: SandboxRecord) -> None:
        await self._destroy_id(record.id, record.backend_state)

    async def _kill(self, sandbox_id: str, state: dict[str, Any]) -> None:
        vm = self._vms.pop(sandbox_id, None)
        if vm is not None and vm.client is not None:
            vm.client.mark_dead("sandbox destroyed")
        pid = state.get("qemu_pid")
        if pid and start_time(pid) == state.get("qemu_start"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc = vm.proc if vm is not None and vm.proc is not None else _DETACHED.pop(pid, None) if pid else None
        if proc is not None:
            await asyncio.to_thread(proc.wait)
        if vm is not None and vm.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(vm.watcher, 5)
        if vm is not None and vm.console_task is not None:
            vm.console_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await vm.console_task
        if vm is not None and vm.client is not None:
            await vm.client.aclose()
        cg = self._cgroups(sandbox_id)
        for _ in range(500):
            pids = cg.pids()
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            await asyncio.sleep(0.004)
        await asyncio.to_thread(cg.remove)

    async def _destroy_id(self, sandbox_id: str, state: dict[str, Any]) -> None:
        await self._kill(sandbox_id, state)
        self.networks.forget(state)
        try:
            await asyncio.to_thread(self._network_down, sandbox_id, state)
        finally:  # the files go even if the network's removal failed (the orphan sweep retries it)
            rundir = self.run_root / sandbox_id
            await asyncio.to_thread(shutil.rmtree, rundir, True)
            await asyncio.to_thread(shutil.rmtree, self.root / "hibernated" / sandbox_id, True)
            await asyncio.to_thread(shutil.rmtree, self.sandbox_files / sandbox_id, True)
            if not self._started:  # closed meanwhile: its close could not remove the run directory
                self._remove_run_root()

    async def recover(self, record: SandboxRecord) -> bool:
        if record.backend_state.get("hibernated"):
            record.state = "paused"
            if not (Path(record.backend_state["hibernated"]) / "state").is_file():
                return False
            if record.backend_state.get("netns") and not self._namespace(record.id).exists():
                return False  # the host rebooted: the NIC's namespace is gone
            await self.networks.recover(record.backend_state, record.spec.network)  # its namespace stayed
            return True
        pid = record.backend_state.get("qemu_pid")
        rundir = record.backend_state.get("rundir")
        if not pid or not rundir or start_time(pid) != record.backend_state.get("qemu_start"):
            return False
        vm = _VM(pid=pid, proc=None, rundir=Path(rundir))
        self._adopt(record.id, vm)
        try:
            vm.client = await self._connect(vm, 5)
            await vm.client.ping(timeout=10)
            status = (await self._qmp(vm.rundir, [("query-status", {})]))[-1]["status"]
        except (SandboxError, OSError):
            return False
        if status == "paused":
            record.state = "paused"
        await self.networks.recover(record.backend_state, record.spec.network)
        return True

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        found: set[str] = set()
        if self.run_root.is_dir():
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith(("sb-", "tpl-")))
        if self.sandbox_files.is_dir():
            found.update(p.name for p in self.sandbox_files.iterdir() if p.name.startswith(("sb-", "tpl-")))
        namespaces = await asyncio.to_thread(TapNamespace.names, self.net_tag)
        found.update(n for n in namespaces if n.startswith(("sb-", "tpl-")))
        for cg in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            if Path(cg).is_dir():
                found.update(p.name for p in Path(cg).iterdir() if p.is_dir() and p.name.startswith(("sb-", "tpl-")))
        orphans = sorted(found - known)
        for sandbox_id in orphans:
            state: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                pid = int((self.run_root / sandbox_id / "qemu.pid").read_text())
                if f"/{self.cgroup_parent}/{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text():
                    state = {"qemu_pid": pid, "qemu_start": start_time(pid)}
            await self._destroy_id(sandbox_id, state)
        await self.networks.sweep()  # chains of sandboxes no recovered record claims (recover() runs first)
        return orphans


def record_spec(image: ImageRef, vcpus: int, mem_mib: int, disk_bytes: int) -> SandboxSpec:
    return SandboxSpec(image=image.name, backend="microvm", cpu=vcpus, memory=mem_mib * MiB, disk=disk_bytes)


def _as_root(record: SandboxRecord, user: Identity | None) -> bool:
    """Whether a file call acts as the guest's root (the agent's own credentials)."""
    identity = user or default_identity(record)
    return identity.is_root and identity.gid == 0 and not identity.groups


def _normalise(path: str) -> str:
    import posixpath

    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute and free of NUL bytes, got {path!r}", path=path)
    return posixpath.normpath(path)


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
