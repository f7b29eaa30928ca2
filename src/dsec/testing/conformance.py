"""The backend conformance suite: the behaviour every backend must share, checked at the Backend interface.

Each check is ``async def check_x(backend, image) -> None``; :data:`CHECKS` lists them so pytest can
parametrize over them, and :func:`check_backend` runs them all from a :data:`BackendFactory`.

Commands use only ``/bin/sh`` and coreutils, and paths in commands are relative to the working
directory, so the same checks pass on a backend whose processes see the sandbox root as ``/`` and
on the fake backend (host processes in a directory standing in for the root). This module owns the
definition of "a conforming backend"; it never reaches around the Backend interface (no engine,
no HTTP) and never leaves a sandbox behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, cast, get_args

from dsec.backends.base import Backend, ImageRef
from dsec.errors import DSecError, NotFound
from dsec.models import BackendName, ExecEvent, ExecRequest, ExecResult, SandboxRecord, SandboxSpec

__all__ = ["CHECKS", "BackendFactory", "Check", "SharedSandbox", "check_backend", "expect_error", "new_record",
           "own_sandbox", "run", "sandbox"]

BackendFactory = Callable[[], AbstractAsyncContextManager[tuple[Backend, ImageRef]]]
"""Makes a ready backend (``start()`` done) and an image to create sandboxes from; cleans up on exit."""

Check = Callable[[Backend, ImageRef], Awaitable[None]]

MiB = 1024 * 1024
_CHECK_TIMEOUT = 120.0


def new_record(backend_name: str, image: ImageRef | str | None, **spec_overrides: Any) -> SandboxRecord:
    """A fresh ``creating`` record for ``image`` (as the engine would make it), with spec overrides."""
    backend = cast(BackendName, backend_name if backend_name in get_args(BackendName) else "container")
    name = image.name if isinstance(image, ImageRef) else image
    spec = SandboxSpec(image=name, backend=backend, **spec_overrides)
    now = time.time()
    return SandboxRecord(id="sb-" + uuid.uuid4().hex[:12], spec=spec, state="creating", created_at=now,
                         expires_at=now + spec.timeout)


_OWN_SANDBOX: set[str] = set()
_lender: contextvars.ContextVar[SharedSandbox | None] = contextvars.ContextVar("dsec_conformance_lender",
                                                                               default=None)


def own_sandbox(check: Check) -> Check:
    """Mark ``check`` as needing sandboxes of its own even where a :class:`SharedSandbox` lends one: it destroys
    its sandbox, or changes it outside the working directory (the root's files) where no reset can undo it."""
    _OWN_SANDBOX.add(check.__name__)
    return check


class SharedSandbox:
    """One running sandbox of the default spec, lent in turn to checks that only need "a running sandbox".

    On a backend whose sandboxes are slow to make (a guest per sandbox under TCG) this saves a create per
    check. Only :func:`sandbox` calls without spec overrides borrow, one at a time; a check marked
    :func:`own_sandbox`, a spec override or a second sandbox within one check gets a fresh one as before.
    When the borrower returns, ``reset`` (a shell command, for what a backend knows how to undo, e.g.
    ``kill -KILL -1`` where the sandbox has a pid namespace of its own) is run and its working directory is
    emptied; both must succeed and the sandbox must then be as it was lent (an empty working directory), or
    the return fails. A
    borrower that raised, or a reset that failed, gets the sandbox destroyed: the next borrower gets a new
    one, so one failure never leaks into the next check."""

    def __init__(self, backend: Backend, image: ImageRef, reset: str | None = None) -> None:
        self.backend, self.image, self.reset = backend, image, reset
        self.record: SandboxRecord | None = None
        self.lent = False
        self.created = 0
        """How many sandboxes it made (1 unless a borrower failed or broke it)."""

    @contextlib.contextmanager
    def serving(self, check: Check) -> Iterator[None]:
        """Lend to ``check``'s :func:`sandbox` calls while inside (unless it is marked :func:`own_sandbox`)."""
        shares = check.__name__ not in _OWN_SANDBOX
        token = _lender.set(self if shares else None)
        try:
            yield
        finally:
            _lender.reset(token)

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[SandboxRecord]:
        if self.record is None:
            record = new_record(self.backend.name, self.image)
            try:
                await self.backend.create(record, self.image)
            except BaseException:
                await self.backend.destroy(record)
                raise
            record.state = "running"
            self.record, self.created = record, self.created + 1
        self.lent = True
        try:
            yield self.record
        except BaseException:
            await self.discard()
            raise
        finally:
            self.lent = False
        try:
            await self._restore(self.record)
        except BaseException:
            await self.discard()
            raise

    async def _restore(self, record: SandboxRecord) -> None:
        # the reset first: a process it ends can no longer write into the emptied directory. Relative paths:
        # the working directory is the sandbox's /workspace on every backend (fake included)
        clean = "find . -mindepth 1 -delete"
        r = await run(self.backend, record, f"{self.reset} && {clean}" if self.reset else clean, timeout=60)
        left = await run(self.backend, record, "ls -A")
        assert r.exit_code == 0 and left.exit_code == 0 and left.stdout == b"", \
            f"the shared sandbox was not reset: {r} {left}"

    async def discard(self) -> None:
        """Destroy the sandbox (if any); the next borrower gets a new one."""
        record, self.record = self.record, None
        if record is not None:
            await self.backend.destroy(record)

    async def aclose(self) -> None:
        await self.discard()


@contextlib.asynccontextmanager
async def sandbox(backend: Backend, image: ImageRef, **spec_overrides: Any) -> AsyncIterator[SandboxRecord]:
    """Create a sandbox and always destroy it, even when creation fails half-way (or borrow the running
    :class:`SharedSandbox` when one serves this check, and return it reset)."""
    lender = _lender.get()
    if lender is not None and lender.backend is backend and not lender.lent and not spec_overrides:
        async with lender.lend() as shared:
            yield shared
        return
    record = new_record(backend.name, image, **spec_overrides)
    try:
        await backend.create(record, image)
        record.state = "running"
        yield record
    finally:
        await backend.destroy(record)


async def run(backend: Backend, record: SandboxRecord, command: str | list[str], **kw: Any) -> ExecResult:
    """Run one command to completion (default timeout 30 s so a broken backend fails instead of hanging)."""
    kw.setdefault("timeout", 30.0)
    return await backend.exec(record, ExecRequest(command=command, **kw))


def _probe_name() -> str:
    return f"dsec-conformance-{uuid.uuid4().hex[:12]}"


# ------------------------------------------------------------------------------------------ exec
async def check_exit_codes(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        for code in (0, 3, 255):
            r = await run(backend, sb, f"exit {code}")
            assert r.exit_code == code, f"exit {code} reported as {r.exit_code}"
            assert r.ok == (code == 0) and r.limit is None and not r.truncated


async def check_shell_and_argv(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, "echo a  b | tr a-z A-Z; echo $((6 * 7))")
        assert r.stdout == b"A B\n42\n", r
        # an argv list is not re-parsed by a shell: spaces, quotes and globs arrive verbatim
        r = await run(backend, sb, ["/bin/sh", "-c", 'printf "%s|" "$@"', "sh", "a b", "c*", "'q'", "$HOME"])
        assert r.stdout == b"a b|c*|'q'|$HOME|", r
        r = await run(backend, sb, ["printf", "%s", "found via PATH"])
        assert r.exit_code == 0 and r.stdout == b"found via PATH", r


async def check_stdout_stderr_separated(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, "echo out; echo err >&2; echo out2; echo err2 >&2; exit 7")
        assert r.stdout == b"out\nout2\n" and r.stderr == b"err\nerr2\n" and r.exit_code == 7, r


async def check_stdin(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        data = b"line one\n\x00\xff\xfe binary\n" * 1000
        r = await run(backend, sb, "cat", stdin=data)
        assert r.exit_code == 0 and r.stdout == data, (r.exit_code, len(r.stdout))
        # no stdin: the command must see end-of-file, not hang
        r = await run(backend, sb, "cat; echo done", timeout=20)
        assert r.stdout == b"done\n" and r.limit is None, r


async def check_env(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image, env={"DSEC_A": "from spec", "DSEC_B": "from spec"}) as sb:
        r = await run(backend, sb, 'printf "%s|%s|%s" "$DSEC_A" "$DSEC_B" "$DSEC_C"',
                      env={"DSEC_B": "from request", "DSEC_C": "only request"})
        assert r.stdout == b"from spec|from request|only request", r
        r = await run(backend, sb, 'printf "%s|%s" "$DSEC_A" "$DSEC_C"')
        assert r.stdout == b"from spec|", f"request env leaked into a later exec: {r.stdout!r}"
        r = await run(backend, sb, 'printf %s "$PATH"')
        assert b"/bin" in r.stdout, f"PATH not set: {r.stdout!r}"


async def check_cwd(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, "pwd")
        assert r.exit_code == 0 and r.stdout.rstrip(b"\n").endswith(b"/workspace"), r
        await backend.write_file(sb, "/workspace/sub/dir/marker", b"m", None)
        r = await run(backend, sb, "pwd; cat marker", cwd="/workspace/sub/dir")
        assert r.stdout.split(b"\n")[0].endswith(b"/workspace/sub/dir") and r.stdout.endswith(b"\nm"), r
    async with sandbox(backend, image, workdir="/home/agent") as sb:
        r = await run(backend, sb, "pwd")
        assert r.stdout.rstrip(b"\n").endswith(b"/home/agent"), f"custom workdir not used: {r}"


async def check_binary_output(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, r"printf '\377\000\001'; printf '\200\000' >&2")
        assert r.stdout == b"\xff\x00\x01" and r.stderr == b"\x80\x00", r


async def check_large_output(backend: Backend, image: ImageRef) -> None:
    size = 5 * MiB
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, f"yes | head -c {size}", timeout=60)
        assert r.exit_code == 0 and not r.truncated, r.model_copy(update={"stdout": b"..."})
        assert len(r.stdout) == size and r.stdout == b"y\n" * (size // 2), len(r.stdout)


async def check_output_cap(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, "yes", max_output=MiB, timeout=60)
        assert r.truncated and r.limit == "output", r.model_copy(update={"stdout": b"..."})
        assert len(r.stdout) == MiB and r.stdout == b"y\n" * (MiB // 2), len(r.stdout)
        r = await run(backend, sb, "echo still alive")
        assert r.stdout == b"still alive\n"


async def check_timeout(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        # the background job must die with the command: the whole process group is killed (2 s leaves a
        # slow, loaded host time to print "started" before the deadline)
        r = await asyncio.wait_for(
            run(backend, sb, "(sleep 4; echo late > late.txt) & echo started; sleep 30", timeout=2), 30)
        assert r.limit == "time" and r.timed_out and r.exit_code != 0, r
        assert r.stdout == b"started\n", r
        r = await run(backend, sb, "echo ok")
        assert r.stdout == b"ok\n", "sandbox unusable after a timeout"
        await asyncio.sleep(4.5)
        r = await run(backend, sb, "ls")
        assert b"late.txt" not in r.stdout, "a background process survived the command's timeout"


async def _first_chunk(events: AsyncIterator[ExecEvent]) -> ExecEvent:
    async for event in events:
        return event
    raise AssertionError("exec stream ended without any event")


async def check_streaming(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        # the command cannot finish until we react to its first chunk: events must arrive before exit
        cmd = "echo first; while [ ! -e go ]; do sleep 0.05; done; echo second"
        stream = backend.exec_stream(sb, ExecRequest(command=cmd, timeout=30, max_output=MiB))
        try:
            first = await asyncio.wait_for(_first_chunk(stream), 20)
            assert first.type == "stdout" and first.data == b"first\n", first
            await backend.write_file(sb, "/workspace/go", b"", None)
            rest = [e async for e in stream]
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        assert b"".join(e.data or b"" for e in rest if e.type == "stdout") == b"second\n", rest
        assert rest[-1].type == "exit" and rest[-1].result is not None, rest
        assert rest[-1].result.exit_code == 0 and rest[-1].result.stdout == b"first\nsecond\n"
        assert all(e.type != "exit" for e in rest[:-1]), "events after the exit event"


async def check_stream_close_kills(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        cmd = "echo started; while [ ! -e go ]; do sleep 0.05; done; sleep 0.5; echo late > marker.txt"
        stream = backend.exec_stream(sb, ExecRequest(command=cmd, timeout=30, max_output=MiB))
        first = await asyncio.wait_for(_first_chunk(stream), 20)
        assert first.data == b"started\n", first
        await stream.aclose()  # type: ignore[attr-defined]
        await backend.write_file(sb, "/workspace/go", b"", None)
        await asyncio.sleep(1.5)
        try:
            await backend.read_file(sb, "/workspace/marker.txt", 1024)
        except NotFound:
            pass
        else:
            raise AssertionError("closing the exec stream did not kill the command")


async def check_concurrent_execs(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        results = await asyncio.gather(*(
            run(backend, sb, f"sleep 0.2; printf %s {i}; printf e{i} >&2; exit {i}") for i in range(10)
        ))
        for i, r in enumerate(results):
            assert (r.exit_code, r.stdout, r.stderr) == (i, str(i).encode(), f"e{i}".encode()), (i, r)


# ----------------------------------------------------------------------------------------- files
async def check_file_round_trip(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        small = bytes(range(256)) + b"\xff\xfe\x00 not utf-8"
        await backend.write_file(sb, "/workspace/bin.dat", small, None)
        assert await backend.read_file(sb, "/workspace/bin.dat", MiB) == small
        big = os.urandom(3 * MiB)
        await backend.write_file(sb, "/workspace/big.dat", big, None)
        assert await backend.read_file(sb, "/workspace/big.dat", 4 * MiB) == big
        await backend.write_file(sb, "/workspace/bin.dat", b"replaced", None)
        assert await backend.read_file(sb, "/workspace/bin.dat", MiB) == b"replaced"
        await backend.write_file(sb, "/workspace/empty", b"", None)
        assert await backend.read_file(sb, "/workspace/empty", MiB) == b""


async def check_file_mode_and_parents(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        await backend.write_file(sb, "/workspace/a/b/c/run.sh", b"#!/bin/sh\necho ran\n", 0o750)
        entries = {e.name: e for e in await backend.list_files(sb, "/workspace/a/b/c")}
        assert entries["run.sh"].mode & 0o7777 == 0o750, oct(entries["run.sh"].mode)
        r = await run(backend, sb, "./run.sh", cwd="/workspace/a/b/c")
        assert r.stdout == b"ran\n", r
        await backend.write_file(sb, "/workspace/plain.txt", b"x", None)
        r = await run(backend, sb, "[ -f plain.txt ] && [ ! -x plain.txt ] && echo yes")
        assert r.stdout == b"yes\n", "a file written without mode must not be executable"


async def check_list_files(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        await backend.write_file(sb, "/workspace/f.txt", b"12345", None)
        await backend.write_file(sb, "/workspace/d/inner", b"", None)
        r = await run(backend, sb, "ln -s f.txt link")
        assert r.exit_code == 0, r
        entries = {e.name: e for e in await backend.list_files(sb, "/workspace")}
        assert set(entries) == {"f.txt", "d", "link"}, sorted(entries)
        assert (entries["f.txt"].type, entries["f.txt"].size) == ("file", 5)
        assert entries["d"].type == "dir" and entries["link"].type == "symlink"
        assert entries["f.txt"].path == "/workspace/f.txt", entries["f.txt"].path
        assert entries["f.txt"].mtime > 0
        with expect_error(NotFound, "listing a missing directory"):
            await backend.list_files(sb, "/workspace/no-such-dir")


async def check_files_and_exec_agree(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        await backend.write_file(sb, "/workspace/in.txt", b"from the file API\n", None)
        r = await run(backend, sb, "cat in.txt; printf 'from exec\\377' > out.bin")
        assert r.stdout == b"from the file API\n" and r.exit_code == 0, r
        assert await backend.read_file(sb, "/workspace/out.bin", MiB) == b"from exec\xff"


async def check_file_errors(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as sb:
        with expect_error(NotFound, "reading a missing file"):
            await backend.read_file(sb, "/workspace/missing.txt", MiB)
        await backend.write_file(sb, "/workspace/dir/file", b"x", None)
        with expect_error(DSecError, "reading a directory"):
            await backend.read_file(sb, "/workspace/dir", MiB)
        with expect_error(DSecError, "writing over a directory"):
            await backend.write_file(sb, "/workspace/dir", b"x", None)
        with expect_error(DSecError, "listing a regular file"):
            await backend.list_files(sb, "/workspace/dir/file")
        assert await backend.read_file(sb, "/workspace/dir/file", MiB) == b"x"


@own_sandbox
async def check_path_containment(backend: Backend, image: ImageRef) -> None:
    """``..``, absolute paths and symlinks in file-API paths resolve inside the sandbox, never on the host.

    On a backend whose root is read-only (``root_writable`` False) a write outside the workdir must be
    refused with a DSecError; the same paths are then probed through the workdir instead."""
    name = _probe_name()
    host_probe = Path("/") / name
    async with sandbox(backend, image) as sb:
        try:
            if backend.root_writable:
                await backend.write_file(sb, f"/workspace/../../../{name}", b"inside", None)
                assert not host_probe.exists(), "write through '..' landed on the host"
                assert await backend.read_file(sb, f"/{name}", MiB) == b"inside"
                assert await backend.read_file(sb, f"/workspace/../{name}", MiB) == b"inside"
                listed = {e.name for e in await backend.list_files(sb, "/workspace/../..")}
                assert name in listed, "listing '/workspace/../..' is not the sandbox root"
            else:
                with expect_error(DSecError, "writing outside the workdir of a read-only root"):
                    await backend.write_file(sb, f"/workspace/../../../{name}", b"inside", None)
                assert not host_probe.exists(), "write through '..' landed on the host"
                await backend.write_file(sb, f"/workspace/../../workspace/{name}", b"inside", None)
                assert await backend.read_file(sb, f"/workspace/{name}", MiB) == b"inside"
                assert await backend.read_file(sb, f"/../workspace/../workspace/{name}", MiB) == b"inside"
                listed = {e.name for e in await backend.list_files(sb, "/workspace/../..")}
                assert "workspace" in listed, "listing '/workspace/../..' is not the sandbox root"
            # a symlink planted by the agent must not lead the file API out of the sandbox
            r = await run(backend, sb, "ln -s / escape && ln -s /etc etc-link")
            assert r.exit_code == 0, r
            with contextlib.suppress(DSecError):  # refusing is fine too
                await backend.write_file(sb, f"/workspace/escape/{name}-2", b"via link", None)
            assert not Path(f"/{name}-2").exists(), "write through a symlink landed on the host"
            host_shadow = _host_bytes("/etc/shadow")
            for path in ("/workspace/../../etc/shadow", "/etc/shadow", "/workspace/etc-link/shadow"):
                try:
                    data = await backend.read_file(sb, path, 16 * MiB)
                except DSecError:
                    continue
                assert host_shadow is None or data != host_shadow, f"{path} read the host's /etc/shadow"
        finally:
            for leaked in (host_probe, Path(f"/{name}-2")):
                with contextlib.suppress(OSError):
                    leaked.unlink()


async def check_state_between_execs(backend: Backend, image: ImageRef) -> None:
    """What one exec leaves for the next: the workdir always; background processes only where the backend
    says so (``processes_persist``). Writes outside the workdir are :func:`check_path_containment`'s."""
    async with sandbox(backend, image) as sb:
        r = await run(backend, sb, "(sleep 1; echo late > late.txt) >/dev/null 2>&1 & echo started; "
                                   "echo kept > kept.txt")
        assert r.stdout == b"started\n", r
        assert r.duration_s < 10, f"the exec waited for its background job: {r}"
        await asyncio.sleep(2.0)
        r = await run(backend, sb, "cat kept.txt; ls")
        assert r.stdout.startswith(b"kept\n"), f"the workdir did not persist between execs: {r}"
        survived = b"late.txt" in r.stdout
        assert survived == backend.processes_persist, (
            f"processes_persist={backend.processes_persist} but the background job "
            f"{'ran on' if survived else 'died'} after its exec returned")


def _host_bytes(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


# ----------------------------------------------------------------------------------- lifecycle
@own_sandbox
async def check_destroy(backend: Backend, image: ImageRef) -> None:
    record = new_record(backend.name, image)
    try:
        await backend.create(record, image)
        await backend.write_file(record, "/workspace/x", b"x", None)
        r = await run(backend, record, "echo alive")
        assert r.stdout == b"alive\n"
    finally:
        await backend.destroy(record)
    await backend.destroy(record)  # idempotent
    try:
        r = await run(backend, record, "echo zombie", timeout=10)
    except (DSecError, OSError):
        pass
    else:
        raise AssertionError(f"exec on a destroyed sandbox returned {r!r}")
    with expect_error((DSecError, OSError), "reading a file of a destroyed sandbox"):
        await backend.read_file(record, "/workspace/x", MiB)


async def check_sandboxes_isolated_files(backend: Backend, image: ImageRef) -> None:
    async with sandbox(backend, image) as a, sandbox(backend, image) as b:
        await backend.write_file(a, "/workspace/only-a", b"a", None)
        with expect_error(NotFound, "one sandbox's file visible in another"):
            await backend.read_file(b, "/workspace/only-a", MiB)
        r = await run(backend, b, "ls")
        assert b"only-a" not in r.stdout, r


@contextlib.contextmanager
def expect_error(exc: type[BaseException] | tuple[type[BaseException], ...], what: str) -> Any:
    try:
        yield
    except exc:
        return
    except BaseException as other:
        raise AssertionError(f"{what}: expected {exc}, got {type(other).__name__}: {other}") from other
    raise AssertionError(f"{what}: expected {exc}, nothing was raised")


CHECKS: list[Check] = [
    check_exit_codes, check_shell_and_argv, check_stdout_stderr_separated, check_stdin, check_env,
    check_cwd, check_binary_output, check_large_output, check_output_cap, check_timeout,
    check_streaming, check_stream_close_kills, check_concurrent_execs,
    check_file_round_trip, check_file_mode_and_parents, check_list_files, check_files_and_exec_agree,
    check_file_errors, check_path_containment, check_state_between_execs, check_destroy,
    check_sandboxes_isolated_files,
]
"""Every conformance check, in a stable order (pytest ids: their ``__name__``)."""

from dsec.testing.conformance_surface import SURFACE_CHECKS  # noqa: E402 (built on the helpers above)

CHECKS += SURFACE_CHECKS


async def check_backend(factory: BackendFactory, checks: list[Check] | None = None) -> None:
    """Run every check (own sandbox each, bounded in time); raise one AssertionError listing the failures."""
    failures: list[str] = []
    async with factory() as (backend, image):
        for check in checks or CHECKS:
            try:
                await asyncio.wait_for(check(backend, image), _CHECK_TIMEOUT)
            except Exception as exc:
                failures.append(f"{check.__name__}: {type(exc).__name__}: {exc}")
    if failures:
        raise AssertionError(f"{len(failures)} conformance check(s) failed:\n" + "\n".join(failures))
