"""``dsec cluster up`` and ``dsec cluster down`` end to end, on a real local Ray cluster (a head plus two
worker nodes, ``dsec.cluster.local`` without its own gateway) and a real PostgreSQL server.

The CLI is run as a user would: ``cluster up`` starts the gateway as a detached Ray actor, waits until it
answers, and the gateway starts a node daemon on each worker; the SDK then creates, runs and closes
sandboxes through it; ``cluster down --destroy`` stops the gateway and every node daemon. A bad jobs file
and a second ``cluster up`` are refused with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec
from cluster_support import LocalCluster, checked_cluster, cluster_services
from dsec.cluster.local import _pids_with
from postgres_support import PgServer

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(600)]

FN = {"image": "debian-python", "backend": "function", "cpu": 0.1, "memory": "64Mi", "timeout": 300}


@pytest.fixture(scope="module")
def ray_cluster(debian_python_image: object) -> Iterator[tuple[LocalCluster, PgServer]]:
    with cluster_services() as pg, checked_cluster(pg, 2, {"job": {}}, {"function": 4, "container": 0},
                                                   start_gateway=False) as handle:
        yield handle, pg


def dsec_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The ``dsec`` command of this environment (in the test's network namespace, like everything)."""
    return subprocess.run([sys.executable, "-m", "dsec", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def test_cluster_up_then_down(ray_cluster: tuple[LocalCluster, PgServer]) -> None:
    cluster, pg = ray_cluster
    base, address = cluster.base, cluster.ray.address
    listen = cluster.gateway.url.removeprefix("http://")
    bad = base / "bad-jobs.json"
    bad.write_text(json.dumps({"jobs": {"j": {"token": "short"}}}))
    refused = dsec_cli("cluster", "up", "--db", pg.dsn, "--jobs", str(bad), "--ray-address", address,
                       "--listen", listen, "--log", str(base / "up.log"))
    assert refused.returncode != 0 and "at least 16 characters" in refused.stderr, refused

    up = dsec_cli("cluster", "up", "--db", pg.dsn, "--jobs", str(base / "jobs.json"), "--node-config",
                  str(base / "node.json"), "--ray-address", address, "--listen", listen,
                  "--log", str(base / "up.log"))
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_tail(base / 'up.log')}"
    assert "gateway up" in up.stdout
    try:
        again = dsec_cli("cluster", "up", "--db", pg.dsn, "--jobs", str(base / "jobs.json"),
                         "--ray-address", address, "--listen", listen, "--log", str(base / "up2.log"))
        assert again.returncode != 0 and "already runs" in again.stderr, again
        cluster.wait_nodes(2)  # the gateway started a node daemon on each worker
        asyncio.run(_use(cluster))
    finally:
        down = dsec_cli("cluster", "down", "--destroy", "--ray-address", address)
    assert down.returncode == 0 and "cluster stopped" in down.stdout, down
    deadline = time.monotonic() + 60
    while _answers(cluster.gateway.url):
        assert time.monotonic() < deadline, "the gateway still answers after `dsec cluster down`"
        time.sleep(0.3)
    homes = cluster.node_homes()
    assert len(homes) == 2
    deadline = time.monotonic() + 60
    while any(_pids_with(f"--home\0{home}\0") for home in homes):
        assert time.monotonic() < deadline, "node daemons still run after `dsec cluster down`"
        time.sleep(0.3)


def test_cluster_up_with_replicas_then_down(ray_cluster: tuple[LocalCluster, PgServer]) -> None:
    """``--replicas 2``: two gateway actors (ports PORT and PORT+1) sharing the nodes in cells; a client given
    both addresses works through them, and ``down`` stops both."""
    cluster, pg = ray_cluster
    base, address = cluster.base, cluster.ray.address
    host, _, port = cluster.gateway.url.removeprefix("http://").rpartition(":")
    listen = f"{host}:{int(port) + 10}"
    up = dsec_cli("cluster", "up", "--replicas", "2", "--db", pg.dsn, "--jobs", str(base / "jobs.json"),
                  "--node-config", str(base / "node.json"), "--ray-address", address, "--listen", listen,
                  "--log", str(base / "replicas.log"))
    urls = [f"http://{host}:{int(port) + 10}", f"http://{host}:{int(port) + 11}"]
    try:
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_tail(base / 'replicas.log')}"
        assert f"gateway up on {','.join(urls)}" in up.stdout, up.stdout
        again = dsec_cli("cluster", "up", "--db", pg.dsn, "--jobs", str(base / "jobs.json"),
                         "--ray-address", address, "--listen", cluster.gateway.url.removeprefix("http://"),
                         "--log", str(base / "up3.log"))
        assert again.returncode != 0 and "already runs" in again.stderr, again
        asyncio.run(_use_replicas(urls, cluster.tokens["job"]))
    finally:
        down = dsec_cli("cluster", "down", "--destroy", "--ray-address", address)
    assert down.returncode == 0 and "cluster stopped" in down.stdout, down
    deadline = time.monotonic() + 60
    while any(_answers(url) for url in urls):
        assert time.monotonic() < deadline, "a replica still answers after `dsec cluster down`"
        time.sleep(0.3)


async def _use_replicas(urls: list[str], token: str) -> None:
    async with dsec.Client(urls, token) as c:
        deadline = time.monotonic() + 120
        while True:  # until the replicas hold the cells of both nodes between them
            try:
                sandboxes = await dsec.AsyncSandbox.create_many(4, client=c, **FN)
                break
            except dsec.BackendUnavailable:
                assert time.monotonic() < deadline, "the replicas never placed"
                await asyncio.sleep(1)
        try:
            result = await sandboxes[0].exec(["python3", "-c", "print(6 * 7)"])
            assert result.exit_code == 0 and result.stdout == b"42\n"
        finally:
            closed = await dsec.AsyncSandbox.close_many(sandboxes, client=c)
        assert sorted(closed.destroyed) == sorted(sb.id for sb in sandboxes), closed


async def _use(cluster: LocalCluster) -> None:
    async with dsec.Client(cluster.gateway.url, cluster.tokens["job"]) as c:
        sandboxes = await dsec.AsyncSandbox.create_many(4, client=c, **FN)
        try:
            assert sorted(collections.Counter(sb._info.node for sb in sandboxes).values()) == [2, 2]
            result = await sandboxes[0].exec(["python3", "-c", "print(6 * 7)"])
            assert result.exit_code == 0 and result.stdout == b"42\n"
        finally:
            await asyncio.gather(*(sb.close() for sb in sandboxes))
        assert await dsec.AsyncSandbox.list(client=c) == []


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/v1/health", timeout=2).status_code == 200
    return False


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-30:])
    return ""
