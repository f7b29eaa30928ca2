"""The gateway's sandbox records against two real node daemons (uvicorn on TCP with tokens): a create
answered before its row commits, rows rebuilt from the nodes' own records (reconcile), sandboxes that
expired or were destroyed behind the gateway's back, and creates placed again when their node's daemon
stops or does not answer.

The database is a recorder (what the gateway asked to write, and whether it waited): the durable side is
tested on a real PostgreSQL and a real gateway kill in tests/integration/functional/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sdk_daemon import Daemon, free_port, running_daemon

import dsec
from dsec.backends.base import ImageRef
from dsec.cluster.gateway import GatewayEngine, NodeFacts, current_job
from dsec.cluster.placement import Capacity
from dsec.cluster.records import Row
from dsec.cluster.server import Jobs, gateway_app
from dsec.cluster.state import NodeRow
from dsec.daemon.auth import JOB_LABEL
from dsec.errors import BackendUnavailable, ImageNotFound, SandboxNotFound, SandboxTimeout
from dsec.models import BatchCreateRequest, SandboxRecord, SandboxSpec
from dsec.testing.fake import FakeBackend


class _Writer:
    """Records the gateway's writes: ``waited`` for the ones a caller awaited, ``submitted`` for the rest."""

    def __init__(self) -> None:
        self.waited: list[tuple[str, Any]] = []
        self.submitted: list[tuple[str, Any]] = []

    async def put_rows(self, rows: list[tuple[str, Row]]) -> None:
        self.waited += [("put", sid) for sid, _row in rows]

    async def put_node(self, row: NodeRow) -> None:
        self.waited.append(("node", row.name))

    def submit_rows(self, rows: list[tuple[str, Row]], *, new: bool = False) -> None:
        self.submitted += [("put", (sid, r.job, r.state)) for sid, r in rows]

    def submit_delete(self, ids: list[str]) -> None:
        self.submitted += [("delete", sid) for sid in ids]


class _State:
    def __init__(self) -> None:
        self.writer = _Writer()

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    with (running_daemon(tmp_path_factory.mktemp("n1"), token="node-one-token-0123456789") as one,
          running_daemon(tmp_path_factory.mktemp("n2"), token="node-two-token-0123456789") as two):
        yield [one, two]


_ROOM = {"cpu": 64, "memory": 2**36, "slots": {"container": 100}}


def gateway(nodes: list[Daemon]) -> tuple[GatewayEngine, _Writer]:
    state = _State()

    async def membership() -> list[NodeFacts]:  # Ray's view: every node alive, at the address it had
        return [NodeFacts(name, True, row.url, row.token, _ROOM) for name, row in g.node_rows.items()]

    g = GatewayEngine(state, membership)
    for i, node in enumerate(nodes):
        name = f"node-{i}"
        assert node.tcp_url is not None and node.token is not None
        g.node_rows[name] = NodeRow(name, node.tcp_url, node.token, True, _ROOM)
        g.placer.set_node(name, Capacity(cpu=64, memory=2**36, slots={"container": 100}))
    return g, state.writer


def node_client(node: Daemon) -> dsec.Client:
    assert node.tcp_url is not None
    return dsec.Client(node.tcp_url, node.token)


async def test_create_answers_before_the_commit_and_stamps_the_job(nodes: list[Daemon]) -> None:
    g, writer = gateway(nodes)
    jobs = Jobs(by_token={"job-token-0123456789": "j1"}, quotas={})
    try:
        transport = httpx.ASGITransport(app=gateway_app(g, jobs))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            job = {"Authorization": "Bearer job-token-0123456789"}
            # A client cannot claim another job through the label: the gateway sets it.
            r = await c.post("/v1/sandboxes", json={"image": "tiny", "labels": {JOB_LABEL: "other", "k": "v"}},
                             headers=job)
            assert r.status_code == 201, r.text
            info = r.json()
            assert info["labels"] == {JOB_LABEL: "j1", "k": "v"} and info["endpoint"]["url"].startswith("http")
            assert ("put", (info["id"], "j1", "running")) in writer.submitted
            assert not [w for w in writer.waited if w[0] == "put"], "the create waited for its commit"
            assert g.placer.job("j1").live == 1
            # The fast path sits inside the job guard: no token, no create and no exec.
            assert (await c.post("/v1/sandboxes", json={"image": "tiny"})).status_code == 401
            refused = await c.post(f"/v1/sandboxes/{info['id']}/exec/result", json={"command": ["true"]})
            assert refused.status_code == 401, refused.text
            assert (await c.delete(f"/v1/sandboxes/{info['id']}", headers=job)).status_code == 204
            assert writer.submitted[-1] == ("delete", info["id"]) and g.placer.job("j1").live == 0
    finally:
        await g.aclose()


