"""``dsec.AsyncTrajectory``: a trajectory by name, to look at, end or delete (not to drive: that is
``AsyncSandbox.create(trajectory=...)``).

Owns the SDK's face of the node API's trajectory operations (list, end, delete, the log). It never numbers
a call nor matches one against the log (``replay.py`` and the daemon do).
"""

from __future__ import annotations

import builtins

from dsec.errors import NotFound
from dsec.models import LoggedCall, TrajectoryInfo

from .client import Client, default_client

__all__ = ["AsyncTrajectory"]


class AsyncTrajectory:
    """A trajectory in the node's log, by name: ``await AsyncTrajectory("job-17/rollout-3").delete()``."""

    def __init__(self, name: str, client: Client | None = None) -> None:
        self._name = name
        self._given = client

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def name(self) -> str:
        """The trajectory's name."""
        return self._name

    @property
    def _client(self) -> Client:
        return self._given or default_client()

    @classmethod
    async def list(cls, prefix: str = "", client: Client | None = None, limit: int = 1000
                   ) -> builtins.list[TrajectoryInfo]:
        """Trajectories in the log whose name starts with ``prefix``, by name (at most ``limit``)."""
        return await (client or default_client()).api.list_trajectories(prefix=prefix, limit=limit)

    async def info(self) -> TrajectoryInfo:
        """Its calls, sandbox, latest checkpoint and whether it ended (raises :class:`dsec.NotFound`)."""
        found = [t for t in await self._client.api.list_trajectories(prefix=self.name, limit=1) if t.name == self.name]
        if not found:
            raise NotFound(f"no trajectory {self.name!r} in the log", trajectory=self.name)
        return found[0]

    async def log(self, start: int = 0, limit: int = 1000) -> builtins.list[LoggedCall]:
        """Its logged calls from ``start`` (what a re-run replays)."""
        return await self._client.api.trajectory_log(self.name, start, limit)

    async def end(self) -> TrajectoryInfo:
        """End it on purpose: its sandbox is destroyed; its log stays readable until the name is opened again,
        which starts a new trajectory (``sb.close(end=True)`` does this for the handle's trajectory)."""
        return await self._client.api.end_trajectory(self.name)

    async def delete(self) -> None:
        """Delete it: its sandbox, its log, and the checkpoints no other trajectory (a branch) shares."""
        await self._client.api.delete_trajectory(self.name)
