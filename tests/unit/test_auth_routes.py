"""The token guard's routes come from the node API's declarations: every operation has a job-token policy,
and a request is matched to the operation the server would run."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dsec.api.operations import Operation, operations_of
from dsec.api.protocol import NodeAPI
from dsec.daemon import auth

OPS = operations_of(NodeAPI)


def _filled(path: str) -> str:
    return re.sub(r"{(\w+)}", lambda m: f"x-{m.group(1)}", path)


def test_job_tokens_reach_outside_their_sandboxes_only_what_was_decided() -> None:
    """A new operation outside ``/v1/sandboxes/{sandbox_id}`` is admin-only until someone decides otherwise."""
    reachable = {op.name: auth.job_policy(op) for op in OPS
                 if auth.job_policy(op) not in ("owner", "admin")}
    assert reachable == {"create": "create", "create_many": "batch", "create_many_stream": "batch",
                         "fork": "fork", "list": "list", "destroy_many": "destroy_many",
                         "list_images": "read", "get_image": "read"}
    for op in OPS:
        under = op.path.startswith("/v1/sandboxes/{sandbox_id}")
        assert (auth.job_policy(op) in ("owner", "fork")) == under, op.name


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_route_is_matched_to_its_own_operation(op: Operation[Any, Any]) -> None:
    found = auth._ROUTES.match(op.method, _filled(op.path))
    assert found is not None and found[0].name == op.name
    if "{sandbox_id}" in op.path:
        assert found[1]["sandbox_id"] == "x-sandbox_id"


def test_a_literal_path_wins_over_a_template_and_ids_are_unquoted() -> None:
    create_many = auth._ROUTES.match("POST", NodeAPI.create_many.path)
    assert create_many is not None and create_many[0].name == "create_many"
    get = auth._ROUTES.match("GET", "/v1/sandboxes/batch")
    assert get is not None and get[0].name == "get" and get[1] == {"sandbox_id": "batch"}
    quoted = auth._ROUTES.match("DELETE", "/v1/sandboxes/sb%2Dx")
    assert quoted is not None and quoted[0].name == "destroy" and quoted[1] == {"sandbox_id": "sb-x"}
    assert auth._ROUTES.match("PUT", "/v1/sandboxes/sb-1") is None
    assert auth._ROUTES.match("GET", "/v1/nothing") is None


def test_a_scoped_token_opens_its_sandbox_but_neither_destroy_nor_fork() -> None:
    token = auth.scoped_token("admin-secret", "sb-1")
    header = f"Bearer {token}".encode()
    assert auth._scoped_ok("admin-secret", header, "GET", "/v1/sandboxes/sb-1")
    assert auth._scoped_ok("admin-secret", header, "POST", "/v1/sandboxes/sb-1/exec")
    assert not auth._scoped_ok("admin-secret", header, "DELETE", "/v1/sandboxes/sb-1")
    assert not auth._scoped_ok("admin-secret", header, "POST", "/v1/sandboxes/sb-1/fork")
    assert not auth._scoped_ok("admin-secret", header, "GET", "/v1/sandboxes/sb-2")
    assert not auth._scoped_ok("admin-secret", header, "GET", "/v1/sandboxes/sb-10")
    assert not auth._scoped_ok("other-secret", header, "GET", "/v1/sandboxes/sb-1")


def _guarded(tmp_path: Path, **limits: float) -> tuple[auth.AuthGuard, str, list[bytes]]:
    """A guard over an app that records the bodies it was handed, and an admin token of the file with ``limits``."""
    tmp_path.mkdir()
    tokens = auth.TokenFile(tmp_path / "tokens.json")
    token = tokens.create("grader", admin=True, requests_per_s=limits.get("requests_per_s"))
    seen: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def owner_of(sandbox_id: str) -> dict[str, str] | None:
        return None

    return auth.AuthGuard(app, admin_token=None, tokens=tokens, owner_of=owner_of), token, seen


def _request(guard: auth.AuthGuard, token: str, method: str, path: str, body: bytes = b"") -> int:
    """The status the guard (or the app behind it) answers."""
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(b"authorization", f"Bearer {token}".encode()), (b"content-length", str(len(body)).encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return int(sent[0]["status"])


def test_a_call_batch_takes_one_request_per_item_from_the_limit(tmp_path: Path) -> None:
    """``sb.map`` sends up to 64 calls in one request: each is a call, and counts as a request."""
    path = _filled(NodeAPI.call_many.path)
    batch = json.dumps({"function": "gA==", "items": ["gA=="] * 4}).encode()
    guard, token, seen = _guarded(tmp_path / "many", requests_per_s=2)
    assert _request(guard, token, "POST", path, batch) == 200
    assert seen == [batch]  # the app gets the body the guard read
    assert _request(guard, token, "GET", "/v1/sandboxes") == 429  # 4 items of a 2/s burst: in debt
    guard, token, _ = _guarded(tmp_path / "one", requests_per_s=2)
    one = json.dumps({"function": "gA==", "items": ["gA=="]}).encode()
    assert _request(guard, token, "POST", path, one) == 200
    assert _request(guard, token, "GET", "/v1/sandboxes") == 200  # one item: one request
    # The guard counts a batch of any size: a lone item over 16 MiB (the SDK sends one so) is the route's business
    guard, token, seen = _guarded(tmp_path / "big", requests_per_s=2)
    big = json.dumps({"function": "gA==", "items": ["A" * (17 << 20)]}).encode()
    assert _request(guard, token, "POST", path, big) == 200 and seen == [big]
