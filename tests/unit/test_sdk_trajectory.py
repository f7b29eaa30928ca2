"""The SDK's side of trajectories, over the real HTTP app: numbering, local fast-forward, divergence."""

from __future__ import annotations

import asyncio
import gc
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec.models import ExecRequest


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(Path(tmp_path_factory.mktemp("sdk-traj"))) as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[dsec.Client]:
    async with dsec.Client(daemon.unix_url) as c:
        yield c


async def rollout(sb: dsec.AsyncSandbox) -> list[object]:
    """A small agent episode: what it saw, in order."""
    seen: list[object] = []
    seen.append((await sb.exec("echo x >> ran; wc -l < ran")).stdout)
    await sb.files.write("/workspace/notes.txt", "step 1", mode=0o600)
    seen.append(await sb.files.read("/workspace/notes.txt"))
    seen.append(sorted(e.name for e in await sb.files.list()))
    events = [e async for e in sb.exec_stream(["sh", "-c", "echo out; echo err >&2"])]
    seen.append([(e.type, e.data) for e in events if e.type != "exit"])
    seen.append(await sb.snapshot())
    return seen


async def test_rerun_fast_forwards_locally_then_runs_live(client: dsec.Client) -> None:
    first = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/ff", client=client)
    try:
        original = await rollout(first)
        again = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/ff", client=client)
        assert again.id == first.id and again._cursor is not None
        assert await rollout(again) == original
        assert again._cursor.served == 6  # every call answered from the log copy, none sent
        assert (await again.exec("wc -l < ran")).stdout.strip() == b"1"  # the count ran once
        info = await again.info()
        assert info.trajectory is not None and info.trajectory.calls == 7
    finally:
        await first.close()


async def test_divergence_reaches_the_client_with_both_calls(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/div", client=client)
    try:
        await sb.exec("echo one")
        replay = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/div", client=client)
        with pytest.raises(dsec.ReplayDivergence, match="echo one") as caught:
            await replay.exec("echo two")
        assert "echo two" in str(caught.value) and caught.value.detail["seq"] == 0
    finally:
        await sb.close()


def test_blocking_sandbox_replays_too(daemon: Daemon) -> None:
    client = dsec.Client(daemon.unix_url)
    try:
        sb = dsec.Sandbox.create(image="tiny", trajectory="sdk/sync", client=client)
        first = sb.exec("echo x >> ran; wc -l < ran")
        again = dsec.Sandbox.create(image="tiny", trajectory="sdk/sync", client=client)
        replay = again.exec("echo x >> ran; wc -l < ran")
        assert replay.replayed and replay.stdout == first.stdout == b"1\n"
        kids = sb.fork(2)
        assert [k.exec("wc -l < ran").stdout for k in kids] == [b"1\n", b"1\n"]
        for k in kids:
            k.close()
        sb.close()
    finally:
        client.close()


async def test_trajectory_refusals(client: dsec.Client) -> None:
    with pytest.raises(dsec.InvalidRequest, match="either trajectory or snapshot"):
        await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/x", snapshot="snap-0123456789abcdef",
                                       client=client)
    with pytest.raises(dsec.InvalidRequest, match="one at a time"):
        await dsec.AsyncSandbox.create_many(2, image="tiny", trajectory="sdk/y", client=client)
    with pytest.raises(dsec.InvalidRequest, match="lease"):
        await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/z", lease=0, client=client)
    await asyncio.sleep(0)


async def test_on_divergence_fork_branches_at_the_last_matching_call(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/branch", client=client)
    try:
        await sb.exec("echo base > state")
        snap = await sb.snapshot()
        await sb.exec("echo a >> state")
        await sb.exec("echo a2 >> state")
        other = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/branch", on_divergence="fork",
                                               rerun_missing=True, client=client)
        await other.exec("echo base > state")  # calls 0 and 1 match: replayed
        assert await other.snapshot() == snap
        assert other.id == sb.id
        result = await other.exec("echo b >> state; cat state")  # call 2 differs: the handle branches
        assert result.stdout == b"base\nb\n" and not result.replayed
        info = await other.info()
        assert other.id != sb.id and info.trajectory is not None
        assert info.trajectory.forked_from == "sdk/branch" and info.trajectory.fork_point == 2
        assert info.trajectory.name.startswith("sdk/branch~2-") and info.trajectory.calls == 3
        # The original trajectory and its sandbox are untouched.
        assert (await sb.exec("cat state")).stdout == b"base\na\na2\n"
        await other.close()
    finally:
        await sb.close()


async def test_a_diverging_pristine_stream_keeps_pristine_on_the_branch(client: dsec.Client) -> None:
    """A grader's ``exec_stream(..., pristine=True)`` that diverges is sent on the branch as it was asked: the
    retry dropped ``pristine``, so the grader ran on the agent's modified root."""
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/pristine-branch", client=client)
    try:
        await sb.exec("echo a > state")
        other = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/pristine-branch", on_divergence="fork",
                                               client=client)
        events = [e async for e in other.exec_stream(["cat", "state"], pristine=True)]
        assert events[-1].type == "exit" and other.id != sb.id
        info = await other.info()
        assert info.trajectory is not None
        page = await client.api.trajectory_log(info.trajectory.name, 0, 10)
        calls = [json.loads(c.request) for c in page]
        assert calls[-1]["args"]["command"] == ["cat", "state"], calls
        assert calls[-1]["args"].get("pristine") is True, calls[-1]
        await other.close()
    finally:
        await sb.close()


