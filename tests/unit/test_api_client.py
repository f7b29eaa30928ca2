"""dsec.api.NodeClient over dsec._http.Connections: many nodes on one set of connections, per-call timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec._http.connections import Connections, parse_url
from dsec.api import NodeClient
from dsec.api.client import FailoverClient


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    with (running_daemon(tmp_path_factory.mktemp("a"), token="node-a-token-0123456789") as a,
          running_daemon(tmp_path_factory.mktemp("b"), token="node-b-token-0123456789") as b):
        yield [a, b]


async def test_one_set_of_connections_serves_every_node(nodes: list[Daemon]) -> None:
    connections = Connections()
    try:
        first = NodeClient(nodes[0].tcp_url or "", nodes[0].token, connections=connections)
        second = first.at(nodes[1].tcp_url or "", nodes[1].token)
        assert second.connections is connections
        infos = await asyncio.gather(*(api.health() for api in (first, second) for _ in range(5)))
        assert {i.node for i in infos} == {nodes[0].engine.settings.node, nodes[1].engine.settings.node}
        # Another token for a node already known (a sandbox-scoped one) shares that node's connections.
        sandbox = await first.create(dsec.SandboxSpec(image="tiny"))
        again = first.at(nodes[0].tcp_url or "", "not-the-token")
        with pytest.raises(dsec.Unauthorized):
            await again.get(sandbox.id)
        await first.destroy(sandbox.id)
        assert connections.statistics() == {"loops": 1, "origins": 2, "stream_clients": 0}
        events = first.subscribe(0)
        assert (await anext(events)).kind in ("created", "destroyed")
        await events.aclose()  # type: ignore[attr-defined]
        assert connections.statistics()["stream_clients"] == 1
    finally:
        await connections.aclose()
    assert connections.statistics() == {"loops": 0, "origins": 0, "stream_clients": 0}


async def test_lean_streams_follow_a_node_and_map_its_failures(nodes: list[Daemon]) -> None:
    connections = Connections(lean_streams=True)
    try:
        api = NodeClient(nodes[0].tcp_url or "", nodes[0].token, connections=connections)
        sandbox = await api.create(dsec.SandboxSpec(image="tiny"))
        events = api.subscribe(0)
        await api.destroy(sandbox.id)
        kinds = set()
        async for event in events:
            if event.sandbox_id == sandbox.id:
                kinds.add(event.kind)
            if "destroyed" in kinds:
                break
        await events.aclose()  # type: ignore[attr-defined]
        assert {"created", "destroyed"} <= kinds
        assert connections.statistics()["stream_clients"] == 0  # no httpx client was made
        with pytest.raises(dsec.Unauthorized):
            await anext(api.at(nodes[0].tcp_url or "", "not-the-token").subscribe(0))
    finally:
        await connections.aclose()
    with pytest.raises(dsec.ConnectionFailed, match="cannot reach"):
        await anext(NodeClient("http://127.0.0.1:9", connections=Connections(lean_streams=True)).subscribe(0))


async def test_a_timeout_bounds_each_call_of_its_view(tmp_path: Path) -> None:
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        await done.wait()
        writer.close()

    server = await asyncio.start_unix_server(silent, path=str(tmp_path / "silent.sock"))
    async with server, NodeClient(f"unix://{tmp_path}/silent.sock") as api:
        with pytest.raises(dsec.ConnectionFailed, match="did not answer in time"):
            await api.with_timeout(httpx.Timeout(0.2)).health()
        done.set()
        await asyncio.sleep(0.05)


async def test_views_add_headers_share_connections_and_never_close_them(nodes: list[Daemon]) -> None:
    async with NodeClient(nodes[0].tcp_url or "", nodes[0].token) as api:
        fenced = api.with_headers({"X-Test": "1"})
        assert api.with_headers({"X-Test": "1"}) is fenced  # a node's every create carries the same fence
        other = api.with_headers({"X-Test": "2"})
        assert other is not fenced and other._header.endswith("X-Test: 2\r\n") and api.with_headers(None) is api
        assert fenced.connections is api.connections and fenced.url == api.url and fenced.token == api.token
        assert (await fenced.with_timeout(httpx.Timeout(5.0)).health()).node == nodes[0].engine.settings.node
        await fenced.aclose()  # a view closes nothing: its parent's connections still serve
        assert (await api.health()).node == nodes[0].engine.settings.node


def test_urls_name_their_origin() -> None:
    assert parse_url("http://h:80/x/").netloc == "h" and parse_url("http://h:80/x/").prefix == "/x"
    assert parse_url("http://h:81").key == parse_url("http://h:81/other").key != parse_url("https://h:81").key
    assert parse_url("http://[::1]:7070").netloc == "[::1]:7070"
    assert parse_url("unix:///run/d.sock").key == "unix:/run/d.sock"
    with pytest.raises(dsec.InvalidRequest, match="bad port"):
        parse_url("http://h:99999")


def _free_address() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # nobody listens there once closed


async def test_a_client_given_several_gateways_fails_over_only_what_was_never_sent(nodes: list[Daemon]) -> None:
    """An address that refuses the connection passes the call on; one that took the request and hung up does
    not (the call may have acted there): its ConnectionFailed is raised and the next address sees nothing."""
    live = nodes[0].tcp_url or ""
    async with dsec.Client([_free_address(), live], nodes[0].token) as client:
        assert isinstance(client.api, FailoverClient)
        sb = await dsec.AsyncSandbox.create(image="tiny", client=client)
        assert client.api.url == live.rstrip("/")
        await dsec.AsyncSandbox.close_many([sb], client=client)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    taker = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with FailoverClient([taker, live], nodes[0].token) as api:
            before = len(await api.replicas[1].list())
            with pytest.raises(dsec.ConnectionFailed, match="lost mid-call"):
                await api.create(dsec.SandboxSpec(image="tiny"))
            assert api.url == taker and len(await api.replicas[1].list()) == before
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(ValueError, match="at least one"):
        FailoverClient([])
    every_dead = FailoverClient([_free_address(), _free_address()])
    with pytest.raises(dsec.ConnectionFailed, match="cannot reach"):
        await every_dead.health()
    await every_dead.aclose()
