"""Two gateway replicas over the fleet simulator (200 nodes, ~20,000 sandboxes) and a real PostgreSQL, under
faults: a replica SIGKILLed in the middle of a batch, a node dying in the middle of a batch, a node's event
stream lagging while it times sandboxes out. Checked throughout and at the end, by the fleet's own count:

- no node is ever over capacity (the fleet refuses and counts any create that would put it over);
- no job ever has more live sandboxes than its quota (sampled every few hundred milliseconds);
- batches are all or nothing (every batch label the fleet holds has exactly its batch's count);
- the replicas' records and the fleet agree: no row for a sandbox the fleet does not have, no sandbox in
  the fleet that no replica knows.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from dsec.testing.simcluster import SimCluster, sim_cluster
from postgres_support import PgServer, postgres_or_missing

pytestmark = [pytest.mark.slow]

NODES = 200
CAPACITY = {"cpu": 64.0, "memory": 256 * 2**30, "slots": {"function": 150}}
JOBS: dict[str, dict[str, Any]] = {"a": {"max_live": 11_000, "max_rate": 50_000}, "b": {"max_live": 9_000}}
SPEC = {"image": "debian-python", "backend": "function", "cpu": 0.01, "memory": 16 * 2**20, "timeout": 86_400}


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


class Watch:
    """Samples the fleet's live sandboxes per job in a thread; the highest count seen per job."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.peak: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            counts: collections.Counter[str] = collections.Counter()
            for held in self.cluster.fleet.sandboxes().values():
                for job, _batch in held.values():
                    counts[job or ""] += 1
            for job, n in counts.items():
                self.peak[job] = max(self.peak[job], n)
            self.samples += 1

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def batch(http: httpx.AsyncClient, url: str, token: str, count: int) -> list[str] | str:
    """One batch through ``url``: the ids, or why it failed."""
    try:
        r = await http.post(url + "/v1/sandboxes/batch", json={"count": count, "spec": SPEC},
                            headers={"Authorization": f"Bearer {token}"}, timeout=120)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if r.status_code != 201:
        return r.text[:300]
    return [item["id"] for item in r.json()]


async def scenario(c: SimCluster) -> dict[str, Any]:
    r0, r1 = c.replicas
    a, b = c.tokens["a"], c.tokens["b"]
    out: dict[str, Any] = {}
    async with httpx.AsyncClient() as http:
        made = await asyncio.gather(*(batch(http, (r0, r1)[i % 2].url, (a, b)[i % 2], 1000) for i in range(14)))
        assert all(isinstance(m, list) for m in made), made
        # Single creates through both replicas, some destroyed through the other one (passed on to the owner).
        singles = []
        for i in range(200):
            r = await http.post((r0, r1)[i % 2].url + "/v1/sandboxes", json=SPEC,
                                headers={"Authorization": f"Bearer {b}"}, timeout=60)
            assert r.status_code == 201, r.text
            singles.append(r.json()["id"])
        for i, sid in enumerate(singles[:80]):
            r = await http.delete((r1, r0)[i % 2].url + f"/v1/sandboxes/{sid}",
                                  headers={"Authorization": f"Bearer {b}"})
            assert r.status_code == 204, r.text
        # One batch destroy through one replica of sandboxes both hold: the other destroys those it has.
        r = await http.post(r0.url + "/v1/sandboxes/destroy", json={"ids": singles[80:120]},
                            headers={"Authorization": f"Bearer {b}"}, timeout=60)
        assert r.status_code == 200 and sorted(r.json()["destroyed"]) == sorted(singles[80:120]), r.text

        # A replica killed in the middle of a batch: the nodes answer slowly so that the kill lands mid-way.
        c.fleet.fault("latency", value=0.4)
        pending = asyncio.create_task(batch(http, r0.url, a, 2500))
        await asyncio.sleep(0.25)
        await asyncio.to_thread(r0.kill)
        out["killed_batch"] = await pending
        c.fleet.fault("latency", value=0.0)
        assert isinstance(out["killed_batch"], str), "the batch of a killed replica cannot have been answered"
        await asyncio.to_thread(c.wait_placing, NODES, 60)  # the other replica took its cells over
        r0.start()
        await asyncio.to_thread(c.wait_ready, r0)

        # A node dying in the middle of a batch (what it held goes with it: noted, for the batch check).
        held = await asyncio.to_thread(c.fleet.sandboxes)
        victim = max(held.items(), key=lambda kv: len(kv[1]))[0]
        out["gone"] = dict(held[victim])
        c.fleet.fault("latency", value=0.3)
        pending = asyncio.create_task(batch(http, r1.url, b, 1500))
        await asyncio.sleep(0.1)
        c.fleet.fault("die", victim)
        out["node_batch"] = await pending
        c.fleet.fault("latency", value=0.0)

        # A node's event stream lags while it times sandboxes out: the events are gone, the replica reconciles.
        held = await asyncio.to_thread(c.fleet.sandboxes)
        lagging = max(held.items(), key=lambda kv: len(kv[1]))[0]
        c.fleet.fault("lag", lagging, 40)
        c.fleet.fault("expire", lagging, 30)
        out["gone"].update(held[lagging])  # some of these expired

        # Quota pressure: job a asks for more than its quota allows at once, through both replicas together.
        out["over_quota"] = await asyncio.gather(batch(http, r0.url, a, 2500), batch(http, r1.url, a, 2500))
    return out


