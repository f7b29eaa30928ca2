"""The red-team suite: every registered attack (``attacks_*.py``) against every backend.

One module-scoped arena per backend (started backend + one shared sandbox, see ``redteam.Arena``);
each attack runs, then the host is checked unchanged and the backend must still serve. The table
attack x backend is printed at the end of the session and written to ``tests/artifacts/redteam.json``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from redteam import ATTACKS, BACKENDS, Arena, HostState, all_attacks, new_host_marker

from conftest import missing
from container_support import images_dir, short_home, sweep
from dsec.backends.base import Backend, ImageRef
from dsec.config import Settings
from dsec.errors import DSecError
from dsec.models import ExecRequest
from function_support import fn_leftovers

pytestmark = [pytest.mark.root]

NOT_BUILT = "not applicable: backend {} is not built yet"
ATTACK_TIMEOUT = 300.0


def _backend_params() -> list[object]:
    # vm: the first attack also waits for the session's template cold boot (minutes under TCG, as in test_vm.py)
    marks = {"microvm": [pytest.mark.vm, pytest.mark.slow],
             "vm": [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1800)]}
    return [pytest.param(name, marks=marks.get(name, []), id=name) for name in BACKENDS]


def _make_backend(name: str, home: Path) -> Backend:
    settings = Settings(home=home, images_dir=images_dir())
    if name == "container":
        from dsec.backends.container import ContainerBackend

        return ContainerBackend(settings)
    if name == "function":
        from dsec.backends.function import FunctionBackend

        return FunctionBackend(settings)
    if name == "microvm":
        from dsec.backends.microvm import MicroVMBackend
        from dsec.guest.kernel import default_guest_dir, find_kernel

        try:
            find_kernel(default_guest_dir())
        except DSecError as e:
            missing(str(e))
        return MicroVMBackend(settings)
    if name == "vm":
        from dsec.backends.vm import VMBackend
        from dsec.guest.vmimage import find_vm_image

        try:
            find_vm_image(VM_IMAGE)
        except DSecError as e:
            missing(str(e))
        return VMBackend(settings)
    pytest.skip(NOT_BUILT.format(name))
    raise AssertionError("unreachable")


VM_IMAGE = "debian-desktop"
"""The vm backend's image (built by scripts/setup; tests/backends/test_vm.py runs it too, on the same template)."""


def _qemu_pids(backend: Backend) -> list[int]:
    run_root = getattr(backend, "run_root", None)
    if run_root is None:
        return []
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline and f"{run_root}/".encode() in cmdline:
                found.append(int(proc.name))
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=_backend_params())
async def arena(request: pytest.FixtureRequest) -> AsyncIterator[Arena]:
    """A started backend of one kind with a lazily created shared sandbox; nothing of it survives."""
    name: str = request.param
    # vm, microvm: the session's homes (conftest.py), whose templates the backend suites share (one cold boot of
    # each per session)
    session_home = {"vm": "vm_home", "microvm": "microvm_home"}.get(name)
    home = request.getfixturevalue(session_home) if session_home else short_home(f"dsec-rt-{name[:3]}-")
    try:
        backend = _make_backend(name, home)
        await backend.start()
        # vm: its own disk image; the others: debian-python from the store (requested only here, so a vm-only
        # run never mounts it)
        image = backend.resolve_image(VM_IMAGE) if name == "vm" else request.getfixturevalue("debian_python_image")
        assert isinstance(image, ImageRef)
        ring = Arena(name, backend, image, home)
        try:
            if name == "vm":
                await ring.load_reference()
            yield ring
        finally:
            try:
                await ring.aclose()
            finally:
                removed = await backend.cleanup_orphans(set())
                await backend.aclose()
                if name == "container":
                    removed += await sweep(home, images_dir())
                for pid in _qemu_pids(backend):
                    os.kill(pid, signal.SIGKILL)
                    removed.append(f"qemu {pid}")
                left = fn_leftovers(home) if name == "function" else {}
            assert [r for r in removed if r.startswith(("sb-", "qemu"))] == [], f"arena leaked: {removed}"
            assert not any(left.values()), f"arena leaked: {left}"
    finally:
        if session_home is None:
            shutil.rmtree(home, ignore_errors=True)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("attack_id", [a.id for a in all_attacks()])
async def test_attack(arena: Arena, attack_id: str, request: pytest.FixtureRequest) -> None:
    item = ATTACKS[attack_id]
    reason = item.reason_not_applicable(arena.name)
    if reason:
        pytest.skip(f"not applicable: {reason}")
    gap = item.open_gaps.get(arena.name)
    if gap:
        request.applymarker(pytest.mark.xfail(reason=f"open gap: {gap}", strict=False))
    marker = new_host_marker()
    try:
        async with arena.target(item, marker) as target:
            before = HostState.capture(arena.image)  # after creating the sandbox (a VM template writes GBs)
            await asyncio.wait_for(item.fn(target), ATTACK_TIMEOUT)
    finally:
        failed_to_stay_away = marker.exists()
        marker.unlink(missing_ok=True)
    assert not failed_to_stay_away, f"the attack created {marker} on the host"
    before.assert_unchanged(arena.image, marker)
    # the platform survived: the backend still creates sandboxes and runs commands
    shared = await arena.shared()
    r = await arena.backend.exec(shared, ExecRequest(command="echo alive", timeout=60))
    assert r.stdout == b"alive\n", f"the backend stopped serving after the attack: {r}"


def test_registry_is_well_formed() -> None:
    """At least 30 distinct attacks, each documented, each applicable somewhere, reasons for the rest."""
    attacks = all_attacks()
    assert len(attacks) >= 30, f"only {len(attacks)} attacks registered"
    for a in attacks:
        assert a.description and a.models and a.defence, a.id
        assert set(a.not_applicable) <= set(BACKENDS), (a.id, a.not_applicable)
        assert len(a.not_applicable) < len(BACKENDS), f"{a.id} applies to no backend"
        assert all(r.strip() for r in a.not_applicable.values()), a.id
