"""The HTTP app: routes, error payloads, token, streams and the checked-in OpenAPI document."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate
from test_engine import started

from dsec.accounts import Identity
from dsec.config import Settings
from dsec.daemon.app import create_app
from dsec.daemon.engine import Engine
from dsec.errors import SandboxError
from dsec.models import ExecEvent, ExecRequest, SandboxRecord
from dsec.testing.fake import FakeBackend, FakeImages

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


class BrokenStreamBackend(FakeBackend):
    """Sends one chunk, then fails mid-stream."""

    async def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                          ) -> AsyncIterator[ExecEvent]:
        yield ExecEvent(type="stdout", data=b"partial")
        raise SandboxError("init died")


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with started(Engine(Settings(home=tmp_path / "home"), {"container": FakeBackend(root=tmp_path / "fake")},
                              FakeImages())) as eng:
        yield eng


def client_for(engine: Engine, token: str | None = None, **kwargs: int) -> httpx.AsyncClient:
    app = create_app(engine, token, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsec")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(engine) as c:
        yield c


async def new_sandbox(client: httpx.AsyncClient, **spec: object) -> str:
    r = await client.post("/v1/sandboxes", json={"image": "base", **spec})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def events(response: httpx.Response) -> list[dict[str, object]]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


async def test_health_and_sandbox_lifecycle(client: httpx.AsyncClient) -> None:
    health = (await client.get("/v1/health")).json()
    assert health["backends"]["container"] == "ok" and health["sandboxes"] == 0
    sid = await new_sandbox(client, labels={"job": "a"}, memory="512Mi")
    await new_sandbox(client, labels={"job": "b"})
    got = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert got["state"] == "running" and got["spec"]["memory"] == 512 * 1024**2
    listed = (await client.get("/v1/sandboxes", params={"label": "job=a"})).json()
    assert [i["id"] for i in listed] == [sid]
    assert len((await client.get("/v1/sandboxes", params={"state": "running"})).json()) == 2
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).json()["state"] == "paused"
    assert (await client.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
    assert (await client.get(f"/v1/sandboxes/{sid}/stats")).json()["pids"] == 0
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["error"]["type"] == "SandboxNotFound"


async def test_batch_create(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/sandboxes/batch", json={"count": 3, "spec": {"image": "base"}})
    assert r.status_code == 201
    assert len({i["id"] for i in r.json()}) == 3


async def test_validation_errors_are_400_naming_the_field(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/sandboxes", json={"image": "base", "cpu": 0})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "InvalidRequest"
    assert "body.cpu: Input should be greater than 0" in error["message"]
    r = await client.post("/v1/sandboxes", json={"image": "base", "colour": "red"})
    assert r.status_code == 400 and "body.colour" in r.json()["error"]["message"]
    r = await client.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "InvalidRequest"
    assert "malformed JSON" in r.json()["error"]["message"]
    r = await client.get("/v1/sandboxes", params={"label": "novalue"})
    assert r.status_code == 400 and "key=value" in r.json()["error"]["message"]


async def test_error_payloads_carry_type_and_status(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/sandboxes/sb-000000000000")
    assert r.status_code == 404
    assert r.json() == {"error": {
        "type": "SandboxNotFound",
        "message": "no sandbox 'sb-000000000000' on node " + r.json()["error"]["message"].split()[-1],
        "detail": {"sandbox_id": "sb-000000000000"},
    }}
    r = await client.post("/v1/sandboxes/sb-000000000000/exec", json={"command": "true"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxNotFound"
    r = await client.post("/v1/sandboxes", json={"image": "missing"})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "ImageNotFound")
    r = await client.post("/v1/sandboxes", json={"image": "base", "backend": "vm"})
    assert (r.status_code, r.json()["error"]["type"]) == (503, "BackendUnavailable")
    r = await client.get("/v1/images/missing")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "ImageNotFound")
    assert [i["name"] for i in (await client.get("/v1/images")).json()] == ["base"]


async def test_token_guards_every_route_but_health(engine: Engine) -> None:
    async with client_for(engine, token="s3cret") as c:
        assert (await c.get("/v1/health")).status_code == 200
        for path in ("/v1/sandboxes", "/metrics", "/openapi.json"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
        r = await c.get("/v1/sandboxes", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.get("/v1/sandboxes", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json() == []


async def test_exec_streams_ndjson_events(client: httpx.AsyncClient, engine: Engine) -> None:
    sid = await new_sandbox(client)
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={
        "command": ["sh", "-c", "printf out; printf err >&2; exit 4"],
        "stdin": base64.b64encode(b"x").decode(),
    })
    assert r.status_code == 200
    evs = events(r)
    assert {e["type"] for e in evs[:-1]} <= {"stdout", "stderr"}
    assert evs[-1]["type"] == "exit"
    result = evs[-1]["result"]
    assert isinstance(result, dict)
    assert result["exit_code"] == 4
    assert base64.b64decode(result["stdout"]) == b"out"
    assert base64.b64decode(result["stderr"]) == b"err"
    chunks = b"".join(base64.b64decode(str(e["data"])) for e in evs if e["type"] == "stdout")
    assert chunks == b"out"
    await client.post(f"/v1/sandboxes/{sid}/pause")
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true"})
    assert (r.status_code, r.json()["error"]["type"]) == (409, "SandboxStateError")


async def test_exception_inside_stream_becomes_error_event(tmp_path: Path) -> None:
    async with started(Engine(Settings(home=tmp_path), {"container": BrokenStreamBackend(root=tmp_path / "fake")},
                              FakeImages())) as eng, client_for(eng) as c:
        sid = await new_sandbox(c)
        evs = events(await c.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true"}))
        assert [e["type"] for e in evs] == ["stdout", "error"]
        assert evs[-1]["error"] == {"type": "SandboxError", "message": "init died", "detail": {}}
        assert eng.metrics.value("dsec_exec_total", backend="container", outcome="error") == 1


async def test_exec_result_answers_in_one_response(client: httpx.AsyncClient, engine: Engine) -> None:
    sid = await new_sandbox(client)
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", json={
        "command": ["sh", "-c", "cat; printf err >&2; exit 4"],
        "stdin": base64.b64encode(b"in").decode(),
    })
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    result = r.json()
    assert result["exit_code"] == 4 and result["limit"] is None
    assert base64.b64decode(result["stdout"]) == b"in"
    assert base64.b64decode(result["stderr"]) == b"err"
    assert engine.metrics.value("dsec_exec_total", backend="container", outcome="nonzero") == 1
    # Bad input and wrong states answer the same errors as the streamed route.
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", content=b"{not json")
    assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": []})
    assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "true", "cwd": ""})
    assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")
    r = await client.post("/v1/sandboxes/sb-000000000000/exec/result", json={"command": "true"})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "SandboxNotFound")
    await client.post(f"/v1/sandboxes/{sid}/pause")
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "true"})
    assert (r.status_code, r.json()["error"]["type"]) == (409, "SandboxStateError")


async def test_exec_result_fast_path_hands_what_it_does_not_serve_to_the_route(
        engine: Engine, client: httpx.AsyncClient) -> None:
    """FastPath serves well-formed exec requests itself; every other one is FastAPI's to answer (and word)."""
    sid = await new_sandbox(client)
    url = f"/v1/sandboxes/{sid}/exec/result"
    for params, message in (({"seq": "abc"}, "query.seq: Input should be a valid integer"),
                            ({"seq": "-1"}, "query.seq: Input should be greater than or equal to 0"),
                            ({"seq": "\u00b2"}, "query.seq: Input should be a valid integer")):
        r = await client.post(url, params=params, json={"command": "true"})
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest"), r.text
        assert message in r.json()["error"]["message"], r.text
    r = await client.post(url, json={"command": "true", "bogus": 1})
    assert r.status_code == 400 and "body.bogus: Extra inputs are not permitted" in r.text, r.text
    for headers in ({"content-type": "text/plain"}, {}):
        r = await client.post(url, content=b'{"command": "true"}', headers=headers)
        assert r.status_code == 400 and "invalid request: body:" in r.text, r.text
    # served: with a seq, and with a query parameter the route ignores
    r = await client.post(url, params={"seq": "0"}, json={"command": "echo hi"})
    assert r.status_code == 200 and base64.b64decode(r.json()["stdout"]) == b"hi\n", r.text
    r = await client.post(url, params={"other": "1"}, json={"command": "echo hi"})
    assert r.status_code == 200 and r.headers["content-length"] == str(len(r.content)), r.text
    # other methods on the path are the router's (405), and the token guard wraps the fast path
    assert (await client.get(url)).status_code == 405
    async with client_for(engine, token="s3cret") as guarded:
        r = await guarded.post(url, json={"command": "true"})
        assert (r.status_code, r.json()["error"]["type"]) == (401, "Unauthorized")
        r = await guarded.post(url, json={"command": "true"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["exit_code"] == 0


async def test_create_fast_path_serves_creates_and_hands_bad_ones_to_the_route(client: httpx.AsyncClient) -> None:
    """POST /v1/sandboxes is served by FastPath (201, the SandboxInfo); what it does not serve is FastAPI's."""
    r = await client.post("/v1/sandboxes", json={"image": "base", "labels": {"k": "v"}})
    assert r.status_code == 201 and r.headers["content-length"] == str(len(r.content)), r.text
    assert r.json()["state"] == "running" and r.json()["labels"] == {"k": "v"}
    r = await client.post("/v1/sandboxes", json={"image": "base", "bogus": 1})
    assert r.status_code == 400 and "body.bogus: Extra inputs are not permitted" in r.text, r.text
    r = await client.post("/v1/sandboxes", json={"image": "base", "cpu": -1})
    assert r.status_code == 400 and "body.cpu" in r.text, r.text
    r = await client.post("/v1/sandboxes", content=b'{"image": "base"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "invalid request: body:" in r.text, r.text
    r = await client.post("/v1/sandboxes", params={"x": "1"}, json={"image": "base"})  # the route ignores it
    assert r.status_code == 201, r.text
    r = await client.post("/v1/sandboxes", json={"image": "no-such-image"})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "ImageNotFound"), r.text


async def test_delete_fast_path_answers_as_the_route(engine: Engine, client: httpx.AsyncClient) -> None:
    """DELETE /v1/sandboxes/{id} is served by FastPath: 204 without a body, idempotent, the error payload for
    an unknown id; with a query it is the route's (same answers), and the token guard wraps it."""
    sid = await new_sandbox(client)
    r = await client.delete(f"/v1/sandboxes/{sid}")
    assert (r.status_code, r.content) == (204, b""), r.text
    r = await client.get(f"/v1/sandboxes/{sid}")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "SandboxNotFound"), r.text  # it is gone
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204  # idempotent
    r = await client.delete("/v1/sandboxes/sb-nope")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "SandboxNotFound"), r.text
    r = await client.delete("/v1/sandboxes/sb-nope", params={"x": "1"})  # FastAPI's route: the same answer
    assert (r.status_code, r.json()["error"]["type"]) == (404, "SandboxNotFound"), r.text
    other = await new_sandbox(client)
    assert (await client.delete(f"/v1/sandboxes/{other}/exec")).status_code == 405  # not a sandbox path
    async with client_for(engine, token="s3cret") as guarded:
        r = await guarded.delete(f"/v1/sandboxes/{other}")
        assert (r.status_code, r.json()["error"]["type"]) == (401, "Unauthorized")
        assert (await client.get(f"/v1/sandboxes/{other}")).json()["state"] == "running"
        r = await guarded.delete(f"/v1/sandboxes/{other}", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 204


async def test_exception_inside_one_response_exec_is_a_sandbox_error(tmp_path: Path) -> None:
    async with started(Engine(Settings(home=tmp_path), {"container": BrokenStreamBackend(root=tmp_path / "fake")},
                              FakeImages())) as eng, client_for(eng) as c:
        sid = await new_sandbox(c)
        r = await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "true"})
        assert r.status_code == 500
        assert r.json() == {"error": {"type": "SandboxError", "message": "init died", "detail": {}}}
        assert eng.metrics.value("dsec_exec_total", backend="container", outcome="error") == 1


