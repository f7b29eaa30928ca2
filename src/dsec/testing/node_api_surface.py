"""The node API conformance checks of the sandbox surface: users, file operations and watches, process handles
and terminals, shell sessions, exposed ports (part of :data:`dsec.testing.node_api.NODE_CHECKS`).

Same rules as :mod:`dsec.testing.node_api`: only the protocol, the same checks on the engine, a daemon and a
gateway, nothing left behind. Where the backend behind ``image`` cannot act as a user other than root (the
fake backend runs everything as the test's user), the check accepts the documented :class:`~dsec.NotSupported`
there; the backend conformance kit (:mod:`dsec.testing.conformance_surface`) holds each backend to users. An
exposed port is reached at the URL the target answered, as the target's client would, so a gateway must
answer one its clients reach. The servers the checks start in a sandbox listen on ports the kernel picked
and say which; a port "nothing listens on" is one a sandbox process holds bound without listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import AsyncIterator, Iterator

import httpx

from dsec.api.operations import close_stream
from dsec.api.protocol import NodeAPI
from dsec.errors import (
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    InvalidRequest,
    IsADirectory,
    NotADirectory,
    NotFound,
    NotSupported,
    PermissionDenied,
    ProcessNotFound,
    SandboxFileError,
    UserNotFound,
)
from dsec.models import ExecRequest, SandboxInfo, SandboxSpec
from dsec.models.surface import (
    ExposeRequest,
    MkdirRequest,
    ProcessRequest,
    PtySize,
    RenameRequest,
    ShellRequest,
    ShellRunRequest,
    WatchRequest,
    XattrRequest,
)

__all__ = ["ECHO_SERVER", "SURFACE_NODE_CHECKS", "echo_server"]

_WAIT = 20.0
_NOBODY = "no-such-user-dsec"


@contextlib.asynccontextmanager
async def _sandbox(api: NodeAPI, image: str) -> AsyncIterator[SandboxInfo]:
    info = await api.create(SandboxSpec(image=image))
    try:
        yield info
    finally:
        await api.destroy(info.id)


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None, reason: str | None = None) -> Iterator[None]:
    """Expect ``kind`` (saying ``match``; for a file error, with the errno named ``reason``)."""
    try:
        yield
    except kind as exc:
        assert match is None or match in str(exc), f"{kind.__name__} says {exc!s}, not {match!r}"
        if reason is not None:
            assert isinstance(exc, SandboxFileError), exc
            assert (exc.detail.get("reason"), exc.errno) == (reason, getattr(errno, reason)), exc.detail
        return
    raise AssertionError(f"no {kind.__name__} was raised")


async def check_users(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        await api.write_file(sb.id, "secret", b"s", 0o600, user="root")
        assert await api.read_file(sb.id, "secret", user="root") == b"s"
        r = await api.exec(sb.id, ExecRequest(command="id -u", user="0:0", timeout=30))
        assert (r.exit_code, r.stdout) == (0, b"0\n"), r
        with _raises(UserNotFound, _NOBODY):
            await api.read_file(sb.id, "secret", user=_NOBODY)
        with _raises(UserNotFound, _NOBODY):
            await api.exec(sb.id, ExecRequest(command="true", user=_NOBODY))
        with _raises(UserNotFound, _NOBODY):
            await api.start_process(sb.id, ProcessRequest(command=["true"], user=_NOBODY))
        with _raises(UserNotFound, _NOBODY):
            await api.start_shell(sb.id, ShellRequest(user=_NOBODY))
        try:  # an id the sandbox's passwd lacks is taken as it is: checked as that user, not as the daemon
            await api.read_file(sb.id, "secret", user="4242:4242")
        except NotSupported:  # a backend that runs everything as one user
            pass
        except PermissionDenied as exc:
            assert exc.detail.get("reason") == "EACCES" and isinstance(exc, PermissionError), exc.detail
        else:
            raise AssertionError("uid 4242 read root's mode-0600 file")
        assert (await api.exec(sb.id, ExecRequest(command="true", timeout=30))).exit_code == 0  # still usable


async def _check_xattrs(api: NodeAPI, sandbox_id: str, path: str) -> None:
    """Extended attributes set, read back by stat, removed (an absent one too); the backends whose files API has
    none answer NotSupported."""
    try:
        tagged = await api.set_xattrs(sandbox_id, XattrRequest(path=path, set={"user.origin": "check", "user.n": "1"}))
    except NotSupported:
        return
    assert tagged.xattrs == {"user.origin": "check", "user.n": "1"}, tagged
    await api.set_xattrs(sandbox_id, XattrRequest(path=path, remove=["user.n", "user.absent"]))
    assert (await api.stat_file(sandbox_id, path)).xattrs == {"user.origin": "check"}
    with _raises(InvalidRequest, "user namespace"):
        await api.set_xattrs(sandbox_id, XattrRequest.model_construct(path=path, set={"trusted.x": "1"}, remove=[]))


async def check_file_operations(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        made = await api.make_dir(sb.id, MkdirRequest(path="d/e", parents=True, mode=0o750))
        assert (made.path, made.type, made.mode) == ("/workspace/d/e", "dir", 0o750), made
        await api.write_file(sb.id, "d/f", b"xyz")  # relative to the workdir
        stat = await api.stat_file(sb.id, "/workspace/d/f")
        assert (stat.name, stat.size, stat.type, stat.uid) == ("f", 3, "file", 0), stat
        moved = await api.rename_file(sb.id, RenameRequest(source="d/f", destination="g"))
        assert moved.path == "/workspace/g", moved
        assert (await api.chmod_file(sb.id, "g", 0o600)).mode == 0o600
        assert (await api.chown_file(sb.id, "g", "0:0")).uid == 0
        await _check_xattrs(api, sb.id, "g")
        with _raises(FileNotFound, "nope", reason="ENOENT"):
            await api.stat_file(sb.id, "nope")
        with _raises(IsADirectory, reason="EISDIR"):
            await api.write_file(sb.id, "d", b"onto a directory")
        with _raises(NotADirectory, reason="ENOTDIR"):
            await api.make_dir(sb.id, MkdirRequest(path="g/under-a-file"))
        with _raises(FileExists, reason="EEXIST"):
            await api.make_dir(sb.id, MkdirRequest(path="d"))
        await api.write_file(sb.id, "d/h", b"")
        with _raises(FileExists, reason="EEXIST"):
            await api.rename_file(sb.id, RenameRequest(source="g", destination="d/h", overwrite=False))
        with _raises(DirectoryNotEmpty, reason="ENOTEMPTY"):
            await api.remove_file(sb.id, "d")
        with _raises(UserNotFound, _NOBODY):
            await api.chown_file(sb.id, "g", _NOBODY)
        with _raises(InvalidRequest, "NUL"):
            await api.stat_file(sb.id, "a\0b")
        made = await api.make_dir(sb.id, MkdirRequest(path="../../../../../top-level"))  # '..' stops at the root
        assert made.path == "/top-level" and (await api.stat_file(sb.id, "/top-level")).type == "dir", made
        await api.remove_file(sb.id, "d", recursive=True)
        with _raises(FileNotFound, reason="ENOENT"):
            await api.remove_file(sb.id, "d")
        assert [e.name for e in await api.list_files(sb.id, "/workspace")] == ["g"]


async def check_file_watch(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        await api.make_dir(sb.id, MkdirRequest(path="sub"))
        await api.write_file(sb.id, "sub/new", b"1")
        watch = await api.watch_files(sb.id, WatchRequest(path="/workspace", recursive=True))
        assert [w.id for w in await api.list_watches(sb.id)] == [watch.id]
        await api.make_dir(sb.id, MkdirRequest(path="made"))
        await api.rename_file(sb.id, RenameRequest(source="sub/new", destination="moved"))
        await api.remove_file(sb.id, "moved")
        wanted = [("create", "/workspace/made", None), ("move", "/workspace/sub/new", "/workspace/moved"),
                  ("delete", "/workspace/moved", None)]
        seen: list[tuple[str, str, str | None]] = []
        numbers: list[int] = []
        events = api.watch_events(sb.id, watch.id)  # followed: events as they come
        try:
            async with asyncio.timeout(_WAIT):
                async for event in events:
                    seen.append((event.type, event.path, event.dest))
                    numbers.append(event.number)
                    if seen[-1] == wanted[-1]:
                        break
        except TimeoutError:
            raise AssertionError(f"the watch's events never came: {seen}") from None
        finally:
            await close_stream(events)
        assert [e for e in seen if e in wanted] == wanted, seen  # in the order they happened
        assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), numbers
        later = [e.number async for e in api.watch_events(sb.id, watch.id, since=numbers[-1], follow=False)]
        assert later[:1] == [numbers[-1]], later
        await api.unwatch(sb.id, watch.id)
        with _raises(ProcessNotFound):
            await api.unwatch(sb.id, watch.id)
        with _raises(FileNotFound):
            await api.watch_files(sb.id, WatchRequest(path="/workspace/absent"))


async def check_processes(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        cat = await api.start_process(sb.id, ProcessRequest(command=["cat"], tag="echo"))
        assert cat.running and cat.tag == "echo" and cat.stdin_open, cat
        await api.send_stdin(sb.id, cat.pid, b"round trip")
        await api.close_stdin(sb.id, cat.pid)
        done = await api.wait_process(sb.id, cat.pid, timeout=_WAIT)
        assert (done.running, done.exit_code) == (False, 0), done
        events = [e async for e in api.process_output(sb.id, cat.pid)]
        assert b"".join(e.data or b"" for e in events if e.type == "stdout") == b"round trip", events
        assert events[-1].type == "exit" and events[-1].exit_code == 0, events
        tail = [e async for e in api.process_output(sb.id, cat.pid, stdout=6)]
        assert b"".join(e.data or b"" for e in tail if e.type == "stdout") == b"trip", tail
        sleeper = await api.start_process(sb.id, ProcessRequest(command=["sleep", "100"]))
        await api.close_stdin(sb.id, sleeper.pid)
        with _raises(InvalidRequest, "closed"):
            await api.send_stdin(sb.id, sleeper.pid, b"too late")
        assert {p.pid for p in await api.list_processes(sb.id)} == {cat.pid, sleeper.pid}
        assert (await api.get_process(sb.id, sleeper.pid)).running  # found again by pid (any client)
        await api.signal_process(sb.id, sleeper.pid, 9)
        killed = await api.wait_process(sb.id, sleeper.pid, timeout=_WAIT)
        assert (killed.exit_code, killed.signal) == (137, 9), killed
        assert (await api.get_process(sb.id, sleeper.pid)).running is False
        for call in (api.get_process(sb.id, 1 << 30), api.send_stdin(sb.id, 1 << 30, b"x"),
                     api.signal_process(sb.id, 1 << 30, 15)):
            with _raises(ProcessNotFound, str(1 << 30)):
                await call


async def check_process_output_tail(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:  # past the node's buffer (4 MiB): a late reader gets the tail
        big = await api.start_process(sb.id, ProcessRequest(command="head -c 4500000 /dev/zero; echo END"))
        done = await api.wait_process(sb.id, big.pid, timeout=_WAIT)
        assert done.exit_code == 0 and done.output_bytes.get("stdout") == 4_500_004, done
        dropped = done.dropped_bytes.get("stdout", 0)
        assert dropped > 0, done
        events = [e async for e in api.process_output(sb.id, big.pid, follow=False)]
        assert events[0].type == "dropped" and (events[0].dropped, events[0].offset) == (dropped, dropped), events[0]
        kept = b"".join(e.data or b"" for e in events if e.type == "stdout")
        assert len(kept) == 4_500_004 - dropped and kept.endswith(b"\0END\n"), len(kept)


async def check_terminal(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        term = await api.start_process(sb.id, ProcessRequest(command="read x; stty size; echo got=$x",
                                                             pty=PtySize(cols=90, rows=30)))
        assert term.pty == PtySize(cols=90, rows=30), term
        await api.resize_process(sb.id, term.pid, PtySize(cols=100, rows=40))
        await api.send_stdin(sb.id, term.pid, b"typed\n")
        assert (await api.wait_process(sb.id, term.pid, timeout=_WAIT)).exit_code == 0
        out = b"".join([e.data or b"" async for e in api.process_output(sb.id, term.pid) if e.type == "pty"])
        assert b"40 100" in out and b"got=typed" in out, out
        plain = await api.start_process(sb.id, ProcessRequest(command=["sleep", "100"]))
        with _raises(InvalidRequest, "terminal"):
            await api.resize_process(sb.id, plain.pid, PtySize(cols=10, rows=10))
        await api.signal_process(sb.id, plain.pid, 9)


async def check_shell_sessions(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        shell = await api.start_shell(sb.id, ShellRequest())
        assert [s.id for s in await api.list_shells(sb.id)] == [shell.id]
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="cd /tmp && export X=7 && f() { echo f$1; }"))
        assert r.exit_code == 0, r
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="pwd; echo $X; f 1; echo e >&2; (exit 3)"))
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"/tmp\n7\nf1\n", b"e\n"), r
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="sleep 100", timeout=0.5))
        assert r.timed_out, r
        r = await api.run_shell(sb.id, shell.id, ShellRunRequest(command="echo $X $PWD"))  # interrupted, usable
        assert (r.exit_code, r.stdout) == (0, b"7 /tmp\n"), r
        await api.close_shell(sb.id, shell.id)
        assert await api.list_shells(sb.id) == []
        with _raises(ProcessNotFound, shell.id):
            await api.run_shell(sb.id, shell.id, ShellRunRequest(command="true"))


ECHO_SERVER = """
import http.server, socket
closed = socket.socket(); closed.bind(("127.0.0.1", 0))  # held, never listening: a port nothing listens on
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("you said " + self.path + " token=" + str(self.headers.get("X-DSec-Token"))).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", 0), Echo)
print("ports", server.server_port, closed.getsockname()[1], flush=True)
server.serve_forever()
"""
"""A Python HTTP server answering ``you said <path> token=<X-DSec-Token it got>``; it prints ``ports <its port>
<a port held bound that nothing listens on>``."""


async def echo_server(api: NodeAPI, sandbox_id: str) -> tuple[int, int]:
    """Start :data:`ECHO_SERVER` in the sandbox: its port, and a port nothing listens on."""
    proc = await api.start_process(sandbox_id, ProcessRequest(command=["python3", "-c", ECHO_SERVER]))
    deadline = time.monotonic() + _WAIT
    while time.monotonic() < deadline:
        out = b"".join([e.data or b"" async for e in api.process_output(sandbox_id, proc.pid, follow=False)
                        if e.type == "stdout"])
        if out.endswith(b"\n"):
            _, port, closed = out.split()
            return int(port), int(closed)
        await asyncio.sleep(0.05)
    raise AssertionError("the test server in the sandbox did not start")


async def check_ports(api: NodeAPI, image: str) -> None:
    async with _sandbox(api, image) as sb:
        port, closed = await echo_server(api, sb.id)
        exposed = await api.expose_port(sb.id, ExposeRequest(port=port))
        assert exposed.protocol == "http" and exposed.url and exposed.token, exposed
        assert await api.list_ports(sb.id) == [exposed] and await api.get_port(sb.id, port) == exposed
        async with httpx.AsyncClient(timeout=_WAIT) as client:
            refused = await client.get(exposed.url)
            assert refused.status_code == 401, refused.text
            reached = await client.get(exposed.url + "/x?y=1", headers=exposed.headers)
            assert (reached.status_code, reached.text) == (200, "you said /x?y=1 token=None"), reached.text
            nothing = await api.expose_port(sb.id, ExposeRequest(port=closed))
            gone = await client.get(nothing.url or "", headers=nothing.headers)
            assert gone.status_code == 502 and f"port {closed}" in gone.text, gone.text
            raw = await api.expose_port(sb.id, ExposeRequest(port=port, protocol="tcp"))
            assert raw.url is None and raw.token == exposed.token, raw
            reader, writer = await asyncio.open_connection(raw.host, raw.host_port)
            writer.write(f"DSEC {raw.token}\nGET /raw HTTP/1.0\r\n\r\n".encode())
            reply = await asyncio.wait_for(reader.read(), _WAIT)
            writer.close()
            assert reply.startswith(b"HTTP/1.0 200") and reply.endswith(b"you said /raw token=None"), reply
            await api.unexpose_port(sb.id, port)
            with _raises(NotFound, str(port)):
                await api.get_port(sb.id, port)
            with _raises(NotFound, str(port)):
                await api.unexpose_port(sb.id, port)
            try:
                cut = await client.get(exposed.url, headers=exposed.headers)
            except httpx.TransportError:
                pass
            else:
                raise AssertionError(f"an unexposed port still answers: {cut.status_code} {cut.text}")
        assert [p.port for p in await api.list_ports(sb.id)] == [closed]
        with _raises(InvalidRequest):  # not checked here (model_construct): the target refuses it
            await api.expose_port(sb.id, ExposeRequest.model_construct(port=0, protocol="http"))


SURFACE_NODE_CHECKS = (check_users, check_file_operations, check_file_watch, check_processes,
                       check_process_output_tail, check_terminal, check_shell_sessions, check_ports)
"""The surface's checks, in the order of their operations in :class:`NodeAPI`."""
