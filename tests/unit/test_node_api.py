"""One conformance suite, three targets: the node's engine in process, a daemon over HTTP, a gateway over HTTP.

The checks (``dsec.testing.node_api``) reach each target only through :class:`dsec.api.NodeAPI`; the two
HTTP targets are real uvicorn servers (the daemon on its unix socket, where the fast path sits in front of
the app; the gateway on TCP with a job token, over a node daemon on TCP with its token). Beside them, the
contract itself: every operation is checked by the suite, bound as a route, and sent by the client as its
declaration says.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sdk_daemon import Daemon, Gateway, TinyImages, running_daemon, running_gateway

from dsec.api import NODE_OPERATIONS, NodeAPI, NodeClient
from dsec.config import Settings
from dsec.daemon.app import create_app
from dsec.daemon.engine import Engine
from dsec.testing.fake import FakeBackend
from dsec.testing.node_api import NODE_CHECKS, NodeCheck, covered

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
