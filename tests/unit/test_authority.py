"""A job's live quota split into per-cell allowances (dsec.cluster.authority) over an in-memory stand-in for
the database's grant and shrink (dsec_grant's rule: all of the need or nothing, the sum within the quota).
The real PostgreSQL functions are exercised by the cluster integration and fault tests."""

from __future__ import annotations

import collections
import time

import pytest

from dsec.cluster.authority import Authority
from dsec.cluster.cells import Lease
from dsec.cluster.placement import JobQuota, Placer
from dsec.errors import QuotaExceeded


class _Leases:
    def __init__(self, cells: int) -> None:
        self.cells = cells
        self.draining: set[int] = set()
        self.allowance: collections.Counter[tuple[int, str]] = collections.Counter()

    def lease(self, cell: int) -> Lease:
        return Lease(cell, 1, time.monotonic() + 60)

    async def grant(self, cell: int, job: str, need: int, want: int, max_live: int) -> int:
        total = sum(n for (_c, j), n in self.allowance.items() if j == job)
        granted = min(want, max_live - total)
        if granted < need:
            return 0
        self.allowance[cell, job] += granted
        return granted

    async def shrink(self, cell: int, job: str, amount: int) -> bool:
        if self.allowance[cell, job] < amount:
            return False
        self.allowance[cell, job] -= amount
        return True


class _Records:
    def __init__(self) -> None:
        self.live: collections.Counter[tuple[int, str]] = collections.Counter()

    def live_in(self, cell: int, job: str) -> int:
        return self.live[cell, job]


def _authority(cells: int, max_live: int) -> tuple[Authority, _Leases, _Records]:
    placer = Placer()
    placer.quotas["small"] = JobQuota(max_live=max_live)
    leases, records = _Leases(cells), _Records()
    return Authority(leases, records, placer), leases, records  # type: ignore[arg-type]


async def _create(authority: Authority, records: _Records, cell: int) -> None:
    reserved = await authority.admit("small", {f"n{cell}": 1})
    records.live[cell, "small"] += 1  # recorded: it counts as live now
    authority.settle("small", reserved)


async def test_a_small_quota_is_not_held_by_the_first_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    authority, leases, records = _authority(cells=4, max_live=3)
    monkeypatch.setattr(authority, "cell", lambda node: int(node[1:]))
    for cell in range(3):
        await _create(authority, records, cell)
    with pytest.raises(QuotaExceeded, match="quota of 3"):
        await authority.admit("small", {"n3": 1})
    assert not authority.pending, "a refused decision holds nothing"
    assert sum(leases.allowance.values()) == 3


async def test_a_cell_refused_more_takes_the_unused_allowance_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    authority, leases, records = _authority(cells=4, max_live=64)
    monkeypatch.setattr(authority, "cell", lambda node: int(node[1:]))
    await _create(authority, records, 0)
    # Cell 0 holds the whole quota (granted when it was busy), one of it used: cell 1 must still get one.
    leases.allowance[0, "small"] = authority.allowed[0, "small"] = 64
    await _create(authority, records, 1)
    assert leases.allowance[0, "small"] == 1 and leases.allowance[1, "small"] >= 1
    assert sum(leases.allowance.values()) <= 64