async def test_reconcile_adopts_what_the_node_holds_and_forgets_what_it_does_not(nodes: list[Daemon]) -> None:
    async with node_client(nodes[0]) as node:
        labelled = await dsec.AsyncSandbox.create(image="tiny", labels={JOB_LABEL: "j2"}, client=node)
        foreign = await dsec.AsyncSandbox.create(image="tiny", client=node)  # made on the node, not by a gateway
        gone = await dsec.AsyncSandbox.create(image="tiny", labels={JOB_LABEL: "j2"}, client=node)
        g, writer = gateway(nodes)
        g.records.put(gone.id, g._new_row(gone._info, "node-0", "j2"))
        g.placer.adopt("j2", "node-0", gone._info.spec)
        await gone.close()  # destroyed behind the gateway's back (while it was down)
        try:
            await g.reconcile("node-0")
            assert set(g.records.rows) == {labelled.id}
            row = g.records.rows[labelled.id]
            assert row.job == "j2" and row.node == "node-0"
            assert ("put", labelled.id) in writer.waited  # rare, and the only record: waited for
            assert ("delete", gone.id) in writer.submitted
            assert g.placer.job("j2").live == 1
            # Reconciling again changes nothing.
            before = list(writer.submitted)
            await g.reconcile("node-0")
            assert writer.submitted == before and g.placer.job("j2").live == 1
            token = current_job.set("j2")
            try:
                assert [i.id for i in await g.list({})] == [labelled.id]
            finally:
                current_job.reset(token)
        finally:
            await g.aclose()
            for sb in (labelled, foreign):
                await sb.close()


