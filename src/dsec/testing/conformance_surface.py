"""The conformance checks of the sandbox surface agent harnesses drive: users, process handles, terminals,
shell sessions, file operations and watches, ports, and the kernel's argument limit.

Same rules as :mod:`dsec.testing.conformance` (its :func:`sandbox` and helpers, paths relative to the
working directory, only ``/bin/sh`` and coreutils, plus ``bash`` for shell sessions and ``python3`` for a
listening server). A backend that cannot do something says so with a class attribute (``users``,
``ports``, ``processes_persist``) and the check then asserts the clear refusal instead. It never reaches
around the Backend interface, except for the shell session protocol, which is built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from dsec.accounts import ROOT, Identity
from dsec.backends.base import Backend, ImageRef, resolve_user_in
from dsec.backends.surface import ProcessSpec, Stream
from dsec.daemon.shells import ShellSession
from dsec.errors import (
    DirectoryNotEmpty,
    DSecError,
    FileExists,
    FileNotFound,
    InvalidRequest,
    IsADirectory,
    NotADirectory,
    NotSupported,
    PermissionDenied,
    UserNotFound,
)
from dsec.models import ExecRequest, SandboxRecord
from dsec.models.surface import FileEvent
from dsec.testing.conformance import MiB, expect_error, own_sandbox, run, sandbox

__all__ = ["SURFACE_CHECKS"]

_USER = Identity(uid=4242, gid=4242, groups=(4343,), home="/home/dsecuser", name="dsecuser")


class _Sink:
    """Collects what a process reports."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray(), "pty": bytearray()}
        self.exit: tuple[int, int | None] | None = None
        self.ended = asyncio.Event()
        self.changed = asyncio.Event()

    def output(self, stream: Stream, data: bytes) -> None:
        self.data[stream] += data
        self.changed.set()

    def exited(self, exit_code: int, signal: int | None) -> None:
        self.exit = (exit_code, signal)
        self.ended.set()

    async def wait_for(self, stream: str, text: bytes, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.data[stream]:
            self.changed.clear()
            left = deadline - time.monotonic()
            assert left > 0 and not self.ended.is_set(), f"{text!r} never came on {stream}: {self.data}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    async def wait_exit(self, timeout: float = 20.0) -> tuple[int, int | None]:
        await asyncio.wait_for(self.ended.wait(), timeout)
        assert self.exit is not None
        return self.exit


# -------------------------------------------------------------------------------------------- users
async def _user(backend: Backend, sb: SandboxRecord) -> Identity:
    """A user of the sandbox (uid 4242, a supplementary group 4343): named in its files where the root is
    writable, by number elsewhere."""
    if not backend.root_writable:
        return Identity(uid=4242, gid=4242, groups=(4343,), home="/tmp", name=None)
    add = ("echo 'dsecuser:x:4242:4242::/home/dsecuser:/bin/sh' >> /etc/passwd && "
           "echo 'dsecuser:x:4242:' >> /etc/group && echo 'dsecextra:x:4343:dsecuser' >> /etc/group")
    r = await run(backend, sb, add)
    assert r.exit_code == 0, r
    found = await resolve_user_in(backend, sb, "dsecuser")
    assert found == _USER, found
    assert (await resolve_user_in(backend, sb, "dsecuser:dsecextra")).gid == 4343
    return found


@own_sandbox
async def check_exec_as_user(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        if not backend.users:
            with expect_error(NotSupported, "a backend without users, asked to run as uid 4242"):
                await backend.exec(sb, ExecRequest(command="id -u"), _USER)
            return
        user = await _user(backend, sb)
        r = await backend.exec(sb, ExecRequest(command="id -u; id -g; id -G; echo $HOME"), user)
        assert r.stdout == f"4242\n4242\n4242 4343\n{user.home}\n".encode(), r
        r = await backend.exec(sb, ExecRequest(command=["id", "-u"]), ROOT)
        assert r.stdout == b"0\n", r
        with expect_error(UserNotFound, "a user the sandbox does not have"):
            await resolve_user_in(backend, sb, "no-such-user-here")
        r = await run(backend, sb, "echo still fine")
        assert r.stdout == b"still fine\n", "the sandbox is unusable after a refused user"


@own_sandbox
async def check_files_as_user(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        if not backend.users:
            with expect_error(NotSupported, "a backend without users, asked to read as uid 4242"):
                await backend.read_file(sb, "/workspace/x", MiB, _USER)
            return
        user = await _user(backend, sb)
        home = "/workspace/userdir"
        await backend.make_dir(sb, home, False, 0o755, ROOT)
        await backend.chown_file(sb, home, user, ROOT)
        await backend.write_file(sb, f"{home}/secret", b"s", 0o600, ROOT)
        with expect_error(PermissionDenied, "a user reading root's 0600 file"):
            await backend.read_file(sb, f"{home}/secret", MiB, user)
        assert await backend.read_file(sb, f"{home}/secret", MiB, ROOT) == b"s"
        r = await backend.exec(sb, ExecRequest(command=f"cat {home}/secret"), user)
        assert r.exit_code != 0, "the user read it through exec"
        await backend.write_file(sb, f"{home}/mine", b"m", None, user)
        st = await backend.stat_file(sb, f"{home}/mine", ROOT)
        assert (st.uid, st.gid, st.mode) == (4242, 4242, 0o644), st
        await backend.write_file(sb, f"{home}/made/by/user", b"u", None, user)  # missing parents made as the user
        st = await backend.stat_file(sb, f"{home}/made", ROOT)
        assert (st.type, st.uid) == ("dir", 4242), st
        assert await backend.read_file(sb, f"{home}/made/by/user", MiB, user) == b"u"
        await backend.chmod_file(sb, f"{home}/mine", 0o444, user)
        with expect_error(PermissionDenied, "a user writing its own read-only file"):
            await backend.write_file(sb, f"{home}/mine", b"x", None, user)
        with expect_error(PermissionDenied, "a user writing in root's directory"):
            await backend.write_file(sb, "/workspace/not-mine", b"x", None, user)
        with expect_error(PermissionDenied, "a user giving its file away"):
            await backend.chown_file(sb, f"{home}/mine", ROOT, user)
        with expect_error(PermissionDenied, "a user removing from root's directory"):
            await backend.remove_file(sb, home, True, user)


# -------------------------------------------------------------------------------------------- files
async def _check_xattrs(backend: Backend, sb: SandboxRecord, path: str) -> None:
    """``user.`` extended attributes: set through the files API, seen by the sandbox's own commands and by stat."""
    try:
        tagged = await backend.set_xattrs(sb, f"/workspace/{path}", {"user.origin": "kit"}, [])
    except NotSupported:  # a files API without them (microvm, vm)
        return
    assert tagged.xattrs == {"user.origin": "kit"}, tagged
    r = await run(backend, sb, f"python3 -c \"import os; print(os.getxattr('{path}', 'user.origin').decode())\"")
    assert r.stdout == b"kit\n", r
    await backend.set_xattrs(sb, f"/workspace/{path}", {}, ["user.origin"])
    assert (await backend.stat_file(sb, f"/workspace/{path}")).xattrs == {}


async def check_file_operations(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        made = await backend.make_dir(sb, "/workspace/a/b/c", True, 0o750)
        assert (made.type, made.mode, made.path) == ("dir", 0o750, "/workspace/a/b/c"), made
        again = await backend.make_dir(sb, "/workspace/a/b/c", True, 0o750)  # mkdir -p: fine
        assert again.type == "dir"
        with expect_error(FileExists, "mkdir of an existing directory without parents"):
            await backend.make_dir(sb, "/workspace/a", False, 0o755)
        with expect_error(FileNotFound, "mkdir below a missing parent"):
            await backend.make_dir(sb, "/workspace/none/x", False, 0o755)
        await backend.write_file(sb, "/workspace/a/f.txt", b"12345", 0o640)
        st = await backend.stat_file(sb, "/workspace/a/f.txt")
        assert (st.name, st.type, st.size, st.mode, st.uid) == ("f.txt", "file", 5, 0o640, 0), st
        r = await run(backend, sb, "ln -s f.txt a/link && echo ok")
        assert r.stdout == b"ok\n", r
        link = await backend.stat_file(sb, "/workspace/a/link")
        assert (link.type, link.symlink_target) == ("symlink", "f.txt"), link
        with expect_error(NotADirectory, "mkdir below a file"):
            await backend.make_dir(sb, "/workspace/a/f.txt/x", False, 0o755)
        with expect_error(IsADirectory, "reading a directory"):
            await backend.read_file(sb, "/workspace/a", MiB)
        with expect_error(IsADirectory, "writing over a directory"):
            await backend.write_file(sb, "/workspace/a/b", b"x", None)
        chmodded = await backend.chmod_file(sb, "/workspace/a/f.txt", 0o600)
        assert chmodded.mode == 0o600, chmodded
        await _check_xattrs(backend, sb, "a/f.txt")
        moved = await backend.rename_file(sb, "/workspace/a/f.txt", "/workspace/g.txt", True)
        assert (moved.path, moved.size) == ("/workspace/g.txt", 5), moved
        await backend.write_file(sb, "/workspace/h.txt", b"h", None)
        with expect_error(FileExists, "rename onto an existing file without overwrite"):
            await backend.rename_file(sb, "/workspace/g.txt", "/workspace/h.txt", False)
        await backend.rename_file(sb, "/workspace/g.txt", "/workspace/h.txt", True)
        assert await backend.read_file(sb, "/workspace/h.txt", MiB) == b"12345"
        with expect_error(FileNotFound, "stat of a moved file"):
            await backend.stat_file(sb, "/workspace/g.txt")
        with expect_error(DirectoryNotEmpty, "removing a non-empty directory without recursive"):
            await backend.remove_file(sb, "/workspace/a", False)
        await backend.remove_file(sb, "/workspace/a", True)
        await backend.remove_file(sb, "/workspace/h.txt", False)
        with expect_error(FileNotFound, "removing a missing file"):
            await backend.remove_file(sb, "/workspace/h.txt", False)
        r = await run(backend, sb, "ls -A")
        assert r.stdout == b"", f"left after removing: {r.stdout!r}"


def _file_calls(backend: Backend, sb: SandboxRecord, file: str, directory: str
                ) -> list[Callable[[], Awaitable[object]]]:
    """Every file operation that changes or reads an entry, on ``file`` or ``directory``."""
    return [
        lambda: backend.stat_file(sb, file), lambda: backend.chmod_file(sb, file, 0o777),
        lambda: backend.chown_file(sb, file, _USER), lambda: backend.rename_file(sb, file, "/workspace/taken", True),
        lambda: backend.remove_file(sb, file, False), lambda: backend.remove_file(sb, directory, True),
        lambda: backend.make_dir(sb, f"{directory}/made", False, 0o755),
    ]


async def check_file_operations_contained(backend: Backend, image: ImageRef) -> None:
    """stat, mkdir, remove, rename, chmod, chown and watch resolve ``..`` and symlinks the sandbox planted
    inside the sandbox, never on the host: a host file and directory beside the sandbox stay untouched (a
    refusal is fine too; where the sandbox's root is read-only, so are refusals of the writes)."""
    host = Path(tempfile.mkdtemp(prefix="dsec-contained-"))  # a host directory the sandbox has no twin of
    victim, victim_dir = host / "f", host / "d"
    victim.write_bytes(b"host")
    victim.chmod(0o644)
    victim_dir.mkdir()
    try:
        async with sandbox(backend, image) as sb:
            r = await run(backend, sb, "ln -s / escape")
            assert r.exit_code == 0, r
            for via in ("/workspace/escape", "/workspace/../../.."):
                attempts = _file_calls(backend, sb, f"{via}{victim}", f"{via}{victim_dir}")
                for attempt in attempts:
                    with contextlib.suppress(DSecError):  # the sandbox has no such file: not found, or refused
                        found = await attempt()
                        raise AssertionError(f"a file operation through {via} reached the host: {found}")
                with contextlib.suppress(DSecError):
                    events = await backend.watch_files(sb, f"{via}{victim_dir}", False)
                    await events.aclose()  # type: ignore[attr-defined]
                    raise AssertionError(f"a watch through {via} watched the host's {victim_dir}")
        assert victim.read_bytes() == b"host" and victim.stat().st_mode & 0o777 == 0o644
        assert victim.stat().st_uid == os.getuid() and victim_dir.is_dir() and not any(victim_dir.iterdir())
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _squeeze(events: list[FileEvent]) -> list[tuple[str, str, str | None]]:
    out: list[tuple[str, str, str | None]] = []
    for e in events:
        item = (e.type, e.path.rsplit("/w", 1)[-1], None if e.dest is None else e.dest.rsplit("/w", 1)[-1])
        if not out or out[-1] != item:
            out.append(item)
    return out


async def check_file_watch(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        await backend.make_dir(sb, "/workspace/w", False, 0o755)
        events = await backend.watch_files(sb, "/workspace/w", True)
        seen: list[FileEvent] = []

        async def collect(stream: AsyncIterator[FileEvent]) -> None:
            async for event in stream:
                seen.append(event)

        task = asyncio.create_task(collect(events))
        try:
            for step in ("echo 1 > w/f", "chmod 600 w/f", "mv w/f w/g", "mkdir w/sub"):
                assert (await run(backend, sb, step)).exit_code == 0, step
            await asyncio.sleep(0.5)  # the new directory's watch
            for step in ("echo 2 > w/sub/x", "rm w/g"):
                assert (await run(backend, sb, step)).exit_code == 0, step
            want = [("create", "/f", None), ("modify", "/f", None), ("chmod", "/f", None), ("move", "/f", "/g"),
                    ("create", "/sub", None), ("create", "/sub/x", None), ("modify", "/sub/x", None),
                    ("delete", "/g", None)]
            deadline = time.monotonic() + 20
            while _squeeze(seen) != want and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert _squeeze(seen) == want, f"watch saw {_squeeze(seen)}, expected {want}"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await events.aclose()  # type: ignore[attr-defined]
        with expect_error(FileNotFound, "watching a missing directory"):
            await backend.watch_files(sb, "/workspace/none", False)


# -------------------------------------------------------------------------------------------- processes
async def check_process_handle(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        sink = _Sink()
        spec = ProcessSpec(argv=["sh", "-c", "read line; echo got:$line; echo err >&2; exit 3"])
        proc = await backend.start_process(sb, spec, sink)
        assert proc.pid > 0 and proc.streams == ("stdout", "stderr"), (proc.pid, proc.streams)
        await proc.write(b"hello\n")
        assert await sink.wait_exit() == (3, None), sink.exit
        assert (bytes(sink.data["stdout"]), bytes(sink.data["stderr"])) == (b"got:hello\n", b"err\n"), sink.data
        await proc.aclose()

        sink = _Sink()
        proc = await backend.start_process(sb, ProcessSpec(argv=["cat"]), sink)
        await proc.write(b"abc")
        await proc.close_stdin()
        assert await sink.wait_exit() == (0, None) and sink.data["stdout"] == b"abc", sink.data
        await proc.aclose()

        sink = _Sink()
        proc = await backend.start_process(sb, ProcessSpec(argv=["sh", "-c", "echo up; sleep 100"]), sink)
        await sink.wait_for("stdout", b"up\n")
        if backend.processes_persist:  # one pid namespace for the whole sandbox: other commands see it
            r = await run(backend, sb, f"kill -0 {proc.pid} && echo seen")
            assert r.stdout == b"seen\n", f"pid {proc.pid} is not the process's pid in the sandbox: {r}"
        proc.signal(signal.SIGTERM)
        assert await sink.wait_exit() == (128 + signal.SIGTERM, signal.SIGTERM), sink.exit
        await proc.aclose()
        with expect_error(OSError, "writing to an ended process"):
            await proc.write(b"late")


@own_sandbox
async def check_process_dies_with_sandbox(backend: Backend, image: ImageRef) -> None:
    sink = _Sink()
    async with sandbox(backend, image) as sb:
        proc = await backend.start_process(sb, ProcessSpec(argv=["sleep", "1000"]), sink)
        await asyncio.sleep(0.3)
        assert not sink.ended.is_set(), f"the process ended by itself: {sink.exit}"
    try:
        await sink.wait_exit()
    finally:
        await proc.aclose()


async def check_pty(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        sink = _Sink()
        script = 'stty size; test -t 0 && echo tty; read x; stty size; echo "[$x]"'
        proc = await backend.start_process(sb, ProcessSpec(argv=["sh", "-c", script], pty=(80, 24)), sink)
        assert proc.streams == ("pty",), proc.streams
        await sink.wait_for("pty", b"tty")
        assert b"24 80" in sink.data["pty"], sink.data["pty"]
        await proc.resize(100, 30)
        await proc.write(b"typed\n")
        assert (await sink.wait_exit())[0] == 0, sink.exit
        assert b"30 100" in sink.data["pty"] and b"[typed]" in sink.data["pty"], sink.data["pty"]
        await proc.aclose()


async def check_shell_session(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        one = await ShellSession.start("s1", backend, sb, None, None, None)
        two = await ShellSession.start("s2", backend, sb, None, None, None)
        try:
            start = (await two.run("pwd")).stdout
            assert start.endswith(b"/workspace\n"), start
            r = await one.run("cd /tmp && export FOO=bar && f() { echo fn$1; }")
            assert r.exit_code == 0 and r.stdout == b"", r
            r = await one.run("pwd; echo $FOO; f 1")
            assert r.stdout == b"/tmp\nbar\nfn1\n", r
            r = await two.run("pwd; echo ${FOO:-unset}")
            assert r.stdout == start + b"unset\n", f"sessions share state: {r}"
            r = await one.run("echo out; echo err >&2; (exit 7)")
            assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n", b"err\n"), r
            r = await one.run('echo "unbalanced')
            assert r.exit_code != 0, r
            r = await one.run("sleep 30", timeout=1)
            assert r.timed_out and r.exit_code != 0 and r.duration_s < 15, r
            r = await one.run("trap '' INT; sleep 30", timeout=1)  # ignores SIGINT: killed
            assert r.timed_out, r
            r = await one.run("trap - INT; pwd; echo $FOO")
            assert r.stdout == b"/tmp\nbar\n", f"the session lost its state after interrupts: {r}"
            r = await one.run("printf 'no newline'")
            assert r.stdout == b"no newline", r
            r = await one.run("exit 5")
            assert r.exit_code == 5 and not one.alive, r
            with expect_error(Exception, "a command in an ended session"):
                await one.run("true")
        finally:
            await one.aclose()
            await two.aclose()


# -------------------------------------------------------------------------------------------- ports
_SERVER = """
import socket
closed = socket.socket(); closed.bind(("127.0.0.1", 0))  # held, never listening: a port nothing listens on
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print("listening", s.getsockname()[1], closed.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); data = c.recv(100); c.sendall(b"pong:" + data); c.close()
"""


async def check_port(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        if not backend.ports:
            with expect_error(NotSupported, "a backend without ports, asked for one"):
                await backend.open_port(sb, 8000)
            return
        # The server's ports are the kernel's pick, said by the server: a port chosen here could be taken
        # where the sandbox shares a loopback (the fake backend shares the host's).
        sink = _Sink()
        proc = await backend.start_process(sb, ProcessSpec(argv=["python3", "-c", _SERVER]), sink)
        try:
            await sink.wait_for("stdout", b"\n", timeout=90)  # python starts slowly in a TCG guest on a busy host
            _, port, closed = sink.data["stdout"].split()
            with expect_error(ConnectionRefusedError, "a port nothing listens on"):
                await backend.open_port(sb, int(closed))
            for _ in range(2):
                stream = await backend.open_port(sb, int(port))
                try:
                    await stream.write(b"ping")
                    reply = b""
                    while len(reply) < 9 and (chunk := await asyncio.wait_for(stream.read(100), 10)):
                        reply += chunk
                    assert reply == b"pong:ping", reply
                finally:
                    await stream.aclose()
        finally:
            await proc.aclose()


# -------------------------------------------------------------------------------------------- limits
async def check_large_command(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        chunk = "x" * (64 * 1024)
        r = await run(backend, sb, ["printf", "%s", *([chunk] * 16)], max_output=4 * MiB)
        assert r.exit_code == 0 and len(r.stdout) == 16 * len(chunk), (r.exit_code, len(r.stdout), r.stderr[:200])
        with expect_error(InvalidRequest, "arguments past the kernel's 2 MiB"):
            await run(backend, sb, ["printf", "%s", *([chunk] * 40)])
        with expect_error(InvalidRequest, "one argument past the kernel's 128 KiB per string"):
            await run(backend, sb, ["echo", "y" * (200 * 1024)])
        r = await run(backend, sb, "echo still fine")
        assert r.stdout == b"still fine\n", r


SURFACE_CHECKS = [
    check_exec_as_user, check_files_as_user, check_file_operations, check_file_operations_contained,
    check_file_watch, check_process_handle, check_process_dies_with_sandbox, check_pty, check_shell_session,
    check_port, check_large_command,
]
"""The surface's checks (part of :data:`dsec.testing.CHECKS`)."""
