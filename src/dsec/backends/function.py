"""The ``function`` backend: every exec a fresh, isolated process tree forked from a pre-warmed zygote.

Create: a workspace directory, a scaffold of mount points, a cgroup with the sandbox's limits and its
layout for per-call cgroups, and one ``dsec-zygote`` (:mod:`dsec.isolation.zygote`, ``zygote.c``) that
has already mounted the image read-only (an overlay of the scaffold over ``ImageRef.rootfs``), bound the
workspace writable, prepared the Landlock ruleset and the seccomp program, entered its user namespace and
made the sandbox's one network namespace (loopback only, down). Exec: one ``clone`` of the zygote into new
pid, mount, ipc and uts namespaces and a cgroup of its own, with a fresh ``/proc`` and ``/tmp``, the
sandbox's user (``spec.user``, else the image's), no capabilities, no_new_privs, rlimits, Landlock and
seccomp; the command's exit ends the pid namespace, so nothing it started outlives the call. Only the
workspace persists between calls. Files: confined ``openat2`` through the zygote's root. Call:
:meth:`FunctionBackend.call` forks a pickled callable from the sandbox's Python zygote (``pyzygote.py``: the
image's interpreter, cloudpickle and the loader imported once). Limits, verdicts and Python zygotes:
:mod:`dsec.backends.function_calls`.

This module owns the sandbox's host resources (directory, cgroups, zygote) and must leave none
of them behind, including after a daemon crash (:meth:`recover`, :meth:`cleanup_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import posixpath
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from dsec.accounts import ROOT, Identity
from dsec.backends.base import (
    ImageRef,
    apply_image_defaults,
    collect_exec,
    default_identity,
    store_identity,
    workdir_of,
)
from dsec.backends.function_calls import Calls, cpu_rlimit, default_tmp, release_when_exited, warm_program
from dsec.backends.hostside import HostFileOps, HostFiles, actor_of
from dsec.backends.surface import ProcessIO, ProcessSink, ProcessSpec
from dsec.config import Settings
from dsec.errors import BackendUnavailable, DSecError, InvalidRequest, PermissionDenied, SandboxError
from dsec.images.users import resolve_user
from dsec.isolation import call_loader, pyzygote
from dsec.isolation.binaries import ensure_callinit, ensure_zygote
from dsec.isolation.callslots import lay_out, zygote_procs
from dsec.isolation.cgroups import TEARDOWN_BOUND, CgroupSet, Limits, background_group, cgroup_mode
from dsec.isolation.disk import disk_full, disk_used, mount_disk, umount
from dsec.isolation.exec_client import check_exec_size
from dsec.isolation.files import SandboxFS
from dsec.isolation.landlock import landlock_abi
from dsec.isolation.oci_runtime import DEFAULT_PATH
from dsec.isolation.paths import cover_paths, protect_paths, reveal_paths
from dsec.isolation.process_io import host_pty, spawn_process
from dsec.isolation.procs import ended, start_time
from dsec.isolation.seccomp import DEFAULT_PROFILE, ZYGOTE_PROFILE
from dsec.isolation.zygote import PyZygote, Zygote, ZygoteConfig
from dsec.models import (
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    FileEntry,
    SandboxRecord,
    SandboxStats,
)

__all__ = ["FunctionBackend"]

_NOFILE = 1024
_SCAFFOLD_DIRS = ("tmp", "proc", "dev", ".dsec")
# Headroom over the result cap for the reply's framing; past it the call's output is cut (verdict "output").
_REPLY_OVERHEAD = 64 * 1024


class FunctionBackend(HostFileOps):
    """A zygote per sandbox (image, limits, workspace); a clone per call."""

    name = "function"
    root_writable: ClassVar[bool] = False
    processes_persist: ClassVar[bool] = False
    ports: ClassVar[bool] = False
    """The calls share a network namespace with a loopback that is down, and Landlock refuses TCP."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.root = self.settings.home / "function"
        tag = hashlib.sha256(str(self.settings.home.resolve()).encode()).hexdigest()[:8]
        # Not the container backend's parent: each backend's orphan sweep must see only its own sandboxes.
        self.cgroup_parent = f"dsec-{tag}-fn"
        self._zygotes: dict[str, Zygote] = {}
        self._calls = Calls()
        self.files = HostFiles(self._fs)
        self._binary: Path | None = None
        self._bpf = b""
        self._zygote_bpf = b""
        self._support: Path | None = None

    def available(self) -> str:
        if os.geteuid() != 0:
            return "needs root (it creates namespaces, cgroups and mounts)"
        abi = landlock_abi()
        if abi < 1:
            return "Landlock is not enabled in this kernel (needs Linux >= 5.13 with lsm=...,landlock)"
        return "ok"

    async def start(self) -> None:
        reason = self.available()
        if reason != "ok":
            raise BackendUnavailable(f"function backend: {reason}")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._binary = await asyncio.to_thread(ensure_zygote, self.settings.home / "bin")
        self._bpf = await asyncio.to_thread(DEFAULT_PROFILE.compile_bpf)
        self._zygote_bpf = await asyncio.to_thread(ZYGOTE_PROFILE.compile_bpf)
        callinit = await asyncio.to_thread(ensure_callinit, self.settings.home / "bin")
        self._support = await asyncio.to_thread(_ensure_support, self.root, callinit)
        # The sandboxes' group gets its CPU class when a create makes it (see container.start).
        await asyncio.to_thread(background_group, self.cgroup_parent, self.settings.sandbox_cpu_idle, make=False)

    async def aclose(self) -> None:
        # Zygotes die with their sockets; workspaces and cgroups stay for a restarted daemon's recover().
        self._calls.close()
        for zygote in self._zygotes.values():
            await asyncio.to_thread(zygote.close)
        self._zygotes.clear()

    def release_host(self, live: set[str]) -> list[str]:
        # The zygotes died with the daemon (PR_SET_PDEATHSIG); the workspaces stay for the next daemon's recover().
        for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            with contextlib.suppress(OSError):  # only an empty parent goes
                os.rmdir(d)
        return []

    # -- lifecycle ------------------------------------------------------------------------

    def _base(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        if self._binary is None:
            raise BackendUnavailable("function backend is not started")
        if record.spec.network != "none":
            raise InvalidRequest(f"network={record.spec.network!r} is not available on the function backend: "
                                 f"its calls share a network namespace with nothing but a loopback device, down")
        if not record.spec.landlock:
            raise InvalidRequest("landlock=False is not available on the function backend: every call is confined")
        if record.spec.allow_privilege_escalation:
            raise InvalidRequest("allow_privilege_escalation=True is not available on the function backend: every "
                                 "call runs with no_new_privs (use the container backend, or user='root')")
        apply_image_defaults(record, image)
        base = self._base(record.id)
        shift = image.uid_shift
        record.backend_state = {
            "base": str(base), "uid_shift": shift, "image_rootfs": str(image.rootfs),
            "cgroup": f"/{self.cgroup_parent}/{record.id}", "image_env": dict(image.config.env),
        }
        # Calls run as the spec's user, else the image's User (as the container backend's commands do), else the
        # sandbox's root; the workspace, the only writable place, is that user's.
        named = record.spec.user or image.config.user
        user = await asyncio.to_thread(resolve_user, image.rootfs, named) if named else ROOT
        store_identity(record, user)
        await asyncio.to_thread(self._make_dirs, base, workdir_of(record), shift, record.spec.disk,
                                (user.uid + shift, user.gid + shift))
        state = record.backend_state
        state["disk"] = str(base / "workspace")  # the workspace is the sandbox's disk (a tmpfs of spec.disk)
        state["hidden"] = list(record.spec.hidden)  # until reveal()
        await asyncio.to_thread(self._prepare_hidden, record)
        spec = record.spec
        made = await asyncio.to_thread(CgroupSet.create, record.backend_state["cgroup"],
                                       Limits(memory=spec.memory, cpu=spec.cpu, pids=spec.pids),
                                       background=self.settings.sandbox_cpu_idle)
        record.backend_state["cgroups"] = made.dirs
        await self._start_zygote(record)

    @staticmethod
    def _make_dirs(base: Path, workdir: str, shift: int, disk: int, owner: tuple[int, int]) -> None:
        base.mkdir(mode=0o700)
        for sub in ("workspace", "scaffold", "root"):
            (base / sub).mkdir()
        # The workspace (every file that outlives a call) is a tmpfs of `disk` bytes and inodes to match.
        mount_disk(base / "workspace", disk, mode=0o755, uid=shift)
        if owner != (shift, shift):
            os.chown(base / "workspace", *owner)
        scaffold = base / "scaffold"
        for rel in (*_SCAFFOLD_DIRS, workdir.strip("/")):
            current = scaffold
            for part in Path(rel).parts:
                current = current / part
                current.mkdir(exist_ok=True, mode=0o755)
        # The scaffold is the top layer: its directories are what the sandbox sees, owned by its root.
        for path in [scaffold, *scaffold.rglob("*")]:
            os.lchown(path, shift, shift)

    def _in_workspace(self, record: SandboxRecord, path: str) -> str | None:
        """``path`` relative to the workspace's root ('/...') when it lies beneath the working directory."""
        workdir = workdir_of(record).rstrip("/") or "/"
        norm = posixpath.normpath("/" + path.lstrip("/"))
        if norm == workdir:
            return "/"
        if norm.startswith(workdir.rstrip("/") + "/"):
            return norm[len(workdir.rstrip("/")):]
        return None

    def _prepare_hidden(self, record: SandboxRecord) -> None:
        """Hidden directories beneath the workspace are made there (owned by the sandbox's root); elsewhere
        the read-only image must have them."""
        state = record.backend_state
        shift = int(state["uid_shift"])
        for path in record.spec.hidden:
            rel = self._in_workspace(record, path)
            if rel is not None:
                SandboxFS(state["disk"], shift, shift).makedirs(rel)
                continue
            try:
                SandboxFS(state["image_rootfs"], shift, shift).list(path)
            except DSecError:
                raise InvalidRequest(f"hidden path {path} is not a directory of the image: outside "
                                     f"{workdir_of(record)} a function sandbox's root is the read-only image, "
                                     f"where nothing can be created", path=path) from None

    def _mount_paths(self, record: SandboxRecord, zygote: Zygote) -> None:
        """Protected and hidden paths in the zygote's mount namespace (which every call copies): read-only
        binds over the protected and the revealed ones, an empty read-only tmpfs over the hidden ones."""
        assert zygote.pid is not None
        hidden = list(record.backend_state.get("hidden", []))
        protected = [*record.spec.protected, *(h for h in record.spec.hidden if h not in hidden)]
        if not protected and not hidden:
            return
        try:
            protect_paths(zygote.pid, protected, user_ns=False)
        except InvalidRequest as e:
            raise InvalidRequest(f"{e.message} (a function sandbox's workspace starts empty: to give the agent "
                                 f"read-only files there, write them beneath a hidden= path and reveal() it)",
                                 path=e.detail.get("path")) from None
        cover_paths(zygote.pid, hidden, user_ns=False)
        zygote.refresh()
        self._calls.drain_pythons(record.id)

    async def _start_zygote(self, record: SandboxRecord) -> None:
        assert self._binary is not None and self._support is not None
        state = record.backend_state
        base = Path(state["base"])
        cgroups = self._cgroups(record)
        spec = record.spec
        await asyncio.to_thread(lay_out, cgroups, spec.memory, spec.pids)
        config = ZygoteConfig(
            binary=self._binary, newroot=base / "root", lowerdirs=(base / "scaffold", Path(state["image_rootfs"])),
            workspace=base / "workspace", workdir=workdir_of(record), support=self._support,
            tmpfs_bytes=default_tmp(spec.memory, spec.disk), seccomp_bpf=self._bpf, uid_shift=int(state["uid_shift"]),
            uid_count=self.settings.uid_count, cgroup_procs=tuple(zygote_procs(cgroups)), zygote_bpf=self._zygote_bpf,
        )
        zygote = Zygote(config)
        pid = await asyncio.to_thread(zygote.start)
        self._zygotes[record.id] = zygote
        state.update(zygote_pid=pid, zygote_start=start_time(pid))
        await asyncio.to_thread(self._mount_paths, record, zygote)

    def lost(self, record: SandboxRecord) -> str | None:
        pid = record.backend_state.get("zygote_pid")
        how = ended(int(pid), record.backend_state.get("zygote_start")) if pid else "never started"
        return None if how is None else f"its zygote (pid {pid}) {how}"

    def image_mounts(self, record: SandboxRecord) -> list[Path]:
        root = record.backend_state.get("image_rootfs")
        return [Path(root)] if root else []

    async def revive(self, record: SandboxRecord, image: ImageRef) -> bool:
        """A zygote holds nothing a call needs but what it was started with: a new one over the same workspace
        (and ``image``, which may be mounted afresh) serves the sandbox as before."""
        zygote = self._zygotes.pop(record.id, None)
        self._calls.forget(record.id, again=True)
        if zygote is not None:
            await asyncio.to_thread(zygote.close)
        record.backend_state["image_rootfs"] = str(image.rootfs)
        await asyncio.to_thread(self._stop_stale, record)
        try:
            await self._start_zygote(record)
        except DSecError:
            return False
        return True

    def _zygote(self, record: SandboxRecord) -> Zygote:
        zygote = self._zygotes.get(record.id)
        if zygote is None or not zygote.alive():
            raise SandboxError(f"sandbox {record.id} is not running (its zygote is gone)")
        return zygote

    def _cgroups(self, record: SandboxRecord) -> CgroupSet:
        if record.backend_state.get("cgroups"):
            return CgroupSet(mode=cgroup_mode(), dirs=dict(record.backend_state["cgroups"]))
        return CgroupSet.at(record.backend_state.get("cgroup") or f"/{self.cgroup_parent}/{record.id}")

    # -- exec -----------------------------------------------------------------------------

    def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                    ) -> AsyncIterator[ExecEvent]:
        return self._exec_stream(record, request, user)

    def _env(self, record: SandboxRecord, env: dict[str, str] | None, user: Identity | None) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, "HOME": user.home if user else "/tmp",
                **record.backend_state.get("image_env", {}), **record.spec.env, **(env or {})}

    def _head(self, record: SandboxRecord, timeout: float | None, tmp: int) -> list[str]:
        """The fields every request starts with: ``CPU_S FSIZE NOFILE TMP_BYTES``."""
        # No RLIMIT_FSIZE (0) where the workspace is a tmpfs of `disk` bytes: the quota answers ENOSPC (and the
        # verdict limit="disk") instead of a SIGXFSZ; a sandbox created before quotas keeps the per-file limit.
        fsize = 0 if record.backend_state.get("disk") else record.spec.disk
        return [str(cpu_rlimit(timeout, record.spec.cpu)), str(fsize), str(_NOFILE), str(tmp)]

    def _fields(self, record: SandboxRecord, argv: list[str], env: dict[str, str] | None, cwd: str | None,
                timeout: float | None, user: Identity | None, tmp: int, tty: bool = False,
                full_env: dict[str, str] | None = None) -> list[str]:
        """The zygote's request for a command of ``record`` (see ``zygote.c``; ``full_env``: :meth:`_env` of
        ``env``, when the caller has it already)."""
        identity = user or default_identity(record)
        full_env = full_env if full_env is not None else self._env(record, env, user)
        check_exec_size(argv, full_env)
        fields = [*self._head(record, timeout, tmp), cwd or workdir_of(record),
                  str(len(argv)), *argv, str(len(full_env)), *(f"{k}={v}" for k, v in full_env.items())]
        if not identity.is_root or identity.gid or identity.groups or tty:
            groups = ",".join(str(g) for g in (identity.gid, *identity.groups))
            fields += [str(identity.uid), groups, str(int(tty))]
        return fields

    async def _exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None
                           ) -> AsyncIterator[ExecEvent]:
        zygote = self._zygote(record)
        limits, tmp = self._calls.limits(record)
        env = self._env(record, request.env, user)
        if user is None and warm_program(request, env):
            argv = request.argv()
            python = await self._python(record, zygote, argv[0])
            cwd = posixpath.join(workdir_of(record), request.cwd or "")
            check_exec_size(argv, env)
            fields = [*self._head(record, request.timeout, tmp), cwd, "0", pyzygote.PROGRAM, str(len(env)),
                      *(f"{k}={v}" for k, v in env.items()), str(len(argv)), *argv]
            spawn, peer = python.spawn, "the sandbox's Python zygote"
        else:
            fields = self._fields(record, request.argv(), request.env, request.cwd, request.timeout, user, tmp,
                                  full_env=env)
            spawn, peer = zygote.spawn, "the sandbox's zygote (the sandbox was destroyed, or the zygote killed)"
        events = self._calls.run(record, self._cgroups(record), request, fields, spawn, limits, peer,
                                 cpu=int(fields[0]))
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def _python(self, record: SandboxRecord, zygote: Zygote, python: str) -> PyZygote:
        """The sandbox's Python zygote for the image's interpreter ``python``, started on first use."""
        identity = default_identity(record)
        default = default_tmp(record.spec.memory, record.spec.disk)
        argv = [python, "-I", "/.dsec/pyzygote.py", workdir_of(record), str(default), zygote.config.cpus,
                str(identity.uid), ",".join(str(g) for g in (identity.gid, *identity.groups))]
        return await self._calls.python(record, zygote, python, argv)

    async def call(self, record: SandboxRecord, request: CallRequest) -> CallResult:
        zygote = self._zygote(record)
        limits, tmp = self._calls.limits(record, request.memory, request.pids, request.disk)
        python = await self._python(record, zygote, request.python)
        env = self._env(record, request.env, None)
        fields = [*self._head(record, request.timeout, tmp), workdir_of(record), str(request.max_result_bytes),
                  request.client_python, str(len(env)), *(f"{k}={v}" for k, v in env.items())]
        exec_request = ExecRequest(command=[f"{request.python} (sb.call)"], timeout=request.timeout,
                                   stdin=request.payload, max_output=request.max_result_bytes + _REPLY_OVERHEAD)
        caps = {"stderr": request.max_output}
        result = await collect_exec(self._calls.run(record, self._cgroups(record), exec_request, fields, python.spawn,
                                                    limits, "the sandbox's Python zygote", caps=caps,
                                                    cpu=int(fields[0])))
        reply, result = result.stdout, result.model_copy(update={"stdout": b""})
        return CallResult(reply=reply, result=result)

    # -- files ----------------------------------------------------------------------------

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        zygote = self._zygote(record)
        identity = user or default_identity(record)
        env = {"TERM": "xterm-256color", **spec.env} if spec.pty else spec.env
        limits, tmp = self._calls.limits(record)
        fields = self._fields(record, spec.argv, env, spec.cwd, spec.timeout, user, tmp, tty=spec.pty is not None)
        terminal = None
        if spec.pty is not None:
            # A call has no devpts of its own (its /dev is a few read-only nodes): the terminal is the host's.
            shift = int(record.backend_state.get("uid_shift", self.settings.uid_shift))
            terminal = host_pty((identity.uid + shift, identity.gid + shift), spec.pty)
        # A cgroup of its own, as every call has, held for as long as the process runs.
        slots = self._calls.slots(record, self._cgroups(record))
        slot = await slots.acquire(limits)
        try:
            # The zygote reports its call's pid 1 (every call has a pid namespace of its own): its host pid names it.
            process = await spawn_process(lambda stdio: zygote.spawn(fields, slot.procs_fds, stdio), spec, sink,
                                          terminal, pid_of=lambda host_pid: host_pid)
        except BaseException:
            slots.release(slot)
            raise
        try:
            await process.wait_started()
        except BaseException:
            slots.release(slot)
            raise
        release_when_exited(slots, slot, process.host_pid)
        return process

    def _fs(self, record: SandboxRecord, path: str = "/", user: Identity | None = None) -> tuple[SandboxFS, str]:
        """The files API's view as ``user`` and the path in it: the zygote's root, or for a path beneath a
        hidden (not yet revealed) directory the host's view without the cover: the workspace's tmpfs, or the
        image."""
        zygote = self._zygote(record)
        state = record.backend_state
        shift = int(state.get("uid_shift", self.settings.uid_shift))
        actor = actor_of(user or default_identity(record), shift)
        workspace = str(Path(state["base"]) / "workspace")
        norm = posixpath.normpath("/" + path.lstrip("/"))
        if any(norm == h or norm.startswith(h.rstrip("/") + "/") for h in state.get("hidden", [])):
            rel = self._in_workspace(record, norm)
            if rel is not None:
                return SandboxFS(workspace, shift, shift, actor=actor), rel
            return SandboxFS(str(state["image_rootfs"]), shift, shift, actor=actor), norm
        # The root is an overlay whose files report the device of the layer they come from: the image's too.
        return SandboxFS(f"/proc/{zygote.pid}/root", shift, shift, also_serve=(workspace, str(state["image_rootfs"])),
                         actor=actor), path

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        fs, rel = self._fs(record, path, user)
        return await asyncio.to_thread(fs.read, rel, max_bytes)

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        if self._in_workspace(record, path) is not None:
            read_only = PermissionDenied(f"{path} is read-only: a protected or revealed path", path=path,
                                         errno=errno.EROFS, reason="EROFS")
        else:
            read_only = PermissionDenied(f"{path}: only {workdir_of(record)} is writable in a function sandbox "
                                         f"(the image root is read-only and /tmp lasts one call)", path=path,
                                         errno=errno.EROFS, reason="EROFS")
        fs, rel = self._fs(record, path, user)
        if fs.root == str(record.backend_state.get("image_rootfs")):
            raise read_only  # beneath a hidden directory of the image: never write into the shared image
        try:
            await asyncio.to_thread(fs.write, rel, data, mode)
        except PermissionDenied as e:
            if e.errno == errno.EROFS:
                raise read_only from None
            raise

    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        fs, rel = self._fs(record, path, user)
        entries = await asyncio.to_thread(fs.list, rel)
        if rel != path:  # listed through the host's view of the workspace: name entries by sandbox paths
            entries = [e.model_copy(update={"path": posixpath.join(path, posixpath.basename(e.path))})
                       for e in entries]
        return entries

    async def reveal(self, record: SandboxRecord) -> None:
        zygote = self._zygote(record)
        hidden = list(record.backend_state.get("hidden", []))
        if not hidden:
            return
        assert zygote.pid is not None
        await asyncio.to_thread(reveal_paths, zygote.pid, hidden, False)
        record.backend_state["hidden"] = []
        await asyncio.to_thread(zygote.refresh)
        self._calls.drain_pythons(record.id)

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        cg = self._cgroups(record)
        disk = record.backend_state.get("disk")
        if disk:  # the workspace is its own tmpfs: the kernel counts it
            st = await asyncio.to_thread(os.statvfs, disk)
            used, limit, full = (st.f_blocks - st.f_bfree) * st.f_frsize, record.spec.disk, disk_full(disk)
        else:  # a sandbox created before workspace quotas: a plain directory on DSEC_HOME's filesystem
            used = await asyncio.to_thread(disk_used, Path(record.backend_state["base"]) / "workspace")
            limit, full = None, False
        return SandboxStats(memory_bytes=cg.memory_usage(), memory_peak_bytes=cg.memory_peak(),
                            cpu_seconds=cg.cpu_seconds(), pids=cg.pids_current(), oom_kills=cg.oom_kills(),
                            disk_bytes=used, disk_limit_bytes=limit, disk_full=full)

    # -- teardown and recovery ------------------------------------------------------------

    async def destroy(self, record: SandboxRecord) -> None:
        zygote = self._zygotes.pop(record.id, None)
        self._calls.forget(record.id)
        if zygote is not None:
            await asyncio.to_thread(zygote.close)
        # A zygote of ours is reaped by close(): its pid is free for reuse, so only a previous daemon's is killed.
        await asyncio.to_thread(self._release, record.id, record.backend_state, stale=zygote is None)

    def _release(self, sandbox_id: str, state: dict[str, Any], *, stale: bool = True) -> None:
        pid = state.get("zygote_pid")
        if stale and pid and start_time(int(pid)) == state.get("zygote_start"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)  # a zygote of a previous daemon (not our child)
        cgroups = CgroupSet.at(state.get("cgroup") or f"/{self.cgroup_parent}/{sandbox_id}")
        # Calls die with their zygote (PDEATHSIG); sweep the cgroups (the calls' own too) for any straggler, then
        # remove them (a task killed but not yet gone keeps them busy: again until the bound).
        deadline = time.monotonic() + TEARDOWN_BOUND
        while True:
            cgroups.kill_all(recursive=True)
            try:
                if not cgroups.pids(recursive=True) or time.monotonic() > deadline:
                    cgroups.remove()
                    break
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)
        base = self._base(sandbox_id)
        umount(base / "workspace")  # before rmtree, which would otherwise empty it and fail on the mount point
        if base.exists():
            shutil.rmtree(base)
        with contextlib.suppress(OSError):
            for d in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
                if Path(d).is_dir() and not any(p.is_dir() for p in Path(d).iterdir()):
                    os.rmdir(d)

    async def recover(self, record: SandboxRecord) -> bool:
        """The zygote died with the old daemon; the workspace is the state: start a new zygote over it."""
        base = Path(record.backend_state.get("base", self._base(record.id)))
        if not (base / "workspace").is_dir() or not Path(record.backend_state.get("image_rootfs", "")).is_dir():
            return False
        if record.backend_state.get("disk") and not os.path.ismount(base / "workspace"):
            return False  # its tmpfs is gone (the host rebooted), and with it everything the sandbox wrote
        await asyncio.to_thread(self._stop_stale, record)
        await self._start_zygote(record)
        return True

    def _stop_stale(self, record: SandboxRecord) -> None:
        pid = record.backend_state.get("zygote_pid")
        if pid and start_time(int(pid)) == record.backend_state.get("zygote_start"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        cgroups = self._cgroups(record)
        for _ in range(200):
            cgroups.kill_all(recursive=True)
            if not cgroups.pids(recursive=True):
                break
            time.sleep(0.01)

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        found: set[str] = set()
        if self.root.is_dir():
            found.update(p.name for p in self.root.iterdir() if p.name.startswith("sb-"))
        for cg in CgroupSet.at(f"/{self.cgroup_parent}").dirs.values():
            if Path(cg).is_dir():
                found.update(p.name for p in Path(cg).iterdir() if p.is_dir() and p.name.startswith("sb-"))
        orphans = sorted(found - known - set(self._zygotes))
        for sandbox_id in orphans:
            await asyncio.to_thread(self._release, sandbox_id, {})
        return orphans


def _ensure_support(root: Path, callinit: Path) -> Path:
    """``/.dsec`` of every call: the Python zygote, the init of its calls, the loader and a copy of the client's
    pure-Python cloudpickle, by digest."""
    import cloudpickle

    package = Path(cloudpickle.__file__).parent
    programs = {"loader.py": Path(call_loader.__file__).read_bytes(),
                "pyzygote.py": Path(pyzygote.__file__).read_bytes(), "dsec-callinit": callinit.read_bytes()}
    digest = hashlib.sha256()
    for name, data in sorted(programs.items()):
        digest.update(name.encode() + data)
    sources = sorted(package.glob("*.py"))
    for src in sources:
        digest.update(src.name.encode() + src.read_bytes())
    target = root / f"support-{digest.hexdigest()[:16]}"
    if target.is_dir():
        return target
    tmp = root / f".support-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "cloudpickle").mkdir(parents=True)
    for src in sources:
        shutil.copy2(src, tmp / "cloudpickle" / src.name)
    for name, data in programs.items():
        (tmp / name).write_bytes(data)
    for path in [tmp, *tmp.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() or path.name == "dsec-callinit" else 0o644)
    os.replace(tmp, target)
    return target
