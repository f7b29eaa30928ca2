"""How placement finds the best nodes without scanning them: a lazy load index and a water-level fill.

Owns the two searches behind :class:`~dsec.cluster.placement.Placer`, both equal to the greedy rule "each
sandbox goes to the fitting node of the lowest score, then name", where a node's score is its load (the
highest of its cpu, memory and slot fractions) minus a locality bonus when its cache holds the image:

- :class:`LoadIndex`: min-heaps of (load, name) per backend and per image with lazy invalidation. A node
  whose load rose keeps its old, too-low entry, fixed when it reaches the top; one whose load fell gets a
  fresh entry at once. One sandbox is placed in O(log nodes), usually one pop and one push.
- :func:`water_fill`: a batch placed in one pass over the nodes. Each node's score after ``k`` more
  sandboxes is a maximum of three lines in ``k``, so "how many of node i's next sandboxes score below
  level L" has a closed form; a binary search on L finds the level at which the batch fits, and the few
  sandboxes at the boundary are ordered by (score, name) exactly as the greedy fill orders them.
  O(nodes · log) with numpy instead of O(count · nodes).

Pure functions and data structures over numbers: no I/O, no asyncio. It must never decide quotas or
admission; the placer does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["LoadIndex", "water_fill"]


class LoadIndex:
    """Keys (a backend or an image) -> a lazy min-heap of (load, node name, version)."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[float, str, int]]] = {}
        self._members: dict[str, dict[str, tuple[float, str, int]]] = {}
        """Key -> member -> the entry last pushed for it (a lower bound of its load: it only rose since)."""

    def add(self, key: str, load: float, name: str, version: int) -> None:
        """``name`` belongs under ``key`` with this load now (a new member, or its load fell)."""
        heap = self._heaps.setdefault(key, [])
        members = self._members.setdefault(key, {})
        entry = members[name] = (load, name, version)
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(members) + 64:  # stale entries piled up: one entry a member again
            heap[:] = members.values()
            heapq.heapify(heap)

    def discard(self, key: str, name: str) -> None:
        """``name`` no longer belongs under ``key`` (its entries are dropped when they surface)."""
        members = self._members.get(key)
        if members is not None:
            members.pop(name, None)

    def members(self, key: str) -> set[str]:
        """The names under ``key``."""
        return set(self._members.get(key, {}))

    def best(self, key: str, current: Callable[[str], tuple[float, int] | None],
             acceptable: Callable[[str], bool]) -> str | None:
        """The member of lowest (load, name) that ``acceptable`` takes. ``current(name)`` gives a member's
        (load, version) now, or None once it should leave the index."""
        heap = self._heaps.get(key)
        members = self._members.get(key, {})
        if not heap:
            return None
        passed: list[tuple[float, str, int]] = []
        found = None
        while heap:
            load, name, version = heap[0]
            now = current(name) if name in members else None
            if now is None:
                heapq.heappop(heap)
                members.pop(name, None)
                continue
            if version != now[1]:
                heapq.heappop(heap)
                if load < now[0]:  # its load rose since: re-enter at the right place
                    entry = members[name] = (now[0], name, now[1])
                    heapq.heappush(heap, entry)
                continue  # else a fresher entry (pushed when its load fell) is already in the heap
            if acceptable(name):
                found = name
                break
            passed.append(heapq.heappop(heap))  # fits other specs, not this one
        for entry in passed:
            heapq.heappush(heap, entry)
        return found


def water_fill(names: Sequence[str], fit: npt.NDArray[np.int64], used: npt.NDArray[np.float64],
               step: npt.NDArray[np.float64], bonus: npt.NDArray[np.float64], count: int) -> dict[str, int]:
    """Node name -> how many of ``count`` sandboxes it takes, as the greedy fill would place them one by one.

    Per node (row): ``fit``, how many more fit there; ``used``, its cpu, memory and slot fractions in use
    now (three columns); ``step``, what one more sandbox adds to each; ``bonus``, subtracted from its load
    when its cache holds the image. The caller checked that ``count`` fits (``fit.sum() >= count``) and
    passes only rows with ``fit > 0``."""
    n = len(names)
    if count <= 0 or not n:
        return {}
    moving = step > 0

    def below(level: float) -> npt.NDArray[np.int64]:
        """Per node: how many of its next sandboxes score strictly below ``level``."""
        gap = level + bonus[:, None] - used
        room = np.where(gap > 0, np.inf, 0.0)  # a fraction that never moves: all or none below the level
        np.ceil(np.divide(gap, step, out=room, where=moving), out=room, where=moving)
        counts: npt.NDArray[np.int64] = np.clip(room.min(axis=1), 0, fit).astype(np.int64)
        return counts

    def score(k: npt.NDArray[np.int64], idx: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        scores: npt.NDArray[np.float64] = (used[idx] + k[:, None] * step[idx]).max(axis=1) - bonus[idx]
        return scores

    everyone = np.arange(n)
    lo = float(score(np.zeros(n, dtype=np.int64), everyone).min())
    hi = float(score(fit - 1, everyone).max())
    hi = float(np.nextafter(hi, np.inf))
    at_lo, at_hi = 0, int(below(hi).sum())
    for _ in range(100):  # halving the level's range down to float spacing
        if at_hi - at_lo <= 2 * n:
            break
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        at_mid = int(below(mid).sum())
        if at_mid < count:
            lo, at_lo = mid, at_mid
        else:
            hi, at_hi = mid, at_mid
    base = below(lo)
    left = count - int(base.sum())
    if left > 0:
        # The sandboxes scoring in [lo, hi): taken as the greedy fill takes them, by (score, name).
        extra = below(hi) - base
        idx = np.repeat(everyone, extra)
        offset = np.arange(idx.size) - np.repeat(np.cumsum(extra) - extra, extra)
        ks = base[idx] + offset
        order = np.lexsort((np.asarray(names)[idx], score(ks, idx)))[:left]
        np.add.at(base, idx[order], 1)
    return {names[int(i)]: int(base[i]) for i in np.nonzero(base)[0]}