async def test_file_round_trip_with_binary_data(client: httpx.AsyncClient) -> None:
    sid = await new_sandbox(client)
    data = bytes(range(256)) + b"\xff\xfe not utf-8"
    url = f"/v1/sandboxes/{sid}/files"
    r = await client.put(url, params={"path": "/workspace/x/blob", "mode": "0755"}, content=data)
    assert r.status_code == 204, r.text
    r = await client.get(url, params={"path": "/workspace/x/blob"})
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.content == data
    [entry] = (await client.get(f"{url}/list", params={"path": "/workspace/x"})).json()
    assert (entry["name"], entry["mode"], entry["size"]) == ("blob", 0o755, len(data))
    r = await client.put(url, params={"path": "/workspace/y", "mode": "rwx"}, content=b"")
    assert r.status_code == 400 and "octal" in r.json()["error"]["message"]
    r = await client.get(url, params={"path": "x/blob"})  # relative to the sandbox's working directory
    assert r.status_code == 200 and r.content == data
    r = await client.get(url, params={"path": "x/none"})
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["detail"]["errno"]) == (
        404, "FileNotFound", 2)
    r = await client.get(url)
    assert r.status_code == 400 and "query.path" in r.json()["error"]["message"]


async def test_file_body_is_capped(engine: Engine) -> None:
    async with client_for(engine, max_body=8) as c:
        sid = await new_sandbox(c)
        r = await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=b"x" * 9)
        assert r.status_code == 400 and "8-byte limit" in r.json()["error"]["message"]
        r = await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/small"}, content=b"x" * 8)
        assert r.status_code == 204


