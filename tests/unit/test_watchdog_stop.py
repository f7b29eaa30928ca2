"""The watchdog stops when asked, whatever it was awaiting when the stop landed.

On Python 3.11 ``asyncio.wait_for`` returns its inner result, swallowing the cancel, when that result lands
in the same loop pass as the cancel: a watchdog probing a store then never stopped, and the engine's
``aclose`` waited for it forever (a test hung until its 300 s timeout in CI)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dsec.config import Settings
from dsec.daemon.health import Health
from dsec.daemon.watchdog import Watchdog


class _Node:
    """The engine as the watchdog sees it, with a trajectory probe the test releases."""

    def __init__(self, home: Path) -> None:
        self.settings = Settings(home=home)
        self.images: Any = None
        self.components = Health()
        self.probing = asyncio.Event()
        self.release = asyncio.Event()
        self.probes = 0

    def watched_backends(self) -> dict[str, Any]:
        return {}

    def running(self) -> list[Any]:
        return []

    def image_roots(self, sandbox_id: str) -> list[Path]:
        return []

    async def revive(self, record: Any) -> bool:
        return False

    async def lose(self, record: Any, reason: str, component: str) -> None:
        return None

    async def probe_trajectories(self) -> str | None:
        self.probes += 1
        self.probing.set()
        await self.release.wait()
        return None


async def test_a_stop_landing_with_a_probe_answer_still_stops_the_watchdog(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    watchdog = Watchdog(node, interval=0.01)
    watchdog.start()
    await asyncio.wait_for(node.probing.wait(), 10)
    node.release.set()  # the probe's answer and the stop land in the same loop pass
    await asyncio.wait_for(watchdog.aclose(), 10)
    probes = node.probes
    await asyncio.sleep(0.05)
    assert node.probes == probes == 1
