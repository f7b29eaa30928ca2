"""The blocking SDK: generated twins of AsyncSandbox, run through the portal against a real daemon."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec._sdk.portal import portal
from dsec._sdk.sandbox import AsyncFiles
from dsec._sdk.sync import Files, public_members


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("home")) as d:
        yield d


@pytest.fixture
def client(daemon: Daemon) -> Iterator[dsec.Client]:
    with dsec.Client(url=daemon.unix_url) as c:
        yield c


@pytest.mark.parametrize(("async_cls", "sync_cls"), [
    (dsec.AsyncSandbox, dsec.Sandbox), (AsyncFiles, Files), (dsec.AsyncProcess, dsec.Process),
    (dsec.AsyncProcesses, dsec.Processes), (dsec.AsyncShell, dsec.Shell), (dsec.AsyncWatch, dsec.Watch)])
def test_every_public_async_member_has_a_sync_twin_with_the_same_signature(
    async_cls: type, sync_cls: type
) -> None:
    members = public_members(async_cls)
    assert members, "nothing to derive"
    renames = {"AsyncSandbox": "Sandbox", "AsyncGenerator": "Generator", "AsyncFiles": "Files",
               "AsyncProcesses": "Processes", "AsyncProcess": "Process", "AsyncShell": "Shell",
               "AsyncWatch": "Watch"}
    for name, attr in members.items():
        twin = inspect.getattr_static(sync_cls, name)
        assert type(twin) is type(attr) or (inspect.isfunction(twin) and inspect.isfunction(attr)), name
        if isinstance(attr, property):
            assert twin.__doc__ == attr.__doc__
            continue
        a = inspect.signature(getattr(async_cls, name))
        s = inspect.signature(getattr(sync_cls, name))
        def renamed(annotation: object) -> object:
            if not isinstance(annotation, str):
                return annotation
            for old, new in renames.items():
                annotation = annotation.replace(old, new)
            return annotation

        assert [p.replace(annotation=renamed(p.annotation)) for p in a.parameters.values()] == \
            list(s.parameters.values()), name
        assert s.return_annotation == renamed(a.return_annotation), name
        assert getattr(sync_cls, name).__doc__ == getattr(async_cls, name).__doc__, name
        assert not inspect.iscoroutinefunction(getattr(sync_cls, name)), name
    # The contract's blocking names, spelled out so that a rename in AsyncSandbox is noticed here too.
    for name in ("create", "create_many", "close_many", "connect", "list", "exec", "exec_stream", "info", "stats",
                 "pause", "resume", "snapshot", "close"):
        assert callable(getattr(dsec.Sandbox, name)), name
    assert isinstance(dsec.Sandbox.id, property)
    assert not hasattr(dsec.Sandbox, "aclose")


def test_sync_round_trip(client: dsec.Client, tmp_path: Path) -> None:
    with dsec.Sandbox.create(image="tiny", labels={"suite": "sync"}, client=client) as sb:
        assert isinstance(sb, dsec.Sandbox) and isinstance(sb.files, Files)
        r = sb.exec("echo hi; echo there >&2; exit 4")
        assert (r.exit_code, r.stdout, r.stderr) == (4, b"hi\n", b"there\n")
        sb.files.write("/workspace/x.bin", b"\x00\xff\x80")
        assert sb.files.read("/workspace/x.bin") == b"\x00\xff\x80"
        assert [e.name for e in sb.files.list("/workspace")] == ["x.bin"]
        (tmp_path / "up.txt").write_text("up")
        sb.files.upload(tmp_path / "up.txt", "/workspace/up.txt")
        sb.files.download("/workspace/up.txt", tmp_path / "down.txt")
        assert (tmp_path / "down.txt").read_text() == "up"
        assert sb.info().state == "running" and sb.id in repr(sb) and repr(sb).startswith("Sandbox(")
        found = dsec.Sandbox.list(labels={"suite": "sync"}, client=client)
        assert found == [sb] or [f.id for f in found] == [sb.id]
        assert all(isinstance(f, dsec.Sandbox) for f in found)
        assert dsec.Sandbox.connect(sb.id, client=client).id == sb.id
    with pytest.raises(dsec.SandboxNotFound):
        sb.info()
    sb.close()  # idempotent


def test_sync_exec_stream_iterates_and_break_closes(client: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", client=client) as sb:
        events = list(sb.exec_stream(["sh", "-c", "echo a; echo b >&2"]))
        assert [e.type for e in events][-1] == "exit"
        assert b"".join(e.data or b"" for e in events if e.type == "stdout") == b"a\n"
        stream = sb.exec_stream("echo first; sleep 1; touch marker")
        for event in stream:
            assert event.data == b"first\n"
            break
        stream.close()  # closes the async generator, the HTTP response, and so kills the command
        assert sb.exec("sleep 2; ls").stdout == b""


def test_sync_create_many_and_errors(client: dsec.Client) -> None:
    boxes = dsec.Sandbox.create_many(2, image="tiny", client=client)
    try:
        assert [type(b) for b in boxes] == [dsec.Sandbox, dsec.Sandbox]
        assert boxes[0].id != boxes[1].id
    finally:
        for b in boxes:
            b.close()
    closed = dsec.Sandbox.close_many([boxes[0], boxes[1].id], client=client)  # twins and ids; closed twice: fine
    assert (sorted(closed.missing), closed.destroyed, closed.failed) == (sorted(b.id for b in boxes), [], {})
    with pytest.raises(dsec.ImageNotFound):
        dsec.Sandbox.create(image="missing", client=client)
    with pytest.raises(dsec.InvalidRequest, match="disk"):
        dsec.Sandbox.create(image="tiny", disk="-1", client=client)


def test_sync_api_works_inside_a_running_event_loop(client: dsec.Client) -> None:
    # A notebook runs user code inside a loop; the blocking API must still work there.
    async def inside() -> bytes:
        with dsec.Sandbox.create(image="tiny", client=client) as sb:
            return sb.exec("echo nested").stdout

    assert asyncio.run(inside()) == b"nested\n"


def test_portal_refuses_to_block_its_own_thread() -> None:
    async def reenter() -> None:
        portal.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="own event loop"):
        portal.run(reenter())


def test_sync_api_from_many_threads(client: dsec.Client) -> None:
    outputs: list[bytes] = []

    def work(i: int) -> None:
        with dsec.Sandbox.create(image="tiny", client=client) as sb:
            outputs.append(sb.exec(f"echo {i}").stdout)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outputs) == [f"{i}\n".encode() for i in range(4)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_portal_restarts_in_a_forked_child(client: dsec.Client, daemon: Daemon) -> None:
    with dsec.Sandbox.create(image="tiny", client=client) as sb:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the parent's portal thread does not exist here
            try:
                with dsec.Client(url=daemon.unix_url) as child_client:
                    out = dsec.Sandbox.connect(sb.id, client=child_client).exec("echo child").stdout
                os.write(write, out)
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.read(read, 100) == b"child\n" and status == 0
        os.close(read)


def test_ctrl_c_during_a_blocking_exec_kills_the_command(client: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", client=client) as sb:
        # A real SIGINT to the main thread, as a terminal's Ctrl-C would send, once the command is running
        # (polled, not timed: on a loaded machine a fixed delay can land before the exec or after it).
        def interrupt() -> None:
            watcher = dsec.Sandbox.connect(sb.id, client=client)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if any(e.name == "started" for e in watcher.files.list("/workspace")):
                    break
                time.sleep(0.02)
            signal.pthread_kill(main, signal.SIGINT)

        main = threading.main_thread().ident
        assert main is not None
        # Python's own SIGINT handler, as in a terminal: a shell starts background jobs with SIGINT ignored.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        sender = threading.Thread(target=interrupt)
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                sb.exec("touch started; sleep 8; touch marker", timeout=60)
        finally:
            sender.join()
            signal.signal(signal.SIGINT, previous)
        # interrupted: the command was killed before it got to `touch marker` (8 s leave a loaded host time
        # to deliver the interrupt)
        assert sb.exec("sleep 8.5; ls").stdout == b"started\n"


def test_checked_in_type_stub_matches_the_generated_twins() -> None:
    from dsec._sdk import stubgen

    assert stubgen.STUB_PATH.read_text() == stubgen.render(), "run: python -m dsec._sdk.stubgen"
    stub = stubgen.STUB_PATH.read_text()
    for name in public_members(dsec.AsyncSandbox):
        assert f"def {name}(" in stub, name
