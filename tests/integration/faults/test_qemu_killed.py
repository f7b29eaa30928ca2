"""Chaos on the microvm backend: a real daemon whose sandbox's QEMU is SIGKILLed (found, as an operator would,
by its command line naming the sandbox; the backend's internals are not used). The sandbox is reported lost
with the reason (an event, ``SandboxLost``), nothing of it stays, the node's other sandboxes keep working and
the next microvm create succeeds. One guest boot each (TCG here): kept to one test.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from test_chaos import node_on

import dsec
from container_support import await_until
from guest_support import qemu_of

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_microvm_whose_qemu_is_killed_is_reported_lost(debian_python_image: object, microvm_home: Path) -> None:
    # the session's microvm home (conftest.py): the node restores its guests from the shared template
    # TCG boots on a loaded 2-core machine can pass the default 60 s (scripts/test gives them 240 s): this test
    # is about the kill, not the boot
    boot = os.environ.get("DSEC_MICROVM_BOOT_TIMEOUT") or "240"
    with node_on(microvm_home, DSEC_MICROVM_BOOT_TIMEOUT=boot) as node:
        asyncio.run(_qemu_killed(node.url))


async def _qemu_killed(url: str) -> None:
    async with dsec.Client(url) as client:
        box = await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
        vm = await dsec.AsyncSandbox.create(image="debian-python", backend="microvm", memory="384Mi", client=client)
        assert (await vm.exec("echo up", timeout=300)).stdout == b"up\n"
        qemu = qemu_of(vm.id)
        assert qemu, "no QEMU names the sandbox on its command line"
        events: list[dsec.LifecycleEvent] = []

        async def follow() -> None:
            async for event in client.events():
                events.append(event)

        watcher = asyncio.create_task(follow())
        os.kill(qemu[0], signal.SIGKILL)
        try:
            assert await await_until(lambda: any(e.kind == "lost" and e.sandbox_id == vm.id for e in events),
                                     timeout=30)
        finally:
            watcher.cancel()
        lost = next(e for e in events if e.kind == "lost" and e.sandbox_id == vm.id)
        assert "QEMU" in str(lost.reason) or "qemu" in str(lost.reason), lost
        with pytest.raises(dsec.SandboxLost):
            await vm.exec("true")
        assert await await_until(lambda: qemu_of(vm.id) == [], timeout=20), "the killed VM left a QEMU"
        assert (await box.exec("echo still")).stdout == b"still\n"  # the node's other sandboxes are untouched
        again = await dsec.AsyncSandbox.create(image="debian-python", backend="microvm", memory="384Mi", client=client)
        assert (await again.exec("echo again", timeout=300)).stdout == b"again\n"
        for sb in (again, box):
            await sb.close()
