"""The gateway's lean protocol (:mod:`dsec.cluster.front`) answers byte for byte what the ASGI stack answers.

One gateway engine over two simulated nodes (:mod:`dsec.testing.fleet`, in this event loop) is served twice:
on the lean protocol, as the gateway serves, and on uvicorn's own protocol with the same app. The same raw
requests go to both; the answers must be the same bytes (the ``date`` header aside), and a spy in front of
the lean server's app says which requests took the lean path and which were handed to the app. The
database is a recorder, as in test_gateway_records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from sdk_daemon import free_port

from dsec.cluster.gateway import GatewayEngine, NodeFacts
from dsec.cluster.placement import Capacity, JobQuota
from dsec.cluster.router import FORWARDED_HEADER, ReplicaRouter
from dsec.cluster.server import Jobs, _Admission, _JobGuard, gateway_app, gateway_config
from dsec.cluster.state import NodeRow
from dsec.testing.fleet import Fleet

_TOKEN = "job-token-0123456789"
_CAPPED = "capped-token-0123456789"
_ROOM: dict[str, Any] = {"cpu": 64.0, "memory": 2**36, "slots": {"function": 100}}
_SPEC = b'{"image": "debian-python", "backend": "function"}'


class _Writer:
    async def put_rows(self, rows: list[Any]) -> None:
        pass

    def submit_rows(self, rows: list[Any], *, new: bool = False) -> None:
        pass

    def submit_delete(self, ids: list[str]) -> None:
        pass


class _State:
    writer = _Writer()

    async def aclose(self) -> None:
        pass


@dataclass
class Served:
    engine: GatewayEngine
    lean: int
    """The port of the gateway on its lean protocol."""
    stock: int
    """The port of the same engine and app on uvicorn's own protocol."""
    seen: list[str]
    """Requests the lean server handed to its app ("METHOD path")."""


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    fleet = Fleet(2, _ROOM)
    await fleet.start()

    async def membership() -> list[NodeFacts]:
        return [NodeFacts(n["name"], n["alive"], n["url"], n["token"], n["capacity"]) for n in fleet.membership()]

    g = GatewayEngine(_State(), membership, quotas={"capped": JobQuota(max_live=1)},  # type: ignore[arg-type]
                      admission_wait=0.2)
    for node in fleet.nodes.values():
        g.node_rows[node.name] = NodeRow(node.name, node.url, node.token, True, _ROOM)
        g.placer.set_node(node.name, Capacity(cpu=64, memory=2**36, slots={"function": 100}))
    jobs = Jobs(by_token={_TOKEN: "j1", _CAPPED: "capped"}, quotas={"capped": JobQuota(max_live=1)})
    lean, stock = free_port(), free_port()
    config = gateway_config(g, jobs, "127.0.0.1", lean)
    seen: list[str] = []
    app: Any = config.app
    inner = app.front

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        seen.append(f"{scope['method']} {scope['path']}")
        await inner(scope, receive, send)

    app.front = spy
    servers = [uvicorn.Server(config), uvicorn.Server(uvicorn.Config(
        gateway_app(g, jobs), host="127.0.0.1", port=stock, log_level="warning", http="httptools"))]
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    while not all(server.started for server in servers):
        await asyncio.sleep(0.01)
    try:
        yield Served(g, lean, stock, seen)
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)
        await g.aclose()
        for node in fleet.nodes.values():
            node.die("test over")


