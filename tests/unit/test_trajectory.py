"""Trajectory matching, logging, leases, checkpoints and recovery in the engine, over the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_engine import started

from container_support import await_until
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import (
    DaemonStopping,
    InvalidRequest,
    NotFound,
    ReplayDivergence,
    SandboxError,
    SandboxTimeout,
    StoreUnavailable,
)
from dsec.models import ExecRequest, SandboxSpec
from dsec.testing.fake import FakeBackend, FakeImages
from dsec.trajectory.replay import TrajectoryLog
from dsec.trajectory.store import Entry, SQLiteStore

COUNT = ExecRequest(command="echo run >> ran; wc -l < ran")


def make_engine(tmp_path: Path, fake: FakeBackend | None = None) -> Engine:
    settings = Settings(home=tmp_path / "home")
    return Engine(settings, {"container": fake or FakeBackend(root=tmp_path / "fake")}, FakeImages(),
                  reaper_interval=0.05)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with started(make_engine(tmp_path)) as eng:
        yield eng


def spec(name: str = "job-17/rollout-3", **kw: object) -> SandboxSpec:
    return SandboxSpec(image="base", trajectory=name, **kw)  # type: ignore[arg-type]


def ran(engine: Engine, sandbox_id: str) -> int:
    """How many times the counting command really ran (lines in its file, read on the host)."""
    root = Path(engine.records[sandbox_id].backend_state["root"])
    path = root / "workspace" / "ran"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_new_trajectory_binds_and_reopening_replays_in_order(engine: Engine) -> None:
    info = await engine.create(spec())
    assert info.trajectory is not None and info.trajectory.calls == 0
    first = await engine.exec(info.id, COUNT, seq=0)
    await engine.write_file(info.id, "/workspace/a.txt", b"hello", seq=1)
    assert await engine.read_file(info.id, "/workspace/a.txt", seq=2) == b"hello"
    listing = await engine.list_files(info.id, "/workspace", seq=3)
    assert ran(engine, info.id) == 1 and not first.replayed

    again = await engine.create(spec())
    assert again.id == info.id
    assert again.trajectory is not None and again.trajectory.calls == 4
    # Replayed: same answers, nothing runs (the file changed on the host, the replay still says "hello").
    (Path(engine.records[info.id].backend_state["root"]) / "workspace" / "a.txt").write_bytes(b"changed")
    replay = await engine.exec(info.id, COUNT, seq=0)
    assert replay.replayed and replay.stdout == first.stdout and ran(engine, info.id) == 1
    await engine.write_file(info.id, "/workspace/a.txt", b"hello", seq=1)
    assert await engine.read_file(info.id, "/workspace/a.txt", seq=2) == b"hello"
    assert await engine.list_files(info.id, "/workspace", seq=3) == listing
    # Past the end of the log: live again.
    live = await engine.exec(info.id, COUNT, seq=4)
    assert not live.replayed and live.stdout.strip() == b"2" and ran(engine, info.id) == 2


async def test_divergence_shows_both_calls_and_gaps_are_refused(engine: Engine) -> None:
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    with pytest.raises(ReplayDivergence) as caught:
        await engine.exec(info.id, ExecRequest(command="rm -rf /workspace"), seq=0)
    message = str(caught.value)
    assert "call 0" in message and "wc -l < ran" in message and "rm -rf /workspace" in message
    assert caught.value.detail["logged"]["args"]["command"] == COUNT.command
    with pytest.raises(ReplayDivergence):  # another operation at the same number diverges as well
        await engine.read_file(info.id, "/workspace/ran", seq=0)
    with pytest.raises(InvalidRequest, match="log has 1 calls"):
        await engine.exec(info.id, COUNT, seq=5)
    assert ran(engine, info.id) == 1


async def test_logged_errors_replay_as_errors(engine: Engine) -> None:
    info = await engine.create(spec())
    with pytest.raises(NotFound):
        await engine.read_file(info.id, "/workspace/missing", seq=0)
    await engine.write_file(info.id, "/workspace/missing", b"now here", seq=1)
    with pytest.raises(NotFound):  # the agent saw an error at call 0: a replay gives it again
        await engine.read_file(info.id, "/workspace/missing", seq=0)


async def test_client_gone_mid_exec_command_finishes_once_and_reissue_joins(engine: Engine) -> None:
    info = await engine.create(spec())
    slow = ExecRequest(command="echo started; sleep 0.5; echo run >> ran; echo done")
    stream = engine.exec_stream(info.id, slow, seq=0)
    first = await anext(aiter(stream))
    assert first.type == "stdout"
    await stream.aclose()  # the client died after the command started
    again = await engine.exec(info.id, slow, seq=0)  # its re-run re-issues call 0 while it still runs
    assert again.stdout == b"started\ndone\n" and again.replayed
    assert ran(engine, info.id) == 1
    later = await engine.exec(info.id, slow, seq=0)
    assert later.stdout == again.stdout and ran(engine, info.id) == 1


async def test_exec_in_flight_when_the_daemon_died_is_not_run_again(tmp_path: Path) -> None:
    fake = FakeBackend(root=tmp_path / "fake")
    first = make_engine(tmp_path, fake)
    await first.start()
    info = await first.create(spec())
    await first.exec(info.id, COUNT, seq=0)
    from dsec.trajectory.digest import call_identity, exec_args

    digest, readable = call_identity("exec", exec_args(COUNT))
    # What a daemon killed mid-command leaves: the request logged as running, no result.
    await first.trajectories.log.store.put_entry("job-17/rollout-3", Entry(seq=1, op="exec", digest=digest,
                                                                        request=readable))
    await first.aclose()  # a graceful stop keeps the sandbox for the next daemon
    second = make_engine(tmp_path, fake)
    await second.start()
    try:
        result = await second.exec(info.id, COUNT, seq=1)
        assert result.exit_code == 255 and b"outcome is" in result.stderr and result.replayed
        assert ran(second, info.id) == 1
        entry = (await second.trajectories.log.store.entries("job-17/rollout-3", 1, 1))[0]
        assert entry.status == "interrupted" and json.loads(entry.response or "{}")["exit_code"] == 255
    finally:
        await second.destroy_all()
        await second.aclose()


async def test_output_cap_is_recorded(engine: Engine) -> None:
    engine.trajectories.log.cap = 10
    info = await engine.create(spec())
    live = await engine.exec(info.id, ExecRequest(command="printf 0123456789abcdef"), seq=0)
    assert live.stdout == b"0123456789abcdef" and live.log_truncated
    replay = await engine.exec(info.id, ExecRequest(command="printf 0123456789abcdef"), seq=0)
    assert replay.stdout == b"0123456789" and replay.log_truncated and replay.replayed
    entry = (await engine.trajectories.log.store.entries("job-17/rollout-3"))[0]
    assert entry.truncated and entry.original_bytes == 16


async def test_lease_expires_without_calls(engine: Engine) -> None:
    info = await engine.create(spec(lease=0.3))
    await engine.exec(info.id, COUNT, seq=0)
    await asyncio.sleep(0.1)
    await engine.exec(info.id, COUNT, seq=1)  # activity renews the lease
    assert (await engine.get(info.id)).state == "running"
    for _ in range(100):
        if info.id not in engine.records:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(SandboxTimeout, match="lease"):
        await engine.get(info.id)


async def test_lost_sandbox_restores_checkpoint_and_reports_missing_effects(engine: Engine) -> None:
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    snap = await engine.snapshot(info.id, seq=1)
    await engine.exec(info.id, COUNT, seq=2)
    await engine.write_file(info.id, "/workspace/late.txt", b"late", seq=3)
    await engine.read_file(info.id, "/workspace/late.txt", seq=4)
    await engine.destroy(info.id)  # the sandbox is lost

    back = await engine.create(spec())
    assert back.id != info.id and back.trajectory is not None
    assert back.trajectory.restored_from == snap.snapshot
    assert back.trajectory.missing_effects == [2, 3]  # the exec and the write after the checkpoint
    assert ran(engine, back.id) == 1  # the checkpoint's state: one run, not two
    # The agent's view fast-forwards as before, including calls whose effects are missing.
    assert (await engine.exec(back.id, COUNT, seq=2)).stdout.strip() == b"2"
    assert (await engine.snapshot(back.id, seq=1)).snapshot == snap.snapshot
    await engine.destroy(back.id)

    rebuilt = await engine.create(spec(rerun_missing=True))
    assert rebuilt.trajectory is not None and rebuilt.trajectory.rerun == [2, 3]
    assert rebuilt.trajectory.missing_effects == []
    assert ran(engine, rebuilt.id) == 2
    assert await engine.read_file(rebuilt.id, "/workspace/late.txt", seq=4) == b"late"


async def test_a_lost_sandbox_forgotten_while_its_trajectory_is_reopened_leaves_the_new_one_bound(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lost sandbox's removal finishing while a re-open rebuilds its trajectory must not drop the
    trajectory the re-open just loaded: the new sandbox would answer unbound, and the agent's calls would
    run outside its log."""
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    old = engine.find_record(info.id)
    assert old is not None
    await engine.destroy(info.id)  # lost
    real = engine.create_unpooled

    async def racing(*args: object, **kwargs: object) -> object:
        engine.trajectories.forget(old)  # the lost sandbox's removal, done as the rebuild runs
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "create_unpooled", racing)
    back = await engine.create(spec())
    assert back.trajectory is not None and back.trajectory.missing_effects == [0]
    assert (await engine.exec(back.id, COUNT, seq=0)).replayed
    assert (await engine.get(back.id)).trajectory is not None


