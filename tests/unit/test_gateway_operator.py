"""The gateway's operator views over two real node daemons (uvicorn on TCP with tokens): the audit trail
fanned out and merged, a sandbox's history from its node, the overview summed, the nodes' events merged
and replayed from the gateway's own history.

Only the gateway's database is left out (its placement state is set by hand): what is tested is the
fan-out and merge logic above real node APIs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec.cluster.gateway import GatewayEngine, current_job
from dsec.cluster.placement import Capacity
from dsec.cluster.server import Jobs, gateway_app
from dsec.cluster.state import NodeRow
from dsec.errors import BackendUnavailable, DaemonStopping, Forbidden, SandboxNotFound


class _NoDatabase:
    """The gateway's state store and node source, unused by these calls (closing them is fine)."""

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the operator views must not touch the gateway's database ({name})")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    with (running_daemon(tmp_path_factory.mktemp("n1"), token="node-one-token-0123456789") as one,
          running_daemon(tmp_path_factory.mktemp("n2"), token="node-two-token-0123456789") as two):
        yield [one, two]


def gateway(nodes: list[Daemon], *, alive: tuple[bool, bool] = (True, True)) -> GatewayEngine:
    g = GatewayEngine(_NoDatabase(), _NoDatabase())  # type: ignore[arg-type]
    for i, (node, up) in enumerate(zip(nodes, alive, strict=True)):
        name = f"node-{i}"
        assert node.tcp_url is not None and node.token is not None
        g.node_rows[name] = NodeRow(name, node.tcp_url, node.token, up, {})
        g.placer.set_node(name, Capacity(cpu=2, memory=2**30, slots={"container": 10}))
        if not up:
            g.placer.mark_dead(name)
    return g


async def test_gateway_merges_audit_and_sums_overview(nodes: list[Daemon], tmp_path: Path) -> None:
    made = []
    for i, node in enumerate(nodes):
        async with dsec.Client(node.unix_url) as client:
            sb = await dsec.AsyncSandbox.create(image="tiny", client=client)
            await sb.exec(f"echo node {i}")
            await sb.exec("exit 2")
            made.append((node, sb.id, await sb.info()))
    g = gateway(nodes)
    token = current_job.set("admin")
    try:
        merged = await g.audit_log(limit=100)
        ours = [e for e in merged if e.sandbox_id in {m[1] for m in made}]
        assert len(ours) == 4 and [e.at for e in merged] == sorted((e.at for e in merged), reverse=True)
        assert len(await g.audit_log(limit=1)) == 1
        failed = await g.audit_log(outcome="nonzero", limit=100)
        assert {e.sandbox_id for e in failed} >= {m[1] for m in made}
        # A sandbox's history comes from its own node.
        node, sandbox_id, info = made[1]
        g.records.put(sandbox_id, g._new_row(info, "node-1", "job-a"))
        history = await g.sandbox_logs(sandbox_id)
        assert [e.command for e in history] == ["exit 2", "echo node 1"]
        with pytest.raises(SandboxNotFound):
            await g.sandbox_logs("sb-unknown")
        overview = await g.overview()
        assert [n.node for n in overview.nodes] == ["node-0", "node-1"] and all(n.alive for n in overview.nodes)
        assert overview.exec_count >= 4 and overview.created >= 2 and sum(n.sandboxes for n in overview.nodes) >= 2
        # Nodes do not know the gateway's jobs: the gateway fills them in, and filters on them.
        merged = await g.audit_log(limit=100)
        assert {e.job for e in merged if e.sandbox_id == sandbox_id} == {"job-a"}
        assert {e.sandbox_id for e in await g.audit_log(job="job-a", limit=100)} == {sandbox_id}
        assert {e.job for e in history} == {"job-a"}
        # Another job cannot read the history of a sandbox that is not its own, nor the node-wide views.
        current_job.set("job-b")
        with pytest.raises(SandboxNotFound):
            await g.sandbox_logs(sandbox_id)
        with pytest.raises(Forbidden, match="admin token"):
            await g.audit_log()
        with pytest.raises(Forbidden, match="admin token"):
            await g.overview()
    finally:
        current_job.reset(token)
        await g.aclose()
        for node, sandbox_id, _ in made:
            async with dsec.Client(node.unix_url) as client:
                await (await dsec.AsyncSandbox.connect(sandbox_id, client=client)).close()


