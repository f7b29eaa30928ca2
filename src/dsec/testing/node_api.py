"""The node API conformance suite: what every implementation of :class:`~dsec.api.protocol.NodeAPI` answers.

Each check is ``async def check_x(api, image) -> None`` and reaches the target only through the protocol, so
the same checks run unchanged against the node's engine in process, a daemon over HTTP
(:class:`~dsec.api.client.NodeClient`) and a cluster gateway over HTTP; :data:`NODE_CHECKS` lists them for
pytest to parametrize over. ``image`` names an image of the target's container backend. Where the contract
leaves a choice to the target (a backend without network policies, a gateway without per-node pools), a
check accepts the documented :class:`~dsec.NotSupported` and nothing else. This module owns the definition
of "a conforming node API"; it never reaches around the protocol and never leaves a sandbox behind.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import os
import re
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from dsec._version import __version__
from dsec.api.operations import close_stream
from dsec.api.protocol import NodeAPI
from dsec.errors import (
    DSecError,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    NotSupported,
    ReplayDivergence,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.models import (
    BatchCreateRequest,
    BatchDestroyRequest,
    CallBatch,
    CallRequest,
    ExecRequest,
    ImageBuildRequest,
    ImagePullRequest,
    KeyboardRequest,
    MouseRequest,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
    TrajectoryForkRequest,
)
from dsec.testing import node_api_surface

__all__ = ["NODE_CHECKS", "NodeCheck", "covered"]

NodeCheck = Callable[[NodeAPI, str], Awaitable[None]]

_UNKNOWN = "sb-000000000000"
_WAIT = 20.0


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except kind as exc:
        assert match is None or re.search(match, str(exc)), f"{kind.__name__} says {exc!s}, not /{match}/"
        return
    raise AssertionError(f"no {kind.__name__} was raised")


async def _supported(call: Awaitable[Any]) -> Any:
    """``call``'s answer, or None where the target answers the documented NotSupported."""
    try:
        return await call
    except NotSupported:
        return None


def _tag() -> str:
    return uuid.uuid4().hex[:12]


@contextlib.asynccontextmanager
async def _sandbox(api: NodeAPI, image: str, **spec: Any) -> AsyncIterator[SandboxInfo]:
    info = await api.create(SandboxSpec(image=image, **spec))
    try:
        yield info
    finally:
        await api.destroy(info.id)


async def _run(api: NodeAPI, sandbox_id: str, command: str | list[str], **kw: Any) -> Any:
    return await api.exec(sandbox_id, ExecRequest(command=command, timeout=30, **kw))


async def check_health(api: NodeAPI, image: str) -> None:
    info = await api.health()
    assert info.version == __version__, info
    assert info.backends.get("container") == "ok", info.backends


async def check_lifecycle(api: NodeAPI, image: str) -> None:
    tag = _tag()
    info = await api.create(SandboxSpec(image=image, labels={"conformance": tag}))
    try:
        assert info.state == "running" and info.image == image and info.labels.get("conformance") == tag, info
        assert (await api.get(info.id)).id == info.id
        assert [s.id for s in await api.list({"conformance": tag})] == [info.id]
        assert [s.id for s in await api.list({"conformance": tag}, state="running")] == [info.id]
        assert await api.list({"conformance": tag}, state="paused") == []
        assert await api.list({"conformance": "no-" + tag}) == []
        moved = await api.set_timeout(info.id, 600)
        assert moved.id == info.id and abs(moved.expires_at - (time.time() + 600)) < 60, moved
        with _raises(InvalidRequest):
            await api.set_timeout(info.id, 0)
    finally:
        await api.destroy(info.id)
    with _raises(SandboxNotFound):
        await api.get(info.id)
    await api.destroy(info.id)  # idempotent
    assert await api.list({"conformance": tag}) == []


async def check_create_errors(api: NodeAPI, image: str) -> None:
    with _raises(ImageNotFound):
        await api.create(SandboxSpec(image="no-such-image-" + _tag()))
    for call in (api.get(_UNKNOWN), api.stats(_UNKNOWN), api.exec(_UNKNOWN, ExecRequest(command="true")),
                 api.read_file(_UNKNOWN, "/x")):
        with _raises(SandboxNotFound):
            await call


