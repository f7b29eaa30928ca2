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
(:meth:`ContainerBackend.recover`, :meth:`ContainerBackend.cleanup_orphans`).
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
import posixpath
import secrets
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dsec.accounts import ROOT, Identity
from dsec.backends.base import (
    Backend,
    Check,
    ImageRef,
    apply_image_defaults,
    default_identity,
    signal_of,
    store_identity,
    workdir_of,
)
from dsec.backends.hostside import HostFiles, actor_of
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.config import Settings
from dsec.errors import BackendUnavailable, SandboxError
from dsec.images.users import resolve_user
from dsec.isolation.capabilities import CAP_NUMBERS, DEFAULT_CAPS
from dsec.isolation.cgroups import (
    TEARDOWN_BOUND,
    CgroupSet,
    LimitCounters,
    background_group,
    cgroup_mode,
    v2_controllers_in_hybrid,
)
from dsec.isolation.disk import disk_full, disk_used, umount
from dsec.isolation.exec_client import ExecHelper, check_exec_size, stream_exec
from dsec.isolation.files import SandboxFS, make_workdir
from dsec.isolation.init import ensure_init, ensure_nsenter, ensure_nsexec, ensure_rtshim
from dsec.isolation.mounts import MountHolder, attach, clone_tree, overlay_mount, sysfs_mount, tmpfs_mount
from dsec.isolation.network import Policy, SandboxNetworks
from dsec.isolation.oci_runtime import DEFAULT_PATH, exec_rlimits, runtime_config, sandbox_limits
from dsec.isolation.paths import cover_paths, protect_paths, reveal_paths
from dsec.isolation.ports import connect_in_netns
from dsec.isolation.process_io import PipeProcess, raw_mode, sandbox_pty
from dsec.isolation.procs import ended, reap, sealed_executable, start_time
from dsec.isolation.seccomp import DEFAULT_PROFILE
from dsec.models import ExecEvent, ExecRequest, FileEntry, LimitHit, SandboxRecord, SandboxStats
from dsec.models_surface import FileEvent, FileStat