def request(method: str, path: str, body: bytes = b"", *, token: str | None = _TOKEN,
            headers: tuple[str, ...] = (), version: str = "1.1", json_type: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: gw"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if body or method == "POST":
        lines += [f"Content-Length: {len(body)}"] + (["Content-Type: application/json"] if json_type else [])
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode() + body


async def exchange(port: int, raw: bytes, answers: int = 1) -> list[bytes]:
    """Send ``raw`` on one connection and read ``answers`` answers (each whole, ``date`` left out)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    got = []
    try:
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = re.search(rb"content-length: (\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            if b"connection: close" in head:
                assert await reader.read() == b"", "the server kept talking after connection: close"
            got.append(re.sub(rb"date: [^\r]*\r\n", b"", head) + body)
    finally:
        writer.close()
    return got


async def both(s: Served, raw: bytes, answers: int = 1) -> list[bytes]:
    """The lean server's answers, once checked to be the stock server's."""
    lean = await exchange(s.lean, raw, answers)
    assert lean == await exchange(s.stock, raw, answers)
    return lean


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def payload(answer: bytes) -> Any:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


async def test_create_and_destroy_take_the_lean_path_with_the_apps_answers(served: Served) -> None:
    made = (await exchange(served.lean, request("POST", "/v1/sandboxes", _SPEC)))[0]
    stock = (await exchange(served.stock, request("POST", "/v1/sandboxes", _SPEC)))[0]
    assert status(made) == status(stock) == 201
    lean_head, stock_head = (re.sub(rb"content-length: \d+", b"", a.split(b"\r\n\r\n")[0]) for a in (made, stock))
    assert lean_head == stock_head and lean_head.startswith(b"HTTP/1.1 201 Created\r\nserver: uvicorn\r\n")
    info = payload(made)
    assert set(info) == set(payload(stock)) and info["labels"] == {"dsec.job": "j1"} and info["endpoint"]["token"]
    for sandbox in (info["id"], payload(stock)["id"]):  # each destroyed through the other protocol's peer
        gone = await both(served, request("DELETE", f"/v1/sandboxes/{sandbox}"))
        assert gone == [b"HTTP/1.1 204 No Content\r\nserver: uvicorn\r\n\r\n"]  # gone, or gone already
    assert served.seen == [], "create and destroy went through the ASGI app"
    # A query the fast path does not parse: the app answers (FastAPI ignores what it does not know).
    queried = (await exchange(served.lean, request("POST", "/v1/sandboxes?x=1", _SPEC)))[0]
    assert status(queried) == 201 and served.seen == ["POST /v1/sandboxes"]
    await both(served, request("DELETE", f"/v1/sandboxes/{payload(queried)['id']}"))
    assert served.engine.placer.job("j1").live == 0


async def test_every_error_answers_as_the_app_does(served: Served) -> None:
    cases = {  # name: request, its status, whether the lean server hands it to the app
        "bad JSON": (request("POST", "/v1/sandboxes", b'{"image": '), 400, True),
        "unknown field": (request("POST", "/v1/sandboxes", b'{"image": "x", "colour": "red"}'), 400, True),
        "not JSON": (request("POST", "/v1/sandboxes", _SPEC, json_type=False), 400, True),
        "no token": (request("POST", "/v1/sandboxes", _SPEC, token=None), 401, True),
        "wrong token": (request("DELETE", "/v1/sandboxes/sb-x", token="not-a-job-token-0123"), 401, True),
        "no node fits": (request("POST", "/v1/sandboxes", b'{"image": "x", "backend": "vm"}'), 503, False),
        "HTTP/1.0": (request("DELETE", "/v1/sandboxes/sb-x", version="1.0"), 204, True),
    }
    for name, (raw, code, handed) in cases.items():
        served.seen.clear()
        answer = (await both(served, raw))[0]
        assert status(answer) == code, (name, answer)
        assert code < 400 or payload(answer)["error"]["message"], name
        assert bool(served.seen) is handed, (name, served.seen)
    assert "malformed JSON" in payload((await both(served, cases["bad JSON"][0]))[0])["error"]["message"]
    served.seen.clear()
    waits = request("POST", "/v1/sandboxes", b'{"image": 1}', headers=("Expect: 100-continue",))
    go_on, refused = await both(served, waits, answers=2)
    assert status(go_on) == 100 and status(refused) == 400 and served.seen == ["POST /v1/sandboxes"]


async def test_quota_connection_close_and_pipelining(served: Served) -> None:
    first = (await exchange(served.lean, request("POST", "/v1/sandboxes", _SPEC, token=_CAPPED)))[0]
    assert status(first) == 201
    over = (await both(served, request("POST", "/v1/sandboxes", _SPEC, token=_CAPPED)))[0]
    assert status(over) == 429 and payload(over)["error"]["detail"]["max_live"] == 1
    sandbox = payload(first)["id"]
    # Two requests in one write: answered in order on the one connection, the second closing it.
    pipelined = request("DELETE", f"/v1/sandboxes/{sandbox}", token=_CAPPED) + request(
        "DELETE", f"/v1/sandboxes/{sandbox}", token=_CAPPED, headers=("Connection: close",))
    gone, again = await exchange(served.lean, pipelined, answers=2)
    assert status(gone) == 204 and b"connection: close" not in gone
    assert status(again) == 204 and b"connection: close\r\n" in again
    assert served.seen == []


async def test_an_unexpected_failure_is_uvicorns_500(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(sandbox_id: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(served.engine, "_mine", broken)
    answer = (await both(served, request("DELETE", "/v1/sandboxes/sb-x")))[0]
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n") and answer.endswith(b"Internal Server Error")
    assert served.seen == []


class _Routing:
    def __init__(self, places: bool, held: set[str]) -> None:
        self._places, self.held = places, held

    def holds(self, sandbox_id: str) -> bool:
        return sandbox_id in self.held

    async def owners_of(self, sandbox_id: str) -> list[str]:
        return ["http://other"]

    def other_replicas(self) -> list[str]:
        return ["http://other"]

    def places(self) -> bool:
        return self._places


def _scope(method: str, path: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": b"",
            "headers": [(b"authorization", f"Bearer {_TOKEN}".encode()), *headers]}


def test_admission_leaves_what_another_replica_may_own_to_the_router() -> None:
    jobs = Jobs(by_token={_TOKEN: "j1"}, quotas={})
    routing = _Routing(places=False, held={"sb-here"})
    router = ReplicaRouter(lambda *_: None, routing)  # type: ignore[arg-type, return-value]
    admission = _Admission(None, _JobGuard(router, jobs), router)  # type: ignore[arg-type]
    assert admission.admit(_scope("POST", "/v1/sandboxes")) is None  # placing on no node: passed on
    assert admission.admit(_scope("DELETE", "/v1/sandboxes/sb-elsewhere")) is None
    assert admission.admit(_scope("DELETE", "/v1/sandboxes/sb-here")) is not None
    forwarded = _scope("DELETE", "/v1/sandboxes/sb-elsewhere", (FORWARDED_HEADER.lower().encode(), b"1"))
    enter = admission.admit(forwarded)
    assert enter is not None
    from dsec.cluster.gateway import current_job
    from dsec.cluster.router import was_forwarded

    leave = enter()
    assert current_job.get() == "j1" and was_forwarded.get() is True
    leave()
    assert was_forwarded.get() is False
    routing._places = True
    assert admission.admit(_scope("POST", "/v1/sandboxes")) is not None
    assert admission.admit({**_scope("POST", "/v1/sandboxes"), "headers": []}) is None  # no token: the guard's 401


async def test_the_access_log_names_a_lean_request_as_uvicorn_does(served: Served,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        for port in (served.lean, served.stock):
            await exchange(port, request("DELETE", "/v1/sandboxes/sb-x?"))
    lines = [r.getMessage().split(" - ", 1)[1] for r in caplog.records if r.name == "uvicorn.access"]
    assert lines == ['"DELETE /v1/sandboxes/sb-x HTTP/1.1" 204'] * 2 and served.seen == []
