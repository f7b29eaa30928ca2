"""A destroyed container's cgroups go once its killed tasks have left them, however long a loaded host makes
that take (up to a bound), and a task that never leaves fails the destroy naming the cgroup instead of
holding it forever. A fake clock stands for the host's time; the real cgroups are in tests/backends."""

from __future__ import annotations

import errno
import math
import os
from types import SimpleNamespace

import pytest

from dsec.backends import container as container_module


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

    def pids(self) -> list[int]:
        return list(self.tasks) if self.busy() else []

    def thaw(self) -> None:
        pass

    def remove(self) -> None:
        if self.busy():
            raise OSError(errno.EBUSY, "Device or resource busy", "/sys/fs/cgroup/cpu/dsec-x/sb-0")
        self.removed = True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(container_module, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep))
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
    assert container_module._KILL_BOUND <= clock.now <= container_module._KILL_BOUND + 1
