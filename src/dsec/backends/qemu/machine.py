"""QEMU processes of one backend: launch into the sandbox's cgroups, the console's tail, death, the agent socket.

Owns each running QEMU (:class:`Machine`), its runtime directory under ``/run/dsec-vm`` and its cgroups below
``dsec-<tag>/<backend>``; must never leave a QEMU behind: :meth:`MachineHost.kill` ends one and reaps it, and
:meth:`MachineHost.release_host` ends those a dead daemon left unfinished. It knows nothing of the machine's
command line (:mod:`~dsec.backends.qemu.profile`) nor of templates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.qemu.profile import MiB
from dsec.errors import SandboxError
from dsec.guest.protocol import AgentClient
from dsec.isolation.affinity import sandbox_cpus
from dsec.isolation.cgroups import CgroupSet, background_group, cgroup_mode, v2_make
from dsec.isolation.procs import start_time
from dsec.models import SandboxRecord

__all__ = ["Machine", "MachineHost", "chown_to"]

# QEMU's own memory (TCG translation cache, device models) on top of guest RAM, for the cgroup limit.
_QEMU_OVERHEAD = 384 * MiB
# The serial console is read into memory and only its tail kept: the guest controls what it writes, so a
# file would let it fill the host's disk (or /run's RAM).
_CONSOLE_TAIL = 64 * 1024
# QEMU's threads (vCPUs, I/O, RCU...): the spec's pids limit is for guest processes, which the guest kernel
# counts; the host cgroup only needs to stop a runaway QEMU.
_QEMU_PIDS = 256

_DETACHED: dict[int, subprocess.Popen[bytes]] = {}
"""QEMUs this process started whose backend was closed (they keep running for a later ``recover``); kept so
that they are reaped, by whichever backend destroys them, instead of lingering as zombies."""


@dataclass
class Machine:
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


class MachineHost:
    """The QEMUs of one backend (``name``) on one home (``tag``)."""

    def __init__(self, name: str, tag: str, run_root: Path, qemu_user: str | None, cpu_idle: bool) -> None:
        self.name = name
        # Below the home's dsec-<tag> cgroup, in a directory of its own: each backend's orphan sweep treats
        # every sb-* cgroup under its parent as its own, so the two backends must never share a parent.
        self.cgroup_parent = f"dsec-{tag}/{name}"
        self.run_root = run_root
        self.qemu_user = qemu_user
        self.cpu_idle = cpu_idle
        self.machines: dict[str, Machine] = {}

    # -- files and cgroups --------------------------------------------------------------------------------

    def chown(self, path: Path) -> None:
        """Give ``path`` to the user QEMU runs as."""
        chown_to(path, self.qemu_user)

    def make_rundir(self, sandbox_id: str, fresh: bool = False) -> Path:
        """The sandbox's runtime directory (sockets, pidfile, log), owned by QEMU's user."""
        rundir = self.run_root / sandbox_id
        if fresh:
            rundir.mkdir(mode=0o711)
        else:
            rundir.mkdir(mode=0o711, exist_ok=True)
        self.chown(rundir)
        return rundir

    def remove_run_root(self) -> None:
        """Remove the run directory (and ``/run/dsec-vm``) when no VM is left in it. Also tried when a VM's
        directory goes after :meth:`detach_all` (a template boot or a destroy still finishing then), or the empty
        directory would stay until the next daemon on this home stopped."""
        with contextlib.suppress(OSError):
            self.run_root.rmdir()
            self.run_root.parent.rmdir()

    def cgroups(self, sandbox_id: str) -> CgroupSet:
        return CgroupSet.at(f"/{self.cgroup_parent}/{sandbox_id}")

    def parent_dirs(self) -> list[str]:
        return list(CgroupSet.at(f"/{self.cgroup_parent}").dirs.values())

    def make_cgroups(self, sandbox_id: str, vcpus: int, mem_mib: int) -> CgroupSet:
        cg = self.cgroups(sandbox_id)
        # The top-level group it shares with the container backend's sandboxes, with its CPU class.
        background_group(self.cgroup_parent.split("/", 1)[0], self.cpu_idle)
        limit = mem_mib * MiB + _QEMU_OVERHEAD
        if cgroup_mode() == "v2":
            unified = Path(cg.dirs["unified"])
            # With the controllers enabled down to it: a bare mkdir below the backend's group gives a cgroup
            # without memory.max, and QEMU would run without any limit.
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

    # -- launch and watch ----------------------------------------------------------------------------------

    async def spawn(self, record: SandboxRecord, rundir: Path, cmd: list[str], vcpus: int, mem_mib: int,
                    pass_fds: tuple[int, ...] = ()) -> Machine:
        """Start ``cmd`` (as QEMU's user) inside the sandbox's cgroups and watch it."""
        if self.qemu_user:
            cmd = [*cmd, "-runas", self.qemu_user]
        cg = await asyncio.to_thread(self.make_cgroups, record.id, vcpus, mem_mib)
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
        vm = Machine(pid=proc.pid, proc=proc, rundir=rundir)
        self.adopt(record.id, vm)
        return vm

    def adopt(self, sandbox_id: str, vm: Machine) -> None:
        """Track ``vm`` (just started, or found running by a recover): its console and its death."""
        self.machines[sandbox_id] = vm
        vm.console_task = asyncio.create_task(self._read_console(vm), name=f"dsec-vm-console-{sandbox_id}")
        vm.watcher = asyncio.create_task(self._watch(vm), name=f"dsec-vm-{sandbox_id}")

    async def _read_console(self, vm: Machine) -> None:
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

    async def _watch(self, vm: Machine) -> None:
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
        vm.dead = death_reason(vm, code)
        if vm.client is not None:
            vm.client.mark_dead(vm.dead)

    async def connect(self, vm: Machine, timeout: float) -> AgentClient:
        """Connect to the guest agent's socket once QEMU has opened it."""
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

    # -- lookups -------------------------------------------------------------------------------------------

    def get(self, record: SandboxRecord) -> Machine:
        """``record``'s live QEMU (SandboxError when it has none or it died)."""
        vm = self.machines.get(record.id)
        if vm is None:
            raise SandboxError(f"sandbox {record.id} is not running (no {self.name} QEMU)")
        if vm.dead:
            raise SandboxError(f"sandbox {record.id} is dead: {vm.dead}")
        return vm

    def client(self, record: SandboxRecord) -> AgentClient:
        """``record``'s connected guest agent."""
        vm = self.get(record)
        if vm.client is None or vm.client.dead_reason is not None:
            reason = vm.client.dead_reason if vm.client else "not connected"
            raise SandboxError(f"sandbox {record.id}: guest agent unreachable ({reason})")
        return vm.client

    def alive(self, record: SandboxRecord) -> bool:
        vm = self.machines.get(record.id)
        return vm is not None and not vm.dead and vm.client is not None and vm.client.dead_reason is None

    def lost(self, record: SandboxRecord) -> str | None:
        vm = self.machines.get(record.id)
        if vm is None:
            return f"its {self.name} QEMU is not running"
        return vm.dead or (vm.client.dead_reason if vm.client is not None else None)

    async def why_gone(self, sandbox_id: str, exc: Exception) -> str:
        """Why the agent connection ended: QEMU's fate once the watcher has seen it (panic, power-off...)."""
        vm = self.machines.get(sandbox_id)
        if vm is not None and vm.watcher is not None:
            await asyncio.wait({vm.watcher}, timeout=5)
            if vm.dead:
                return vm.dead
        return str(exc)

    # -- ending --------------------------------------------------------------------------------------------

    async def kill(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """End the sandbox's QEMU (ours, or the one ``state`` names if it is still that process), reap it and
        remove its cgroups."""
        vm = self.machines.pop(sandbox_id, None)
        if vm is not None and vm.client is not None:
            vm.client.mark_dead("sandbox destroyed")
        pid = state.get("qemu_pid")
        if pid and start_time(pid) == state.get("qemu_start"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc = vm.proc if vm is not None and vm.proc is not None else _DETACHED.pop(pid, None) if pid else None
        if proc is not None:
            await asyncio.to_thread(proc.wait)
        if vm is not None:
            await _stop_tasks(vm)
        cg = self.cgroups(sandbox_id)
        for _ in range(500):
            pids = cg.pids()
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            await asyncio.sleep(0.004)
        await asyncio.to_thread(cg.remove)

    async def detach_all(self) -> None:
        """Stop watching every QEMU and leave them running (a later backend on this home recovers them)."""
        for vm in list(self.machines.values()):
            for task in (vm.watcher, vm.console_task):
                if task is not None:
                    task.cancel()
            if vm.proc is not None and vm.proc.poll() is None:
                _DETACHED[vm.pid] = vm.proc
            if vm.client is not None:
                await vm.client.aclose()
        self.machines.clear()
        self.remove_run_root()
        for d in self.parent_dirs():
            with contextlib.suppress(OSError):
                os.rmdir(d)
            with contextlib.suppress(OSError):  # dsec-<tag> (background_group makes it in every joined hierarchy)
                os.rmdir(Path(d).parent)  # unless the container backend still uses it

    def release_host(self, live: set[str]) -> list[str]:
        """End the QEMUs of template boots and of creates a dead daemon left unfinished (a cold boot spins a core
        for a minute or more): nothing re-adopts them. With no live sandbox, the empty directories go too."""
        done = []
        for parent in self.parent_dirs():
            with contextlib.suppress(OSError):
                for child in Path(parent).iterdir():
                    if (child.is_dir() and child.name.startswith(("sb-", "tpl-")) and child.name not in live
                            and self._end_cgroup(child.name)):
                        done.append(f"ended the QEMU of unfinished {child.name}")
        if not live:
            self.remove_run_root()
            for d in self.parent_dirs():
                with contextlib.suppress(OSError):  # only empty ones go: a QEMU just killed keeps its cgroup a moment
                    os.rmdir(d)
                    os.rmdir(Path(d).parent)
        return sorted(set(done))

    def _end_cgroup(self, sandbox_id: str) -> bool:
        """Kill what runs in the sandbox's cgroups and remove them; whether anything ran."""
        cg = self.cgroups(sandbox_id)
        found = bool(cg.pids())
        for _ in range(200):  # a killed QEMU leaves its cgroup within milliseconds
            cg.kill_all()
            if not cg.pids():
                break
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            cg.remove()
        return found

    def leftovers(self) -> set[str]:
        """Sandbox ids with a runtime directory or cgroup of this backend."""
        found: set[str] = set()
        if self.run_root.is_dir():
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith(("sb-", "tpl-")))
        for cg in self.parent_dirs():
            if Path(cg).is_dir():
                found.update(p.name for p in Path(cg).iterdir() if p.is_dir() and p.name.startswith(("sb-", "tpl-")))
        return found

    def orphan_state(self, sandbox_id: str) -> dict[str, Any]:
        """The ``backend_state`` an orphan's destroy needs: its QEMU, if its pidfile names one in its cgroup."""
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.run_root / sandbox_id / "qemu.pid").read_text())
            if f"/{self.cgroup_parent}/{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text():
                return {"qemu_pid": pid, "qemu_start": start_time(pid)}
        return {}


def chown_to(path: Path, user: str | None) -> None:
    """Give ``path`` to ``user`` (QEMU's; None: leave it)."""
    if user:
        pw = pwd.getpwnam(user)
        os.chown(path, pw.pw_uid, pw.pw_gid)


async def _stop_tasks(vm: Machine) -> None:
    if vm.watcher is not None:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(vm.watcher, 5)
    if vm.console_task is not None:
        vm.console_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await vm.console_task
    if vm.client is not None:
        await vm.client.aclose()


def death_reason(vm: Machine, code: int | None) -> str:
    """Why QEMU ended, from its console (panic, power-off), its exit status and its log."""
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
