"""The ``container`` backend: OCI containers (crun) on an overlay over a read-only image root.

Create: make the sandbox's cgroups with their limits (:mod:`dsec.isolation.cgroups`), mount
an overlayfs (image root as the read-only lower, a per-sandbox upper), write the OCI config
(:mod:`dsec.isolation.oci_runtime`) and ``crun run --detach`` a static init from inside those cgroups
(through ``dsec-rtshim``; crun runs with its cgroup manager disabled).
Exec: never ``crun/runc exec``; the node's exec helper (``dsec-nsexec``, ``isolation/nsexec.c``) joins
the running sandbox in ~1 ms with the same restrictions. Files: confined ``openat2`` from the
host (:mod:`dsec.isolation.files`). Pause: the freezer cgroup. Destroy: kill the init (the pid
namespace goes with it), remove the cgroups, unmount, remove the upper and the runtime state.

This module owns the sandbox's host resources (bundle directory, mount, runtime state,
cgroups) and must leave none of them behind, including after a daemon crash
(:meth:`ContainerBackend.recover`, :meth:`ContainerBackend.cleanup_orphans`). The calls into a running
sandbox (exec, processes, ports, files, stats) are :mod:`dsec.backends.container_io`'s mixin, the host-side
mount steps :mod:`dsec.backends.container_host`'s functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dsec.accounts import ROOT
from dsec.backends.base import (
    Check,
    ImageRef,
    apply_image_defaults,
    store_identity,
    workdir_of,
)
from dsec.backends.container_host import (
    attach_sandbox,
    last_runtime_error,
    mask_dir,
    pidfd_of,
    plain_dir,
    private_dir,
)
from dsec.backends.container_io import ContainerIO
from dsec.backends.hostside import HostFiles
from dsec.config import Settings
from dsec.errors import BackendUnavailable, SandboxError
from dsec.images.users import resolve_user
from dsec.isolation.binaries import ensure_init, ensure_nsenter, ensure_nsexec, ensure_rtshim
from dsec.isolation.cgroups import (
    TEARDOWN_BOUND,
    CgroupSet,
    LimitCounters,
    background_group,
    v2_controllers_in_hybrid,
)
from dsec.isolation.disk import umount
from dsec.isolation.exec_client import ExecHelper
from dsec.isolation.files import SandboxFS, make_workdir
from dsec.isolation.mounts import MountHolder, attach, clone_tree, overlay_mount, sysfs_mount, tmpfs_mount
from dsec.isolation.network import Policy, SandboxNetworks
from dsec.isolation.oci_runtime import exec_rlimits, runtime_config, sandbox_limits
from dsec.isolation.paths import cover_paths, protect_paths
from dsec.isolation.procs import ended, reap, sealed_executable, start_time
from dsec.isolation.seccomp import DEFAULT_PROFILE
from dsec.models import SandboxRecord

__all__ = ["ContainerBackend"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_CHILD_SUBREAPER = 36


PRISTINE_DIR = "/.dsec-pristine"
"""Where a sandbox sees its image's original root (read-only); ``dsec-nsenter`` roots pristine execs there."""


