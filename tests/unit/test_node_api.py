"""One conformance suite, three targets: the node's engine in process, a daemon over HTTP, a gateway over HTTP.

The checks (``dsec.testing.node_api``) reach each target only through :class:`dsec.api.NodeAPI`; the two
HTTP targets are real uvicorn servers (the daemon on its unix socket, where the fast path sits in front of
the app; the gateway on TCP with a job token, over a node daemon on TCP with its token). Beside them, the
contract itself: every operation is checked by the suite, bound as a route, and sent by the client as its
declaration says; and what of the sandbox surface is the gateway's own: the exposed port it answers is its
listener (relaying to the node's), which ends with ``unexpose``, with the sandbox, and when the node
unexposed it behind its back; and the SDK, pointed at the gateway, drives the whole surface (it follows the
sandbox's endpoint to the node).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sdk_daemon import Daemon, Gateway, TinyImages, running_daemon, running_gateway

import dsec
from dsec.api import NODE_OPERATIONS, NodeAPI, NodeClient
from dsec.config import Settings
from dsec.daemon.app import create_app
from dsec.daemon.engine import Engine
from dsec.models import SandboxSpec
from dsec.models.surface import ExposeRequest
from dsec.testing.fake import FakeBackend
from dsec.testing.node_api import NODE_CHECKS, NodeCheck, covered
from dsec.testing.node_api_surface import ECHO_SERVER, echo_server

IMAGE = "tiny"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("node"), token="node-token-0123456789") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def gateway(node: Daemon) -> Iterator[Gateway]:
    with running_gateway([node]) as served:
        yield served


@pytest.fixture(params=["engine", "daemon", "gateway"])
async def api(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[NodeAPI]:
    if request.param == "engine":
        settings = Settings(home=tmp_path / "home")
        engine = Engine(settings, {"container": FakeBackend(root=tmp_path / "fake")}, TinyImages(tmp_path / "rootfs"))
        await engine.start()
        try:
            yield engine
        finally:
            await engine.destroy_all()
            await engine.aclose()
        return
    if request.param == "daemon":
        target: Daemon | Gateway = request.getfixturevalue("node")
        assert isinstance(target, Daemon)
        client = NodeClient(target.unix_url)
    else:
        target = request.getfixturevalue("gateway")
        assert isinstance(target, Gateway)
        client = NodeClient(target.url, target.admin_token)
    async with client:
        yield client


@pytest.mark.parametrize("check", NODE_CHECKS, ids=[c.__name__ for c in NODE_CHECKS])
async def test_conforms(api: NodeAPI, check: NodeCheck) -> None:
    await check(api, IMAGE)


def test_every_operation_is_checked_by_the_suite() -> None:
    assert {op.name for op in NODE_OPERATIONS} - covered() == set()


def test_every_operation_is_a_route_of_the_app(tmp_path: Path) -> None:
    engine = Engine(Settings(home=tmp_path), {}, TinyImages(tmp_path / "rootfs"))
    routes = {(method, route.path) for route in create_app(engine).routes
              for method in getattr(route, "methods", None) or ()}
    assert {(op.method, op.path) for op in NODE_OPERATIONS} <= routes


def test_calls_are_encoded_as_declared() -> None:
    from dsec.models import ExecRequest, ImageBuildRequest

    body = ExecRequest(command="true")
    assert NodeAPI.exec.encode(("sb-1", body), {"seq": 3}) == (
        "/v1/sandboxes/sb-1/exec/result?seq=3", body.model_dump_json().encode(), "application/json", None)
    listed = NodeAPI.list.encode(({"a": "b=c"},), {"state": "running"})[0]
    assert listed == "/v1/sandboxes?label=a%3Db%3Dc&state=running"
    assert NodeAPI.write_file.encode(("sb-1", "/x y", b"\x00"), {"mode": 0o644}) == (
        "/v1/sandboxes/sb-1/files?path=%2Fx+y&mode=644", b"\x00", "application/octet-stream", None)
    assert NodeAPI.fork.encode(("sb-1", 2), {}) == ("/v1/sandboxes/sb-1/fork", b'{"count":2}', "application/json",
                                                    None)
    assert NodeAPI.pause.encode(("sb-1",), {"release_memory": False})[0] == "/v1/sandboxes/sb-1/pause"
    assert NodeAPI.pause.encode(("sb-1", True), {})[0] == "/v1/sandboxes/sb-1/pause?release_memory=true"
    assert NodeAPI.audit_log.encode((), {"since": 1.5, "limit": 100})[0] == "/v1/audit?since=1.5"
    assert NodeAPI.get.encode(("sb 1%",), {})[0] == "/v1/sandboxes/sb%201%25"
    # A build's credentials travel in a header, never in the URL; its context is the body, a file.
    context = io.BytesIO(b"tar")
    target, sent, kind, headers = NodeAPI.build_image.encode(
        (ImageBuildRequest(name="img", username="u", password="s3cr3t-pw"), context), {})
    assert target == "/v1/images/build?request=%7B%22name%22%3A%22img%22%7D"
    assert (sent, kind) == (context, "application/octet-stream")
    assert headers is not None and json.loads(base64.urlsafe_b64decode(headers["X-Registry-Auth"] + "==")) == {
        "username": "u", "password": "s3cr3t-pw"}


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b"])
def test_a_path_argument_that_would_route_elsewhere_is_refused(bad: str) -> None:
    import dsec

    with pytest.raises(dsec.InvalidRequest, match="not a sandbox id"):
        NodeAPI.get.encode((bad,), {})


# -- the surface through the gateway ------------------------------------------------------------------------

@pytest.fixture
async def apis(node: Daemon, gateway: Gateway) -> AsyncIterator[tuple[NodeClient, NodeClient]]:
    async with NodeClient(gateway.url, gateway.admin_token) as through, NodeClient(node.unix_url) as direct:
        yield through, direct


async def _get(url: str, headers: dict[str, str]) -> int | None:
    """The status a GET answers, None when nothing takes the connection."""
    async with httpx.AsyncClient(timeout=20) as client:
        try:
            return (await client.get(url, headers=headers)).status_code
        except httpx.TransportError:
            return None


async def test_the_gateway_answers_its_own_listener_and_ends_it(apis: tuple[NodeClient, NodeClient]) -> None:
    through, direct = apis
    sb = await through.create(SandboxSpec(image="tiny"))
    try:
        port, _ = await echo_server(through, sb.id)
        seen = await through.expose_port(sb.id, ExposeRequest(port=port))
        on_node = await direct.get_port(sb.id, port)
        assert seen.host_port != on_node.host_port and seen.token == on_node.token, (seen, on_node)
        assert seen.url is not None and on_node.url is not None
        assert await _get(seen.url, seen.headers) == await _get(on_node.url, on_node.headers) == 200
        assert await _get(seen.url, {}) == 401  # the node checks the token: the gateway relays bytes
        assert await through.list_ports(sb.id) == [seen] and await through.get_port(sb.id, port) == seen
        # Unexposed on the node directly (the SDK talks to it): the gateway's listener ends when it learns so.
        await direct.unexpose_port(sb.id, port)
        assert await _get(seen.url, seen.headers) == 502
        assert await through.list_ports(sb.id) == []
        assert await _get(seen.url, seen.headers) is None
        again = await through.expose_port(sb.id, ExposeRequest(port=port))
        assert await _get(again.url or "", again.headers) == 200
    finally:
        await through.destroy(sb.id)
    assert await _get(again.url or "", again.headers) is None  # the sandbox's end closes the gateway's listener


async def test_the_sdk_pointed_at_the_gateway_drives_the_surface(gateway: Gateway) -> None:
    async with dsec.Client(url=gateway.url, token=gateway.admin_token) as client, \
            await dsec.AsyncSandbox.create(image="tiny", client=client) as sb:
        server = await sb.exec(["python3", "-c", ECHO_SERVER], background=True)
        port = int((await anext(server.stdout())).split()[1])
        url = await sb.get_url(port)
        [info] = await sb.ports()
        assert await _get(url, info.headers) == 200
        async with dsec.Client(url=gateway.url, token=gateway.admin_token) as other:
            again = await (await dsec.AsyncSandbox.connect(sb.id, client=other)).processes.connect(server.pid)
            await again.kill(9)
        assert (await server.wait(timeout=20)).signal == 9
        async with await sb.shell() as shell:
            await shell.run("cd /tmp && export X=1")
            assert (await shell.run("echo $PWD $X")).stdout == b"/tmp 1\n"
        term = await sb.pty(cols=100, rows=40, command="stty size")
        assert b"40 100" in b"".join([c async for c in term.stdout()])
        await sb.files.mkdir("a/b", parents=True)
        with pytest.raises(dsec.FileExists):
            await sb.files.mkdir("a/b")
        await sb.unexpose(port)
        assert await sb.ports() == []
