"""A lost sandbox (its init or VM killed) answers ``SandboxLost`` to its client at once: while its leftovers
are being destroyed, and after that destroy failed, not a state error the client cannot act on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import SandboxLost
from dsec.models import ExecRequest, SandboxRecord, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages


class SlowTeardown(FakeBackend):
    """A destroy that waits for ``release`` and then fails with ``error`` (if set), like a container whose
    cgroup is still busy under load."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.release = asyncio.Event()
        self.error: Exception | None = None

    async def destroy(self, record: SandboxRecord) -> None:
        await self.release.wait()
        if self.error is not None:
            raise self.error
        await super().destroy(record)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    eng = Engine(Settings(home=tmp_path / "home"), {"container": SlowTeardown(tmp_path / "fake")},  # type: ignore[dict-item]
                 FakeImages())  # type: ignore[arg-type]
    await eng.start()
    try:
        yield eng
    finally:
        backend(eng).release.set()
        backend(eng).error = None
        await eng.destroy_all()
        await eng.aclose()


def backend(engine: Engine) -> SlowTeardown:
    found = engine.backends.loaded["container"]
    assert isinstance(found, SlowTeardown)
    return found


async def test_a_lost_sandbox_is_lost_while_its_leftovers_are_destroyed(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base"))
    record = engine.records.find(info.id)
    assert record is not None
    losing = asyncio.create_task(engine.lose(record, "its init process (pid 1) was killed", "sandbox"))
    await asyncio.sleep(0.05)
    assert not losing.done()  # the teardown is still going on
    with pytest.raises(SandboxLost, match=r"init process .* was killed"):
        await engine.exec(info.id, ExecRequest(command="true"))
    backend(engine).release.set()
    await losing
    with pytest.raises(SandboxLost, match=r"init process .* was killed"):
        await engine.exec(info.id, ExecRequest(command="true"))


async def test_a_lost_sandbox_whose_teardown_failed_stays_lost_and_can_be_destroyed(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base"))
    record = engine.records.find(info.id)
    assert record is not None
    fake = backend(engine)
    fake.release.set()
    fake.error = OSError(16, "Device or resource busy")
    with pytest.raises(Exception, match="busy"):
        await engine.lose(record, "its init process (pid 1) was killed", "sandbox")
    with pytest.raises(SandboxLost, match=r"was killed; destroy failed: OSError: .*busy"):
        await engine.exec(info.id, ExecRequest(command="true"))
    fake.error = None
    await engine.destroy(info.id)  # the client's destroy tries the teardown again
    assert engine.records.find(info.id) is None
    assert not (fake.root / info.id).exists()