async def test_a_rebuild_that_fails_or_is_cut_off_half_way_keeps_no_sandbox(engine: Engine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost trajectory sandbox is rebuilt in steps (create, re-run, bind); one that fails or is cut off
    (the daemon stopping) after the create destroys what it built: an unbound sandbox would stay, and a
    retry (or a cluster gateway placing the create on another node) would build a second one."""
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    await engine.destroy(info.id)  # lost
    store = engine.trajectories.log.store
    real_bind, real_entries = store.put_binding, store.entries

    async def unbindable(*args: object, **kwargs: object) -> None:
        raise OSError("the log's disk is gone")

    monkeypatch.setattr(store, "put_binding", unbindable)
    with pytest.raises(OSError, match="disk is gone"):
        await engine.create(spec())
    assert await engine.list() == []
    monkeypatch.setattr(store, "put_binding", real_bind)

    async def cut_off(*args: object, **kwargs: object) -> object:
        raise asyncio.CancelledError  # what the server's graceful timeout does to a call in flight

    monkeypatch.setattr(store, "entries", cut_off)
    with pytest.raises(asyncio.CancelledError):
        await engine.create(spec(rerun_missing=True))
    assert await engine.list() == []
    monkeypatch.setattr(store, "entries", real_entries)
    back = await engine.create(spec(rerun_missing=True))
    assert back.trajectory is not None and back.trajectory.rerun == [0]
    assert [i.id for i in await engine.list()] == [back.id]


async def test_a_fork_the_daemon_stops_under_is_refused_and_keeps_nothing(engine: Engine) -> None:
    """A fork with a copy still queued when the daemon begins stopping answers DaemonStopping; the copies it
    had made are retired, and the fork's snapshot goes with the last of them."""
    from dsec.daemon.admission import Admission

    info = await engine.create(SandboxSpec(image="base"))
    engine.admission = Admission(1, shortage=lambda: None)
    fake = engine.backends.loaded["container"]
    assert isinstance(fake, FakeBackend)
    original, gate, restores = fake.restore, asyncio.Event(), []

    async def gated(record, image, layers):  # type: ignore[no-untyped-def]
        restores.append(record.id)
        if len(restores) == 2:  # the second copy holds the one create slot; the third queues behind it
            await gate.wait()
        await original(record, image, layers)

    fake.restore = gated  # type: ignore[method-assign]
    fork = asyncio.create_task(engine.fork(info.id, 3))
    assert await await_until(lambda: len(restores) == 2 and engine.admission.statistics().waiting == 1)
    engine.drain("the test stops the daemon")
    gate.set()
    with pytest.raises(DaemonStopping, match=rf"fork of {info.id} x3 refused: the test stops the daemon; the 2 "
                                             "sandboxes it had made are destroyed again"):
        await fork
    assert [i.id for i in await engine.list()] == [info.id]
    await engine.wait_teardowns()
    assert engine.snapshots.images.snapshot_ids() == []  # dropped with the last retired copy
    assert len(restores) == 2  # the refused copy never reached the backend


async def test_a_stopping_daemon_still_reattaches_a_live_trajectory_but_builds_none(engine: Engine) -> None:
    """Re-attaching to a trajectory's live sandbox makes nothing, so a draining daemon answers it; opening a
    new trajectory needs a create and is refused."""
    first = await engine.create(spec("job-1/rollout-1"))
    engine.drain("the test stops the daemon")
    assert (await engine.create(spec("job-1/rollout-1"))).id == first.id
    with pytest.raises(DaemonStopping, match="create refused: the test stops the daemon"):
        await engine.create(spec("job-1/rollout-2"))


async def test_a_fork_refused_before_any_copy_drops_its_snapshot(engine: Engine) -> None:
    """The daemon began stopping while the fork took its snapshot: no copy is made, and the snapshot, which
    no copy's teardown would drop, goes at once."""
    info = await engine.create(SandboxSpec(image="base"))
    take = engine.take_snapshot

    async def then_stop(record, ephemeral=False):  # type: ignore[no-untyped-def]
        snap = await take(record, ephemeral=ephemeral)
        engine.drain("the test stops the daemon")
        return snap

    engine.take_snapshot = then_stop  # type: ignore[method-assign]
    with pytest.raises(DaemonStopping, match=rf"fork of {info.id} x2 refused: the test stops the daemon$"):
        await engine.fork(info.id, 2)
    assert engine.snapshots.images.snapshot_ids() == []
    assert [i.id for i in await engine.list()] == [info.id]


async def test_fork_copies_are_independent(engine: Engine) -> None:
    info = await engine.create(SandboxSpec(image="base"))
    await engine.write_file(info.id, "/workspace/x", b"parent")
    kids = await engine.fork(info.id, 3)
    assert len({k.id for k in kids}) == 3 and all(k.trajectory is None for k in kids)
    await engine.write_file(kids[0].id, "/workspace/x", b"kid0")
    assert [await engine.read_file(k.id, "/workspace/x") for k in kids] == [b"kid0", b"parent", b"parent"]
    assert await engine.read_file(info.id, "/workspace/x") == b"parent"
    (snap,) = engine.snapshots.images.snapshot_ids()  # fork's own snapshot, shared by the three copies
    assert {(await engine.get(k.id)).spec.snapshot for k in kids} == {snap}
    for k in kids[:2]:
        await engine.destroy(k.id)
    assert engine.snapshots.images.snapshot_ids() == [snap]  # still used by the last copy
    await engine.destroy(kids[2].id)
    assert engine.snapshots.images.snapshot_ids() == []  # gone with its last copy


async def test_sqlite_store_group_commits_and_survives_reopen(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "log.db", sync="full")
    await store.start()
    await asyncio.gather(*(store.put_entry("t", Entry(seq=i, op="exec", digest=str(i), request="{}"))
                           for i in range(200)))
    stats = store.statistics()
    assert stats["writes"] >= 200 and stats["commits"] < stats["writes"]
    await store.aclose()
    again = TrajectoryLog(SQLiteStore(tmp_path / "log.db"))
    await again.store.start()
    try:
        assert [e.seq for e in await again.store.entries("t")] == list(range(200))
    finally:
        await again.store.aclose()
    with pytest.raises(ValueError, match="sync"):
        SQLiteStore(tmp_path / "x.db", sync="sometimes")


@pytest.mark.parametrize("private", [True, False], ids=["home-file", "named-file"])
async def test_sqlite_log_is_created_private_and_a_named_shared_file_keeps_its_mode(
        tmp_path: Path, private: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The log holds every command and its output: a new file is 0600 either way; an existing readable one is
    made 0600 when it is the home's own file, and kept (with a warning naming it) when the operator named it."""
    new, old = tmp_path / "new.db", tmp_path / "old.db"
    old.touch()
    old.chmod(0o644)
    for path in (new, old):
        store = SQLiteStore(path, private=private)
        await store.start()
        await store.put_entry("t", Entry(seq=0, op="exec", digest="d", request="{}"))
        await store.aclose()
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    assert stat.S_IMODE(old.stat().st_mode) == (0o600 if private else 0o644)
    warned = [r.getMessage() for r in caplog.records if "mode 0644" in r.getMessage()]
    assert warned == ([] if private else [f"trajectory log {old} is mode 0644: other users can read or change every "
                                          "logged command and its output (chmod 600 it unless it is shared on "
                                          "purpose)"])


async def test_branch_rebuilds_to_the_branch_point(engine: Engine) -> None:
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    await engine.snapshot(info.id, seq=1)
    await engine.exec(info.id, COUNT, seq=2)
    await engine.exec(info.id, COUNT, seq=3)
    branch = await engine.trajectories.branch("job-17/rollout-3", 3, rerun_missing=False)
    assert branch.trajectory is not None and branch.trajectory.missing_effects == [2]
    assert branch.trajectory.calls == 3 and ran(engine, branch.id) == 1
    rebuilt = await engine.trajectories.branch("job-17/rollout-3", 3, rerun_missing=True)
    assert rebuilt.trajectory is not None and rebuilt.trajectory.rerun == [2]
    assert ran(engine, rebuilt.id) == 2 and ran(engine, info.id) == 3
    # The branch replays the shared prefix and diverges from the original after it.
    assert (await engine.exec(rebuilt.id, COUNT, seq=2)).replayed
    assert not (await engine.exec(rebuilt.id, ExecRequest(command="true"), seq=3)).replayed
    with pytest.raises(InvalidRequest, match="log has 4 calls"):
        await engine.trajectories.branch("job-17/rollout-3", 9, rerun_missing=False)


async def test_responses_are_logged_in_the_next_batch_and_every_read_sees_them(tmp_path: Path) -> None:
    import sqlite3

    store = SQLiteStore(tmp_path / "log.db")
    await store.start()
    outside = sqlite3.connect(tmp_path / "log.db")

    def committed() -> list[tuple[int, str]]:
        return outside.execute("SELECT seq, status FROM dsec_calls WHERE name = 'b' ORDER BY seq").fetchall()

    try:
        await store.put_entry("b", Entry(seq=0, op="exec", digest="d0", request="{}"), durable=True)
        assert committed() == [(0, "running")]  # durable: committed before the call runs
        done = Entry(seq=0, op="exec", digest="d0", request="{}", status="done", response="{}")
        await store.put_entry("b", done, durable=False)
        assert committed() == [(0, "running")]  # the response waits for the next batch...
        assert [e.status for e in await store.entries("b")] == ["done"]  # ...but a read of the log sees it
        await store.put_entry("b", done, durable=False)
        await asyncio.sleep(store.defer_s * 3)
        assert committed() == [(0, "done")]  # and with no further call it lands within defer_s
        await store.put_entry("b", Entry(seq=1, op="exec", digest="d1", request="{}", status="done",
                                         response="{}"), durable=False)
        await store.put_entry("b", Entry(seq=2, op="exec", digest="d2", request="{}"), durable=True)
        assert committed() == [(0, "done"), (1, "done"), (2, "running")]  # one commit, in order
        assert store.statistics() == {"commits": 4, "writes": 5}
    finally:
        outside.close()
        await store.aclose()


async def _lose_answer(engine: Engine, name: str, seq: int) -> None:
    """What a daemon killed inside the deferred-response window (or a failed write of the log) leaves: the
    call logged as running, with no answer."""
    store = engine.trajectories.log.store
    entry = await store.entry(name, seq)
    entry.status, entry.response = "running", None
    await store.put_entry(name, entry, durable=True)


async def test_an_interrupted_write_is_not_run_again_once_later_calls_ran(tmp_path: Path) -> None:
    """Call 0 (a write) lost its answer when the daemon died; the live client went on. A replay of call 0 must
    not write "old" over what later calls wrote: it answers that the outcome is unknown. The log's last call,
    idempotent, still runs again."""
    fake = FakeBackend(root=tmp_path / "fake")
    first = make_engine(tmp_path, fake)
    await first.start()
    info = await first.create(spec())
    await first.write_file(info.id, "/workspace/f", b"old", seq=0)
    await first.exec(info.id, ExecRequest(command="echo new > f"), seq=1)
    await first.write_file(info.id, "/workspace/g", b"last", seq=2)
    for seq in (0, 2):
        await _lose_answer(first, "job-17/rollout-3", seq)
    await first.aclose()
    second = make_engine(tmp_path, fake)
    await second.start()
    workspace = Path(second.records[info.id].backend_state["root"]) / "workspace"
    try:
        with pytest.raises(SandboxError, match="later calls have run since: its outcome is unknown"):
            await second.write_file(info.id, "/workspace/f", b"old", seq=0)
        assert (workspace / "f").read_bytes() == b"new\n", "a replayed write undid a later call"
        with pytest.raises(SandboxError, match="its outcome is unknown"):  # and so it stays
            await second.write_file(info.id, "/workspace/f", b"old", seq=0)
        assert (await second.exec(info.id, ExecRequest(command="echo new > f"), seq=1)).replayed
        (workspace / "g").write_bytes(b"changed")
        await second.write_file(info.id, "/workspace/g", b"last", seq=2)  # the last call: run again
        assert (workspace / "g").read_bytes() == b"last"
    finally:
        await second.destroy_all()
        await second.aclose()


async def test_an_exec_whose_answer_was_not_logged_is_not_run_again(engine: Engine) -> None:
    """The daemon ran call 0 and answered it, but the log never got the answer (its write failed): memory says
    done, the log says running. A re-issue must not run the command a second time."""
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    await _lose_answer(engine, "job-17/rollout-3", 0)
    again = await engine.exec(info.id, COUNT, seq=0)
    assert again.exit_code == 255 and b"its outcome is unknown" in again.stderr, again
    assert ran(engine, info.id) == 1


async def test_a_call_reissued_while_it_is_being_logged_joins_the_first(engine: Engine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow durable write of the call's request (PostgreSQL, a failover): the client dies and re-issues the
    same call meanwhile. The re-issue joins the first run, which runs once, and gets its result; if the write
    fails instead, both get the error, nothing runs, and the call can be issued again."""
    info = await engine.create(spec())
    store = engine.trajectories.log.store
    real = store.put_entry
    fail: list[BaseException] = []

    async def slow(name: str, entry: Entry, durable: bool = True) -> None:
        if durable and entry.status == "running":
            await asyncio.sleep(0.3)
            if fail:
                raise fail[0]
        await real(name, entry, durable=durable)

    monkeypatch.setattr(store, "put_entry", slow)
    first = asyncio.create_task(engine.exec(info.id, COUNT, seq=0))
    await asyncio.sleep(0.05)
    second = await engine.exec(info.id, COUNT, seq=0)
    assert (await first).stdout == second.stdout == b"1\n" and second.replayed
    assert ran(engine, info.id) == 1
    fail.append(StoreUnavailable("the trajectory log is unreachable"))
    first = asyncio.create_task(engine.exec(info.id, COUNT, seq=1))
    await asyncio.sleep(0.05)
    with pytest.raises(StoreUnavailable):
        await engine.exec(info.id, COUNT, seq=1)
    with pytest.raises(StoreUnavailable):
        await first
    assert ran(engine, info.id) == 1
    fail.clear()
    assert (await engine.exec(info.id, COUNT, seq=1)).stdout == b"2\n"


async def test_a_logged_call_failing_with_a_bug_is_a_named_error(engine: Engine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend bug under a logged files call is a SandboxError naming it (as under an exec), not a raw
    exception (an HTTP 500 without the error payload); the call is logged as interrupted."""
    info = await engine.create(spec())
    fake = engine.backends.loaded["container"]

    async def broken(*_args: object, **_kw: object) -> None:
        raise RuntimeError("disk driver bug")

    monkeypatch.setattr(fake, "write_file", broken)
    with pytest.raises(SandboxError, match="write failed: RuntimeError: disk driver bug"):
        await engine.write_file(info.id, "/workspace/f", b"x", seq=0)
    assert (await engine.trajectories.log.store.entry("job-17/rollout-3", 0)).status == "interrupted"


async def test_a_node_that_only_answered_a_log_fetch_rebuilds_from_the_current_log(tmp_path: Path) -> None:
    """Cluster mode: one log, several nodes. Node C answered a log fetch (the gateway sends it to any node)
    while node A owned the trajectory; A logged on, then died, and the job resumed on C. C must rebuild from
    the log as it is then: it kept its early copy, so the calls A logged since ran again."""
    shared = tmp_path / "log.db"

    def node(name: str) -> Engine:
        settings = Settings(home=tmp_path / name)
        return Engine(settings, {"container": FakeBackend(root=tmp_path / f"{name}-fake")}, FakeImages(),
                      reaper_interval=0.05, trajectory_store=SQLiteStore(shared))

    a, c = node("a"), node("c")
    async with started(a), started(c):
        info = await a.create(spec())
        for seq in range(2):
            await a.exec(info.id, COUNT, seq=seq)
        assert len(await c.trajectories.log.logged("job-17/rollout-3", 0, 100)) == 2
        for seq in range(2, 5):
            await a.exec(info.id, COUNT, seq=seq)
        await asyncio.sleep(a.trajectories.log.store.defer_s * 3)  # the last answer's batch lands
        # A is lost; the job re-opens its trajectory and the gateway places it on C.
        rebuilt = await c.create(spec())
        assert rebuilt.id != info.id and rebuilt.trajectory is not None and rebuilt.trajectory.calls == 5
        replayed = await c.exec(rebuilt.id, COUNT, seq=4)
        assert replayed.replayed and replayed.stdout == b"5\n" and ran(c, rebuilt.id) == 0
        await c.destroy_all()
        await a.destroy_all()


async def test_a_branch_counts_a_call_copied_while_running_as_missing(engine: Engine) -> None:
    """A call still ``running`` in the source's log when a branch copies it (a dead daemon's, or another node's
    in flight) runs nowhere on the branch: the branch lists it among the effects its sandbox lacks, and the
    source's own log is left alone."""
    info = await engine.create(spec())
    await engine.exec(info.id, COUNT, seq=0)
    await engine.exec(info.id, COUNT, seq=1)
    await _lose_answer(engine, "job-17/rollout-3", 1)
    branch = await engine.trajectories.branch("job-17/rollout-3", 2, rerun_missing=False)
    assert branch.trajectory is not None and branch.trajectory.missing_effects == [0, 1], branch.trajectory
    store = engine.trajectories.log.store
    assert (await store.entry(branch.trajectory.name, 1)).status == "interrupted"
    assert (await store.entry("job-17/rollout-3", 1)).status == "running"


async def test_sqlite_store_lists_ends_and_deletes(tmp_path: Path) -> None:
    from trajectory_support import check_list_end_and_delete

    for sync in ("normal", "full"):  # inline commits and the writer thread
        store = SQLiteStore(tmp_path / f"{sync}.db", sync=sync)
        await store.start()
        try:
            await check_list_end_and_delete(store)
        finally:
            await store.aclose()


async def test_a_deferred_answer_is_kept_through_a_failed_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """A call's answer is a deferred write, committed with the next durable one; when that commit fails (a store
    turned read-only, a full disk) the answer must wait for the next commit, not vanish with the failed one (the
    call then read as running, and as interrupted after a restart, though it had finished)."""
    import sqlite3

    store = SQLiteStore(tmp_path / "t.db")
    await store.start()
    try:
        await store.put_entry("t", Entry(seq=0, op="exec", digest="d0", request="{}"), durable=True)
        await store.put_entry("t", Entry(seq=0, op="exec", digest="d0", request="{}", status="done", response="{}"),
                              durable=False)
        works = store._apply

        def fails(ops: object) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(store, "_apply", fails)
        with pytest.raises(SandboxError, match="disk I/O error"):
            await store.put_entry("t", Entry(seq=1, op="exec", digest="d1", request="{}"), durable=True)
        assert await store.probe("node") is not None
        monkeypatch.setattr(store, "_apply", works)
        assert await store.probe("node") is None
        assert [(e.seq, e.status) for e in await store.entries("t")] == [(0, "done")]
    finally:
        await store.aclose()


async def test_a_deferred_answer_whose_commit_fails_is_the_next_readers_error(tmp_path: Path) -> None:
    """SQLite (inline commits): an answer logged without waiting whose commit fails (the database turned
    read-only) is the error of the next caller that waits on the log -- a read -- not only a log line; it is
    committed once the database takes writes again."""
    store = SQLiteStore(tmp_path / "t.db")
    await store.start()
    answer = Entry(seq=0, op="exec", digest="a", request="{}", status="done", response='{"exit_code": 0}')
    try:
        await store.put_entry("t", Entry(seq=0, op="exec", digest="a", request="{}"))
        assert store._write_conn is not None
        store._write_conn.execute("PRAGMA query_only = ON")  # SQLite refuses every write on it from now on
        await store.put_entry("t", answer, durable=False)  # answered before its commit
        with pytest.raises(SandboxError, match="readonly"):
            await store.barrier()
        with pytest.raises(SandboxError, match="readonly"):  # still failing: the read waiting on it says so too
            await store.entries("t")
        store._write_conn.execute("PRAGMA query_only = OFF")
        entries = await store.entries("t")
        assert [(e.seq, e.status, e.response) for e in entries] == [(0, "done", '{"exit_code": 0}')]
    finally:
        await store.aclose()


def _hold_writes(monkeypatch: pytest.MonkeyPatch, engine: Engine, path: str) -> asyncio.Event:
    """Writes of ``path`` hang until the returned event is set (a call in flight as long as a test needs)."""
    fake = engine.backends.loaded["container"]
    real = fake.write_file
    release = asyncio.Event()

    async def held(record: object, target: str, *args: object, **kwargs: object) -> None:
        if target == path:
            await release.wait()
            return
        await real(record, target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fake, "write_file", held)
    return release


def _loaded(engine: Engine, name: str = "job-17/rollout-3") -> bool:
    """Whether anything of ``name`` stays in the daemon's memory (the trajectory, its open or load lock)."""
    binding = engine.trajectories
    return (binding.log.by_name(name) is not None or name in binding._opening
            or name in binding.log._loading)


async def test_a_trajectory_whose_sandbox_goes_with_a_call_in_flight_is_forgotten_when_it_lands(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox's removal keeps a trajectory with a call in flight loaded (the call still logs into it);
    nothing forgot it after, so a daemon kept every such trajectory (digests, statuses, ops) for good."""
    info = await engine.create(spec())
    release = _hold_writes(monkeypatch, engine, "/workspace/slow")
    call = asyncio.create_task(engine.write_file(info.id, "/workspace/slow", b"x", seq=0))
    t = engine.trajectories.log.by_name("job-17/rollout-3")
    assert t is not None and await await_until(lambda: bool(t.flights))
    await engine.destroy(info.id)
    assert engine.trajectories.log.by_name("job-17/rollout-3") is t  # its call still lands here
    release.set()
    with contextlib.suppress(Exception):
        await call
    await asyncio.sleep(0)  # (the landing's callbacks)
    assert not _loaded(engine)
    # Kept while its sandbox lives: a call that lands then forgets nothing.
    info = await engine.create(spec())
    await engine.write_file(info.id, "/workspace/a", b"a", seq=1)
    assert engine.trajectories.log.by_name("job-17/rollout-3") is not None
    await engine.destroy(info.id)
    assert not _loaded(engine)


async def test_a_call_still_running_when_its_lost_sandbox_is_rebuilt_is_an_effect_counted(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-open rebuilding a lost sandbox while a call on the old one is still being logged counted that call
    neither as re-run nor as missing: its effect was dropped without a word. The rebuild waits for it (bounded):
    landed, it is re-run if asked; still running, it is reported missing (and not run a second time)."""
    info = await engine.create(spec())
    await engine.write_file(info.id, "/workspace/a", b"a", seq=0)
    release = _hold_writes(monkeypatch, engine, "/workspace/slow")
    call = asyncio.create_task(engine.write_file(info.id, "/workspace/slow", b"x", seq=1))
    t = engine.trajectories.log.by_name("job-17/rollout-3")
    assert t is not None and await await_until(lambda: bool(t.flights))
    await engine.destroy(info.id)  # lost with call 1 in flight
    monkeypatch.setattr("dsec.daemon.trajectories._FLIGHT_WAIT", 0.2)
    back = await engine.create(spec(rerun_missing=True))
    assert back.trajectory is not None
    assert back.trajectory.rerun == [0] and back.trajectory.missing_effects == [1]
    release.set()
    with contextlib.suppress(Exception):
        await call
    await engine.destroy(back.id)

    # Landing during the wait: the call counts as done, and is re-run with the others.
    release.clear()
    info = await engine.create(spec())
    call = asyncio.create_task(engine.write_file(info.id, "/workspace/slow", b"y", seq=2))
    t = engine.trajectories.log.by_name("job-17/rollout-3")
    assert t is not None and await await_until(lambda: bool(t.flights))
    await engine.destroy(info.id)
    monkeypatch.setattr("dsec.daemon.trajectories._FLIGHT_WAIT", 10.0)
    asyncio.get_running_loop().call_later(0.2, release.set)
    back = await engine.create(spec(rerun_missing=True))
    await call
    assert back.trajectory is not None
    assert back.trajectory.rerun == [0, 1, 2] and back.trajectory.missing_effects == []  # (call 1 landed by now)
    await engine.destroy(back.id)


async def test_a_failed_open_or_delete_keeps_no_lock_for_its_name(engine: Engine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An open whose create fails, a rebuild that fails, a delete or end of an unknown name: each left the
    name's locks (and a failed rebuild its trajectory) in memory for good."""
    real = engine.create_unpooled

    async def failing(*args: object, **kwargs: object) -> object:
        raise SandboxError("no capacity")

    monkeypatch.setattr(engine, "create_unpooled", failing)
    with pytest.raises(SandboxError, match="no capacity"):
        await engine.create(spec())
    assert not _loaded(engine)
    for drop in (engine.trajectories.delete, engine.trajectories.end):
        with pytest.raises(NotFound):
            await drop("job-17/rollout-3")
        assert not _loaded(engine)

    monkeypatch.setattr(engine, "create_unpooled", real)
    info = await engine.create(spec())
    await engine.write_file(info.id, "/workspace/a", b"a", seq=0)
    await engine.destroy(info.id)
    assert not _loaded(engine)
    monkeypatch.setattr(engine, "create_unpooled", failing)
    with pytest.raises(SandboxError, match="no capacity"):
        await engine.create(spec())  # its rebuild fails
    assert not _loaded(engine)
    monkeypatch.setattr(engine, "create_unpooled", real)
    back = await engine.create(spec())
    assert back.trajectory is not None and back.trajectory.missing_effects == [0]
    await engine.trajectories.delete("job-17/rollout-3")
    assert not _loaded(engine)