async def test_metrics_endpoint(client: httpx.AsyncClient) -> None:
    sid = await new_sandbox(client)
    await client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true"})
    await client.post("/v1/sandboxes", json={"image": "missing"})
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'dsec_sandboxes_created_total{backend="container"} 1.0' in text
    assert 'dsec_sandboxes_live{backend="container"} 1.0' in text
    assert 'dsec_sandboxes_failed_total{backend="container",reason="ImageNotFound"} 1.0' in text
    assert 'dsec_exec_total{backend="container",outcome="ok"} 1.0' in text
    assert 'dsec_exec_seconds_bucket{backend="container",le="600.0"} 1.0' in text


async def test_served_openapi_matches_checked_in_document(client: httpx.AsyncClient) -> None:
    served = (await client.get("/openapi.json")).json()
    validate(served)
    assert OPENAPI.exists(), "docs/openapi.json is missing: run scripts/gen-openapi"
    checked_in = json.loads(OPENAPI.read_text())
    assert served == checked_in, "docs/openapi.json is stale: run scripts/gen-openapi and commit the result"
    exec_doc = served["paths"]["/v1/sandboxes/{sandbox_id}/exec"]["post"]["responses"]["200"]
    assert "application/x-ndjson" in exec_doc["content"]
    assert "422" not in json.dumps(served["paths"])