async def test_gateway_serves_the_dashboard_without_a_token_and_the_views_with_one(nodes: list[Daemon]) -> None:
    g = gateway(nodes)
    jobs = Jobs(by_token={"admin-token-0123456789": "admin", "job-token-0123456789": "job-a"}, quotas={})
    app = gateway_app(g, jobs)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            page = await c.get("/ui/")
            assert page.status_code == 200 and "dashboard.js" in page.text
            assert (await c.get("/v1/overview")).status_code == 401
            job = {"Authorization": "Bearer job-token-0123456789"}
            forbidden = await c.get("/v1/audit", headers=job)
            assert forbidden.status_code == 403 and "admin token" in forbidden.json()["error"]["message"]
            admin = {"Authorization": "Bearer admin-token-0123456789"}
            overview = await c.get("/v1/overview", headers=admin)
            assert overview.status_code == 200 and len(overview.json()["nodes"]) == 2
            assert (await c.get("/v1/events", headers=job)).status_code == 403
    finally:
        await g.aclose()


async def test_a_dead_node_is_shown_dead_and_left_out(nodes: list[Daemon]) -> None:
    g = gateway(nodes, alive=(True, False))
    token = current_job.set("admin")
    try:
        overview = await g.overview()
        assert [(n.node, n.alive) for n in overview.nodes] == [("node-0", True), ("node-1", False)]
        assert overview.nodes[1].sandboxes == 0
    finally:
        current_job.reset(token)
        await g.aclose()