async def test_a_sandbox_destroyed_while_its_node_is_listed_is_not_adopted_again(
        nodes: list[Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """The node answers a reconcile's listing, then the gateway destroys one of the listed sandboxes before
    the listing is read: that sandbox must not come back as a record the node no longer has."""
    from dsec.api.client import NodeClient
    from dsec.api.protocol import NodeAPI

    g, _writer = gateway(nodes)
    listed, proceed = asyncio.Event(), asyncio.Event()

    async def slow_list(self: NodeClient, *args: Any, **kwargs: Any) -> Any:
        answer = await self.perform(NodeAPI.list, *args, **kwargs)
        listed.set()
        await proceed.wait()
        return answer

    token = current_job.set("j4")
    try:
        made = await g.create(SandboxSpec(image="tiny"))
        where = g.records.rows[made.id].node
        async with node_client(nodes[int(where.removeprefix("node-"))]) as node:
            # made on that node by a gateway that crashed before its record: the node differs from the records
            unknown = await dsec.AsyncSandbox.create(image="tiny", labels={JOB_LABEL: "j4"}, client=node)
            try:
                monkeypatch.setattr(NodeClient, "list", slow_list)
                reconciling = asyncio.create_task(g.reconcile(where))
                await asyncio.wait({reconciling, asyncio.ensure_future(listed.wait())}, timeout=30,
                                   return_when=asyncio.FIRST_COMPLETED)
                assert listed.is_set(), reconciling.exception() if reconciling.done() else "no listing in 30 s"
                await g.destroy(made.id)
                proceed.set()
                await reconciling
                assert made.id not in g.records.rows, "a destroyed sandbox came back from the listing"
                assert unknown.id in g.records.rows
            finally:
                await unknown.close()
    finally:
        current_job.reset(token)
        await g.aclose()


async def test_an_expired_sandbox_is_a_timeout_with_its_reason_through_the_gateway(nodes: list[Daemon]) -> None:
    g, writer = gateway(nodes)
    jobs = Jobs(by_token={"job-token-0123456789": "j3", "other-token-0123456789": "j4"}, quotas={})
    try:
        transport = httpx.ASGITransport(app=gateway_app(g, jobs))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            job = {"Authorization": "Bearer job-token-0123456789"}
            other = {"Authorization": "Bearer other-token-0123456789"}
            r = await c.post("/v1/sandboxes", json={"image": "tiny", "timeout": 0.3}, headers=job)
            sid = r.json()["id"]
            assert g.placer.job("j3").live == 1
            deadline = time.monotonic() + 20
            while (r := await c.get(f"/v1/sandboxes/{sid}", headers=job)).status_code == 200:
                assert time.monotonic() < deadline, "the sandbox did not expire"
                await asyncio.sleep(0.05)
            assert (r.status_code, r.json()["error"]["type"]) == (408, "SandboxTimeout"), r.text
            assert "timeout of 0.3 s" in r.json()["error"]["message"]
            # The gateway remembers: its room is given back, later calls are told the same without the node.
            assert g.placer.job("j3").live == 0 and g.records.rows[sid].state == "expired"
            assert ("put", (sid, "j3", "expired")) in writer.submitted
            r = await c.post(f"/v1/sandboxes/{sid}/pause", headers=job)
            assert (r.status_code, r.json()["error"]["type"]) == (408, "SandboxTimeout"), r.text
            assert (await c.get("/v1/sandboxes", headers=job)).json() == []
            r = await c.get(f"/v1/sandboxes/{sid}", headers=other)  # another job: an unknown id
            assert (r.status_code, r.json()["error"]["type"]) == (404, "SandboxNotFound")
            assert (await c.delete(f"/v1/sandboxes/{sid}", headers=job)).status_code == 204
            assert sid not in g.records.rows and g.placer.job("j3").live == 0
    finally:
        await g.aclose()


async def test_a_sandbox_destroyed_on_its_node_is_forgotten_on_first_contact(nodes: list[Daemon]) -> None:
    g, writer = gateway(nodes)
    token = current_job.set("j5")
    try:
        info = await g.create(SandboxSpec(image="tiny"))
        assert writer.submitted == [("put", (info.id, "j5", "running"))]
        async with node_client(nodes[int(g.records.rows[info.id].node == "node-1")]) as node:
            await (await dsec.AsyncSandbox.connect(info.id, client=node)).close()
        with pytest.raises(SandboxNotFound, match="was destroyed"):
            await g.get(info.id)
        assert info.id not in g.records.rows and g.placer.job("j5").live == 0
        assert writer.submitted[-1] == ("delete", info.id)
        with pytest.raises(SandboxNotFound):
            await g.get(info.id)
    finally:
        current_job.reset(token)
        await g.aclose()


async def test_the_nodes_events_keep_the_records_true_without_a_client_call(nodes: list[Daemon]) -> None:
    """Followed nodes tell the gateway of expiries and destroys at once: the room is given back before any
    client touches the sandbox again."""
    g, writer = gateway(nodes)
    for name in g.node_rows:
        g._follow(name)
    token = current_job.set("j6")
    try:
        short = await g.create(SandboxSpec(image="tiny", timeout=0.3))
        other = await g.create(SandboxSpec(image="tiny"))
        assert g.placer.job("j6").live == 2
        async with node_client(nodes[int(g.records.rows[other.id].node == "node-1")]) as node:
            await (await dsec.AsyncSandbox.connect(other.id, client=node)).close()  # behind the gateway's back
        deadline = time.monotonic() + 20
        while g.placer.job("j6").live:
            assert time.monotonic() < deadline, "the gateway did not learn of the expiry and the destroy"
            await asyncio.sleep(0.05)
        short_row = g.records.rows[short.id]
        assert short_row.state == "expired" and "timeout of 0.3 s" in (short_row.reason or "")
        assert other.id not in g.records.rows and ("delete", other.id) in writer.submitted
        with pytest.raises(SandboxTimeout, match=r"timeout of 0\.3 s"):
            await g.get(short.id)
    finally:
        current_job.reset(token)
        await g.aclose()


def drain(node: Daemon) -> None:
    """What SIGTERM does first to a real daemon (then its servers stop): creates refused from now on."""
    done = threading.Event()

    def on_loop() -> None:
        node.engine.drain("the DSec daemon on node test is stopping; retry once it is back")
        done.set()

    node.loop.call_soon_threadsafe(on_loop)
    assert done.wait(10)


def where(g: GatewayEngine, infos: list[dsec.SandboxInfo]) -> dict[str, int]:
    placed: dict[str, int] = {}
    for info in infos:
        placed[g.records.rows[info.id].node] = placed.get(g.records.rows[info.id].node, 0) + 1
    return placed


async def held_by(node: Daemon) -> int:
    async with node_client(node) as client:
        return len(await dsec.AsyncSandbox.list(client=client))


async def test_a_rolling_daemon_restart_costs_a_job_no_create(tmp_path: Path) -> None:
    """A node whose daemon stops refuses its share of a batch (DaemonStopping): the gateway places that share
    on the other node, places nothing more there while it stops and while it does not answer, and uses it
    again once a daemon serves at its address."""
    port = free_port()
    with running_daemon(tmp_path / "b", token="node-two-token-0123456789") as other:
        token = current_job.set("j7")
        try:
            with running_daemon(tmp_path / "a", token="node-one-token-0123456789", port=port) as first:
                g, _writer = gateway([first, other])
                spread = await g.create_many(BatchCreateRequest(count=4, spec=SandboxSpec(image="tiny")))
                assert where(g, spread) == {"node-0": 2, "node-1": 2}, "placement does not spread: nothing tested"
                drain(first)
                made = await g.create_many(BatchCreateRequest(count=4, spec=SandboxSpec(image="tiny")))
                assert where(g, made) == {"node-1": 4}
                assert await held_by(first) == 2 and await held_by(other) == 6, "the refused share left sandboxes"
                assert g.placer.job("j7").live == 8 and g.placer.nodes["node-0"].live == {"container": 2}
                assert "is stopping" in g.unready["node-0"] and not g.placer.nodes["node-0"].alive
                assert "dsec_cluster_creates_replaced_total 2.0" in g.metrics.render().decode()
                await g.poll()  # its health says it is stopping: still held
                assert "is stopping" in g.unready["node-0"] and not g.placer.nodes["node-0"].alive
                # Its sandboxes still answer through the gateway while it stops.
                assert (await g.get(spread[0].id)).state == "running"
            # The daemon is gone (between its stop and its restart): nothing is placed there.
            await g.poll()
            assert not g.placer.nodes["node-0"].alive
            alone = await g.create_many(BatchCreateRequest(count=2, spec=SandboxSpec(image="tiny")))
            assert where(g, alone) == {"node-1": 2}
            # A daemon serves at the address again: reconciled (the fake backend's sandboxes went with the old
            # daemon, so their room is given back) and used.
            with running_daemon(tmp_path / "a2", token="node-one-token-0123456789", port=port):
                await g.poll()
                assert "node-0" not in g.unready and g.placer.nodes["node-0"].alive
                assert g.placer.nodes["node-0"].live == {"container": 0} and g.placer.job("j7").live == 8
                back = await g.create_many(BatchCreateRequest(count=4, spec=SandboxSpec(image="tiny")))
                assert where(g, back).get("node-0", 0) >= 2
                for info in back:
                    await g.destroy(info.id)
                await g._unfollow("node-0")  # this test daemon's server waits for an open event stream
            for info in spread + made + alone:
                await g.destroy(info.id)
            assert g.placer.job("j7").live == 0
        finally:
            current_job.reset(token)
            await g.aclose()


async def test_a_node_that_does_not_answer_gets_no_create_and_the_last_node_stopping_is_named(
        tmp_path: Path, nodes: list[Daemon]) -> None:
    """No connection opens to a node (nothing was sent): its share goes elsewhere. When no other node can take
    it, the error names the node that refused; any other failure is not placed again."""
    closed = f"http://127.0.0.1:{free_port()}"
    g, _writer = gateway(nodes)
    g.node_rows["node-0"] = NodeRow("node-0", closed, "node-one-token-0123456789", True, _ROOM)
    token = current_job.set("j8")
    try:
        made = await g.create_many(BatchCreateRequest(count=4, spec=SandboxSpec(image="tiny")))
        assert where(g, made) == {"node-1": 4} and "does not answer" in g.unready["node-0"]
        for info in made:
            await g.destroy(info.id)
        with pytest.raises(ImageNotFound):  # the node answered: not placed again, the node not held
            await g.create(SandboxSpec(image="no-such-image"))
        assert "node-1" not in g.unready and g.placer.nodes["node-1"].alive
    finally:
        current_job.reset(token)
        await g.aclose()
    with running_daemon(tmp_path / "last", token="node-one-token-0123456789") as last:
        g, _writer = gateway([last])
        drain(last)
        token = current_job.set("j9")
        try:
            with pytest.raises(BackendUnavailable, match=r"node node-0 is stopping .*; no other node could take "
                                                         r"its 3 sandbox\(es\): no live node runs the 'container'"):
                await g.create_many(BatchCreateRequest(count=3, spec=SandboxSpec(image="tiny")))
            assert g.placer.job("j9").live == 0 and await held_by(last) == 0
        finally:
            current_job.reset(token)
            await g.aclose()


class _HeldSecond(FakeBackend):
    """Makes its first sandbox at once and holds the second one's create until ``go`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.calls = 0
        self.entered = threading.Event()
        self.go = threading.Event()

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            assert await asyncio.to_thread(self.go.wait, 30), "the test never let the held create go"
        await super().create(record, image)


async def test_a_batch_half_made_on_a_stopping_node_is_undone_there_and_placed_elsewhere(tmp_path: Path) -> None:
    """A node that made part of its share when its daemon began to stop (one made, one being made, one queued
    for a create slot) retires what it made, says it kept nothing, and the gateway places the whole share on
    the other node: the job gets its batch, and the stopping node holds none of it."""
    held = _HeldSecond(tmp_path / "fake")
    with (running_daemon(tmp_path / "a", token="node-one-token-0123456789", backends={"container": held},
                         create_slots=1) as first,
          running_daemon(tmp_path / "b", token="node-two-token-0123456789") as other):
        g, _writer = gateway([first, other])
        token = current_job.set("j10")
        try:
            batch = asyncio.create_task(g.create_many(BatchCreateRequest(count=6, spec=SandboxSpec(image="tiny"))))
            assert await asyncio.to_thread(held.entered.wait, 30), "node-0 never got its share: nothing tested"
            deadline = time.monotonic() + 30  # the third member reaches admission after its image lookup
            while first.engine.admission.statistics().waiting < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert first.engine.admission.statistics().waiting == 1, "no member of node-0's share waits for a slot"
            drain(first)  # the queued member is refused; the one being made finishes
            held.go.set()
            made = await batch
            assert len(made) == 6 and where(g, made) == {"node-1": 6}
            assert held.calls == 2, "the refused member reached the backend"
            assert await held_by(first) == 0 and await held_by(other) == 6, "node-0 kept part of its share"
            assert g.placer.job("j10").live == 6 and g.placer.nodes["node-0"].live == {"container": 0}
            assert "is stopping" in g.unready["node-0"]
            assert "dsec_cluster_creates_replaced_total 3.0" in g.metrics.render().decode()
            for info in made:
                await g.destroy(info.id)
            assert g.placer.job("j10").live == 0
        finally:
            held.go.set()
            current_job.reset(token)
            await g.aclose()