async def test_a_call_cut_off_while_the_daemon_stops_is_answered_daemon_stopping(engine: Engine) -> None:
    """At the server's graceful timeout a running call is cancelled: while the engine drains, the outermost
    layer answers 503 DaemonStopping instead of the server's bare 500; otherwise, or once an answer has
    begun, the cancellation goes on to the server untouched."""
    from dsec.daemon.app import AnswerCutOffCalls

    async def run(inner_starts_answer: bool) -> tuple[asyncio.Task[None], list[dict[str, object]]]:
        entered = asyncio.Event()

        async def inner(scope: object, receive: object, send: Callable[[dict[str, object]], Awaitable[None]]) -> None:
            if inner_starts_answer:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            entered.set()
            await asyncio.Event().wait()  # a long exec

        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/sandboxes/sb-1/exec/result", "headers": []}
        task = asyncio.create_task(AnswerCutOffCalls(inner, engine)(scope, receive, send))  # type: ignore[arg-type]
        await entered.wait()
        task.cancel()
        return task, sent

    task, sent = await run(inner_starts_answer=False)  # the daemon is not stopping: the server's business
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent == []

    engine.drain("the DSec daemon on node n1 is stopping; retry once it is back")
    task, sent = await run(inner_starts_answer=False)
    await task  # answered, not raised
    assert sent[0]["status"] == 503
    body = json.loads(sent[1]["body"])["error"]  # type: ignore[arg-type]
    assert body["type"] == "DaemonStopping"
    assert body["message"] == ("POST /v1/sandboxes/sb-1/exec/result was cut off (the command it was running is "
                               "killed): the DSec daemon on node n1 is stopping; retry once it is back")

    task, sent = await run(inner_starts_answer=True)  # a stream under way just ends
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [m["type"] for m in sent] == ["http.response.start"]
