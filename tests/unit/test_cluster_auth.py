"""Cluster credentials: the node's sandbox-scoped tokens, and the gateway's jobs file (bad input)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from test_app import client_for, engine, new_sandbox

from dsec.cluster.server import Jobs
from dsec.daemon.auth import TokenFile, scoped_token
from dsec.daemon.engine import Engine
from dsec.errors import InvalidRequest

__all__ = ["engine"]  # the fixture, re-used from test_app

NODE_TOKEN = "node-secret-token-0123456789"


async def test_scoped_token_opens_its_sandbox_only(engine: Engine) -> None:
    async with client_for(engine, NODE_TOKEN) as admin:
        admin.headers["Authorization"] = f"Bearer {NODE_TOKEN}"
        mine, other = await new_sandbox(admin), await new_sandbox(admin)
    async with client_for(engine, NODE_TOKEN) as c:
        c.headers["Authorization"] = f"Bearer {scoped_token(NODE_TOKEN, mine)}"
        assert (await c.get(f"/v1/sandboxes/{mine}")).status_code == 200
        r = await c.post(f"/v1/sandboxes/{mine}/exec", json={"command": "echo hi"})
        assert r.status_code == 200
        assert (await c.get(f"/v1/sandboxes/{other}")).status_code == 401
        assert (await c.get("/v1/sandboxes")).status_code == 401
        assert (await c.post("/v1/sandboxes", json={"image": "base"})).status_code == 401
        assert (await c.delete(f"/v1/sandboxes/{mine}")).status_code == 401
        assert (await c.post(f"/v1/sandboxes/{mine}/fork", json={"count": 1})).status_code == 401
        # A token for one sandbox, presented with another id's prefix, or made with another key, fails.
        forged = scoped_token(NODE_TOKEN, mine).replace(mine, other, 1)
        c.headers["Authorization"] = f"Bearer {forged}"
        assert (await c.get(f"/v1/sandboxes/{other}")).status_code == 401
        c.headers["Authorization"] = f"Bearer {scoped_token('another-node-key-000000000', mine)}"
        assert (await c.get(f"/v1/sandboxes/{mine}")).status_code == 401
        # A sandbox id that is a prefix of another's must not open the longer one.
        c.headers["Authorization"] = f"Bearer {scoped_token(NODE_TOKEN, mine[:-1])}"
        assert (await c.get(f"/v1/sandboxes/{mine}")).status_code == 401


def write(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "jobs.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_jobs_file_loads_tokens_and_quotas(tmp_path: Path) -> None:
    jobs = Jobs.load(write(tmp_path, {"admin_token": "a" * 20, "jobs": {
        "j1": {"token": "t" * 20, "max_live": 5, "max_rate": 2.5}, "j2": {"token": "u" * 20},
        "j3": {"token": "v" * 20, "max_rate": 10, "burst": 40}}}))
    assert jobs.by_token == {"a" * 20: "admin", "t" * 20: "j1", "u" * 20: "j2", "v" * 20: "j3"}
    assert jobs.quotas["j1"].max_live == 5 and jobs.quotas["j1"].max_rate == 2.5
    assert jobs.quotas["j1"].bucket == 5  # by default a job may create its whole quota at once
    assert jobs.quotas["j2"].max_live is None
    assert jobs.quotas["j3"].bucket == 40


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot read the jobs file"),
    ([1, 2], "expected"),
    ({"jobs": {"j": {"token": "short"}}}, "at least 16 characters"),
    ({"jobs": {"j": {"token": "t" * 20}, "k": {"token": "t" * 20}}}, "reuses another job's token"),
    ({"jobs": {}}, "names no token"),
    ({"jobs": {"j": {"token": "t" * 20, "burst": 0}}}, "'burst' must be a positive whole number"),
    ({"jobs": {"j": {"token": "t" * 20, "max_live": 2.5}}}, "'max_live' must be a positive whole number"),
    ({"jobs": {"j": {"token": "t" * 20, "max_rate": "fast"}}}, "'max_rate' must be a positive number"),
])
def test_bad_jobs_files_are_refused_with_the_reason(tmp_path: Path, content: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Jobs.load(write(tmp_path, content))


def test_missing_jobs_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read"):
        Jobs.load(tmp_path / "absent.json")


def test_cluster_up_refuses_a_bad_jobs_file_before_touching_ray(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dsec.cli import main

    bad = write(tmp_path, {"jobs": {"j": {"token": "short"}}})
    result = CliRunner().invoke(main, ["cluster", "up", "--db", "postgresql://x/y", "--jobs", str(bad),
                                       "--ray-address", "127.0.0.1:1"])
    assert result.exit_code != 0
    assert "at least 16 characters" in result.output + str(result.exception)


async def test_job_token_is_told_its_sandbox_expired(engine: Engine, tmp_path: Path) -> None:
    """A job's token asking for its sandbox after the timeout gets SandboxTimeout with the reason, not a bare
    404; another job's token still gets the 404 of an id that does not exist; a destroyed one says so."""
    tokens = TokenFile(tmp_path / "tokens.json")
    mine, theirs = tokens.create("trainer-1", job="j1"), tokens.create("trainer-2", job="j2")
    async with client_for(engine, NODE_TOKEN, tokens=tokens) as c:  # type: ignore[arg-type]
        job = {"Authorization": f"Bearer {mine}"}
        short = (await c.post("/v1/sandboxes", json={"image": "base", "timeout": 0.3}, headers=job)).json()["id"]
        gone = (await c.post("/v1/sandboxes", json={"image": "base"}, headers=job)).json()["id"]
        assert (await c.delete(f"/v1/sandboxes/{gone}", headers=job)).status_code == 204
        deadline = time.monotonic() + 20
        while (await c.get(f"/v1/sandboxes/{short}", headers=job)).status_code == 200:
            assert time.monotonic() < deadline, "the sandbox did not expire"
            await asyncio.sleep(0.05)
        for call in (c.get(f"/v1/sandboxes/{short}", headers=job),
                     c.post(f"/v1/sandboxes/{short}/exec/result", json={"command": "true"}, headers=job)):
            r = await call
            assert (r.status_code, r.json()["error"]["type"]) == (408, "SandboxTimeout"), r.text
            assert "timeout of 0.3 s" in r.json()["error"]["message"]
        r = await c.get(f"/v1/sandboxes/{gone}", headers=job)
        assert (r.status_code, r.json()["error"]["message"]) == (404, f"sandbox {gone} was destroyed")
        other = {"Authorization": f"Bearer {theirs}"}
        for sid in (short, gone):
            r = await c.get(f"/v1/sandboxes/{sid}", headers=other)
            assert (r.status_code, r.json()["error"]["message"]) == (404, f"no sandbox {sid!r}")
        assert (await c.delete(f"/v1/sandboxes/{short}", headers=job)).status_code == 204


