"""A microvm sandbox in cluster mode: placed by the gateway on a Ray node's daemon, exec'd and its files
used straight on the node (the endpoint) and through the gateway's forwarding, then destroyed.

One worker node and one VM (QEMU under TCG here, seconds per boot): the placement rules themselves are
covered by test_cluster.py; this checks that nothing in the cluster path is container- or function-only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dsec
from cluster_support import LocalCluster, checked_cluster, cluster_services
from conftest import missing
from dsec.errors import DSecError
from dsec.guest.kernel import default_guest_dir, find_kernel
from dsec.models import ExecRequest

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(debian_python_image: object) -> Iterator[LocalCluster]:
    try:
        find_kernel(default_guest_dir())
    except DSecError as exc:
        missing(str(exc))
    with cluster_services() as pg, checked_cluster(pg, 1, {"vm": {}},
                                                   {"microvm": 2, "function": 0, "container": 0}) as handle:
        yield handle


async def test_microvm_placed_through_the_gateway(cluster: LocalCluster) -> None:
    async with dsec.Client(cluster.gateway.url, cluster.tokens["vm"]) as c:
        sb = await dsec.AsyncSandbox.create(image="debian-python", backend="microvm", memory="384Mi", client=c)
        try:
            info = sb._info
            assert info.backend == "microvm" and info.state == "running"
            assert info.endpoint is not None and info.endpoint.url != cluster.gateway.url
            # Straight to the node, with the sandbox-scoped token.
            r = await sb.exec("uname -r", timeout=120)
            assert r.exit_code == 0 and b"cloud-amd64" in r.stdout, r
            await sb.files.write("/workspace/vm.txt", b"in a VM\n")
            assert await sb.files.read("/workspace/vm.txt") == b"in a VM\n"
            # Through the gateway (a client that does not follow the endpoint, e.g. curl).
            forwarded = await c.api.exec(sb.id, ExecRequest(command="cat /workspace/vm.txt"))
            assert forwarded.stdout == b"in a VM\n"
            assert [s.id for s in await dsec.AsyncSandbox.list(client=c)] == [sb.id]
        finally:
            await sb.close()
        assert await dsec.AsyncSandbox.list(client=c) == []
