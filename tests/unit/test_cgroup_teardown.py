"""A destroyed container's or function sandbox's cgroups go once its killed tasks have left them, however long
a loaded host makes that take (up to a bound), and a task that never leaves fails the destroy naming the
cgroup. A fake clock stands for the host's time; the real cgroups are in tests/backends."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsec.backends import container as container_module
from dsec.backends import function as function_module
from dsec.isolation.cgroups import TEARDOWN_BOUND


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Cgroups:
    """A sandbox's cgroup set whose tasks leave at ``free_at`` (fake seconds)."""

    def __init__(self, clock: Clock, free_at: float, tasks: list[int]) -> None:
        self.clock, self.free_at, self.tasks = clock, free_at, tasks
        self.removed = False

    def busy(self) -> bool:
        return self.clock.now < self.free_at

    def pids(self, recursive: bool = False) -> list[int]:
        return list(self.tasks) if self.busy() else []

    def thaw(self) -> None:
        pass

    def kill_all(self, recursive: bool = False) -> None:
        for pid in self.pids():
            os.kill(pid, 9)

    def remove(self) -> None:
        if self.busy():
            raise OSError(errno.EBUSY, "Device or resource busy", "/sys/fs/cgroup/cpu/dsec-x/sb-0")
        self.removed = True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    for module in (container_module, function_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep))
    return fake


@pytest.mark.parametrize("tasks", [[], [4242]], ids=["leaving", "listed"])
def test_tasks_slow_to_leave_on_a_loaded_host_still_let_the_cgroups_go(
        clock: Clock, monkeypatch: pytest.MonkeyPatch, tasks: list[int]) -> None:
    killed: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(pid))
    cgroups = Cgroups(clock, free_at=10.0, tasks=tasks)  # seconds, where an idle host takes microseconds
    container_module._kill_and_remove_cgroups(cgroups)  # type: ignore[arg-type]
    assert cgroups.removed and clock.now >= 10.0
    assert set(killed) == set(tasks)


@pytest.mark.parametrize("tasks", [[], [4242]], ids=["leaving", "listed"])
def test_a_task_that_never_leaves_fails_the_destroy_after_the_bound(
        clock: Clock, monkeypatch: pytest.MonkeyPatch, tasks: list[int]) -> None:
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    cgroups = Cgroups(clock, free_at=math.inf, tasks=tasks)
    with pytest.raises(OSError) as failed:
        container_module._kill_and_remove_cgroups(cgroups)  # type: ignore[arg-type]
    assert failed.value.errno == errno.EBUSY and "sb-0" in str(failed.value)
    assert TEARDOWN_BOUND <= clock.now <= TEARDOWN_BOUND + 1


def release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cgroups: Cgroups) -> None:
    """The function backend's teardown of one sandbox's cgroups and directory (no zygote of a previous daemon)."""
    parent = SimpleNamespace(dirs={})  # the backend's parent cgroup: none here
    monkeypatch.setattr(function_module.CgroupSet, "at",
                        staticmethod(lambda relpath: cgroups if relpath.endswith("/sb-0") else parent))
    backend = SimpleNamespace(cgroup_parent="dsec-x-fn", _base=lambda sandbox_id: tmp_path / sandbox_id)
    function_module.FunctionBackend._release(backend, "sb-0", {}, stale=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("tasks", [[], [4242]], ids=["leaving", "listed"])
def test_a_function_sandbox_slow_to_empty_still_loses_its_cgroups(
        clock: Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tasks: list[int]) -> None:
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    cgroups = Cgroups(clock, free_at=10.0, tasks=tasks)
    release(monkeypatch, tmp_path, cgroups)
    assert cgroups.removed and clock.now >= 10.0


def test_a_function_sandbox_that_never_empties_fails_after_the_bound(
        clock: Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    with pytest.raises(OSError) as failed:
        release(monkeypatch, tmp_path, Cgroups(clock, free_at=math.inf, tasks=[4242]))
    assert failed.value.errno == errno.EBUSY and TEARDOWN_BOUND <= clock.now <= TEARDOWN_BOUND + 1
