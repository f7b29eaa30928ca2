"""The container backend's calls into a running sandbox: exec, processes, ports and the files API.

Owns how a command joins the sandbox (the exec helper's request, the limit verdicts, the CPU class
that follows busy and idle sandboxes) and the files API's view of its root. Must never create, pause
or tear down a sandbox: :class:`dsec.backends.container.ContainerBackend`, which mixes this in, does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dsec.accounts import Identity
from dsec.backends.base import (
    default_identity,
    signal_of,
    workdir_of,
)
from dsec.backends.hostside import HostFileOps, HostFiles, actor_of
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.config import Settings
from dsec.errors import BackendUnavailable, SandboxError
from dsec.isolation.capabilities import CAP_NUMBERS, DEFAULT_CAPS
from dsec.isolation.cgroups import (
    CgroupSet,
    LimitCounters,
    cgroup_mode,
)
from dsec.isolation.disk import disk_full, disk_used
from dsec.isolation.exec_client import ExecHelper, check_exec_size, stream_exec
from dsec.isolation.files import SandboxFS
from dsec.isolation.mounts import MountHolder
from dsec.isolation.oci_runtime import DEFAULT_PATH
from dsec.isolation.paths import reveal_paths
from dsec.isolation.ports import connect_in_netns
from dsec.isolation.process_io import sandbox_pty, spawn_process
from dsec.isolation.procs import start_time
from dsec.models import ExecEvent, ExecRequest, FileEntry, LimitHit, SandboxRecord, SandboxStats

# The sandbox init's capabilities (OCI config) as the mask dsec-nsenter applies to every command.
_CAPMASK = sum(1 << CAP_NUMBERS[name] for name in DEFAULT_CAPS)
CPU_IDLE_AFTER_S = 0.5
"""A sandbox returns to the best-effort CPU class once it has run no command for this long: back-to-back
commands (an agent's tool loop) pay no cgroup write at all, a background hog yields within half a second."""


class ContainerIO(HostFileOps):
    """Exec, processes, ports and files of a running container sandbox (mixed into ``ContainerBackend``)."""

    settings: Settings
    cgroup_parent: str
    files: HostFiles
    _holder: MountHolder | None
    _helper: ExecHelper | None
    _nofile: int
    _busy: dict[str, int]
    _exec_cgroups: dict[str, tuple[CgroupSet, list[str], LimitCounters]]
    _busy_class: set[str]
    _idle_timers: dict[str, asyncio.TimerHandle]

    def mount_view(self, record: SandboxRecord, key: str) -> str:
        """The path of the sandbox's ``key`` mount ("rootfs", "disk" or "upper") as the daemon reaches it:
        through the mount holder's namespace (the host's for a sandbox made before the holder existed)."""
        path = str(record.backend_state[key])
        if record.backend_state.get("mntns"):
            if self._holder is None:
                raise BackendUnavailable("container backend is not started")
            return self._holder.view(path)
        return path


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
                "landlock": record.spec.landlock, "setuid": record.spec.allow_privilege_escalation, **flags}

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

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        identity = user or default_identity(record)
        env = {"TERM": "xterm-256color", **spec.env} if spec.pty else spec.env
        request = self._helper_request(record, spec.argv, env, spec.cwd, user, tty=spec.pty is not None)
        terminal = None
        if spec.pty is not None:
            shift = int(record.backend_state.get("uid_shift", self.settings.uid_shift))
            terminal = sandbox_pty(f"/proc/{request['init_pid']}/root", (identity.uid + shift, 5 + shift), spec.pty)
        helper = self._helper
        assert helper is not None
        process = await spawn_process(lambda stdio: helper.spawn(request, stdio), spec, sink, terminal)
        await process.wait_started()
        return process

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        return await connect_in_netns(f"/proc/{self._pid(record)}/ns/net", port)


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