__all__ = ["ContainerBackend"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_CHILD_SUBREAPER = 36
# The sandbox init's capabilities (OCI config) as the mask dsec-nsenter applies to every command.
_CAPMASK = sum(1 << CAP_NUMBERS[name] for name in DEFAULT_CAPS)
CPU_IDLE_AFTER_S = 0.5
"""A sandbox returns to the best-effort CPU class once it has run no command for this long: back-to-back
commands (an agent's tool loop) pay no cgroup write at all, a background hog yields within half a second."""


PRISTINE_DIR = "/.dsec-pristine"
"""Where a sandbox sees its image's original root (read-only); ``dsec-nsenter`` roots pristine execs there."""


class ContainerBackend(Backend):
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
        _private_dir(self.state_root)
        self.bundles.mkdir(exist_ok=True, mode=0o700)
        self.runtime_root.mkdir(exist_ok=True, mode=0o700)
        # /run/dsec is 0711 (traversable, not listable); /run/dsec/<tag> belongs to the sandboxes' root
        # user, 0700: crun mounts from inside the user namespace and must traverse it, nobody else may.
        self.mounts.parent.mkdir(exist_ok=True, mode=0o711)
        os.chmod(self.mounts.parent, 0o711)
        self.mounts.mkdir(exist_ok=True, mode=0o700)
        os.chown(self.mounts, self.settings.uid_shift, self.settings.uid_shift)
        os.chmod(self.mounts, 0o700)
        _mask_dir(self.mask_dir)
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
            detail = _last_runtime_error(log) if log.exists() else None
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
            # /dev and /dev/shm are directories of the disk, not a tmpfs each (see _mount_dev).
            for name, mode in (("dev", 0o755), ("dev/shm", 0o755), ("shm", 0o1777)):
                os.mkdir(f"{on_disk}/{name}")
                os.chown(f"{on_disk}/{name}", shift, shift)
                os.chmod(f"{on_disk}/{name}", mode)
            root_fd = overlay_mount([str(p) for p in lowers], f"{on_disk}/upper", f"{on_disk}/work",
                                    where=f"the root of {record.id}")
            try:
                root = f"/proc/self/fd/{root_fd}"
                # The image's User, looked up in its own /etc/passwd (through the mounted root, so any image
                # format works): execs run as that user, with its home as HOME unless the image's Env sets one.
                user = resolve_user(Path(root), record.spec.user or image.config.user)
                store_identity(record, user)
                make_workdir(SandboxFS(root, shift, shift), workdir_of(record), user)
                # The image's untouched root for pristine execs, read-only inside the sandbox's root (from the
                # sandbox's user namespace a locked mount it cannot undo). A restored upper already has the dir.
                _plain_dir(f"{root}{PRISTINE_DIR}")
                pristine = clone_tree(str(image.rootfs), readonly=True)
                try:
                    attach(pristine, PRISTINE_DIR.lstrip("/"), root_fd)
                finally:
                    os.close(pristine)
                _plain_dir(f"{root}/sys")
                _plain_dir(f"{root}/dev")
                # The rest in one hop to the holder's thread (each is a hand-off and a wake-up).
                sysfs = (str(self.sysfs), self._sysfs_dev) if node_sysfs else None
                return holder.run(_attach_sandbox, root_fd, disk_fd, str(rootfs), str(disk), sysfs)
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

    def mount_view(self, record: SandboxRecord, key: str) -> str:
        """The path of the sandbox's ``key`` mount ("rootfs", "disk" or "upper") as the daemon reaches it:
        through the mount holder's namespace (the host's for a sandbox made before the holder existed)."""
        path = str(record.backend_state[key])
        if record.backend_state.get("mntns"):
            if self._holder is None:
                raise BackendUnavailable("container backend is not started")
            return self._holder.view(path)
        return path

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

    def _pid(self, record: SandboxRecord) -> int:
        pid = record.backend_state.get("init_pid")
        if not pid or start_time(pid) != record.backend_state.get("init_start"):
            raise SandboxError(f"sandbox {record.id} is not running (its init process is gone)")
        return int(pid)

    def _cgroups(self, record: SandboxRecord) -> CgroupSet:
        return self._cgroup_set(record.id, record.backend_state)

    def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                    ) -> AsyncIterator[ExecEvent]:
        return self._exec_stream(record, request, user)

    def _exec_cgroups_of(self, record: SandboxRecord) -> tuple[CgroupSet, list[str], LimitCounters]:
        cached = self._exec_cgroups.get(record.id)
        if cached is None:
            cgroups = self._cgroups(record)
            cached = self._exec_cgroups[record.id] = (cgroups, cgroups.procs_files(), cgroups.limit_counters())
        return cached

    def _helper_request(self, record: SandboxRecord, argv: list[str], env: dict[str, str] | None, cwd: str | None,
                        user: Identity | None, **flags: bool) -> dict[str, Any]:
        """The exec helper's request for a command of ``record`` as ``user`` (None: the sandbox's default)."""
        if self._helper is None:
            raise BackendUnavailable("container backend is not started")
        identity = user or default_identity(record)
        full_env = {"PATH": DEFAULT_PATH, "HOME": identity.home if user else record.backend_state.get("home", "/root"),
                    **record.backend_state.get("image_env", {}), **record.spec.env, **(env or {})}
        check_exec_size(argv, full_env)
        return {"init_pid": self._pid(record), "cgroup_procs": self._exec_cgroups_of(record)[1], "argv": argv,
                "env": full_env, "cwd": cwd or workdir_of(record), "uid": identity.uid, "gid": identity.gid,
                "groups": identity.groups, "capmask": _CAPMASK, "nofile": self._nofile,
                "landlock": record.spec.landlock, **flags}

    async def _exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None
                           ) -> AsyncIterator[ExecEvent]:
        helper_request = self._helper_request(record, request.argv(), request.env, request.cwd, user,
                                              pristine=request.pristine)
        cgroups, _, counters = self._exec_cgroups_of(record)
        before = (counters.oom_kills(), counters.pids_limit_hits())
        disk = self.mount_view(record, "disk") if record.backend_state.get("disk") else None

        def verdict(exit_code: int, sig: int | None) -> LimitHit | None:
            if signal_of(exit_code, sig) == signal.SIGKILL and counters.oom_kills() > before[0]:
                return "memory"
            if exit_code != 0 and counters.pids_limit_hits() > before[1]:
                return "pids"
            if exit_code != 0 and disk and disk_full(disk):
                return "disk"
            return None

        assert self._helper is not None
        spawned = await self._helper.spawn(helper_request)
        events = stream_exec(spawned, request, verdict)
        self._cpu_busy(record, cgroups, +1)
        try:
            async for event in events:
                yield event
        finally:
            try:
                await events.aclose()  # kills the command now, not whenever the generator is collected
            finally:
                self._cpu_busy(record, cgroups, -1)

    def _cpu_busy(self, record: SandboxRecord, cgroups: CgroupSet, delta: int) -> None:
        """Normal CPU weight while a command runs, best-effort once none has run for ``CPU_IDLE_AFTER_S``
        (one cgroup write at each edge, none for a command that follows another within that time; a
        sandbox destroyed meanwhile has no cgroup left to write)."""
        running = self._busy.get(record.id, 0) + delta
        if running > 0:
            self._busy[record.id] = running
            timer = self._idle_timers.pop(record.id, None)
            if timer is not None:
                timer.cancel()
            if record.id not in self._busy_class:
                with contextlib.suppress(OSError):
                    cgroups.set_cpu_class(busy=True)
                    self._busy_class.add(record.id)
            return
        self._busy.pop(record.id, None)
        if record.id in self._busy_class and record.id not in self._idle_timers:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # an exec stream finalised outside any loop: demote it now
                self._cpu_idle(record.id, cgroups)
                return
            self._idle_timers[record.id] = loop.call_later(CPU_IDLE_AFTER_S, self._cpu_idle, record.id, cgroups)

    def _cpu_idle(self, sandbox_id: str, cgroups: CgroupSet) -> None:
        self._idle_timers.pop(sandbox_id, None)
        if sandbox_id in self._busy_class and not self._busy.get(sandbox_id):
            self._busy_class.discard(sandbox_id)
            with contextlib.suppress(OSError):
                cgroups.set_cpu_class(busy=False)

    def _forget_cpu_class(self, sandbox_id: str) -> None:
        self._exec_cgroups.pop(sandbox_id, None)
        timer = self._idle_timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        self._busy_class.discard(sandbox_id)

    def _fs(self, record: SandboxRecord, path: str = "/", user: Identity | None = None) -> tuple[SandboxFS, str]:
        """The files API's view as ``user``: the sandbox's own root, or for a path beneath a hidden (not yet
        revealed) directory the host's view of the same overlay, where no cover hides it."""
        shift = int(record.backend_state.get("uid_shift", self.settings.uid_shift))
        root = f"/proc/{self._pid(record)}/root"
        norm = posixpath.normpath("/" + path.lstrip("/"))
        if any(norm == h or norm.startswith(h + "/") for h in record.backend_state.get("hidden", [])):
            root = self.mount_view(record, "rootfs")
        return SandboxFS(root, shift, shift, actor=actor_of(user or default_identity(record), shift)), path

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        return await asyncio.to_thread(self._fs(record, path, user)[0].read, path, max_bytes)

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        await asyncio.to_thread(self._fs(record, path, user)[0].write, path, data, mode)

    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        return await asyncio.to_thread(self._fs(record, path, user)[0].list, path)

    async def stat_file(self, record: SandboxRecord, path: str, user: Identity | None = None) -> FileStat:
        return await self.files.stat(record, path, user)

    async def make_dir(self, record: SandboxRecord, path: str, parents: bool, mode: int,
                       user: Identity | None = None) -> FileStat:
        return await self.files.mkdir(record, path, parents, mode, user)

    async def remove_file(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> None:
        await self.files.remove(record, path, recursive, user)

    async def rename_file(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                          user: Identity | None = None) -> FileStat:
        return await self.files.rename(record, source, destination, overwrite, user)

    async def chmod_file(self, record: SandboxRecord, path: str, mode: int, user: Identity | None = None
                         ) -> FileStat:
        return await self.files.chmod(record, path, mode, user)

    async def set_xattrs(self, record: SandboxRecord, path: str, values: dict[str, str], remove: list[str],
                         user: Identity | None = None) -> FileStat:
        return await self.files.set_xattrs(record, path, values, remove, user)

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        return await self.files.chown(record, path, owner, user)

    async def watch_files(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> AsyncIterator[FileEvent]:
        return await self.files.watch(record, path, recursive, user)

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        identity = user or default_identity(record)
        env = {"TERM": "xterm-256color", **spec.env} if spec.pty else spec.env
        request = self._helper_request(record, spec.argv, env, spec.cwd, user, tty=spec.pty is not None)
        master = slave = None
        if spec.pty is not None:
            shift = int(record.backend_state.get("uid_shift", self.settings.uid_shift))
            master, slave = sandbox_pty(f"/proc/{request['init_pid']}/root", (identity.uid + shift, 5 + shift),
                                        spec.pty)
            if spec.pty_stdin:
                raw_mode(slave)
        stdio = (slave, None, None) if spec.pty_stdin else (slave, slave, slave)
        assert self._helper is not None
        try:
            spawned = await self._helper.spawn(request, stdio)
        except BaseException:
            if master is not None:
                os.close(master)
            raise
        finally:
            if slave is not None:
                os.close(slave)
        process = PipeProcess(spawned, sink, master, pty_io=spec.pty is not None and not spec.pty_stdin,
                              timeout=spec.timeout)
        await process.wait_started()
        return process

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        return await connect_in_netns(f"/proc/{self._pid(record)}/ns/net", port)

    async def reveal(self, record: SandboxRecord) -> None:
        hidden = list(record.backend_state.get("hidden", []))
        await asyncio.to_thread(reveal_paths, self._pid(record), hidden)
        record.backend_state["hidden"] = []

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        cg = self._cgroups(record)
        upper = self.mount_view(record, "upper") if record.backend_state.get("upper") else None
        disk = self.mount_view(record, "disk") if record.backend_state.get("disk") else None
        if disk:  # the writable layer is its own tmpfs: the kernel counts it
            st = await asyncio.to_thread(os.statvfs, disk)
            used, limit, full = (st.f_blocks - st.f_bfree) * st.f_frsize, record.spec.disk, disk_full(disk)
        else:  # a sandbox created before disk limits existed: its upper sits on DSEC_HOME's filesystem
            used = await asyncio.to_thread(disk_used, Path(upper)) if upper else 0
            limit, full = None, False
        return SandboxStats(memory_bytes=cg.memory_usage(), memory_peak_bytes=cg.memory_peak(),
                            cpu_seconds=cg.cpu_seconds(), pids=cg.pids_current(), oom_kills=cg.oom_kills(),
                            disk_bytes=used, disk_limit_bytes=limit, disk_full=full)

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
        pidfd = _pidfd_of(int(pid), state.get("init_start")) if pid else None
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

    def _cgroup_set(self, sandbox_id: str, state: dict[str, Any]) -> CgroupSet:
        expected = f"/{self.cgroup_parent}/{sandbox_id}"
        dirs = state.get("cgroups") or {}
        if dirs and all(d.endswith(expected) for d in dirs.values()):
            # The host's mode, not "is there a unified dir": on a hybrid host the v1 controllers sit next
            # to an empty v2 "unified" hierarchy, and reading limits there reported 0 memory, 0 pids and
            # no OOM kills (so a memory-killed command got no limit="memory" verdict).
            return CgroupSet(mode=cgroup_mode(), dirs=dict(dirs))
        # Never trust a recorded path outside our own parent: killing "every pid in the cgroup"
        # of a wrong path would kill host processes.
        return CgroupSet.at(expected)

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


def _attach_sandbox(root_fd: int, disk_fd: int, rootfs: str, disk: str, sysfs: tuple[str, int] | None) -> int:
    """In the holder's namespace: the node's sysfs on the detached root's /sys (``sysfs``: its path and device
    there; read-only, and from the sandbox's user namespace a locked mount), the root on ``rootfs``, the disk
    on ``disk``, /dev and /dev/shm from the disk (:func:`_mount_dev`); returns a detached clone of the mounted
    root for the runtime shim. A failure part-way leaves mounts that destroy's unmounts remove."""
    if sysfs is not None:
        fd = _clone_node_sysfs(*sysfs)
        try:
            attach(fd, "sys", root_fd)
        finally:
            os.close(fd)
    attach(root_fd, rootfs)
    attach(disk_fd, disk)
    _mount_dev(disk, rootfs)
    return clone_tree(rootfs)


def _mount_dev(disk: str, rootfs: str) -> None:
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


def _clone_node_sysfs(path: str, dev: int) -> int:
    """A read-only clone of the node's sysfs (in the holder's namespace), checked to still be the one mounted
    at start: an empty directory there would give a sandbox an empty /sys without a word."""
    if os.stat(path).st_dev != dev:
        raise SandboxError(f"the node's sysfs is no longer mounted on {path} in the mount holder's namespace; "
                           "restart the daemon")
    return clone_tree(path, readonly=True)


def _plain_dir(path: str) -> None:
    """Make ``path`` (in a sandbox's root, before the sandbox runs) a real directory: an image's symlink or file
    there is replaced, so that nothing mounted on it can land outside the root."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return
        os.unlink(path)
    os.mkdir(path, 0o555)


def _mask_dir(path: Path) -> None:
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


def _private_dir(path: Path) -> None:
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


def _pidfd_of(pid: int, started: str | None) -> int | None:
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


def _last_runtime_error(log: Path) -> str | None:
    message = None
    with contextlib.suppress(OSError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if entry.get("level") in ("error", "fatal"):
                    message = entry.get("msg")
    return message
