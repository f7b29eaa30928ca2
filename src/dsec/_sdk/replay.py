"""The SDK side of a trajectory: numbering calls and fast-forwarding through the logged ones.

The daemon owns the log and decides every call it receives. This cursor only saves round trips: it
numbers the calls of one ``AsyncSandbox.create(trajectory=...)`` from 0, fetches the log in pages and,
while a call's identity (``dsec.trajectory.digest``) equals the logged one and the logged call is done,
returns the logged response without asking the daemon. Anything else (a different call, a call still
running or interrupted, a response the log did not keep whole, the end of the log) goes to the daemon
with its number, and the daemon's rules apply. Log entries never change once done, so a copy is as good
as the original.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec.models import LoggedCall
from dsec.trajectory.digest import call_identity
from dsec.trajectory.replay import decode_response

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Cursor"]

_PAGE = 2000


class Cursor:
    """Call numbers and a read-ahead copy of the log of one trajectory-bound sandbox handle."""

    def __init__(self, client: Client, name: str, logged: int) -> None:
        self._client = client
        self.name = name
        self.logged = logged
        """Calls in the log when the trajectory was opened."""
        self.next_seq = 0
        self._page: dict[int, LoggedCall] = {}
        self.served = 0
        """Calls answered from the local copy (no request sent)."""

    def take(self) -> int:
        """The next call's number."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    async def cached(self, seq: int, op: str, args: dict[str, Any]) -> tuple[bool, Any]:
        """``(True, response)`` when call ``seq`` can be answered from the log; ``(False, None)`` otherwise.

        A logged error is raised, as the daemon would.
        """
        if seq >= self.logged:
            return False, None
        entry = self._page.get(seq)
        if entry is None:
            await self._fetch(seq)
            entry = self._page.get(seq)
        if entry is None or entry.status != "done" or entry.response is None:
            return False, None
        digest, _ = call_identity(op, args)
        if digest != entry.digest or entry.op != op:
            return False, None  # the daemon raises ReplayDivergence with both calls
        del self._page[seq]
        self.served += 1
        return True, decode_response(op, entry.response)

    async def _fetch(self, start: int) -> None:
        self._page = {call.seq: call for call in await self._client.api.trajectory_log(self.name, start, _PAGE)}