async def test_node_refuses_a_stale_fence(engine: Engine, tmp_path: Path) -> None:
    """A create under an older lease epoch of a cell than the node has seen is refused (409 Fenced), and makes
    nothing; the fenced health of a takeover raises the floor; only the admin token may send a fence."""
    tokens = TokenFile(tmp_path / "tokens.json")
    job_token = tokens.create("trainer-1", job="j1")
    async with client_for(engine, NODE_TOKEN, tokens=tokens) as c:  # type: ignore[arg-type]
        c.headers["Authorization"] = f"Bearer {NODE_TOKEN}"
        assert (await c.post("/v1/sandboxes", json={"image": "base"}, headers={"X-DSec-Fence": "3:1"})).status_code \
            == 201
        assert (await c.get("/v1/health", headers={"X-DSec-Fence": "3:2"})).status_code == 200  # the new owner
        before = len(await engine.list())
        for path, body in (("/v1/sandboxes", {"image": "base"}),
                           ("/v1/sandboxes/batch", {"count": 2, "spec": {"image": "base"}})):
            r = await c.post(path, json=body, headers={"X-DSec-Fence": "3:1"})
            assert (r.status_code, r.json()["error"]["type"]) == (409, "Fenced"), r.text
            assert "epoch 2 on cell 3" in r.json()["error"]["message"]
        assert len(await engine.list()) == before
        # Another cell's epochs are its own; the current epoch still passes.
        for fence in ("4:1", "3:2"):
            assert (await c.post("/v1/sandboxes", json={"image": "base"},
                                 headers={"X-DSec-Fence": fence})).status_code == 201
        r = await c.post("/v1/sandboxes", json={"image": "base"}, headers={"X-DSec-Fence": "3"})
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")
        assert "'<cell>:<epoch>'" in r.json()["error"]["message"]
        r = await c.post("/v1/sandboxes", json={"image": "base"},
                         headers={"X-DSec-Fence": "3:99", "Authorization": f"Bearer {job_token}"})
        assert (r.status_code, r.json()["error"]["type"]) == (403, "Forbidden")
        del c.headers["Authorization"]
        assert (await c.get("/v1/health", headers={"X-DSec-Fence": "3:99"})).status_code == 401  # a fence needs it
        c.headers["Authorization"] = f"Bearer {NODE_TOKEN}"
        assert (await c.post("/v1/sandboxes", json={"image": "base"},
                             headers={"X-DSec-Fence": "3:2"})).status_code == 201  # nobody raised the floor


