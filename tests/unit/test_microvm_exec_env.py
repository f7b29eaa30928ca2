"""What the microvm/vm backends hand the guest agent for a command: the sandbox's environment, user and
working directory for its own commands; none of them for the backend's own upkeep (unconfined root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsec.backends.microvm import MicroVMBackend
from dsec.config import Settings
from dsec.models import ExecRequest, SandboxRecord, SandboxSpec


class _Stop(Exception):
    pass


class _Agent:
    def __init__(self) -> None:
        self.started: list[tuple[Any, ...]] = []

    async def start_exec(self, argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
                         **kw: Any) -> int:
        self.started.append((argv, env, cwd, uid, gid, kw))
        raise _Stop


async def test_upkeep_commands_ignore_the_sandboxs_environment_user_and_workdir(tmp_path: Path) -> None:
    backend = MicroVMBackend(Settings(home=tmp_path / "home"), guest_dir=tmp_path / "guest")
    agent = _Agent()
    backend.agent.client = lambda record: agent  # type: ignore[method-assign,assignment,return-value]
    spec = SandboxSpec(image="img", backend="microvm", env={"PATH": "/workspace/bin:/usr/bin",
                                                             "LD_PRELOAD": "/workspace/evil.so"})
    record = SandboxRecord(id="sb-1", spec=spec, state="running", created_at=0.0, expires_at=1.0)
    record.backend_state = {"image_env": {"LD_LIBRARY_PATH": "/workspace/lib"}, "user": [1000, 1000],
                            "home": "/home/agent"}
    with pytest.raises(_Stop):
        await backend.agent.system_exec(record, ExecRequest(command=["date"]))
    with pytest.raises(_Stop):
        await backend.exec(record, ExecRequest(command=["date"]))
    (_, system_env, system_cwd, *system_ids, system_kw), (_, env, cwd, *ids, kw) = agent.started
    assert system_env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    assert (system_cwd, system_ids, system_kw["system"]) == ("/", [0, 0], True)
    assert env["PATH"] == "/workspace/bin:/usr/bin" and env["LD_PRELOAD"] == "/workspace/evil.so"
    assert env["LD_LIBRARY_PATH"] == "/workspace/lib"
    assert (cwd, ids, kw["system"]) == ("/workspace", [1000, 1000], False)


async def test_a_vm_directory_removed_after_close_takes_the_empty_run_directory_with_it(tmp_path: Path) -> None:
    """A template boot or destroy that finishes after the backend closed removes the run directory its
    close had to leave (one VM was still in it); while the backend runs, the directory stays."""
    backend = MicroVMBackend(Settings(home=tmp_path / "home"), guest_dir=tmp_path / "guest")
    backend.machines.run_root = tmp_path / "run" / "dsec-vm" / "tag"
    for sandbox_id in ("sb-a", "tpl-b"):
        (backend.machines.run_root / sandbox_id).mkdir(parents=True)
    backend.started = True  # what start() leaves (it needs QEMU and a guest kernel)
    await backend.destroy_id("sb-a", {})
    assert sorted(p.name for p in backend.machines.run_root.iterdir()) == ["tpl-b"]
    await backend.aclose()  # the template is still booting: the close leaves its directory
    assert (backend.machines.run_root / "tpl-b").is_dir()
    await backend.destroy_id("tpl-b", {})  # the boot's own cleanup, after the close
    assert not (tmp_path / "run" / "dsec-vm").exists() and (tmp_path / "run").is_dir()
