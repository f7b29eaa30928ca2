"""Operator views: the audit trail, lifecycle events, the overview and the dashboard's static files."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest
from test_app import client_for, engine

from dsec.daemon.audit import AuditLog, AuditQuery, as_row
from dsec.daemon.auth import TokenFile
from dsec.daemon.engine import Engine
from dsec.daemon.events import EventBus
from dsec.errors import InvalidRequest
from dsec.models import AuditEntry, SandboxSpec

__all__ = ["engine"]  # the fixture, re-used from test_app


def entry(sandbox: str = "sb-1", **fields: object) -> tuple[object, ...]:
    base: dict[str, object] = {"at": time.time(), "sandbox_id": sandbox, "backend": "container", "who": "local",
                               "command": "true", "outcome": "ok", "exit_code": 0}
    return as_row(AuditEntry.model_validate({**base, **fields}))


# ----- the audit log itself ----------------------------------------------------------------------------


async def test_audit_ring_keeps_the_newest_rows(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.db", max_rows=5, flush_interval=3600)
    await audit.start()
    try:
        for i in range(12):
            audit.record(entry(command=["echo", str(i)]))
        assert audit.statistics()["pending"] == 12  # nothing written on the hot path
        got = await audit.query(AuditQuery(limit=100))
        assert [e.command for e in got] == [["echo", str(i)] for i in range(11, 6, -1)]
        assert audit.statistics() == {"pending": 0, "written": 12, "dropped": 0, "max_rows": 5}
    finally:
        await audit.aclose()
    rows = sqlite3.connect(tmp_path / "audit.db").execute("SELECT COUNT(*) FROM dsec_audit").fetchone()
    assert rows == (5,)


def _sqlite_memory() -> int:
    """Bytes SQLite holds in this process (its page caches most of them)."""
    import _sqlite3
    import ctypes

    used = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used
    used.restype = ctypes.c_int64
    return int(used())


async def test_the_audit_trails_page_cache_stays_small_as_its_file_grows(tmp_path: Path) -> None:
    """SQLite's default page cache (2 MiB a connection) fills as the file grows past it: a daemon's RSS would
    climb for its first minutes of load by that much per database."""
    audit = AuditLog(tmp_path / "audit.db", flush_interval=3600)
    await audit.start()
    try:
        before = _sqlite_memory()
        for i in range(6):
            for j in range(4000):
                audit.record(entry(command=["echo", f"{i}-{j}", "x" * 200]))
            await audit.flush()
        grown = _sqlite_memory() - before
    finally:
        await audit.aclose()
    assert (tmp_path / "audit.db").stat().st_size > 5 << 20  # (checkpointed at close)
    assert grown < 512 << 10, grown  # PAGE_CACHE_KIB (256), not the 2 MiB default


async def test_audit_flusher_writes_in_the_background_and_close_flushes(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.db", flush_interval=0.05)
    await audit.start()
    audit.record(entry("sb-a"))
    for _ in range(100):
        if audit.statistics()["written"] == 1:
            break
        await asyncio.sleep(0.02)
    assert audit.statistics()["written"] == 1
    audit.record(entry("sb-b"))
    await audit.aclose()  # the pending record is written, not lost
    reopened = AuditLog(tmp_path / "audit.db")
    await reopened.start()
    try:
        assert [e.sandbox_id for e in await reopened.query(AuditQuery())] == ["sb-b", "sb-a"]
    finally:
        await reopened.aclose()


async def test_audit_trail_is_private_to_the_daemons_user(tmp_path: Path) -> None:
    """Commands and the heads of their output: readable by nobody else, also when an older daemon left the file
    world-readable."""
    (tmp_path / "old.db").touch(mode=0o644)
    os.chmod(tmp_path / "old.db", 0o644)
    for name in ("audit.db", "old.db"):
        audit = AuditLog(tmp_path / name, flush_interval=0.05)
        await audit.start()
        try:
            audit.record(entry("sb-a"))
        finally:
            await audit.aclose()
        for suffix in ("", "-wal"):
            path = tmp_path / f"{name}{suffix}"
            if path.exists():
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def test_audit_pending_overflow_drops_oldest_and_counts(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.db", max_pending=3, flush_interval=3600)
    for i in range(5):
        audit.record(entry(f"sb-{i}"))
    assert audit.statistics()["dropped"] == 2
    await audit.start()
    try:
        assert [e.sandbox_id for e in await audit.query(AuditQuery())] == ["sb-4", "sb-3", "sb-2"]
    finally:
        await audit.aclose()


async def test_audit_write_failure_keeps_the_batch(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.db", flush_interval=3600)
    await audit.start()
    try:
        assert audit._db is not None
        audit._db.execute("DROP TABLE dsec_audit")  # the next write fails
        audit.record(entry())
        with pytest.raises(sqlite3.OperationalError):
            await audit.flush()
        assert audit.statistics()["pending"] == 1
    finally:
        audit._pending.clear()
        await audit.aclose()


def test_audit_bad_queries_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="between 1 and 10000"):
        AuditQuery(limit=0)
    with pytest.raises(InvalidRequest, match=r"since .* is after until"):
        AuditQuery(since=10, until=5)
    with pytest.raises(InvalidRequest, match="at least one row"):
        AuditLog(Path("/nonexistent/audit.db"), max_rows=0)


# ----- through the engine and the HTTP API ----------------------------------------------------------------


async def test_every_exec_is_audited_with_outcome_limit_and_output(engine: Engine) -> None:
    async with client_for(engine) as c:
        sid = (await c.post("/v1/sandboxes", json={"image": "base", "labels": {"dsec.job": "j1"}})).json()["id"]
        other = (await c.post("/v1/sandboxes", json={"image": "base"})).json()["id"]
        r = await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "echo hi; exit 3"})
        assert r.status_code == 200
        r = await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": ["sleep", "5"], "timeout": 0.2})
        assert r.json()["limit"] == "time"
        stream = await c.post(f"/v1/sandboxes/{other}/exec", json={"command": "printf out; printf err >&2"})
        assert stream.status_code == 200
        logs = (await c.get(f"/v1/sandboxes/{sid}/logs")).json()
        assert [(e["command"], e["outcome"], e["exit_code"], e["limit"]) for e in logs] == [
            (["sleep", "5"], "limit", 137, "time"), ("echo hi; exit 3", "nonzero", 3, None)]
        assert logs[1]["stdout"] == "hi\n" and logs[1]["who"] == "local" and logs[1]["job"] == "j1"
        assert logs[1]["duration_s"] > 0 and logs[0]["id"] > logs[1]["id"]
        everything = (await c.get("/v1/audit")).json()
        assert len(everything) == 3 and everything[0]["sandbox_id"] == other
        assert everything[0]["stdout"] == "out" and everything[0]["stderr"] == "err"
        assert [e["sandbox_id"] for e in (await c.get("/v1/audit", params={"job": "j1"})).json()] == [sid, sid]
        assert len((await c.get("/v1/audit", params={"outcome": "limit"})).json()) == 1
        assert len((await c.get("/v1/audit", params={"limit": 1})).json()) == 1
        paged = (await c.get("/v1/audit", params={"before": everything[0]["id"]})).json()
        assert [e["id"] for e in paged] == [e["id"] for e in everything[1:]]
        assert (await c.get("/v1/audit", params={"since": time.time() + 60})).json() == []
        # History outlives the sandbox; a sandbox that never existed is an error naming it.
        assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204
        assert len((await c.get(f"/v1/sandboxes/{sid}/logs")).json()) == 2
        missing = await c.get("/v1/sandboxes/sb-nope/logs")
        assert missing.status_code == 404 and "sb-nope" in missing.json()["error"]["message"]
        bad = await c.get("/v1/audit", params={"outcome": "bogus"})
        assert bad.status_code == 400 and "outcome" in bad.json()["error"]["message"]
        bad = await c.get("/v1/audit", params={"since": 9, "until": 1})
        assert bad.status_code == 400 and "after until" in bad.json()["error"]["message"]


async def test_audit_records_who_ran_it_per_token(engine: Engine, tmp_path: Path) -> None:
    tokens = TokenFile(tmp_path / "tokens.json")
    job_token = tokens.create("trainer-7", job="j7")
    async with client_for(engine, "adm1n", tokens=tokens) as c:  # type: ignore[arg-type]
        admin = {"Authorization": "Bearer adm1n"}
        job = {"Authorization": f"Bearer {job_token}"}
        sid = (await c.post("/v1/sandboxes", json={"image": "base"}, headers=job)).json()["id"]
        await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "true"}, headers=job)
        await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "false"}, headers=admin)
        logs = (await c.get(f"/v1/sandboxes/{sid}/logs", headers=job)).json()
        assert [(e["who"], e["job"]) for e in logs] == [("admin", "j7"), ("trainer-7", "j7")]
        # The node-wide trail, events and overview are admin views.
        assert (await c.get("/v1/audit", headers=job)).status_code == 403
        assert (await c.get("/v1/overview", headers=job)).status_code == 403
        assert (await c.get("/v1/audit")).status_code == 401
        assert len((await c.get("/v1/audit", headers=admin)).json()) == 2
        # The dashboard's files need no token (they hold no data); its API calls do.
        page = await c.get("/ui/")
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert (await c.get("/ui", follow_redirects=False)).headers["location"] == "/ui/"
        # a browser pointed at the daemon's address lands on the dashboard, not on a 401
        root = await c.get("/", headers={"Accept": "text/html"}, follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/ui/"
        assert (await c.get("/ui/dashboard.js")).headers["content-type"].startswith(("text/javascript",
                                                                                     "application/javascript"))


async def test_lifecycle_events_stream_and_resume(engine: Engine) -> None:
    received: list[dict[str, object]] = []
    async with client_for(engine) as c:
        sid = (await c.post("/v1/sandboxes", json={"image": "base", "labels": {"team": "rl"}})).json()["id"]
        await c.post(f"/v1/sandboxes/{sid}/pause")
        await c.post(f"/v1/sandboxes/{sid}/resume")
        await c.delete(f"/v1/sandboxes/{sid}")
        bad = await c.post("/v1/sandboxes", json={"image": "no-such-image"})
        assert bad.status_code == 404

        async def read() -> None:
            # The engine's stream (httpx's ASGI transport buffers whole responses; the CLI test reads the
            # HTTP stream from a real server).
            stream = engine.subscribe(0)
            try:
                async for event in stream:
                    received.append(event.model_dump(mode="json"))
                    if len(received) == 6:
                        return
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        sid2 = (await c.post("/v1/sandboxes", json={"image": "base"})).json()["id"]  # live, after the replay
        await asyncio.wait_for(reader, 10)
    kinds = [(e["kind"], e["sandbox_id"]) for e in received]
    assert kinds == [("created", sid), ("paused", sid), ("resumed", sid), ("destroyed", sid),
                     ("create_failed", None), ("created", sid2)]
    assert received[0]["labels"] == {"team": "rl"} and received[0]["backend"] == "container"
    assert "no-such-image" in str(received[4]["reason"]) and received[4]["image"] == "no-such-image"
    assert [e["seq"] for e in received] == sorted(e["seq"] for e in received)


async def test_a_slow_subscriber_gets_a_lagged_event_not_unbounded_memory() -> None:
    bus = EventBus("n1", queue_size=2)
    stream = bus.subscribe()
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    spec = SandboxSpec(image="base")
    for _ in range(5):
        bus.publish("create_failed", spec=spec, reason="x")
    assert (await first).seq == 1
    assert (await stream.__anext__()).seq == 2  # queued before the queue filled up
    lagged = await stream.__anext__()
    assert lagged.kind == "lagged" and lagged.detail["dropped"] == 3 and lagged.seq == 3
    bus.publish("create_failed", spec=spec, reason="x")
    assert (await stream.__anext__()).seq == 6
    await stream.aclose()
    assert bus.statistics()["subscribers"] == 0


async def test_overview_counts_creates_execs_failures_and_host_load(engine: Engine) -> None:
    async with client_for(engine) as c:
        sid = (await c.post("/v1/sandboxes", json={"image": "base"})).json()["id"]
        await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "true"})
        await c.post(f"/v1/sandboxes/{sid}/exec/result", json={"command": "exit 1"})
        await c.post("/v1/sandboxes", json={"image": "no-such-image"})
        o = (await c.get("/v1/overview")).json()
    assert o["created"] == 1 and o["exec_count"] == 2 and o["execs"] == {"ok": 1, "nonzero": 1}
    assert o["failures"] == {"ImageNotFound": 1}
    node = o["nodes"][0]
    assert node["sandboxes"] == 1 and node["by_backend"] == {"container": 1}
    assert len(node["load"]) == 3 and node["cpus"] >= 1 and 0 < node["memory_used_bytes"] < node["memory_total_bytes"]
    assert o["audit"]["max_rows"] > 0
    assert o["history"][-1]["exec_count"] == 2 and o["history"][-1]["created"] == 1
    assert o["history"][-1]["failures"] == 1


async def test_overview_history_is_sampled_and_bounded(engine: Engine) -> None:
    engine.observation.sampled_at = 0.0
    engine.observation.sample()
    engine.observation.sample()  # within SAMPLE_SECONDS of the first: not taken
    assert len(engine.observation.samples) == 1
    for _ in range(1000):
        engine.observation.sampled_at = 0.0
        engine.observation.sample()
    assert len(engine.observation.samples) == engine.observation.samples.maxlen
    history = (await engine.overview()).history
    assert len(history) == engine.observation.samples.maxlen + 1 and history[-1].at >= history[0].at
