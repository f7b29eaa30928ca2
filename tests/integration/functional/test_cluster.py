"""Cluster mode on a real local Ray cluster: a head plus three worker nodes, each with its own DSec node
daemon (started by a Ray actor pinned to it), state directory and port; a gateway process with its state
in a real PostgreSQL server; the trajectory log in the same server; images and snapshots in an S3 store
(a real SeaweedFS server), nothing shared through a POSIX directory.

Covered: creates spread by placement; image locality read from the nodes' own caches; the SDK's exec and
file calls go straight to the owning node with a token scoped to the sandbox; quota refusals
(``QuotaExceeded``) and unknown tokens; a burst of 500 creates that must queue for room and all complete;
a worker node killed mid-run (its sandboxes reported lost with the reason, new creates go elsewhere, a
trajectory resumes on another node from its checkpoint in S3); one node's daemon stopped and restarted by
its actor with no create failing; the gateway SIGKILLed and restarted with nothing lost.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

import dsec
from cluster_support import LocalCluster, checked_cluster, cluster_services
from container_support import images_dir
from dsec.api import NodeClient
from dsec.images.image_store import ImageStore
from dsec.models.surface import ShellRequest, ShellRunRequest
from dsec.testing.node_api_surface import ECHO_SERVER
from image_support import seaweedfs

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

FN = {"image": "debian-python", "backend": "function", "cpu": 0.1, "memory": "64Mi", "timeout": 600}
FUSION_PORT = 24731
"""The gateway's SandboxFusion listener, in the cluster's own network namespace: below the ephemeral range
(which the cluster's other servers bind at random) and outside Ray's worker ports (10002-19999)."""
ALIAS = "debian-python-cl"
"""A second name of the image in the S3 store, which no node has resolved before the locality test."""


@pytest.fixture(scope="module")
def cluster(debian_python_image: object) -> Iterator[LocalCluster]:
    scratch = Path(tempfile.mkdtemp(prefix="dsec-cl-img-", dir="/tmp"))
    with cluster_services() as pg, pytest.MonkeyPatch.context() as env:
        try:
            with seaweedfs(env) as weed:
                # Seed the S3 store from the local one; the nodes' image root is an empty scratch
                # directory, so every image byte they use comes from SeaweedFS.
                url = weed.url("dsec", "cluster")
                s3 = ImageStore(scratch / "seed", url)
                manifest = s3.copy_image(ImageStore(images_dir()), "debian-python")
                s3.blobs.put(f"tags/{ALIAS}", manifest.digest.encode() + b"\n")
                jobs = {"alpha": {}, "small": {"max_live": 3}, "burst": {}, "rate": {"max_rate": 2}, "fusion": {}}
                creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
                fusion = ["--sandbox-fusion", f"127.0.0.1:{FUSION_PORT}"]
                with checked_cluster(pg, 3, jobs, {"function": 10, "container": 4}, images=scratch / "nodes",
                                     image_store=url, node_env=creds, gateway_args=fusion) as handle:
                    yield handle
                    local = scratch / "nodes" / "store"
                    used = [str(f) for f in local.rglob("*") if f.is_file()] if local.exists() else []
                    assert not used, f"a node used a POSIX image store: {used[:5]}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def client(cluster: LocalCluster, job: str) -> dsec.Client:
    return dsec.Client(cluster.gateway.url, cluster.tokens[job])


async def test_creates_spread_and_data_goes_to_the_node(cluster: LocalCluster) -> None:
    async with client(cluster, "alpha") as c:
        sandboxes = await dsec.AsyncSandbox.create_many(6, client=c, **FN)
        try:
            by_node = collections.Counter(sb._info.node for sb in sandboxes)
            assert sorted(by_node.values()) == [2, 2, 2], by_node
            sb = sandboxes[0]
            endpoint = sb._info.endpoint
            assert endpoint is not None and endpoint.url != cluster.gateway.url
            assert endpoint.token.startswith("sb1." + sb.id + ".")
            result = await sb.exec(["python3", "-c", "print(6 * 7)"])
            assert result.exit_code == 0 and result.stdout == b"42\n"
            await sb.files.write("/workspace/a.txt", b"hello")
            assert await sb.files.read("/workspace/a.txt") == b"hello"
            # The scoped token opens this sandbox only, and cannot destroy it behind the gateway's back.
            auth = {"Authorization": f"Bearer {endpoint.token}"}
            async with httpx.AsyncClient(base_url=endpoint.url, headers=auth) as node:
                other = next(s for s in sandboxes if s._info.node == sb._info.node and s.id != sb.id)
                assert (await node.get(f"/v1/sandboxes/{other.id}")).status_code == 401
                assert (await node.get("/v1/sandboxes")).status_code == 401
                assert (await node.delete(f"/v1/sandboxes/{sb.id}")).status_code == 401
                assert (await node.get(f"/v1/sandboxes/{sb.id}")).status_code == 200
            # Another job does not see alpha's sandboxes.
            async with client(cluster, "burst") as other_job:
                with pytest.raises(dsec.SandboxNotFound):
                    await dsec.AsyncSandbox.connect(sb.id, client=other_job)
        finally:
            await asyncio.gather(*(s.close() for s in sandboxes))


def node_endpoints(cluster: LocalCluster) -> dict[str, tuple[str, str]]:
    """Node name -> (URL, node token), as the gateway recorded them."""
    with psycopg.connect(cluster.dsn) as conn:
        rows = conn.execute("SELECT name, url, token FROM dsec_cluster_nodes WHERE alive").fetchall()
    return {name: (url, token) for name, url, token in rows}


async def cached_on(c: dsec.Client, image: str) -> set[str]:
    """The nodes whose cache holds ``image``, as the gateway last read them (its /metrics)."""
    text = (await c.api.metrics_text()).decode()
    return {line.split('node="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("dsec_cluster_node_image_cached{") and f'image="{image}"' in line}


def test_run_code_through_the_gateway(cluster: LocalCluster) -> None:
    """SandboxFusion's /run_code on the gateway: a job's token, the request placed on a node, the job's label.
    A job of its own: the listener keeps the sandbox for the job's next request, which other tests would list."""
    url = f"http://127.0.0.1:{FUSION_PORT}/run_code"
    body = {"code": "import os\nprint(input()[::-1], os.getcwd())", "stdin": "abc", "language": "python",
            "memory_limit_MB": 64}
    r = httpx.post(url, json=body, auth=("dsec", cluster.tokens["fusion"]), timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["status"] == "Success" and got["run_result"]["stdout"] == "cba /workspace\n", got
    assert httpx.post(url, json=body, auth=("dsec", "not-a-job-token"), timeout=60).status_code == 401


async def test_placement_prefers_a_node_whose_cache_holds_the_image(cluster: LocalCluster) -> None:
    nodes = node_endpoints(cluster)
    assert len(nodes) == 3
    # The node that would lose every tie (placement breaks ties by name) gets the image in its cache,
    # behind the gateway's back: straight through its own daemon.
    warm = max(nodes)
    url, token = nodes[warm]
    async with client(cluster, "alpha") as c:
        assert await cached_on(c, ALIAS) == set()
        async with dsec.Client(url, token) as node:
            health = await node.health()
            assert ALIAS not in health.images
            sb = await dsec.AsyncSandbox.create(client=node, **{**FN, "image": ALIAS})
            assert (await sb.exec("true")).exit_code == 0
            await sb.close()
            deadline = time.monotonic() + 30  # the node's listing may be a few seconds old
            while (held := (await node.health()).images).get(ALIAS, 0) == 0:
                assert time.monotonic() < deadline, f"the node does not report the image it ran: {held}"
                await asyncio.sleep(0.5)
            # held[ALIAS] > 0: chunks fetched from S3 into this node's cache
        deadline = time.monotonic() + 30
        while await cached_on(c, ALIAS) != {warm}:
            assert time.monotonic() < deadline, "the gateway did not learn the node's cache"
            await asyncio.sleep(0.3)
        # One decision for three: all go to the warm node (the others are idle, so without locality the
        # batch would spread 1/1/1).
        sandboxes = await dsec.AsyncSandbox.create_many(3, client=c, **{**FN, "image": ALIAS})
        try:
            assert [sb._info.node for sb in sandboxes] == [warm] * 3
        finally:
            await asyncio.gather(*(s.close() for s in sandboxes))


async def test_the_surface_for_the_sdk_and_for_a_client_of_the_gateway_only(cluster: LocalCluster) -> None:
    async with client(cluster, "alpha") as c, await dsec.AsyncSandbox.create(
            image="debian-python", backend="container", network="none", cpu=0.2, memory="256Mi", client=c) as sb:
        server = await sb.exec(["python3", "-c", ECHO_SERVER], background=True)
        said = await anext(server.stdout())
        port = int(said.split()[1])
        url = await sb.get_url(port)  # the SDK follows the endpoint: the node's listener, on the node's address
        [on_node] = await sb.ports()
        async with httpx.AsyncClient(timeout=30) as web:
            assert (await web.get(url, headers=on_node.headers)).text == "you said / token=None"
            # A client of the gateway only: every call through it, the port through the gateway's listener.
            async with NodeClient(cluster.gateway.url, cluster.tokens["alpha"]) as gateway:
                seen = await gateway.get_port(sb.id, port)
                assert seen.host_port != on_node.host_port and seen.token == on_node.token, (seen, on_node)
                assert (await web.get(seen.url or "", headers=seen.headers)).text == "you said / token=None"
                assert (await web.get(seen.url or "")).status_code == 401
                shell = await gateway.start_shell(sb.id, ShellRequest())
                run = ShellRunRequest
                await gateway.run_shell(sb.id, shell.id, run(command="cd /tmp && export X=1"))
                assert (await gateway.run_shell(sb.id, shell.id, run(command="echo $PWD $X"))).stdout == b"/tmp 1\n"
                output = [e async for e in gateway.process_output(sb.id, server.pid, follow=False)]
                assert b"".join(e.data or b"" for e in output) == said, output
                await gateway.unexpose_port(sb.id, port)
                with pytest.raises(httpx.TransportError):
                    await web.get(seen.url or "", headers=seen.headers)


async def test_quota_and_bad_tokens(cluster: LocalCluster) -> None:
    async with client(cluster, "small") as c:
        with pytest.raises(dsec.QuotaExceeded, match="quota is 3"):
            await dsec.AsyncSandbox.create_many(4, client=c, **FN)
        held = [await dsec.AsyncSandbox.create(client=c, **FN) for _ in range(3)]
        try:
            with pytest.raises(dsec.QuotaExceeded, match="would have 4 live"):
                await dsec.AsyncSandbox.create(client=c, **FN)
        finally:
            await asyncio.gather(*(s.close() for s in held))
        again = await dsec.AsyncSandbox.create(client=c, **FN)  # closing gave the quota back
        await again.close()
    async with client(cluster, "rate") as c:
        with pytest.raises(dsec.QuotaExceeded, match="2 sandboxes per second"):
            await dsec.AsyncSandbox.create_many(3, client=c, **FN)
    async with dsec.Client(cluster.gateway.url, "not-a-job-token") as bad:
        with pytest.raises(dsec.Unauthorized):
            await dsec.AsyncSandbox.create(client=bad, **FN)
    async with client(cluster, "alpha") as c:
        with pytest.raises(dsec.BackendUnavailable, match="microvm"):
            await dsec.AsyncSandbox.create(client=c, **{**FN, "backend": "microvm"})


async def test_burst_of_500_queues_and_completes(cluster: LocalCluster) -> None:
    # 3 nodes x 10 function slots = 30 at once; 500 creates, 64 in flight at a time (one client's
    # connection pool on a loaded 2-core machine), must wait for each other's room.
    gate = asyncio.Semaphore(64)
    async with client(cluster, "burst") as c:
        async def one(i: int) -> str:
            async with gate:
                sb = await dsec.AsyncSandbox.create(client=c, labels={"i": str(i)}, **FN)
                node = sb._info.node
                await sb.close()
                return node

        try:
            results = await asyncio.gather(*(one(i) for i in range(500)), return_exceptions=True)
        finally:  # a failed create must not leave the others' sandboxes holding the cluster's slots
            await asyncio.gather(*(sb.close() for sb in await dsec.AsyncSandbox.list(client=c)),
                                 return_exceptions=True)
        failures = [repr(r) for r in results if isinstance(r, BaseException)]
        assert not failures, f"{len(failures)} of 500 creates failed, e.g. {failures[:3]}"
        nodes = [r for r in results if isinstance(r, str)]
        assert len(nodes) == 500 and len(set(nodes)) == 3
        metrics = (await c.api.metrics_text()).decode()
        queued = next(float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("dsec_cluster_admission_queued "))
        assert queued > 0, "no create had to wait: the burst did not exceed the cluster's room"
        assert await dsec.AsyncSandbox.list(client=c) == []


def daemon_pid(home: Path) -> int:
    """The pid of ``dsec serve --home <home>`` (the node daemon a NodeDaemon actor supervises)."""
    wanted = b"\0serve\0--home\0" + str(home).encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if wanted in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    assert len(found) == 1, f"not one node daemon with home {home}: {found}"
    return found[0]


def metric(text: str, name: str) -> float:
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


async def test_a_node_daemon_restart_costs_the_job_no_create(cluster: LocalCluster) -> None:
    """One node's ``dsec serve`` is stopped (SIGTERM, as a rolling upgrade does) and its actor restarts it:
    Ray still sees the node alive. Creates made meanwhile all succeed on the other nodes, and the node takes
    creates again once its daemon serves."""
    async with client(cluster, "alpha") as c:
        made = await dsec.AsyncSandbox.create_many(3, client=c, **FN)
        try:
            victim = made[0]._info.node
            pid = daemon_pid(next(h for h in cluster.node_homes() if h.name == victim))
            actor = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its supervisor
            replaced = metric((await c.api.metrics_text()).decode(), "dsec_cluster_creates_replaced_total")
            # The actor is held while its daemon stops, so that no restarted daemon can listen before the
            # next create (one bound but not started yet would take the connection and make the sandbox).
            os.kill(actor, signal.SIGSTOP)
            try:
                os.kill(pid, signal.SIGTERM)
                await_gone = time.monotonic() + 60
                while Path(f"/proc/{pid}/stat").exists() and \
                        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    assert time.monotonic() < await_gone, "the node daemon did not stop on SIGTERM"
                    await asyncio.sleep(0.02)
                # Down until its actor restarts it. Either the gateway already holds it (the daemon said it
                # stops on its event stream, or the stream broke), or it still places there, finds no
                # connection and places that share again: no create fails either way.
                during = await dsec.AsyncSandbox.create_many(3, client=c, **FN)
                text = (await c.api.metrics_text()).decode()
            finally:
                os.kill(actor, signal.SIGCONT)
            made += during
            assert victim not in {s._info.node for s in during}
            assert metric(text, "dsec_cluster_creates_replaced_total") > replaced or \
                metric(text, "dsec_cluster_nodes_unready") >= 1, text
            back_by = time.monotonic() + 90
            while True:
                batch = await dsec.AsyncSandbox.create_many(3, client=c, **FN)  # none may fail
                made += batch
                if victim in {s._info.node for s in batch}:
                    break
                assert time.monotonic() < back_by, "the restarted node daemon never took creates again"
                await asyncio.sleep(0.3)
            assert daemon_pid(next(h for h in cluster.node_homes() if h.name == victim)) != pid
        finally:
            await asyncio.gather(*(s.close() for s in made), return_exceptions=True)
        assert await dsec.AsyncSandbox.list(client=c) == []


async def test_node_killed_then_gateway_restarted(cluster: LocalCluster) -> None:
    async with client(cluster, "alpha") as c:
        traj = await dsec.AsyncSandbox.create(image="debian-python", backend="container", cpu=0.5,
                                              memory="256Mi", trajectory="cluster/rollout-1", client=c)
        await traj.files.write("/workspace/state.txt", b"before checkpoint")
        r = await traj.exec("echo step1 >> /workspace/log.txt")
        assert r.exit_code == 0
        await traj.snapshot()  # the checkpoint the trajectory resumes from
        victim = traj._info.node
        fn = await dsec.AsyncSandbox.create_many(6, client=c, **FN)
        doomed = [s for s in fn if s._info.node == victim]
        survivors = [s for s in fn if s._info.node != victim]
        assert doomed and survivors

        worker = next(w for w in cluster.workers if f"node-{w.node_id[:12]}" == victim)
        cluster.ray.remove_node(worker, allow_graceful=False)
        start = time.monotonic()
        while True:
            try:
                if (await traj.info()).state == "lost":
                    break
            except dsec.BackendUnavailable as exc:  # until Ray declares the node dead
                assert victim in str(exc)
            assert time.monotonic() - start < 60, "the dead node's sandboxes were not reported lost"
            await asyncio.sleep(0.2)
        info = await traj.info()
        assert victim in (info.reason or "") and "died" in (info.reason or "")
        for sb in doomed:
            assert (await sb.info()).state == "lost"
        with pytest.raises(dsec.SandboxLost):
            await c.api.pause(doomed[0].id)
        for sb in survivors:
            assert (await sb.exec("true")).exit_code == 0

        fresh = await dsec.AsyncSandbox.create_many(4, client=c, **FN)
        assert victim not in {s._info.node for s in fresh}

        resumed = await dsec.AsyncSandbox.create(image="debian-python", backend="container", cpu=0.5,
                                                 memory="256Mi", trajectory="cluster/rollout-1", client=c)
        try:
            assert resumed._info.node != victim
            assert resumed._info.trajectory is not None and resumed._info.trajectory.restored_from
            # Calls before the end of the log fast-forward from the log; the file came from the checkpoint.
            await resumed.files.write("/workspace/state.txt", b"before checkpoint")
            assert (await resumed.exec("echo step1 >> /workspace/log.txt")).exit_code == 0
            await resumed.snapshot()
            assert await resumed.files.read("/workspace/state.txt") == b"before checkpoint"
            assert await resumed.files.read("/workspace/log.txt") == b"step1\n"

            # The gateway dies and comes back: placements, lost records and quotas are all still there.
            before = sorted((s.id, s._info.state) for s in await dsec.AsyncSandbox.list(client=c))
            cluster.gateway.kill()
            # A create is answered before its row commits: a gateway killed in between has no row for it.
            # Made so here (the row deleted while the gateway is dead): the restarted gateway rebuilds it
            # from the node's own record, job and room included.
            with psycopg.connect(cluster.dsn) as conn:
                assert conn.execute("DELETE FROM dsec_cluster_rows WHERE id = %s",
                                    (survivors[1].id,)).rowcount == 1
            # The data plane does not need the gateway.
            assert (await survivors[0].exec("echo still")).stdout == b"still\n"
            await asyncio.to_thread(cluster.gateway.start)
            after = sorted((s.id, s._info.state) for s in await dsec.AsyncSandbox.list(client=c))
            assert after == before
            with psycopg.connect(cluster.dsn) as conn:
                job = conn.execute("SELECT job FROM dsec_cluster_rows WHERE id = %s", (survivors[1].id,))
                assert job.fetchone() == ("alpha",)
            assert (await survivors[1].info()).state == "running"
            assert (await doomed[0].info()).state == "lost"
            again = await dsec.AsyncSandbox.connect(survivors[1].id, client=c)
            assert (await again.exec("echo back")).stdout == b"back\n"
        finally:
            for sb in [resumed, *fresh, *fn, traj]:
                await sb.close()
        assert await dsec.AsyncSandbox.list(client=c) == []