async def test_a_diverging_files_call_branches_and_is_sent_on_the_branch(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/files-branch", client=client)
    try:
        await sb.files.write("/work/notes.txt", "base\n")
        await sb.files.write("/work/notes.txt", "agent a\n")
        other = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/files-branch", on_divergence="fork",
                                               rerun_missing=True, client=client)
        await other.files.write("/work/notes.txt", "base\n")  # call 0 matches: replayed
        assert other.id == sb.id
        await other.files.write("/work/notes.txt", "agent b\n")  # call 1 differs: the handle branches, then writes
        assert other.id != sb.id
        assert await other.files.read("/work/notes.txt") == b"agent b\n"
        info = await other.info()
        assert info.trajectory is not None and info.trajectory.fork_point == 1 and info.trajectory.calls == 3
        assert await sb.files.read("/work/notes.txt") == b"agent a\n"  # the original is untouched
        await other.close()
    finally:
        await sb.close()


async def test_unknown_divergence_policy_is_refused(client: dsec.Client) -> None:
    with pytest.raises(dsec.InvalidRequest, match="on_divergence"):
        await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/p", on_divergence="ignore", client=client)


async def test_heartbeat_renews_an_idle_handles_lease_until_the_handle_is_dropped(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/heartbeat", lease=1.5, client=client)
    sandbox_id = sb.id
    status = (await sb.info()).trajectory
    assert status is not None
    first = status.lease_expires_at
    await asyncio.sleep(4.5)  # three leases without a call of the agent's: only the heartbeat renews
    status = (await sb.info()).trajectory
    assert status is not None and status.lease_expires_at > first + 2.5
    assert (await sb.exec("echo alive")).stdout == b"alive\n"

    del sb, status  # a dropped handle stops renewing: the lease runs out and the sandbox goes
    gc.collect()

    async def alive() -> bool:
        return any(i.id == sandbox_id for i in await dsec.AsyncSandbox.list(client=client))

    for _ in range(60):
        if not await alive():
            break
        await asyncio.sleep(0.2)
    assert not await alive(), "the lease of a dropped handle never ran out"


async def test_lease_renewal_of_a_sandbox_without_trajectory_is_refused(client: dsec.Client) -> None:
    async with await dsec.AsyncSandbox.create(image="tiny", client=client) as sb:
        with pytest.raises(dsec.InvalidRequest, match="not bound to a trajectory"):
            await client.api.renew_lease(sb.id)
    with pytest.raises(dsec.SandboxNotFound):
        await client.api.renew_lease("sb-000000000000")


def test_heartbeat_interval_is_a_third_of_the_lease_within_bounds() -> None:
    from dsec._sdk.sandbox import heartbeat_interval

    assert heartbeat_interval(1800) == 300 and heartbeat_interval(60) == 20 and heartbeat_interval(0.3) == 0.5


async def test_a_call_that_never_reached_the_log_does_not_wedge_the_handle(client: dsec.Client) -> None:
    """A call refused at connect (the daemon restarting) used its number without reaching the log: every later
    call was refused as past the log's end, for good. The handle now numbers the next call where the log ends."""
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/lost-call", client=client)
    try:
        await sb.exec("echo one >> ran")
        assert sb._cursor is not None
        for send in (lambda: sb.exec("echo two >> ran"), lambda: sb.files.write("/work/x", "x"),
                     lambda: _drain(sb.exec_stream("echo three >> ran"))):
            sb._cursor.take()  # what a call lost before the log took
            await send()
        info = await sb.info()
        assert info.trajectory is not None and info.trajectory.calls == 4, info.trajectory
        assert (await sb.exec("cat ran")).stdout == b"one\ntwo\nthree\n"
        with pytest.raises(dsec.InvalidRequest, match="in order"):  # a raw call past the end is still refused
            await client.api.exec(sb.id, ExecRequest(command="true"), seq=99)
    finally:
        await sb.close()


async def _drain(events: AsyncIterator[dsec.ExecEvent]) -> None:
    async for _ in events:
        pass


async def test_close_end_ends_the_trajectory_and_its_name_starts_over(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/end", client=client)
    try:
        assert (await sb.exec("echo x >> ran; wc -l < ran")).stdout.strip() == b"1"
        await sb.close(end=True)
        with pytest.raises(dsec.SandboxNotFound):
            await client.api.get(sb.id)
        ended = await dsec.AsyncTrajectory("sdk/end", client).info()
        assert ended.ended_at is not None and ended.calls == 1  # the log stays readable until the name is reused
        assert [c.op for c in await dsec.AsyncTrajectory("sdk/end", client).log()] == ["exec"]
        again = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/end", client=client)
        assert again.id != sb.id and again._info.trajectory is not None and again._info.trajectory.calls == 0
        assert (await again.exec("echo x >> ran; wc -l < ran")).stdout.strip() == b"1"  # a new sandbox, run live
        assert (await dsec.AsyncTrajectory("sdk/end", client).info()).ended_at is None
        plain = await dsec.AsyncSandbox.create(image="tiny", client=client)
        with pytest.raises(dsec.InvalidRequest, match="not bound to a trajectory"):
            await plain.close(end=True)
        await plain.close()
    finally:
        await dsec.AsyncTrajectory("sdk/end", client).delete()


async def test_delete_takes_the_sandbox_log_and_checkpoints_a_branch_does_not_share(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/del", client=client)
    await sb.exec("echo a > f")
    shared = await sb.snapshot()  # call 1: before the branch point, so the branch shares it
    await sb.exec("echo b > f")
    own = await sb.snapshot()  # call 3: the original's alone
    branch = await client.api.branch_trajectory(dsec.models.TrajectoryForkRequest(name="sdk/del", at=3))
    assert branch.trajectory is not None
    names = [t.name for t in await dsec.AsyncTrajectory.list(prefix="sdk/del", client=client)]
    assert names == ["sdk/del", branch.trajectory.name]
    await dsec.AsyncTrajectory("sdk/del", client).delete()
    with pytest.raises(dsec.SandboxNotFound):
        await client.api.get(sb.id)
    assert [t.name for t in await dsec.AsyncTrajectory.list(prefix="sdk/del", client=client)] == [
        branch.trajectory.name]
    with pytest.raises(dsec.NotFound):
        await dsec.AsyncTrajectory("sdk/del", client).info()
    with pytest.raises(dsec.NotFound):  # its own checkpoint went with it
        await dsec.AsyncSandbox.create(snapshot=own, client=client)
    kept = await dsec.AsyncSandbox.create(snapshot=shared, client=client)  # the branch's stays
    assert await kept.files.read("f") == b"a\n"
    await kept.close()
    await dsec.AsyncTrajectory(branch.trajectory.name, client).delete()
    with pytest.raises(dsec.NotFound):
        await dsec.AsyncSandbox.create(snapshot=shared, client=client)
    with pytest.raises(dsec.NotFound, match="no trajectory"):
        await dsec.AsyncTrajectory("sdk/del", client).delete()


async def test_operator_calls_stay_out_of_the_log_and_the_agent_is_told(client: dsec.Client) -> None:
    agent = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/operator", client=client)
    try:
        await agent.exec("echo agent >> ran")
        operator = await dsec.AsyncSandbox.connect(agent.id, client=client)  # what `dsec exec` and the dashboard use
        await operator.exec("echo operator >> ran")
        await operator.files.write("/workspace/poked", b"x")
        assert await operator.files.read("ran") == b"agent\noperator\n"
        assert [c.op for c in await dsec.AsyncTrajectory("sdk/operator", client).log()] == ["exec"]
        audited = await client.audit(sandbox_id=agent.id)
        assert [(e.op, e.command if e.op == "exec" else e.command[0]) for e in reversed(audited)] == [
            ("exec", "echo agent >> ran"), ("exec", "echo operator >> ran"), ("file", "write")]
        with pytest.warns(UserWarning, match="2 state-changing call.* outside the log"):
            info = await agent.info()
        assert info.trajectory is not None and info.trajectory.outside_log == 2
        again = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/operator", client=client)
        assert (await again.exec("echo agent >> ran")).replayed  # the re-run does not diverge
        assert not (await again.exec("true")).replayed
        assert [c.op for c in await dsec.AsyncTrajectory("sdk/operator", client).log()] == ["exec", "exec"]
    finally:
        await dsec.AsyncTrajectory("sdk/operator", client).delete()


async def test_reopening_with_another_spec_names_both_unless_the_logged_one_is_kept(client: dsec.Client) -> None:
    sb = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/spec", labels={"team": "a"}, client=client)
    try:
        shown = re.escape("labels: logged {'team': 'a'}, given {'team': 'b'}")
        with pytest.raises(dsec.ReplayDivergence, match=shown) as err:
            await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/spec", labels={"team": "b"}, client=client)
        assert err.value.detail["fields"] == ["labels"]
        assert err.value.detail["logged"]["labels"] == {"team": "a"}
        assert err.value.detail["given"]["labels"] == {"team": "b"}
        kept = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/spec", labels={"team": "b"},
                                              keep_logged_spec=True, client=client)
        assert kept.id == sb.id and kept._info.spec.labels == {"team": "a"}
        same = await dsec.AsyncSandbox.create(image="tiny", trajectory="sdk/spec", labels={"team": "a"}, lease=60,
                                              client=client)  # a lease is the open's own: not a divergence
        assert same.id == sb.id
    finally:
        await dsec.AsyncTrajectory("sdk/spec", client).delete()
