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
from dsec.testing.conformance import Check, SharedSandbox, own_sandbox, run, sandbox


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


async def test_every_check_passes_on_one_shared_sandbox(tmp_path: Path) -> None:
    """Checks borrowing one sandbox in turn pass, each returning it as it found it (in reverse order here: the
    microvm suite shares one in the forward order)."""
    async with fake_factory(tmp_path) as (backend, image):
        lender = SharedSandbox(backend, image)
        try:
            for check in reversed(CHECKS):
                with lender.serving(check):
                    await check(backend, image)
            assert lender.created == 1 and lender.record is not None
        finally:
            await lender.aclose()
        assert list((tmp_path / "sandboxes").iterdir()) == []


async def test_a_shared_sandbox_is_lent_only_where_it_fits(tmp_path: Path) -> None:
    seen: dict[str, str] = {}

    async def plain(backend: Backend, image: ImageRef) -> None:
        async with sandbox(backend, image) as a, sandbox(backend, image) as b, \
                sandbox(backend, image, env={"X": "1"}) as c:
            seen.update(a=a.id, b=b.id, c=c.id)

    @own_sandbox
    async def owner(backend: Backend, image: ImageRef) -> None:
        async with sandbox(backend, image) as sb:
            seen["own"] = sb.id

    async with fake_factory(tmp_path) as (backend, image):
        lender = SharedSandbox(backend, image)
        try:
            with lender.serving(plain):
                await plain(backend, image)
            with lender.serving(owner):
                await owner(backend, image)
            assert lender.record is not None and seen["a"] == lender.record.id
            assert len({lender.record.id, seen["b"], seen["c"], seen["own"]}) == 4, seen  # fresh ones
            async with sandbox(backend, image) as outside:  # not serving: never lent
                assert outside.id != lender.record.id
            assert sorted(p.name for p in (tmp_path / "sandboxes").iterdir()) == [lender.record.id]
        finally:
            await lender.aclose()


async def test_a_failed_or_unresettable_borrower_gets_a_new_sandbox(tmp_path: Path) -> None:
    async def fails(backend: Backend, image: ImageRef) -> None:
        async with sandbox(backend, image) as sb:
            await backend.write_file(sb, "/workspace/half-done", b"x", None)
            raise RuntimeError("check failed")

    async def clean(backend: Backend, image: ImageRef) -> None:
        async with sandbox(backend, image) as sb:
            assert (await run(backend, sb, "ls -A")).stdout == b""

    async with fake_factory(tmp_path) as (backend, image):
        lender = SharedSandbox(backend, image, reset="touch stuck; false")  # a reset that fails
        try:
            with lender.serving(fails), pytest.raises(RuntimeError, match="check failed"):
                await fails(backend, image)
            assert lender.record is None and list((tmp_path / "sandboxes").iterdir()) == []
            with lender.serving(clean), pytest.raises(AssertionError, match="not reset"):
                await clean(backend, image)
            assert lender.record is None and lender.created == 2
            assert list((tmp_path / "sandboxes").iterdir()) == []
        finally:
            await lender.aclose()


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
