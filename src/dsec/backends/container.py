"""The ``container`` backend: runc containers on an overlay over a read-only image root.

Create: mount an overlayfs (image root as the read-only lower, a per-sandbox upper),
write runc's config (:mod:`dsec.isolation.oci`) and ``runc run --detach`` a static init.
Exec: never ``runc exec`` (~45 ms); the node's exec helper (:mod:`dsec.isolation.nsexec`)
joins the running sandbox in ~1 ms with the same restrictions. Files: confined
``openat2`` from the host (:mod:`dsec.isolation.files`). Destroy: ``runc delete --force``,
unmount, remove the upper and the cgroups.

This module owns the sandbox's host resources (bundle directory, mount, runc state,
cgroups) and must leave none of them behind, including after a daemon crash
(:meth:`ContainerBackend.recover`, :meth:`ContainerBackend.cleanup_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend, ImageRef
from dsec.config import Settings
from dsec.errors import BackendUnavailable, InvalidRequest, SandboxError
from dsec.isolation.capabilities import CAP_NUMBERS, DEFAULT_CAPS
from dsec.isolation.cgroups import CgroupSet, cgroup_mode
from dsec.isolation.exec_client import ExecHelper, stream_exec
from dsec.isolation.files import SandboxFS
from dsec.isolation.init import ensure_init, ensure_nsenter
from dsec.isolation.oci import DEFAULT_PATH, exec_rlimits, runtime_config
from dsec.isolation.seccomp import DEFAULT_PROFILE
from dsec.models import ExecEvent, ExecRequest, FileEntry, LimitHit, SandboxRecord, SandboxStats

__all__ = ["ContainerBackend"]

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_NOSUID = 2
_MS_NODEV = 4
_PR_SET_CHILD_SUBREAPER = 36
# The sandbox init's capabilities (runc config) as the mask dsec-nsenter applies to every command.
_CAPMASK = sum(1 << CAP_NUMBERS[name] for name in DEFAULT_CAPS)


def _mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    # nosuid, nodev: every process in a sandbox runs with no_new_privs anyway, and the mount point is
    # visible on the host, where a setuid file or device node planted by an agent must mean nothing.
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"overlay mount on {target} failed: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            raise SandboxError(f"unmounting {target} failed: {os.strerror(err)}")


_F_ADD_SEALS = 1033
_F_GET_SEALS = 1034
# F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE: what runc's nsexec checks before it skips
# copying itself into a fresh memfd on every container start (its CVE-2019-5736 defence).
_RUNC_MEMFD_SEALS = 0x1 | 0x2 | 0x4 | 0x8


def _sealed_copy(binary: str) -> int:
    """A fully sealed in-memory copy of ``binary``; returns its fd (close-on-exec).

    runc 1.1 re-copies its ~10 MB binary into a memfd for every container it starts, so that a
    container cannot overwrite the host's runc through ``/proc/self/exe`` (CVE-2019-5736). Run from a
    sealed memfd, runc sees that its executable is already immutable and skips the copy: one shared
    copy per daemon instead of one per create (upstream's ``memfd-bind`` does the same for a whole host).
    """
    fd = os.memfd_create("runc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as src:
            while chunk := src.read(1 << 20):
                os.write(fd, chunk)
        fcntl.fcntl(fd, _F_ADD_SEALS, _RUNC_MEMFD_SEALS)
        if fcntl.fcntl(fd, _F_GET_SEALS) != _RUNC_MEMFD_SEALS:
            raise SandboxError("could not seal the in-memory copy of runc")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a live init from a recycled pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class ContainerBackend(Backend):
    """runc + overlayfs + user namespace; exec through the node's exec helper."""

    name = "container"

    def __init__(self, settings: Settings | None = None, runc: str | None = None) -> None:
        self.settings = settings or Settings()
        self.root = self.settings.home / "container"
        self.runc_root = self.settings.home / "runc"
        self.runc = runc or shutil.which("runc") or "/usr/sbin/runc"
        # Cgroups and /run are host-wide: each DSEC_HOME gets its own tag so that two daemons (tests, a
        # developer's and CI's) never touch each other's sandboxes when cleaning up orphans.
        tag = hashlib.sha256(str(self.settings.home.resolve()).encode()).hexdigest()[:8]
        self.cgroup_parent = f"dsec-{tag}"
        # Root filesystems are mounted where the container's (shifted) root user can traverse to
        # them: runc mounts them from inside the user namespace, and DSEC_HOME may sit below a
        # 0700 directory. The writable layers stay in DSEC_HOME, on disk.
        self.mounts = Path("/run/dsec") / tag
        self._helper: ExecHelper | None = None
        self._init: Path | None = None
        self._nofile = 0
        self._runc_fd: int | None = None
        # runc calls block a thread each (~30 ms); enough threads for a burst of creates on a big node.
        self._runc_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="dsec-runc")

    def available(self) -> str:
        if os.geteuid() != 0:
            return "needs root (it creates namespaces, cgroups and overlay mounts)"
        if not Path(self.runc).exists():
            return "runc not found: apt-get install runc"
        return "ok"

    async def start(self) -> None:
        reason = self.available()
        if reason != "ok":
            raise BackendUnavailable(f"container backend: {reason}")
        # Sandbox inits are orphaned when `runc run --detach` exits; as a subreaper the daemon
        # inherits them and reaps each one on destroy, instead of leaving zombies for the host's
        # pid 1 (which may reap late, or never in a minimal container host).
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runc_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # /run/dsec is 0711 (traversable, not listable); /run/dsec/<tag> belongs to the sandboxes' root
        # user, 0700: runc mounts from inside the user namespace and must traverse it, nobody else may.
        self.mounts.parent.mkdir(exist_ok=True, mode=0o711)
        os.chmod(self.mounts.parent, 0o711)
        self.mounts.mkdir(exist_ok=True, mode=0o700)
        os.chown(self.mounts, self.settings.uid_shift, self.settings.uid_shift)
        os.chmod(self.mounts, 0o700)
        built = await asyncio.to_thread(ensure_init, self.settings.home / "bin")
        self._init = self.mounts / built.name
        if not self._init.exists():
            await asyncio.to_thread(shutil.copy2, built, self._init)
        bpf = await asyncio.to_thread(DEFAULT_PROFILE.compile_bpf)
        nsenter = await asyncio.to_thread(ensure_nsenter, self.settings.home / "bin")
        # The init's open-file limit (runc config), read once: commands get the same.
        self._nofile = exec_rlimits()["nofile"][0]
        self._helper = ExecHelper(bpf, nsenter)
        self._helper.start()
        if self._runc_fd is None:
            self._runc_fd = await asyncio.to_thread(_sealed_copy, self.runc)

    async def aclose(self) -> None:
        if self._helper is not None:
            await asyncio.to_thread(self._helper.close)
            self._helper = None
        if self._runc_fd is not None:
            os.close(self._runc_fd)
            self._runc_fd = None
        await asyncio.to_thread(self._remove_empty_parent)
        await asyncio.to_thread(self._remove_empty_mounts_dir)

    def _remove_empty_mounts_dir(self) -> None:
        """Drop /run/dsec/<tag> (and the init copy in it) when no sandbox of this home is left;
        live sandboxes keep it, since their init is bind-mounted from there."""
        if not self.mounts.is_dir() or any(p.name.startswith("sb-") for p in self.mounts.iterdir()):
            return
        for p in self.mounts.iterdir():
            if p.name.startswith("dsec-init-"):
                p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.mounts.rmdir()
            self.mounts.parent.rmdir()  # only if no other home uses /run/dsec

    def _remove_empty_parent(self) -> None:
        """runc leaves the parent cgroup behind; drop it when no sandbox of this home is left."""
        for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):  # missing, or still holding sandboxes
                os.rmdir(d)

    # -- runc -----------------------------------------------------------------------------

    async def _runc(self, *args: str, log: Path | None = None, check: bool = True) -> str:
        cmd = [self.runc, "--root", str(self.runc_root)]
        if log is not None:
            cmd += ["--log", str(log), "--log-format", "json"]
        # `runc run --detach` hands its own stdio to the container's init, which never closes it:
        # detached runs get /dev/null and report errors through --log instead.
        pipe = subprocess.DEVNULL if "--detach" in args else subprocess.PIPE
        # subprocess.run in a worker thread, not the event loop's subprocess support: CPython spawns with
        # vfork, while uvloop's libuv forks the whole daemon (page tables and all) for every runc call.
        # The sealed copy when started (see _sealed_copy); the path itself for calls before start().
        executable = self.runc if self._runc_fd is None else f"/proc/{os.getpid()}/fd/{self._runc_fd}"

        def run() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run([*cmd, *args], executable=executable, stdin=subprocess.DEVNULL, stdout=pipe,
                                  stderr=pipe, check=False)

        proc = await asyncio.get_running_loop().run_in_executor(self._runc_pool, run)
        if check and proc.returncode != 0:
            detail = (proc.stderr or b"").decode(errors="replace").strip()
            if log is not None and log.exists():
                detail = _last_runc_error(log) or detail
            # runc's own message already reads "runc run failed: ...": do not say it twice.
            raise SandboxError(detail if detail.startswith("runc") else f"runc {args[0]} failed: {detail}")
        return (proc.stdout or b"").decode(errors="replace")

    # -- lifecycle ------------------------------------------------------------------------

    def _bundle(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        if self._helper is None or self._init is None:
            raise BackendUnavailable("container backend is not started")
        if record.spec.network != "none":
            raise InvalidRequest(f"network={record.spec.network!r} is not available yet on the container "
                                 f"backend: only 'none' (network policies land with the security issue)")
        bundle = self._bundle(record.id)
        rootfs, upper, work = self.mounts / record.id, bundle / "upper", bundle / "work"
        shift = image.uid_shift
        record.backend_state = {
            "bundle": str(bundle), "rootfs": str(rootfs), "upper": str(upper), "uid_shift": shift,
            "cgroups_path": f"/{self.cgroup_parent}/{record.id}",
            # The image's environment (PATH of a Python or Node image...) under the spec's and the call's.
            "image_env": dict(image.config.env),
        }
        bundle.mkdir(mode=0o700)
        for d in (rootfs, upper, work):
            d.mkdir()
        os.chown(upper, shift, shift)
        await asyncio.to_thread(_mount_overlay, image.rootfs, upper, work, rootfs)
        record.backend_state["mounted"] = True
        await asyncio.to_thread(SandboxFS(str(rootfs), shift, shift).makedirs, record.spec.workdir)
        config = runtime_config(
            sandbox_id=record.id, spec=record.spec, rootfs=rootfs, init_binary=self._init, uid_shift=shift,
            uid_count=self.settings.uid_count, cgroups_path=record.backend_state["cgroups_path"],
            profile=DEFAULT_PROFILE,
        )
        (bundle / "config.json").write_text(json.dumps(config))
        await self._runc("run", "--detach", "--bundle", str(bundle), "--pid-file", str(bundle / "init.pid"),
                         record.id, log=bundle / "runc.log")
        pid = int((bundle / "init.pid").read_text())
        record.backend_state.update(
            init_pid=pid, init_start=_start_time(pid), cgroups=CgroupSet.of_pid(pid).dirs,
        )

    def _pid(self, record: SandboxRecord) -> int:
        pid = record.backend_state.get("init_pid")
        if not pid or _start_time(pid) != record.backend_state.get("init_start"):
            raise SandboxError(f"sandbox {record.id} is not running (its init process is gone)")
        return int(pid)

    def _cgroups(self, record: SandboxRecord) -> CgroupSet:
        return self._cgroup_set(record.id, record.backend_state)

    def exec_stream(self, record: SandboxRecord, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self._exec_stream(record, request)

    async def _exec_stream(self, record: SandboxRecord, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        if self._helper is None:
            raise BackendUnavailable("container backend is not started")
        pid = self._pid(record)
        cgroups = self._cgroups(record)
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", **record.backend_state.get("image_env", {}),
               **record.spec.env, **(request.env or {})}
        before = (cgroups.oom_kills(), cgroups.pids_limit_hits())

        def verdict(exit_code: int, sig: int | None) -> LimitHit | None:
            if sig == 9 and cgroups.oom_kills() > before[0]:
                return "memory"
            if exit_code != 0 and cgroups.pids_limit_hits() > before[1]:
                return "pids"
            return None

        spawned = self._helper.spawn({
            "init_pid": pid,
            "cgroup_procs": cgroups.procs_files(),
            "argv": request.argv(),
            "env": env,
            "cwd": request.cwd or record.spec.workdir,
            "uid": 0,
            "gid": 0,
            "capmask": _CAPMASK,
            "nofile": self._nofile,
        })
        events = stream_exec(spawned, request, verdict)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # kills the command now, not whenever the generator is collected

    def _fs(self, record: SandboxRecord) -> SandboxFS:
        shift = int(record.backend_state.get("uid_shift", self.settings.uid_shift))
        return SandboxFS(f"/proc/{self._pid(record)}/root", shift, shift)

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int) -> bytes:
        return await asyncio.to_thread(self._fs(record).read, path, max_bytes)

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None) -> None:
        await asyncio.to_thread(self._fs(record).write, path, data, mode)

    async def list_files(self, record: SandboxRecord, path: str) -> list[FileEntry]:
        return await asyncio.to_thread(self._fs(record).list, path)

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        cg = self._cgroups(record)
        upper = record.backend_state.get("upper")
        disk = await asyncio.to_thread(_du, Path(upper)) if upper else 0
        return SandboxStats(memory_bytes=cg.memory_usage(), memory_peak_bytes=cg.memory_peak(),
                            cpu_seconds=cg.cpu_seconds(), pids=cg.pids_current(), oom_kills=cg.oom_kills(),
                            disk_bytes=disk)

    async def pause(self, record: SandboxRecord) -> None:
        self._pid(record)
        await self._runc("pause", record.id)

    async def resume(self, record: SandboxRecord) -> None:
        self._pid(record)
        await self._runc("resume", record.id)

    async def destroy(self, record: SandboxRecord) -> None:
        await self._destroy_id(record.id, record.backend_state)

    async def _destroy_id(self, sandbox_id: str, state: dict[str, Any]) -> None:
        # What `runc delete --force` does, without its ~100 ms: kill init (the pid namespace dies
        # with it), empty and remove the cgroups, drop runc's state, unmount, remove the layer.
        pid = state.get("init_pid")
        if pid and _start_time(pid) == state.get("init_start"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        cgroups = self._cgroup_set(sandbox_id, state)
        await asyncio.to_thread(_kill_and_remove_cgroups, cgroups)
        if pid:
            await asyncio.to_thread(_reap, pid)
        await asyncio.to_thread(shutil.rmtree, self.runc_root / sandbox_id, True)
        rootfs = self.mounts / sandbox_id
        await asyncio.to_thread(_umount, rootfs)
        with contextlib.suppress(FileNotFoundError):
            rootfs.rmdir()
        bundle = self._bundle(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, bundle, True)
        if bundle.exists() or rootfs.exists():
            raise SandboxError(f"could not remove {bundle} or {rootfs} (still mounted?)")

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
        if not pid or _start_time(pid) != record.backend_state.get("init_start"):
            return False
        out = await self._runc("state", record.id, check=False)
        try:
            status = json.loads(out).get("status")
        except json.JSONDecodeError:
            return False
        if status == "paused":
            record.state = "paused"
        return status in ("running", "paused")

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        found: set[str] = set()
        for parent in (self.root, self.runc_root, self.mounts):
            if parent.is_dir():
                found.update(p.name for p in parent.iterdir() if p.name.startswith("sb-"))
        for cg in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            if Path(cg).is_dir():
                found.update(p.name for p in Path(cg).iterdir() if p.is_dir() and p.name.startswith("sb-"))
        orphans = sorted(found - known)
        for sandbox_id in orphans:
            state: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                pid = int((self._bundle(sandbox_id) / "init.pid").read_text())
                # Without a record there is no start time to check the pid against: trust it only while
                # it still sits in this sandbox's cgroup, or a recycled pid would be SIGKILLed as root.
                if f"/{self.cgroup_parent}/{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text():
                    state = {"init_pid": pid, "init_start": _start_time(pid)}
            await self._destroy_id(sandbox_id, state)
        await asyncio.to_thread(self._remove_empty_parent)
        return orphans


def _reap(pid: int) -> None:
    """Collect a killed init if it is our child (we are its subreaper); a no-op otherwise."""
    for _ in range(500):  # at most ~1 s; a SIGKILLed process becomes a zombie within microseconds
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not ours (the daemon restarted since) or already reaped
        if done:
            return
        time.sleep(0.002)


def _kill_and_remove_cgroups(cgroups: CgroupSet) -> None:
    for attempt in range(1000):  # at most ~2 s: dying tasks leave the cgroup within microseconds
        pids = cgroups.pids()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if attempt == 0:
            cgroups.thaw()  # frozen tasks (a paused sandbox) only die once thawed
        time.sleep(0.002)
    # Not the shared dsec-<tag> parent: a create running concurrently needs it (runc would fail with
    # ENOENT); aclose() and cleanup_orphans() remove it once empty.
    cgroups.remove()


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _last_runc_error(log: Path) -> str | None:
    message = None
    with contextlib.suppress(OSError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if entry.get("level") in ("error", "fatal"):
                    message = entry.get("msg")
    return message
