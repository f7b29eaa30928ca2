"""A gateway replica SIGKILLed and started again on its address serves before it has read its rows back.

The nodes answer slowly, so that the restarted replica's takeover of its cells (rows read, every node
reconciled) is still under way when the calls below arrive: a create is placed on the first node
reconciled, and a call about a sandbox made before the restart waits for the rows rather than answering
that there is no such sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from dsec.testing.simcluster import sim_cluster
from postgres_support import PgServer, postgres_or_missing

pytestmark = [pytest.mark.slow]

NODES = 40
CAPACITY = {"cpu": 64.0, "memory": 256 * 2**30, "slots": {"function": 400}}
SPEC = {"image": "debian-python", "backend": "function", "cpu": 0.01, "memory": 16 * 2**20, "timeout": 86_400}


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


def test_a_restarted_replica_answers_for_its_sandboxes_while_it_reads_them_back(pg: PgServer) -> None:
    with sim_cluster(pg.dsn, NODES, {"a": {"max_live": 20_000, "max_rate": 50_000}}, replicas=1, cells=8,
                     lease_ttl=5.0, capacity=CAPACITY) as c:
        c.wait_placing(NODES)
        replica, token = c.replicas[0], c.tokens["a"]
        auth = {"Authorization": f"Bearer {token}"}
        made = httpx.post(replica.url + "/v1/sandboxes/batch", json={"count": 4000, "spec": SPEC}, headers=auth,
                          timeout=120)
        assert made.status_code == 201, made.text
        ids = [item["id"] for item in made.json()]

        c.fleet.fault("latency", value=3.0)  # no node is reconciled within 3 s of the restart
        replica.kill()
        replica.start()
        c.wait_ready(replica)

        async def at_once() -> tuple[httpx.Response, ...]:
            async with httpx.AsyncClient(base_url=replica.url, headers=auth, timeout=60) as http:
                return await asyncio.gather(
                    http.get(f"/v1/sandboxes/{ids[0]}"),
                    http.get("/v1/sandboxes"),
                    http.post("/v1/sandboxes/destroy", json={"ids": ids[:1000]}),
                    http.post("/v1/sandboxes", json=SPEC))

        got, listed, destroyed, created = asyncio.run(at_once())
        c.fleet.fault("latency", value=0.0)
        assert got.status_code == 200 and got.json()["id"] == ids[0], got.text
        assert listed.status_code == 200 and {i["id"] for i in listed.json()} >= set(ids[1000:]), listed.text[:300]
        assert destroyed.status_code == 200, destroyed.text
        assert sorted(destroyed.json()["destroyed"]) == sorted(ids[:1000]), destroyed.json()["missing"][:5]
        assert created.status_code == 201, created.text
        held = {sid for sandboxes in c.fleet.sandboxes().values() for sid in sandboxes}
        assert held == set(ids[1000:]) | {created.json()["id"]}
