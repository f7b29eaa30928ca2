"""A revive (the watchdog's, of a sandbox whose image mount died) against a destroy of the same sandbox, and a
revive or a recovery that fails unexpectedly: no image pin leaks, no record comes back, the daemon starts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.daemon.state import StateStore
from dsec.models import SandboxInfo, SandboxRecord, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages


class MountedImages(FakeImages):
    """Images mounted at ``/img/<n>``, pinned and released (``refs``); a mount made dead (:meth:`kill`) is named by
    ``stale`` and the next resolve mounts the image afresh at the next path."""

    def __init__(self) -> None:
        super().__init__()
        self.mount = 1
        self.refs: dict[Path, int] = {}
        self.dead: set[Path] = set()
        self.error: Exception | None = None

    def resolve(self, name: str) -> ImageRef:
        if self.error is not None:
            raise self.error
        ref = ImageRef(name=name, rootfs=Path(f"/img/{self.mount}"))
        self.refs[ref.rootfs] = self.refs.get(ref.rootfs, 0) + 1
        return ref

    def release(self, ref: ImageRef) -> None:
        self.refs[ref.rootfs] -= 1

    def stale(self, root: Path) -> str | None:
        return "its lazy server died" if root in self.dead else None

    def kill(self) -> None:
        self.dead.add(Path(f"/img/{self.mount}"))
        self.mount += 1


class SlowRevive(FakeBackend):
    """A revive that waits for ``go`` (a new zygote starting), then fails with ``error`` if set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.go = asyncio.Event()
        self.entered = asyncio.Event()
        self.error: Exception | None = None
        self.calls: list[str] = []

    async def revive(self, record: SandboxRecord, image: ImageRef) -> bool:
        self.calls.append(f"revive {image.rootfs}")
        self.entered.set()
        await self.go.wait()
        if self.error is not None:
            raise self.error
        self.calls.append("revived")
        return True

    async def destroy(self, record: SandboxRecord) -> None:
        self.calls.append("destroy")
        await super().destroy(record)


def make_engine(tmp_path: Path, images: MountedImages) -> Engine:
    # The watchdog stays out of the way: the test revives by hand.
    return Engine(Settings(home=tmp_path / "home"), {"container": SlowRevive(tmp_path / "fake")},  # type: ignore[dict-item]
                  images, reaper_interval=3600)  # type: ignore[arg-type]


def fake_of(engine: Engine) -> SlowRevive:
    found = engine.backends.loaded["container"]
    assert isinstance(found, SlowRevive)
    return found


async def on_a_dead_mount(engine: Engine, images: MountedImages) -> tuple[SandboxInfo, SandboxRecord]:
    """A sandbox of ``engine`` whose image mount has just died (its revive is the test's to start)."""
    info = await engine.create(SandboxSpec(image="base"))
    record = engine.records.find(info.id)
    assert record is not None
    images.kill()
    return info, record


async def left_for_readoption(tmp_path: Path, images: MountedImages) -> SandboxInfo:
    """A sandbox a closed engine left for the next one of ``tmp_path`` to re-adopt."""
    first = make_engine(tmp_path, images)
    await first.start()
    kept = await first.create(SandboxSpec(image="base"))
    await first.aclose()  # sandboxes stay for re-adoption
    return kept


async def test_a_destroy_during_a_revive_waits_for_it_and_leaks_nothing(tmp_path: Path) -> None:
    images = MountedImages()
    engine = make_engine(tmp_path, images)
    await engine.start()
    try:
        info, record = await on_a_dead_mount(engine, images)
        fake = fake_of(engine)
        reviving = asyncio.create_task(engine.revive(record))
        await asyncio.wait_for(fake.entered.wait(), 10)
        destroying = asyncio.create_task(engine.destroy(info.id))
        await asyncio.sleep(0.05)
        # The destroy waits for the revive under way: it must not tear down what the revive is starting.
        assert not destroying.done() and fake.calls == ["revive /img/2"]
        joining = asyncio.create_task(engine.revive(record))  # joins the one under way (starts none)
        fake.go.set()
        await asyncio.wait_for(destroying, 10)
        assert reviving.done() and await joining is True
        assert fake.calls == ["revive /img/2", "revived", "destroy"]
        assert images.refs == {Path("/img/1"): 0, Path("/img/2"): 0}  # the fresh pin went with the sandbox
        assert info.id not in StateStore.peek(engine.settings.state_db)  # no record written back after the destroy
        assert not engine.records.reviving
    finally:
        fake_of(engine).go.set()
        await engine.destroy_all()
        await engine.aclose()


async def test_a_revive_that_raises_is_not_revived_and_gives_its_fresh_pin_back(tmp_path: Path) -> None:
    images = MountedImages()
    engine = make_engine(tmp_path, images)
    await engine.start()
    try:
        info, record = await on_a_dead_mount(engine, images)
        fake = fake_of(engine)
        fake.error = OSError(2, "No such file or directory")  # not a DSecError: lay_out or a zygote's start
        fake.go.set()
        assert await engine.revive(record) is False
        assert images.refs == {Path("/img/1"): 1, Path("/img/2"): 0}
        assert engine.pins.image_of(info.id) is not None and engine.pins.image_of(info.id).rootfs == Path("/img/1")
        await engine.destroy(info.id)
        assert images.refs == {Path("/img/1"): 0, Path("/img/2"): 0}
    finally:
        await engine.destroy_all()
        await engine.aclose()


async def test_a_recovery_that_raises_unexpectedly_does_not_stop_the_daemon_starting(tmp_path: Path) -> None:
    images = MountedImages()
    kept = await left_for_readoption(tmp_path, images)
    images.error = OSError(5, "Input/output error")  # the re-pin fails unexpectedly
    second = make_engine(tmp_path, images)
    await asyncio.wait_for(second.start(), 30)
    try:
        assert [i.id for i in await second.list()] == [kept.id]
    finally:
        images.error = None
        await second.destroy_all()
        await second.aclose()


async def test_moving_a_sandbox_off_a_dead_mount_that_raises_does_not_stop_the_start(tmp_path: Path) -> None:
    images = MountedImages()
    kept = await left_for_readoption(tmp_path, images)
    second = make_engine(tmp_path, images)
    fake = fake_of(second)

    async def off_dead_mounts(*_args: object) -> None:
        raise RuntimeError("unexpected")

    second._off_dead_mounts = off_dead_mounts  # type: ignore[method-assign]
    await asyncio.wait_for(second.start(), 30)
    try:
        assert [i.id for i in await second.list()] == [kept.id]
        assert fake.calls == []
    finally:
        await second.destroy_all()
        await second.aclose()