def settled(c: SimCluster, dsn: str) -> tuple[set[str], set[str], dict[str, tuple[int, str]]]:
    """(live ids the replicas know, ids the fleet holds, batch id -> (count, state))."""
    known: set[str] = set()
    for replica in c.replicas:
        r = httpx.get(replica.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {c.admin}"}, timeout=120)
        r.raise_for_status()
        known |= {i["id"] for i in r.json() if i["state"] in ("running", "paused", "creating")}
    fleet = {sid for held in c.fleet.sandboxes().values() for sid in held}
    with psycopg.connect(dsn) as conn:
        batches = {str(i): (int(n), str(s)) for i, n, s in
                   conn.execute("SELECT id, count, state FROM dsec_cluster_batches").fetchall()}
    return known, fleet, batches


def test_two_replicas_keep_the_invariants_under_faults(pg: PgServer) -> None:
    with sim_cluster(pg.dsn, NODES, JOBS, replicas=2, cells=8, lease_ttl=5.0, capacity=CAPACITY,
                     admission_wait=5.0) as c:
        c.wait_placing(NODES)
        with Watch(c) as watch:
            out = asyncio.run(scenario(c))
            deadline = time.monotonic() + 60
            while True:  # takeovers, the lag's reconcile and the batches' undoing settle within seconds
                known, fleet, batches = settled(c, pg.dsn)
                if known == fleet or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
        stats = c.fleet.statistics()
        assert stats["over_capacity"] == 0, stats
        assert watch.samples > 5 and all(watch.peak[job] <= JOBS[job]["max_live"] for job in JOBS), watch.peak
        assert known == fleet, (f"records without a sandbox: {sorted(known - fleet)[:10]}; sandboxes without a "
                                f"record: {sorted(fleet - known)[:10]}")
        # All or nothing: a batch not done has no member left; a done one has all of its members, but for those
        # that died with the node or timed out afterwards.
        now = {sid: label for held in c.fleet.sandboxes().values() for sid, (_job, label) in held.items()}
        members = collections.Counter(label for label in now.values() if label)
        lost = collections.Counter(label for sid, (_job, label) in out["gone"].items() if label and sid not in now)
        for label, (count, state) in batches.items():
            if state == "done":
                assert members[label] + lost[label] == count, (label, members[label], lost[label], count)
            else:
                assert members[label] == 0, (label, state, members[label], out, [r.tail(60) for r in c.replicas])
        assert not set(members) - set(batches), "sandboxes of a batch the gateway never recorded"
        assert 20_000 >= stats["live"] >= 14_000, stats
        # The fault injections did happen.
        assert stats["alive"] == NODES - 1 and isinstance(out["killed_batch"], str)
        assert any("QuotaExceeded" in str(r) for r in out["over_quota"]), out["over_quota"]