class ContainerBackend(ContainerIO):
    """crun + overlayfs + user namespace + DSec-made cgroups; exec through the node's exec helper."""

    name = "container"

    STATE_BASE = Path("/dev/shm")
    """A tmpfs on every Linux host (``/run`` is ext4 on some): where each home keeps its sandboxes' bundles and
    crun's state (see :attr:`state_root`)."""

    def __init__(self, settings: Settings | None = None, runtime: str | None = None) -> None:
        self.settings = settings or Settings()
        # DSEC_HOME/container keeps the mount holder's pid file (and, from before the state moved to a tmpfs,
        # bundles of sandboxes still alive: teardown and orphan cleanup look in both places).
        self.root = self.settings.home / "container"
        self._legacy_runtime_root = self.settings.home / "runtime"
        self.runtime = runtime or shutil.which("crun") or "/usr/bin/crun"
        # Cgroups and /run are host-wide: each DSEC_HOME gets its own tag so that two daemons (tests, a
        # developer's and CI's) never touch each other's sandboxes when cleaning up orphans.
        tag = hashlib.sha256(str(self.settings.home.resolve()).encode()).hexdigest()[:8]
        self.cgroup_parent = f"dsec-{tag}"
        self._tag = tag
        # Per-sandbox bundles (config.json, init.pid, the runtime's log, the disk's mount point) and crun's state
        # directory live on a tmpfs: on an ext4 DSEC_HOME their ~10 creates, writes and unlinks per sandbox would be
        # journal commits (jbd2 and kworker CPU charged to nobody, and waits on a busy journal). A tmpfs keeps
        # them across a daemon crash (recover() reads them), not across a reboot, which no sandbox survives.
        self.state_root = self.STATE_BASE / f"dsec-{tag}"
        self.bundles = self.state_root / "container"
        self.runtime_root = self.state_root / "runtime"
        # Root filesystems are mounted where the container's (shifted) root user can traverse to
        # them: crun mounts them from inside the user namespace, and DSEC_HOME may sit below a
        # 0700 directory. The writable layers stay in DSEC_HOME, on disk.
        self.mounts = Path("/run/dsec") / tag
        # Both beside /run/dsec/<tag>, in root's /run/dsec: the sandboxes' root user owns /run/dsec/<tag> and
        # could swap an entry there, and crun and the backend find these by path at every create.
        self.mask_dir = Path("/run/dsec") / f"{tag}.masked"
        """Empty, root's, 0555: bound read-only over the masked directories of every sandbox (oci.runtime_config)."""
        self.sysfs = Path("/run/dsec") / f"{tag}.sysfs"
        """Where the node's shared sysfs (mounts.sysfs_mount) is mounted in the holder's namespace."""
        self._sysfs_dev = 0
        self._helper: ExecHelper | None = None
        self._init: Path | None = None
        self._nofile = 0
        self._shim: Path | None = None
        # A sealed in-memory copy of the runtime (procs.sealed_executable), or None: crun then runs from its path.
        self._runtime_exe: int | None = None
        self._runtime_exe_lock = threading.Lock()
        # The node's private mount namespace, where each sandbox's overlay and disk live (mounts.py).
        self._holder: MountHolder | None = None
        self._mask_v2 = False
        self.networks = SandboxNetworks(tag)
        self.files = HostFiles(self._fs)
        # Sandbox id -> execs running now; a sandbox with none (for CPU_IDLE_AFTER_S) is in the best-effort
        # CPU class. _busy_class: the sandboxes in the normal class now; _idle_timers: their pending demotions.
        self._busy: dict[str, int] = {}
        # Sandbox id -> what every exec needs of its cgroups (the set, the cgroup.procs files to join, the
        # limit counters), resolved at its first exec instead of at each one; dropped on destroy.
        self._exec_cgroups: dict[str, tuple[CgroupSet, list[str], LimitCounters]] = {}
        self._busy_class: set[str] = set()
        self._idle_timers: dict[str, asyncio.TimerHandle] = {}
        # Runtime calls block a thread each (~10 ms); enough threads for a burst of creates on a big node.
        self._runtime_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="dsec-runtime")

    def available(self) -> str:
        if os.geteuid() != 0:
            return "needs root (it creates namespaces, cgroups and overlay mounts)"
        if not Path(self.runtime).exists():
            return "crun not found: apt-get install crun"
        return "ok"

    async def start(self) -> None:
        reason = self.available()
        if reason != "ok":
            raise BackendUnavailable(f"container backend: {reason}")
        # Sandbox inits are orphaned when `crun run --detach` exits; as a subreaper the daemon
        # inherits them and reaps each one on destroy, instead of leaving zombies for the host's
        # pid 1 (which may reap late, or never in a minimal container host).
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_dir(self.state_root)
        self.bundles.mkdir(exist_ok=True, mode=0o700)
        self.runtime_root.mkdir(exist_ok=True, mode=0o700)
        # /run/dsec is 0711 (traversable, not listable); /run/dsec/<tag> belongs to the sandboxes' root
        # user, 0700: crun mounts from inside the user namespace and must traverse it, nobody else may.
        self.mounts.parent.mkdir(exist_ok=True, mode=0o711)
        os.chmod(self.mounts.parent, 0o711)
        self.mounts.mkdir(exist_ok=True, mode=0o700)
        os.chown(self.mounts, self.settings.uid_shift, self.settings.uid_shift)
        os.chmod(self.mounts, 0o700)
        mask_dir(self.mask_dir)
        built = await asyncio.to_thread(ensure_init, self.settings.home / "bin")
        self._init = self.mounts / built.name
        if not self._init.exists():
            await asyncio.to_thread(shutil.copy2, built, self._init)
        bpf = await asyncio.to_thread(DEFAULT_PROFILE.compile_bpf)
        nsenter = await asyncio.to_thread(ensure_nsenter, self.settings.home / "bin")
        nsexec = await asyncio.to_thread(ensure_nsexec, self.settings.home / "bin")
        # The init's open-file limit (OCI config), read once: commands get the same.
        self._nofile = exec_rlimits()["nofile"][0]
        self._shim = await asyncio.to_thread(ensure_rtshim, self.settings.home / "bin")
        if self._runtime_exe is None:
            self._runtime_exe = await asyncio.to_thread(self._sealed_runtime)
        self._mask_v2 = v2_controllers_in_hybrid()
        # The sandboxes' group gets its CPU class when a create makes it; one kept from an earlier daemon (live
        # sandboxes) gets this daemon's setting here.
        await asyncio.to_thread(background_group, self.cgroup_parent, self.settings.sandbox_cpu_idle, make=False)
        holder = MountHolder(self._shim, self.root / "mntns.pid", self._tag)
        await asyncio.to_thread(holder.start)
        self._holder = holder
        await asyncio.to_thread(self._mount_sysfs)
        self._helper = ExecHelper(bpf, nsenter, nsexec)
        self._helper.start()

    async def aclose(self) -> None:
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        self._busy_class.clear()
        if self._helper is not None:
            await asyncio.to_thread(self._helper.close)
            self._helper = None
        await self.networks.aclose()
        if self._holder is not None:  # ended with the last sandbox; kept (and re-adopted) while any is alive
            await asyncio.to_thread(self._holder.close, not self._sandbox_dirs())
            self._holder = None
        await asyncio.to_thread(self._remove_empty_parent)
        await asyncio.to_thread(self._remove_empty_mounts_dir)
        await asyncio.to_thread(self._remove_empty_state_root)
        with self._runtime_exe_lock:  # a create still running takes its own duplicate first (_run_runtime)
            if self._runtime_exe is not None:
                os.close(self._runtime_exe)
                self._runtime_exe = None

    def release_host(self, live: set[str]) -> list[str]:
        if live or self._sandbox_dirs():  # the next daemon re-adopts or destroys them through the holder
            return []
        done = []
        if MountHolder(Path("dsec-rtshim"), self.root / "mntns.pid", self._tag).stop_left_behind():
            done.append("mount holder ended")
        if not self.networks.network.indexes():
            self.networks.network.drop_table()
        self._remove_empty_parent()
        self._remove_empty_mounts_dir()
        self._remove_empty_state_root()
        return done

    def _sandbox_dirs(self) -> set[str]:
        """Ids with a bundle, runtime state or root mount point of this home (live or left behind)."""
        found: set[str] = set()
        for parent in (self.bundles, self.root, self.runtime_root, self._legacy_runtime_root, self.mounts):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                found.update(p.name for p in parent.iterdir() if p.name.startswith("sb-"))
        return found

    def _remove_empty_state_root(self) -> None:
        """Drop the home's tmpfs state directory when no sandbox of this home is left."""
        with contextlib.suppress(OSError):
            st = os.lstat(self.state_root)
            if self._sandbox_dirs() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                return  # in use, or not ours (start() refused it)
        for d in (self.bundles, self.runtime_root, self.state_root):
            with contextlib.suppress(OSError):
                d.rmdir()

    def _remove_empty_mounts_dir(self) -> None:
        """Drop /run/dsec/<tag> (and the init copy in it), the mask directory and the sysfs mount point when no
        sandbox of this home is left; live sandboxes keep them, since their init is bind-mounted from there."""
        if self._sandbox_dirs():
            return
        for p in (self.mask_dir, self.sysfs):  # the sysfs is mounted only in the holder's namespace, now gone
            with contextlib.suppress(OSError):
                p.rmdir()
        if not self.mounts.is_dir():
            return
        for p in self.mounts.iterdir():
            if p.name.startswith("dsec-init-"):
                p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.mounts.rmdir()
            self.mounts.parent.rmdir()  # only if no other home uses /run/dsec

    def _remove_empty_parent(self) -> None:
        """The parent cgroup is shared by the home's sandboxes; drop it when no sandbox is left."""
        for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):  # missing, or still holding sandboxes
                os.rmdir(d)

    # -- OCI runtime ----------------------------------------------------------------------

    def _sealed_runtime(self) -> int | None:
        """A sealed copy of the runtime that runs (``--version`` from it, once), or None, with a warning: crun then
        runs from its path and copies itself at every create, as it does anywhere else."""
        try:
            exe = sealed_executable(self.runtime, Path(self.runtime).name)
        except OSError as exc:
            log.warning("container backend: no sealed copy of %s (%s); it will copy itself at every create",
                        self.runtime, exc)
            return None
        try:
            probe = subprocess.run([f"/proc/self/fd/{exe}", "--version"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(exe,), timeout=30,
                                   check=False)
            failure = None if probe.returncode == 0 else (
                probe.stderr.decode(errors="replace").strip() or f"exit status {probe.returncode}")
        except (OSError, subprocess.SubprocessError) as exc:
            failure = str(exc)
        if failure is not None:
            os.close(exe)
            log.warning("container backend: the sealed copy of %s does not run (%s); it will copy itself at every "
                        "create", self.runtime, failure)
            return None
        return exe

    def _run_runtime(self, *args: str, log: Path, cgroups: CgroupSet, root: tuple[int, Path]) -> None:
        """Run crun (cgroup manager disabled) with ``args`` from inside ``cgroups`` (through the shim), in a
        mount namespace of its own where the detached mount tree ``root[0]`` is attached on ``root[1]``.
        Blocking (~10 ms): call it from a worker thread.

        crun's errors go to ``log`` (JSON lines), the shim's to ``log`` + ``.shim``.
        """
        if self._shim is None:
            raise BackendUnavailable("container backend is not started")
        # From the sealed copy (the shim execs /proc/self/fd/N itself): crun skips copying itself first. A duplicate
        # of this call's own, which aclose() closing the backend's meanwhile cannot take away or renumber.
        with self._runtime_exe_lock:
            exe = None if self._runtime_exe is None else os.dup(self._runtime_exe)
        try:
            self._spawn_runtime(args, log, cgroups, root, exe)
        finally:
            if exe is not None:
                os.close(exe)

    def _spawn_runtime(self, args: tuple[str, ...], log: Path, cgroups: CgroupSet, root: tuple[int, Path],
                       exe: int | None) -> None:
        assert self._shim is not None
        shim_errors = log.with_name(log.name + ".shim")
        fds = (root[0],) if exe is None else (root[0], exe)
        cmd = [str(self._shim), str(shim_errors), "1" if self._mask_v2 else "0", f"{root[0]}:{root[1]}",
               *cgroups.procs_files(), "--",
               self.runtime if exe is None else f"/proc/self/fd/{exe}", "--cgroup-manager=disabled", "--root",
               str(self.runtime_root), f"--log=file:{log}", "--log-format=json"]

        # `crun run --detach` hands its own stdio to the container's init, which never closes it: the
        # init gets /dev/null (no host file or pipe inside the sandbox), errors come through the logs.
        # subprocess.run in a worker thread, not the event loop's subprocess support: CPython spawns with
        # vfork, while uvloop's libuv forks the whole daemon (page tables and all) for every call.
        proc = subprocess.run([*cmd, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, check=False, pass_fds=fds)
        if proc.returncode != 0:
            detail = last_runtime_error(log) if log.exists() else None
            with contextlib.suppress(OSError):
                detail = shim_errors.read_text(errors="replace").strip() or detail
            raise SandboxError(f"crun {args[0]} failed: {detail or f'exit status {proc.returncode}'}")

    # -- lifecycle ------------------------------------------------------------------------

    def _bundle(self, sandbox_id: str) -> Path:
        return self.bundles / sandbox_id

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        await self._create(record, image, None)

    layered = True

    async def restore(self, record: SandboxRecord, image: ImageRef, layers: list[Path]) -> None:
        # The snapshot's layers go under a fresh upper as read-only overlay lowers: nothing is copied, and
        # every sandbox restored from (or forked off) one snapshot shares its layers' page cache.
        await self._create(record, image, layers)

    async def snapshot(self, record: SandboxRecord, target: Path) -> None:
        # The upper layer is copied while the cgroup is frozen, so the copy is one instant of the sandbox
        # (no file half-written by a running command). `cp -a` keeps what overlayfs needs when the copy is
        # stacked as a lower: whiteouts (0:0 character devices), opaque-directory xattrs (trusted.overlay.*),
        # owners, modes, hard links, sparse files; the copy shares extents where the filesystem can reflink.
        upper = record.backend_state.get("upper")
        if not upper:
            raise SandboxError(f"sandbox {record.id} has no writable layer recorded")
        self._pid(record)
        was_running = record.state == "running"
        cgroups = self._cgroups(record)
        if was_running:
            await asyncio.to_thread(cgroups.freeze)
        try:
            await self._tool("cp", "-a", "--reflink=auto", "--sparse=always", f"{self.mount_view(record, 'upper')}/.",
                             str(target))
        finally:
            if was_running:
                await asyncio.to_thread(cgroups.thaw)

    async def _tool(self, *cmd: str) -> None:
        def run() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, check=False)

        proc = await asyncio.get_running_loop().run_in_executor(self._runtime_pool, run)
        if proc.returncode != 0:
            raise SandboxError(f"{cmd[0]} failed: {proc.stderr.decode(errors='replace').strip()}")

    async def _create(self, record: SandboxRecord, image: ImageRef, layers: list[Path] | None) -> None:
        if self._helper is None or self._init is None:
            raise BackendUnavailable("container backend is not started")
        policy = Policy.parse(record.spec.network)
        apply_image_defaults(record, image)
        bundle = self._bundle(record.id)
        disk = bundle / "disk"
        rootfs, upper = self.mounts / record.id, disk / "upper"
        shift = image.uid_shift
        record.backend_state = {
            "bundle": str(bundle), "rootfs": str(rootfs), "upper": str(upper), "disk": str(disk), "uid_shift": shift,
            "cgroups_path": f"/{self.cgroup_parent}/{record.id}",
            # The image's environment (PATH of a Python or Node image...) under the spec's and the call's.
            "image_env": dict(image.config.env),
            # Its overlay and disk are mounted in the node's mount holder, not on the host (mount_view).
            "mntns": True,
            # What its overlay's lowers are (image_mounts): a restart finds a root left on a dead image mount.
            "image_mounts": [str(p) for p in [*(layers or []), image.rootfs]],
        }
        # Cgroups, mounts, user lookup, bundle and the runtime in one worker-thread hop (each hop is a thread
        # hand-off and a wake-up of the loop); the record notes each step as it is done, for the cleanup of a failure.
        started = asyncio.get_running_loop().run_in_executor(
            self._runtime_pool, self._start, record, image, [*(layers or []), image.rootfs], rootfs, bundle,
            # The node's shared sysfs, unless the sandbox has a network: then crun mounts its own (a superblock
            # more), which lists its interfaces under /sys/class/net, as tools that pick an interface expect.
            policy.mode == "none")
        try:
            pid = await asyncio.shield(started)
        except asyncio.CancelledError:
            # A worker thread cannot be stopped: let it finish (tens of ms), so that the caller's cleanup
            # (destroy) finds everything it made instead of racing with a crun still starting the sandbox.
            # A second cancellation meanwhile must not cut that wait short either.
            while not started.done():
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait([started])
            raise
        # Each a worker-thread hop (a hand-off and a wake-up of the loop): only when there is something to do.
        if record.spec.protected:
            await asyncio.to_thread(protect_paths, pid, record.spec.protected)
        if record.spec.hidden:
            await asyncio.to_thread(cover_paths, pid, record.spec.hidden)
        record.backend_state["hidden"] = list(record.spec.hidden)  # until reveal()
        if policy.mode != "none":
            await self._connect(record, policy)

    def _start(self, record: SandboxRecord, image: ImageRef, lowers: list[Path], rootfs: Path, bundle: Path,
               node_sysfs: bool) -> int:
        """Everything blocking of a create (in one worker thread): the bundle, cgroups, mounts, ``crun run``;
        returns the init's pid (its start time noted in the record)."""
        disk = bundle / "disk"
        bundle.mkdir(mode=0o700)
        disk.mkdir()
        rootfs.mkdir()
        cgroups, root_fd = self._prepare(record, image, lowers, rootfs, disk, node_sysfs)
        try:
            self._run_runtime("run", "--detach", "--bundle", str(bundle), "--pid-file", str(bundle / "init.pid"),
                              record.id, log=bundle / "runtime.log", cgroups=cgroups, root=(root_fd, rootfs))
        finally:
            os.close(root_fd)
        pid = int((bundle / "init.pid").read_text())
        # crun keeps its own copy in its state directory; the bundle's would only hold a page of the tmpfs.
        (bundle / "config.json").unlink(missing_ok=True)
        record.backend_state.update(init_pid=pid, init_start=start_time(pid))
        return pid

    def _prepare(self, record: SandboxRecord, image: ImageRef, lowers: list[Path], rootfs: Path,
                 disk: Path, node_sysfs: bool) -> tuple[CgroupSet, int]:
        """Cgroups, mounts and bundle of a new sandbox: its cgroups and a detached clone of its root for the
        runtime shim (the caller closes it)."""
        assert self._init is not None
        cgroups = CgroupSet.create(record.backend_state["cgroups_path"], sandbox_limits(record.spec),
                                   background=self.settings.sandbox_cpu_idle)
        record.backend_state["cgroups"] = cgroups.dirs
        cgroups.set_cpu_class(busy=False)  # born idle: nobody has asked it for anything yet
        root_fd = self._mount_root(record, image, lowers, rootfs, disk, node_sysfs)
        try:
            config = runtime_config(
                sandbox_id=record.id, spec=record.spec, rootfs=rootfs, init_binary=self._init,
                uid_shift=image.uid_shift, uid_count=self.settings.uid_count, cgroups_path=None,
                profile=DEFAULT_PROFILE, mask_dir=self.mask_dir, node_mounts=True, node_sysfs=node_sysfs,
            )
            (self._bundle(record.id) / "config.json").write_text(json.dumps(config))
        except BaseException:
            os.close(root_fd)
            raise
        return cgroups, root_fd

    def _mount_root(self, record: SandboxRecord, image: ImageRef, lowers: list[Path], rootfs: Path,
                    disk: Path, node_sysfs: bool) -> int:
        """Build the sandbox's disk tmpfs and overlay detached (never on the host's mount table), attach them
        on ``disk`` and ``rootfs`` in the mount holder's namespace, and return a detached clone of the root
        for the runtime shim."""
        holder = self._holder
        if holder is None:
            raise BackendUnavailable("container backend is not started")
        shift = image.uid_shift
        disk_fd = tmpfs_mount(record.spec.disk, where=f"the disk of {record.id}")
        try:
            on_disk = f"/proc/self/fd/{disk_fd}"
            os.mkdir(f"{on_disk}/upper")
            os.mkdir(f"{on_disk}/work")
            os.chown(f"{on_disk}/upper", shift, shift)
            # /dev and /dev/shm are directories of the disk, not a tmpfs each (see mount_dev).
            for name, mode in (("dev", 0o755), ("dev/shm", 0o755), ("shm", 0o1777)):
                os.mkdir(f"{on_disk}/{name}")
                os.chown(f"{on_disk}/{name}", shift, shift)
                os.chmod(f"{on_disk}/{name}", mode)
            root_fd = overlay_mount([str(p) for p in lowers], f"{on_disk}/upper", f"{on_disk}/work",
                                    where=f"the root of {record.id}",
                                    setuid=record.spec.allow_privilege_escalation)
            try:
                root = f"/proc/self/fd/{root_fd}"
                # The image's User, looked up in its own /etc/passwd (through the mounted root, so any image
                # format works): execs run as that user, with its home as HOME unless the image's Env sets one.
                user = resolve_user(Path(root), record.spec.user or image.config.user)
                store_identity(record, user)
                make_workdir(SandboxFS(root, shift, shift), workdir_of(record), user)
                # The image's untouched root for pristine execs, read-only inside the sandbox's root (from the
                # sandbox's user namespace a locked mount it cannot undo). A restored upper already has the dir.
                plain_dir(f"{root}{PRISTINE_DIR}")
                pristine = clone_tree(str(image.rootfs), readonly=True)
                try:
                    attach(pristine, PRISTINE_DIR.lstrip("/"), root_fd)
                finally:
                    os.close(pristine)
                plain_dir(f"{root}/sys")
                plain_dir(f"{root}/dev")
                # The rest in one hop to the holder's thread (each is a hand-off and a wake-up).
                sysfs = (str(self.sysfs), self._sysfs_dev) if node_sysfs else None
                return holder.run(attach_sandbox, root_fd, disk_fd, str(rootfs), str(disk), sysfs)
            finally:
                os.close(root_fd)
        finally:
            os.close(disk_fd)

    def _mount_sysfs(self) -> None:
        """The node's shared sysfs in the holder's namespace (kept when an adopted holder already has it)."""
        assert self._holder is not None
        self.sysfs.mkdir(mode=0o555, exist_ok=True)
        if not self._holder.run(os.path.ismount, str(self.sysfs)):
            fd = sysfs_mount()
            try:
                self._holder.run(attach, fd, str(self.sysfs))
            finally:
                os.close(fd)
        self._sysfs_dev = self._holder.run(os.stat, str(self.sysfs)).st_dev

    # -- network --------------------------------------------------------------------------

    async def _connect(self, record: SandboxRecord, policy: Policy) -> None:
        """Give a running sandbox its veth pair, DNS and ``policy`` (see :mod:`dsec.isolation.network`)."""
        host = await self.networks.connect(record.backend_state, self._pid(record), policy)
        fs = self._fs(record, "/", ROOT)[0]
        await asyncio.to_thread(fs.write, "/etc/resolv.conf", f"nameserver {host}\n".encode(), 0o644)

    async def set_network(self, record: SandboxRecord, network: str | list[str]) -> None:
        policy = Policy.parse(network)
        if not await self.networks.set_policy(record.backend_state, policy) and policy.mode != "none":
            await self._connect(record, policy)

    def alive(self, record: SandboxRecord) -> bool:
        pid = record.backend_state.get("init_pid")
        return pid is not None and start_time(int(pid)) == record.backend_state.get("init_start")

    def image_mounts(self, record: SandboxRecord) -> list[Path]:
        return [Path(p) for p in record.backend_state.get("image_mounts", [])]

    def lost(self, record: SandboxRecord) -> str | None:
        pid = record.backend_state.get("init_pid")
        how = ended(int(pid), record.backend_state.get("init_start")) if pid else "never started"
        return None if how is None else f"its init process (pid {pid}) {how}"

    def components(self) -> dict[str, Check]:
        found: dict[str, Check] = {}
        if self._helper is not None:
            found["exec-helper"] = Check(None if self._helper.alive() else "the exec helper (dsec-nsexec) is not "
                                         "running", f"pid {self._helper.pid}")
        if self._holder is not None:
            found["mount-holder"] = Check(None if self._holder.alive() else "the mount holder (dsec-mntns) is gone",
                                          f"pid {self._holder.pid}")
        return found

    def take_healed(self) -> list[tuple[str, str, float, float]]:
        if self._helper is None or not self._helper.healed:
            return []
        done, self._helper.healed = self._helper.healed, []
        return [("exec-helper", why, began, ended) for why, began, ended in done]

    async def repair(self, component: str) -> None:
        if component == "exec-helper" and self._helper is not None:
            await asyncio.to_thread(self._helper.restart)
        elif component == "mount-holder" and self._holder is not None:
            await asyncio.to_thread(self._holder.respawn)

    async def pause(self, record: SandboxRecord) -> None:
        self._pid(record)
        await asyncio.to_thread(self._cgroups(record).freeze)

    async def resume(self, record: SandboxRecord) -> None:
        self._pid(record)
        await asyncio.to_thread(self._cgroups(record).thaw)

    async def destroy(self, record: SandboxRecord) -> None:
        await self._destroy_id(record.id, record.backend_state)

    async def _destroy_id(self, sandbox_id: str, state: dict[str, Any]) -> None:
        self._forget_cpu_class(sandbox_id)
        self.networks.forget(state)
        # Every blocking step in one worker-thread hop: each hop is a thread hand-off and a wake-up of the
        # loop, and six of them are a visible share of a create -> exec -> destroy cycle.
        await asyncio.to_thread(self._teardown, sandbox_id, state)

    def _teardown(self, sandbox_id: str, state: dict[str, Any]) -> None:
        self.networks.release(state)
        # What `crun delete --force` does, without running it: kill init (the pid namespace dies
        # with it), empty and remove the cgroups, drop the runtime's state, unmount, remove the layer.
        pid = state.get("init_pid")
        pidfd = pidfd_of(int(pid), state.get("init_start")) if pid else None
        try:
            if pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            _kill_and_remove_cgroups(self._cgroup_set(sandbox_id, state), pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if pid:
            reap(int(pid), 1.0)  # a killed init, if it is our child (we are its subreaper): not a zombie
        # A sandbox made before bundles and crun's state moved to the tmpfs has them in DSEC_HOME.
        bundles = [self._bundle(sandbox_id), self.root / sandbox_id]
        for runtime_root in (self.runtime_root, self._legacy_runtime_root):
            shutil.rmtree(runtime_root / sandbox_id, True)
        rootfs = self.mounts / sandbox_id
        if self._holder is not None:
            disk = str(state.get("disk") or "")
            if disk not in {str(b / "disk") for b in bundles}:  # never trust a recorded path outside our own
                disk = str(bundles[0] / "disk")
            self._holder.umount(str(rootfs), disk)
        umount(rootfs)  # a sandbox made before the mount holder existed has its mounts on the host
        with contextlib.suppress(FileNotFoundError):
            rootfs.rmdir()
        for bundle in bundles:
            if bundle.exists():
                umount(bundle / "disk")
                shutil.rmtree(bundle, True)
        if any(b.exists() for b in bundles) or rootfs.exists():
            raise SandboxError(f"could not remove {bundles[0]} or {rootfs} (still mounted?)")

    async def recover(self, record: SandboxRecord) -> bool:
        pid = record.backend_state.get("init_pid")
        if not pid or start_time(pid) != record.backend_state.get("init_start"):
            return False
        # The init is alive (same pid, same start time) and is DSec's: it sits in this sandbox's cgroup.
        try:
            in_cgroup = f"/{self.cgroup_parent}/{record.id}" in Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        if not in_cgroup:
            return False
        if await asyncio.to_thread(self._cgroups(record).frozen):
            record.state = "paused"
        await self.networks.recover(record.backend_state, record.spec.network)
        return True

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        found = self._sandbox_dirs()
        for cg in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            if Path(cg).is_dir():
                found.update(p.name for p in Path(cg).iterdir() if p.is_dir() and p.name.startswith("sb-"))
        orphans = sorted(found - known)
        for sandbox_id in orphans:
            state: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                bundle = self._bundle(sandbox_id)
                if not bundle.is_dir():
                    bundle = self.root / sandbox_id
                pid = int((bundle / "init.pid").read_text())
                # Without a record there is no start time to check the pid against: trust it only while
                # it still sits in this sandbox's cgroup, or a recycled pid would be SIGKILLed as root.
                if f"/{self.cgroup_parent}/{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text():
                    state = {"init_pid": pid, "init_start": start_time(pid)}
            await self._destroy_id(sandbox_id, state)
        await asyncio.to_thread(self._remove_empty_parent)
        await self.networks.sweep()  # chains of sandboxes no recovered record claims (recover() runs first)
        return orphans



def _kill_and_remove_cgroups(cgroups: CgroupSet, init: int | None = None) -> None:
    """Kill every task of ``cgroups`` and remove them; ``init``: a pidfd of the sandbox's (killed) init, whose
    exit (the namespaces' teardown, a few ms) is waited for in one poll instead of polling the cgroup."""
    thawed = False
    waiter = None
    if init is not None:
        waiter = select.poll()
        waiter.register(init, select.POLLIN)
    deadline = time.monotonic() + TEARDOWN_BOUND
    while True:
        pids = cgroups.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if pids and not thawed:
            cgroups.thaw()  # frozen tasks (a paused sandbox) only die once thawed
            thawed = True
        if pids:
            if waiter is None and time.monotonic() <= deadline:  # (past it, the removal below names the cgroup)
                time.sleep(0.002)
                continue
            # Once, whether the init has exited already or not yet: its pidfd is readable once it has (past
            # leaving its cgroups). It exits after every other process of its pid namespace is gone, so the set
            # is most likely empty then, and is removed without being read again; a task still there fails the
            # rmdir with EBUSY, and only then is the set read again (every 2 ms from here on).
            if waiter is not None and not waiter.poll(0):
                waiter.poll(2000)
            waiter = None
        # Not the shared dsec-<tag> parent: a create running concurrently needs it; aclose() and
        # cleanup_orphans() remove it once empty.
        try:
            cgroups.remove()
            return
        except OSError as err:
            # EBUSY: a task joined after the read (the shim of a create cancelled while it moved itself in, one
            # hierarchy after another), or is still leaving: kill it too, and try again.
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.002)