async def test_job_token_destroys_only_its_own_in_a_batch_destroy(engine: Engine, tmp_path: Path) -> None:
    tokens = TokenFile(tmp_path / "tokens.json")
    mine, theirs = tokens.create("trainer-1", job="j1"), tokens.create("trainer-2", job="j2")
    async with client_for(engine, NODE_TOKEN, tokens=tokens) as c:  # type: ignore[arg-type]
        job, other = {"Authorization": f"Bearer {mine}"}, {"Authorization": f"Bearer {theirs}"}
        a = (await c.post("/v1/sandboxes", json={"image": "base"}, headers=job)).json()["id"]
        b = (await c.post("/v1/sandboxes", json={"image": "base"}, headers=other)).json()["id"]
        # The token's job replaces any job the body names: j2's sandbox is "missing" to j1.
        r = await c.post("/v1/sandboxes/destroy", json={"ids": [a, b], "job": "j2"}, headers=job)
        assert r.status_code == 200, r.text
        assert r.json() == {"destroyed": [a], "missing": [b], "failed": {}}
        assert (await c.get(f"/v1/sandboxes/{b}", headers=other)).status_code == 200
        r = await c.post("/v1/sandboxes/destroy", json={"ids": [b, b]}, headers=other)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")
        assert "distinct" in r.json()["error"]["message"]
        r = await c.post("/v1/sandboxes/destroy", json={"ids": []}, headers=other)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "InvalidRequest")


async def test_a_streamed_batch_is_labelled_and_counted_for_the_tokens_job(engine: Engine, tmp_path: Path) -> None:
    tokens = TokenFile(tmp_path / "tokens.json")
    mine = tokens.create("trainer-1", job="j1", creates_per_s=2)
    async with client_for(engine, NODE_TOKEN, tokens=tokens) as c:  # type: ignore[arg-type]
        job = {"Authorization": f"Bearer {mine}"}
        body = {"count": 2, "spec": {"image": "base", "labels": {"dsec.job": "j2"}}}
        r = await c.post("/v1/sandboxes/batch/stream", json=body, headers=job)
        assert r.status_code == 200, r.text
        items = [json.loads(line) for line in r.text.splitlines()]
        assert [i["type"] for i in items] == ["sandbox", "sandbox", "done"]
        assert {i["sandbox"]["labels"]["dsec.job"] for i in items[:2]} == {"j1"}  # the token's job, not the body's
        r = await c.post("/v1/sandboxes/batch/stream", json=body, headers=job)  # over its 2 creates/s
        assert (r.status_code, r.json()["error"]["type"]) == (429, "RateLimited")
