"""How a sandbox's ``memory`` reaches a QEMU guest: microvm's RAM is it; a vm's guest keeps at least the default
template's RAM and its agent's ``commands`` cgroup is capped at ``memory`` (the limit its commands meet)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsec.backends.microvm import MicroVMBackend
from dsec.backends.qemu.profile import MiB, Shape
from dsec.backends.vm import GUEST_RAM, VMBackend, _limit_commands_memory
from dsec.config import Settings
from dsec.errors import InvalidRequest, SandboxError
from dsec.models import ExecRequest, ExecResult, SandboxRecord, SandboxSpec


def _record(backend: str, memory: int) -> SandboxRecord:
    spec = SandboxSpec(image="img", backend=backend, memory=memory, disk=GUEST_RAM)
    return SandboxRecord(id="sb-1", spec=spec, state="creating", created_at=0.0, expires_at=1.0)


class _Agent:
    """Answers the backend's upkeep commands like a guest whose commands' memory.max starts at ``start``."""

    def __init__(self, start: int, cgroup: str = "/system.slice/dsec-agent.service/commands") -> None:
        self.max, self.cgroup = start, cgroup
        self.commands: list[str] = []

    async def system_exec(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        assert isinstance(request.command, str)
        self.commands.append(request.command)
        if not self.cgroup.endswith("/commands"):
            return ExecResult(exit_code=3, stderr=f"commands run in /sys/fs/cgroup{self.cgroup}".encode())
        want = int(re.search(r"echo (\d+) >", request.command)[1])  # type: ignore[index]
        self.max = min(self.max, want)
        return ExecResult(exit_code=0, stdout=f"{self.max}\n".encode())


def test_a_vm_guest_keeps_the_default_ram_and_microvm_gets_memory(tmp_path: Path) -> None:
    vm = VMBackend(Settings(home=tmp_path / "home"), vm_dir=tmp_path / "vm")
    micro = MicroVMBackend(Settings(home=tmp_path / "home"), guest_dir=tmp_path / "guest")
    vm.profile.check_shape = lambda record, shape: None  # type: ignore[method-assign]
    assert vm.shape(_record("vm", 128 * MiB)) == Shape(1, GUEST_RAM // MiB, GUEST_RAM)
    assert vm.shape(_record("vm", 2048 * MiB)) == Shape(1, 2048, GUEST_RAM)
    assert micro.shape(_record("microvm", 128 * MiB)) == Shape(1, 128, GUEST_RAM)
    with pytest.raises(InvalidRequest, match=r"memory=\d+ is too small for a vm sandbox \(at least 128Mi\)"):
        vm.shape(_record("vm", 64 * MiB))


async def test_a_vm_caps_its_commands_at_memory_below_the_guests_ram() -> None:
    agent = _Agent(start=768 * MiB)
    await _limit_commands_memory(_record("vm", 128 * MiB), agent, GUEST_RAM)  # type: ignore[arg-type]
    assert agent.max == 128 * MiB
    # memory as large as the RAM: the agent's own limit (RAM less the system's share) stays, nothing is run
    idle = _Agent(start=768 * MiB)
    await _limit_commands_memory(_record("vm", GUEST_RAM), idle, GUEST_RAM)  # type: ignore[arg-type]
    assert (idle.max, idle.commands) == (768 * MiB, [])


async def test_a_vm_without_a_commands_cgroup_refuses_a_smaller_memory() -> None:
    agent = _Agent(start=768 * MiB, cgroup="/system.slice/dsec-agent.service")
    with pytest.raises(SandboxError, match="limiting the guest's commands to memory=134217728 failed: commands run"):
        await _limit_commands_memory(_record("vm", 128 * MiB), agent, GUEST_RAM)  # type: ignore[arg-type]


def test_a_vm_snapshot_keeps_its_sandboxs_memory(tmp_path: Path) -> None:
    """A clone gets the snapshotted sandbox's ``memory`` (its commands' limit), not its guest's RAM; a snapshot
    written before ``memory`` was recorded gives its RAM."""
    vm = VMBackend(Settings(home=tmp_path / "home"), vm_dir=tmp_path / "vm")
    (tmp_path / "state").write_bytes(b"")
    shape = {"vcpus": 1, "memory_mib": GUEST_RAM // MiB, "disk": GUEST_RAM, "nic": False}
    (tmp_path / "vm.json").write_text(json.dumps({**shape, "memory": 128 * MiB}))
    assert vm._snapshot_shape(tmp_path) == (Shape(1, GUEST_RAM // MiB, GUEST_RAM), 128 * MiB, False)
    (tmp_path / "vm.json").write_text(json.dumps(shape))
    assert vm._snapshot_shape(tmp_path)[1] == GUEST_RAM