async def test_gateway_merges_the_nodes_events_and_replays_them(nodes: list[Daemon]) -> None:
    g = gateway(nodes)
    token = current_job.set("admin")
    for name in g.node_rows:
        g._follow(name)  # what start() and membership do for each reconciled node
    stream = g.subscribe()
    made: list[str] = []
    got: list[tuple[str, str | None, int]] = []

    async def read() -> None:
        async for event in stream:
            if event.sandbox_id in made:
                got.append((event.kind, event.sandbox_id, event.seq))
                if len(got) == 4:
                    return

    reader = asyncio.create_task(read())
    try:
        deadline = time.monotonic() + 20
        while any(n.engine.events.statistics()["subscribers"] == 0 for n in nodes):
            assert time.monotonic() < deadline, "the gateway did not follow every node"
            await asyncio.sleep(0.05)
        for node in nodes:
            async with dsec.Client(node.unix_url) as client:
                sb = await dsec.AsyncSandbox.create(image="tiny", client=client)
                made.append(sb.id)
                await sb.close()
        await asyncio.wait_for(reader, 20)
        assert sorted((kind, sid) for kind, sid, _ in got) == sorted(
            [("created", made[0]), ("destroyed", made[0]), ("created", made[1]), ("destroyed", made[1])])
        seqs = [seq for _, _, seq in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == 4
        # The gateway keeps a history: a subscriber resuming after a number is replayed what followed it.
        replay = g.subscribe(seqs[0] - 1)
        again = [await anext(replay) for _ in range(seqs[-1] - seqs[0] + 1)]
        await replay.aclose()  # type: ignore[attr-defined]
        assert [(e.kind, e.sandbox_id, e.seq) for e in again if e.sandbox_id in made] == got
        assert {e.node for e in again if e.sandbox_id in made} == {n.engine.settings.node for n in nodes}
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()  # type: ignore[attr-defined]
        current_job.reset(token)
        await g.aclose()
    # Closing the gateway stops its streams from the nodes.
    deadline = time.monotonic() + 20
    while any(n.engine.events.statistics()["subscribers"] for n in nodes):
        assert time.monotonic() < deadline, "the nodes still stream to a closed gateway"
        await asyncio.sleep(0.05)


async def test_the_gateway_learns_a_nodes_cache_and_drain_from_its_stream(nodes: list[Daemon]) -> None:
    """A node's ``node`` events set its image cache in placement and hold it when it stops; a node that says
    its state is no longer polled for images (what it said is not overwritten by a health round)."""
    g = gateway(nodes)
    try:
        g._follow("node-0")
        deadline = time.monotonic() + 20
        while "node-0" not in g._pushing:  # its stream opens with its state now
            assert time.monotonic() < deadline, "the node's state never came"
            await asyncio.sleep(0.05)
        nodes[0].engine.events.publish("node", images={"debian-python": 1 << 20}, stopping=None)
        while g.placer.nodes["node-0"].images != {"debian-python"}:
            assert time.monotonic() < deadline, "the node's image cache was not taken"
            await asyncio.sleep(0.05)
        await g.refresh_images()  # node-0 is not asked (its health would say: no image)
        assert g.placer.nodes["node-0"].images == {"debian-python"}
        nodes[0].engine.events.publish("node", images={}, stopping="the test stops it")
        while "node-0" not in g.unready:
            assert time.monotonic() < deadline, "the node's drain was not taken"
            await asyncio.sleep(0.05)
        assert "stopping (the test stops it)" in g.unready["node-0"] and not g.placer.nodes["node-0"].alive
    finally:
        await g.aclose()
    assert "node-0" not in g._pushing  # a closed stream: polled again, should it come back


def test_a_stopping_node_reads_as_a_node_that_is_stopping_not_a_gateway_going_away() -> None:
    """A node's DaemonStopping (a ConnectionFailed) reaches the gateway's client as BackendUnavailable naming
    the node: passed on as it is, it would read as the gateway itself stopping."""
    g = GatewayEngine(_NoDatabase(), _NoDatabase())  # type: ignore[arg-type]
    with pytest.raises(BackendUnavailable, match=r"node n1 is stopping \(create refused: the DSec daemon on node "
                                                 r"n1 is stopping; retry once it is back\)") as err, g._reaching("n1"):
        raise DaemonStopping("create refused: the DSec daemon on node n1 is stopping; retry once it is back")
    assert err.value.detail == {"node": "n1"}
    with pytest.raises(BackendUnavailable, match="node n1 does not answer"), g._reaching("n1"):
        raise dsec.ConnectionFailed("connection refused")


def test_only_a_create_the_node_kept_nothing_of_is_placed_again() -> None:
    """What `_create_placed` may place on another node: a refusal the node says kept nothing, or a connection
    the node did not take. A call cut off at the node's graceful timeout (no promise), a connection lost
    mid-call, or a connect that failed on the gateway's own side (out of descriptors) fail the create."""
    import errno

    from dsec._http.http11 import Http11Error
    from dsec.cluster.gateway import _took_none

    g = GatewayEngine(_NoDatabase(), _NoDatabase())  # type: ignore[arg-type]

    def passed_on(err: BaseException) -> BaseException:
        with pytest.raises(BackendUnavailable) as caught, g._reaching("n1"):
            raise err
        return caught.value

    def lean(kind: str, why: BaseException | None) -> dsec.ConnectionFailed:
        inner = Http11Error(kind, str(why))
        inner.__cause__ = why
        outer = dsec.ConnectionFailed(f"cannot reach: {inner}")
        outer.__cause__ = inner
        return outer

    assert _took_none(passed_on(DaemonStopping("create refused: stopping", kept=0)))
    assert not _took_none(passed_on(DaemonStopping("POST /v1/sandboxes was cut off: stopping")))
    assert _took_none(passed_on(lean("connect", ConnectionRefusedError(errno.ECONNREFUSED, "refused"))))
    assert _took_none(passed_on(lean("connect", TimeoutError())))
    assert not _took_none(passed_on(lean("connect", OSError(errno.EMFILE, "Too many open files"))))
    assert not _took_none(passed_on(lean("lost", ConnectionResetError(errno.ECONNRESET, "reset"))))
    assert not _took_none(dsec.ImageNotFound("no image 'x'"))


async def test_membership_is_read_slowly_when_settled_and_at_once_when_a_stream_breaks() -> None:
    async def source() -> list[Any]:
        return []

    g = GatewayEngine(_NoDatabase(), source, poll_interval=0.01, idle_poll_interval=30.0)  # type: ignore[arg-type]
    polls = 0

    async def poll() -> None:
        nonlocal polls
        polls += 1

    g.poll = poll  # type: ignore[method-assign]
    task = asyncio.create_task(g._poll_forever())
    try:
        await asyncio.sleep(0.3)
        assert polls == 0  # nothing settles: the next read is 30 s away
        g._membership_due.set()  # what a node's broken event stream does
        await asyncio.sleep(0.1)
        assert polls == 1
        g.unready["node-0"] = "its daemon is stopping"  # held: read often until it serves again
        g._membership_due.set()
        await asyncio.sleep(0.3)
        assert polls >= 5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
