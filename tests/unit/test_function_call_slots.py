"""The function backend's call bookkeeping (``Calls``) across a revive and a destroy, with fake zygotes and slots:
a new zygote's call slots never share a cgroup with the old one's still draining, and a sandbox destroyed while a
call waits for its Python zygote keeps nothing of it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dsec.backends.function_calls import Calls
from dsec.errors import SandboxError
from dsec.isolation import callslots
from dsec.isolation.callslots import CallLimits
from dsec.isolation.cgroups import CgroupSet
from dsec.models import SandboxRecord, SandboxSpec

RECORD = SandboxRecord(id="sb-0123456789ab", spec=SandboxSpec(image="base"), state="running", created_at=1,
                       expires_at=2)
LIMITS = CallLimits(memory=1 << 28, pids=64)


class FakeSlot:
    def __init__(self, name: str) -> None:
        self.name = name
        self.removed = False

    def limit(self, limits: CallLimits) -> None:
        pass

    def close_files(self) -> None:
        pass

    def remove(self) -> None:
        self.removed = True

    def busy(self) -> bool:
        return False

    def kill(self) -> None:
        pass

    def taken_back(self) -> None:
        self.base = 0


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []

    def make(sandbox: CgroupSet, name: str) -> FakeSlot:
        names.append(name)
        return FakeSlot(name)

    monkeypatch.setattr(callslots.Slot, "make", make)
    return names


async def test_the_slots_of_a_revived_zygote_are_named_apart_from_the_old_ones(made: list[str]) -> None:
    calls = Calls()
    cgroups = CgroupSet.at("/dsec-test/sb-0123456789ab")
    old = calls.slots(RECORD, cgroups)
    busy = await old.acquire(LIMITS)  # a call of the old zygote, still running (its slot drains when it ends)
    free = await old.acquire(LIMITS)
    old.release(free)
    calls.forget(RECORD.id, again=True)  # the revive
    assert free.removed  # (not left behind, empty, for the rest of the sandbox's life)
    new = calls.slots(RECORD, cgroups)
    assert new is not old
    fresh = [await new.acquire(LIMITS) for _ in range(3)]
    assert not {s.name for s in fresh} & {busy.name, free.name}, made
    old.release(busy)  # the old slot drains on its own (and goes); the new ones are untouched
    await asyncio.sleep(0.05)
    assert busy.removed and not any(s.removed for s in fresh)
    calls.forget(RECORD.id)  # the destroy: nothing is kept of the sandbox
    again = calls.slots(RECORD, cgroups)
    assert (await again.acquire(LIMITS)).name == "c1"
    calls.close()


class FakePython:
    def __init__(self) -> None:
        self.closed = False

    def alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True


class SlowZygote:
    """A zygote whose Python zygote starts once ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started: list[FakePython] = []

    def start_python(self, argv: list[str]) -> FakePython:
        self.go.wait(10)
        python = FakePython()
        self.started.append(python)
        return python


async def test_a_sandbox_destroyed_while_a_call_starts_its_python_keeps_nothing(made: list[str]) -> None:
    calls = Calls()
    zygote = SlowZygote()
    starting = asyncio.create_task(calls.python(RECORD, zygote, "python3", ["python3"]))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    calls.forget(RECORD.id)  # the destroy
    zygote.go.set()
    with pytest.raises(SandboxError, match="not running"):
        await asyncio.wait_for(starting, 10)
    assert zygote.started and zygote.started[0].closed  # never left running with nothing to close it
    state: Any = vars(calls)
    assert all(RECORD.id not in table for table in state.values() if isinstance(table, dict))