async def check_exec(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        result = await _run(api, sb.id, "echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n"), result
        fed = await _run(api, sb.id, ["sh", "-c", "cat; printf %s \"$X\""], stdin=b"in\xff", env={"X": "y"})
        assert fed.exit_code == 0 and fed.stdout == b"in\xffy", fed
        # A relative cwd resolves against the sandbox's working directory.
        await _run(api, sb.id, "mkdir -p rel-cwd")
        here = await _run(api, sb.id, "pwd", cwd="rel-cwd")
        assert here.exit_code == 0 and here.stdout.strip().endswith(b"/rel-cwd"), here
        with _raises(InvalidRequest, "NUL"):  # not checked here (model_construct): the target refuses it
            await api.exec(sb.id, ExecRequest.model_construct(command="true", cwd="a\0b"))


async def check_exec_stream(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        events = [e async for e in api.exec_stream(sb.id, ExecRequest(command="echo one; echo two >&2", timeout=30))]
        assert events[-1].type == "exit" and events[-1].result is not None and events[-1].result.exit_code == 0
        assert all(e.type in ("stdout", "stderr") for e in events[:-1]), events
        assert b"".join(e.data or b"" for e in events if e.type == "stdout") == b"one\n"
        with _raises(SandboxNotFound):
            async for _ in api.exec_stream(_UNKNOWN, ExecRequest(command="true")):
                pass


async def check_files(api: NodeAPI, image: str) -> None:
    data = bytes(range(256))
    async with _sandbox(api, image) as sb:
        await api.write_file(sb.id, "/workspace/c/blob", data, 0o750)
        assert await api.read_file(sb.id, "/workspace/c/blob") == data
        [entry] = await api.list_files(sb.id, "/workspace/c")
        assert (entry.name, entry.type, entry.size, entry.mode) == ("blob", "file", 256, 0o750), entry
        await api.write_file(sb.id, "/workspace/c/blob", b"")
        assert await api.read_file(sb.id, "/workspace/c/blob") == b""
        big = os.urandom(3 * 1024 * 1024 + 1)  # larger than any one read or write of the transports
        await api.write_file(sb.id, "/workspace/c/big", big)
        assert await api.read_file(sb.id, "/workspace/c/big") == big
        with _raises(NotFound):
            await api.read_file(sb.id, "/workspace/c/missing")
        await api.write_file(sb.id, "relative", b"rel")  # relative paths resolve against the working directory
        assert await api.read_file(sb.id, "relative") == b"rel"
        with _raises(InvalidRequest):
            await api.read_file(sb.id, "")


async def check_pause_and_resume(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        assert isinstance(await api.stats(sb.id), SandboxStats)
        assert (await api.pause(sb.id)).state == "paused"
        with _raises(SandboxStateError):
            await _run(api, sb.id, "true")
        assert (await api.resume(sb.id)).state == "running"
        assert (await _run(api, sb.id, "true")).exit_code == 0
        paused = await _supported(api.pause(sb.id, release_memory=True))
        if paused is not None:
            assert paused.state == "paused"
            await api.resume(sb.id)


async def check_batch_and_fork(api: NodeAPI, image: str) -> None:
    tag = _tag()
    made = await api.create_many(BatchCreateRequest(count=2, spec=SandboxSpec(image=image, labels={"batch": tag})))
    try:
        assert len({s.id for s in made}) == 2 and {s.id for s in await api.list({"batch": tag})} == {s.id for s in made}
        await api.write_file(made[0].id, "/workspace/state", b"forked")
        copies = await api.fork(made[0].id, 2)
        made += copies
        assert len({s.id for s in made}) == 4
        for copy in copies:
            assert await api.read_file(copy.id, "/workspace/state") == b"forked"
    finally:
        await asyncio.gather(*(api.destroy(s.id) for s in made))


async def check_batch_stream(api: NodeAPI, image: str) -> None:
    tag = _tag()
    events = api.create_many_stream(BatchCreateRequest(count=3, spec=SandboxSpec(image=image,
                                                                                 labels={"stream": tag})))
    got = [event async for event in events]
    ids = [e.sandbox.id for e in got if e.sandbox is not None]
    try:
        assert [e.type for e in got] == ["sandbox"] * 3 + ["done"] and len(set(ids)) == 3, got
        assert sorted(s.id for s in await api.list({"stream": tag})) == sorted(ids)
    finally:
        await api.destroy_many(BatchDestroyRequest(ids=ids))
    with _raises(ImageNotFound):  # the stream's error item, raised; nothing is kept
        async for _ in api.create_many_stream(BatchCreateRequest(count=2, spec=SandboxSpec(
                image="no-such-image-" + tag, labels={"stream": tag}))):
            pass
    assert await api.list({"stream": tag}) == []


async def check_destroy_many(api: NodeAPI, image: str) -> None:
    tag = _tag()
    made = await api.create_many(BatchCreateRequest(count=3, spec=SandboxSpec(image=image, labels={"batch": tag})))
    never = f"sb-never-{uuid.uuid4().hex[:12]}"
    try:
        doomed = [s.id for s in made[:2]]
        result = await api.destroy_many(BatchDestroyRequest(ids=[*doomed, never]))
        assert sorted(result.destroyed) == sorted(doomed) and result.missing == [never] and not result.failed
        assert [s.id for s in await api.list({"batch": tag})] == [made[2].id]
        again = await api.destroy_many(BatchDestroyRequest(ids=doomed))  # idempotent: already gone is missing
        assert not again.destroyed and sorted(again.missing) == sorted(doomed) and not again.failed
        other = await api.destroy_many(BatchDestroyRequest(ids=[made[2].id], job=f"not-{tag}"))
        assert other.missing == [made[2].id] and (await api.get(made[2].id)).state == "running"
    finally:
        await asyncio.gather(*(api.destroy(s.id) for s in made))


async def check_list_pages(api: NodeAPI, image: str) -> None:
    tag = _tag()
    made = await api.create_many(BatchCreateRequest(count=3, spec=SandboxSpec(image=image, labels={"page": tag})))
    try:
        ids = sorted(s.id for s in made)
        first = await api.list({"page": tag}, limit=2)
        assert [s.id for s in first] == ids[:2]
        rest = await api.list({"page": tag}, after=first[-1].id, limit=2)
        assert [s.id for s in rest] == ids[2:]  # shorter than the limit: the last page
        assert [s.id for s in await api.list({"page": tag}, after=ids[-1])] == []
        assert sorted(s.id for s in await api.list({"page": tag})) == ids
    finally:
        await api.destroy_many(BatchDestroyRequest(ids=[s.id for s in made]))


async def check_snapshot(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        await api.write_file(sb.id, "/workspace/saved", b"snap")
        ref = await api.snapshot(sb.id)
        await api.write_file(sb.id, "/workspace/saved", b"later")
    async with _sandbox(api, image, snapshot=ref.snapshot) as restored:
        assert await api.read_file(restored.id, "/workspace/saved") == b"snap"


async def check_policies(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        changed = await _supported(api.set_network(sb.id, "none"))
        assert changed is None or (changed.id == sb.id and changed.spec.network == "none"), changed
        with _raises(InvalidRequest):
            await api.set_network(sb.id, ["not a network entry!"])
        revealed = await _supported(api.reveal(sb.id))
        assert revealed is None or revealed.id == sb.id
        with _raises(NotSupported):  # a container has no display, and runs no Python callables
            await api.screenshot(sb.id)
        with _raises(NotSupported):
            await api.mouse(sb.id, MouseRequest(x=1, y=1))
        with _raises(NotSupported):
            await api.keyboard(sb.id, KeyboardRequest(text="x"))
        with _raises(NotSupported):
            await api.call(sb.id, CallRequest(payload=b"\x80\x05N.", client_python="3.11"))
        with _raises(NotSupported):  # a failure that is no item's own ends the batch
            await api.call_many(sb.id, CallBatch(function=b"\x80\x05N.", items=[b"\x80\x05N."], client_python="3.11"))


async def check_trajectory(api: NodeAPI, image: str) -> None:
    name = f"conformance/{_tag()}"
    made: list[str] = []
    try:
        sb = await api.create(SandboxSpec(image=image, trajectory=name))
        made.append(sb.id)
        assert sb.trajectory is not None and sb.trajectory.name == name
        await api.exec(sb.id, ExecRequest(command="echo a >> log"), seq=0)
        await api.exec(sb.id, ExecRequest(command="echo b >> log"), seq=1)
        logged = await api.trajectory_log(name)
        assert [c.seq for c in logged] == [0, 1] and {c.op for c in logged} == {"exec"}, logged
        assert [c.seq for c in await api.trajectory_log(name, start=1, limit=1)] == [1]
        assert (await api.renew_lease(sb.id)).id == sb.id
        branch = await api.branch_trajectory(TrajectoryForkRequest(name=name, at=1, rerun_missing=True))
        made.append(branch.id)
        assert branch.trajectory is not None and branch.trajectory.name != name
        assert await api.read_file(branch.id, "/workspace/log") == b"a\n"
        with _raises(InvalidRequest, "in order"):
            await api.exec(sb.id, ExecRequest(command="true"), seq=99)
        async with _sandbox(api, image) as plain:
            with _raises(InvalidRequest, "not bound to a trajectory"):
                await api.renew_lease(plain.id)
    finally:
        await asyncio.gather(*(api.destroy(i) for i in made))


async def check_trajectory_end(api: NodeAPI, image: str) -> None:
    name = f"conformance/{_tag()}"
    sb = await api.create(SandboxSpec(image=image, trajectory=name, labels={"a": "1"}))
    try:
        await api.exec(sb.id, ExecRequest(command="echo a >> log"), seq=0)
        await api.exec(sb.id, ExecRequest(command="echo operator"))  # no call number: outside the log
        assert [t.calls for t in await api.list_trajectories(prefix=name)] == [1]
        with _raises(ReplayDivergence, "labels"):
            await api.create(SandboxSpec(image=image, trajectory=name, labels={"a": "2"}))
        ended = await api.end_trajectory(name)
        assert ended.ended_at is not None and ended.calls == 1, ended
        with _raises(SandboxNotFound):
            await api.get(sb.id)
        again = await api.create(SandboxSpec(image=image, trajectory=name, labels={"a": "2"}))
        assert again.trajectory is not None and again.trajectory.calls == 0, again
        await api.delete_trajectory(name)
        assert await api.list_trajectories(prefix=name) == []
        with _raises(NotFound):
            await api.delete_trajectory(name)
    finally:
        with contextlib.suppress(DSecError):
            await api.delete_trajectory(name)


async def check_images(api: NodeAPI, image: str) -> None:
    assert image in {i.name for i in await api.list_images()}
    assert (await api.get_image(image)).name == image
    with _raises(ImageNotFound):
        await api.get_image("no-such-image-" + _tag())
    # Nothing listens on loopback's discard port: the pull fails, typed (or the node's store cannot pull).
    try:
        await api.pull_image(ImagePullRequest(reference="127.0.0.1:9/conformance/none:x", insecure=True))
    except NotSupported:
        pass
    except DSecError as exc:
        assert "127.0.0.1" in str(exc), exc
    else:
        raise AssertionError("an image was pulled from a registry that does not exist")


async def check_image_build(api: NodeAPI, image: str) -> None:
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        dockerfile = f"FROM {image}\nRUN echo built > /built\n".encode()
        entry = tarfile.TarInfo("Dockerfile")
        entry.size = len(dockerfile)
        tar.addfile(entry, io.BytesIO(dockerfile))
    context.seek(0)
    name = f"conformance-{_tag()}"
    request = ImageBuildRequest(name=name, network="none", username="user", password="secret")
    try:
        events = [e async for e in api.build_image(request, context)]
    except NotSupported:  # a store that cannot build (raised from the stream, as the node ends it)
        return
    assert events[-1].type == "done" and events[-1].image is not None and events[-1].image.name == name, events
    assert (await api.get_image(name)).name == name


async def check_operator_views(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        await _run(api, sb.id, "echo first")
        await _run(api, sb.id, "exit 4")
        history = await api.sandbox_logs(sb.id)
        assert [e.command for e in history] == ["exit 4", "echo first"], history
        assert [e.command for e in await api.sandbox_logs(sb.id, limit=1)] == ["exit 4"]
        audited = await api.audit_log(sandbox_id=sb.id, outcome="nonzero")
        assert [(e.command, e.exit_code) for e in audited] == [("exit 4", 4)], audited
        overview = await api.overview()
        assert overview.nodes and overview.exec_count >= 2
    metrics = await api.metrics_text()
    assert b"# TYPE dsec_" in metrics, metrics[:200]
    statistics = await _supported(api.statistics())
    assert statistics is None or isinstance(statistics, NodeStatistics)
    pool = await _supported(api.declare_pool(PoolConfig(image=image, min=0, max=0)))
    assert pool is None or isinstance(pool, PoolStatistics)
    with _raises(InvalidRequest):
        await api.audit_log(since=10.0, until=5.0)


async def check_events(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        pass
    seen: set[str] = set()
    events = api.subscribe(0)  # the kept history first: the sandbox's events happened before we asked
    try:
        async with asyncio.timeout(_WAIT):
            async for event in events:
                if event.sandbox_id == sb.id:
                    seen.add(event.kind)
                if {"created", "destroyed"} <= seen:
                    break
    except TimeoutError:
        raise AssertionError(f"sandbox {sb.id}'s events never came: {sorted(seen)}") from None
    finally:
        await close_stream(events)


async def check_node_state(api: NodeAPI, image: str) -> None:
    events = api.subscribe(node_state=True)  # a gateway has no state of its own: NotSupported
    try:
        first = await _supported(anext(events))
        if first is not None:
            assert first.kind == "node" and first.sandbox_id is None, first
            assert isinstance(first.detail["images"], dict) and first.detail["stopping"] is None, first.detail
    finally:
        await close_stream(events)


NODE_CHECKS: tuple[NodeCheck, ...] = (
    check_health, check_lifecycle, check_create_errors, check_exec, check_exec_stream, check_files,
    check_pause_and_resume, check_batch_and_fork, check_batch_stream, check_destroy_many, check_list_pages,
    check_snapshot, check_policies, check_trajectory, check_trajectory_end, check_images, check_image_build,
    check_operator_views, check_events, check_node_state, *node_api_surface.SURFACE_NODE_CHECKS,
)
"""Every check, in the order a reader meets the operations in :class:`NodeAPI`."""


def covered() -> set[str]:
    """The operations the checks call (a test compares it with the protocol's, so none goes unchecked)."""
    found: set[str] = set()
    for module in (Path(__file__), Path(node_api_surface.__file__)):
        tree = ast.parse(module.read_text())
        found |= {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api"}
    return found
