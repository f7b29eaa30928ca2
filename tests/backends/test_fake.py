"""The conformance suite on FakeBackend: keeps the suite honest and the fake faithful."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends.base import Backend, ImageRef
from dsec.testing import CHECKS, FakeBackend, check_backend
from dsec.testing.conformance import Check


@contextlib.asynccontextmanager
async def fake_factory(tmp_path: Path) -> AsyncIterator[tuple[Backend, ImageRef]]:
    backend = FakeBackend(root=tmp_path / "sandboxes")
    await backend.start()
    try:
        yield backend, ImageRef(name="fake", rootfs=tmp_path / "rootfs")
    finally:
        await backend.aclose()
        shutil.rmtree(tmp_path / "sandboxes", ignore_errors=True)


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_fake_conforms(check: Check, tmp_path: Path) -> None:
    async with fake_factory(tmp_path) as (backend, image):
        await check(backend, image)
        left = list((tmp_path / "sandboxes").iterdir())
        assert left == [], f"sandboxes left behind: {left}"


async def test_check_backend_reports_failures(tmp_path: Path) -> None:
    async def broken(backend: Backend, image: ImageRef) -> None:
        raise AssertionError("deliberately broken")

    with pytest.raises(AssertionError, match="1 conformance check\\(s\\) failed:\nbroken: "):
        await check_backend(lambda: fake_factory(tmp_path), [broken])


def test_checks_are_named_and_unique() -> None:
    names = [c.__name__ for c in CHECKS]
    assert len(names) == len(set(names)) >= 20
    assert all(n.startswith("check_") for n in names)


class _ModeIgnoringFake(FakeBackend):
    async def write_file(self, record, path, data, mode, user=None):  # type: ignore[no-untyped-def]
        await super().write_file(record, path, data, None, user)


class _MergingFake(FakeBackend):
    """Reports stderr as stdout, like a backend that forgot to separate the streams."""

    async def exec_stream(self, record, request, user=None):  # type: ignore[no-untyped-def]
        async for event in super().exec_stream(record, request, user):
            if event.type == "stderr":
                event = event.model_copy(update={"type": "stdout"})
            elif event.result is not None:
                r = event.result
                event = event.model_copy(update={"result": r.model_copy(
                    update={"stdout": r.stdout + r.stderr, "stderr": b""})})
            yield event


@pytest.mark.parametrize(("mutant", "check_name"), [
    (_ModeIgnoringFake, "check_file_mode_and_parents"),
    (_MergingFake, "check_stdout_stderr_separated"),
])
async def test_suite_catches_broken_backends(mutant: type[FakeBackend], check_name: str,
                                             tmp_path: Path) -> None:
    """The checks assert real outcomes: a backend with a known defect fails the matching check."""
    check = next(c for c in CHECKS if c.__name__ == check_name)
    backend = mutant(root=tmp_path / "sandboxes")
    with pytest.raises(AssertionError):
        await check(backend, ImageRef(name="fake", rootfs=tmp_path / "rootfs"))


def test_a_fake_removes_the_root_it_made_when_it_goes() -> None:
    import gc

    fake = FakeBackend()
    root = fake.root
    (root / "sandbox").mkdir()
    del fake
    gc.collect()
    assert not root.exists()
    given = Path(tempfile.mkdtemp(prefix="dsec-given-"))
    try:
        fake = FakeBackend(root=given)  # a root the caller gave stays the caller's
        del fake
        gc.collect()
        assert given.is_dir()
    finally:
        shutil.rmtree(given)
