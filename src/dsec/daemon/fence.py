"""Fencing on the node: creates sent under a cell lease older than one the node has seen are refused.

Owns :class:`Fences`, the newest lease epoch this node has seen for each cell of gateway replicas
(:mod:`dsec.cluster.cells`). A replica sends ``X-DSec-Fence: <cell>:<epoch>`` with every create and with
the reconcile that takes a node over; a request naming an older epoch than the newest seen for its cell is
refused with :class:`~dsec.Fenced` before it reaches the engine, so a replica that lost its lease (paused,
partitioned) cannot place on a node its cell's new owner already reached. Only the node's admin token may
send the header (the gateway's): a job's token could otherwise fence every replica out. The epochs live in
memory; after the daemon restarts, the first fence it sees is the floor again (the new owner's reconcile
sends it). Must never decide anything else about a request.
"""

from __future__ import annotations

from dsec.errors import Fenced, Forbidden, InvalidRequest

__all__ = ["FENCE_HEADER", "Fences"]

FENCE_HEADER = "X-DSec-Fence"
"""The header of a request that names the cell lease (``cell:epoch``) it was sent under."""


class Fences:
    """The newest epoch seen per cell."""

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}
        self.refused = 0
        """Requests refused for an old fence (a count)."""

    def admit(self, value: bytes, *, admin: bool) -> None:
        """Accept a request carrying ``X-DSec-Fence: value`` (raising :class:`Fenced` when a newer lease on its
        cell was seen), remembering its epoch as the newest when it is."""
        if not admin:
            raise Forbidden("only the node's admin token (a gateway replica's) may send X-DSec-Fence")
        cell, sep, raw = value.decode(errors="replace").partition(":")
        if not sep or not cell or not raw.isdigit():
            raise InvalidRequest(f"X-DSec-Fence must be '<cell>:<epoch>' (an epoch is a whole number), got "
                                 f"{value.decode(errors='replace')!r}")
        epoch, seen = int(raw), self.newest.get(cell, 0)
        if epoch < seen:
            self.refused += 1
            raise Fenced(f"this node has seen lease epoch {seen} on cell {cell}, newer than {epoch}: the gateway "
                         "replica sending it no longer owns the cell, and nothing was done", cell=cell, epoch=epoch,
                         newest=seen)
        self.newest[cell] = epoch
