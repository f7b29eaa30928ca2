"""The sandbox's display: screenshots, pointer and keyboard actions, each a logged call on a trajectory.

Owns only the pass-through from the node API's display operations to the backend (backends without a
display raise :class:`~dsec.errors.NotSupported`). Must never reach the engine beyond
:class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

from dsec.daemon.engine_parts import EngineParts
from dsec.models import KeyboardRequest, MouseRequest

__all__ = ["GuiOperations"]


class GuiOperations(EngineParts):
    """The engine's display operations."""

    async def screenshot(self, sandbox_id: str, seq: int | None = None) -> bytes:
        """The sandbox's display as PNG bytes (backends without a display raise NotSupported); logged on a
        trajectory like a file read."""
        record = self.records.live(sandbox_id, allow_paused=True)
        backend = self.backends.get(record.spec.backend)
        if record.spec.trajectory is None:
            return await backend.screenshot(record)
        data: bytes = await self.trajectories.call(record, seq, "screenshot", {}, None,
                                               lambda _: backend.screenshot(record))
        return data

    async def mouse(self, sandbox_id: str, request: MouseRequest, seq: int | None = None) -> None:
        """A pointer action on the sandbox's display (a logged call on a trajectory)."""
        record = self.records.live(sandbox_id, allow_paused=False)
        backend = self.backends.get(record.spec.backend)

        async def act(_: int) -> None:
            await backend.mouse(record, request.x, request.y, request.button, request.action)

        if record.spec.trajectory is None:
            await act(0)
            return
        await self.trajectories.call(record, seq, "mouse", request.model_dump(mode="json"), None, act)

    async def keyboard(self, sandbox_id: str, request: KeyboardRequest, seq: int | None = None) -> None:
        """Type text or press key combos on the sandbox's display (a logged call on a trajectory)."""
        record = self.records.live(sandbox_id, allow_paused=False)
        backend = self.backends.get(record.spec.backend)

        async def act(_: int) -> None:
            await backend.keyboard(record, text=request.text, keys=request.keys)

        if record.spec.trajectory is None:
            await act(0)
            return
        await self.trajectories.call(record, seq, "keyboard", request.model_dump(mode="json", exclude_none=True), None,
                                 act)
