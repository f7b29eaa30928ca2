"""Process handles, terminals and shell sessions of a sandbox handle, through the node API.

Owns :class:`AsyncProcess` (a process the node keeps: ``exec(background=True)``, ``pty()``, or found again
with ``processes.connect(pid)``), :class:`AsyncProcesses` (``sandbox.processes``) and :class:`AsyncShell`
(``sandbox.shell()``). A handle holds no connection and no state of the process: any number of handles, in
any clients, drive the same process. Calls that change state are numbered on a trajectory handle. It never
spells a route.
"""

from __future__ import annotations

import builtins
import signal as signals
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pydantic

from dsec.api.operations import close_stream
from dsec.errors import InvalidRequest
from dsec.models import ExecResult
from dsec.models.surface import (
    ProcessEvent,
    ProcessInfo,
    ProcessRequest,
    PtySize,
    ShellInfo,
    ShellRequest,
    ShellResult,
    ShellRunRequest,
)

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

__all__ = ["AsyncProcess", "AsyncProcesses", "AsyncShell", "process_request", "shell_request"]


def process_request(**fields: Any) -> ProcessRequest:
    """A :class:`ProcessRequest`, refused locally (naming the field) when malformed."""
    try:
        return ProcessRequest(**fields)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"invalid process request: {problems}") from None


class AsyncProcess:
    """A process of a sandbox that the node keeps: it outlives the call that started it and this client, and
    dies with its sandbox. Its output is kept (the newest 4 MiB per stream) for any reader."""

    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo) -> None:
        self._sandbox = sandbox
        self._info = info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self.pid}, command={self._info.command!r})"

    @property
    def pid(self) -> int:
        """Its pid inside the sandbox."""
        return self._info.pid

    async def info(self) -> ProcessInfo:
        """Its state now (running, exit status, bytes written and dropped per stream)."""
        sb = self._sandbox
        self._info = await sb._api.get_process(sb.id, self.pid)
        return self._info

    async def wait(self, timeout: float | None = None) -> ProcessInfo:
        """Its info once it has ended (or after ``timeout`` seconds: ``running`` says which)."""
        sb, pid = self._sandbox, self.pid
        self._info = await sb._logged_call("process.wait", {"pid": pid, "timeout": timeout},
                                           lambda seq: sb._api.wait_process(sb.id, pid, timeout, seq))
        return self._info

    async def result(self, timeout: float | None = None) -> ExecResult:
        """Wait for it, then its exit status and all the output kept, as an exec's result (``truncated``: the
        start of a stream was no longer kept)."""
        done = await self.wait(timeout)
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray(), "pty": bytearray()}
        dropped = False
        async for event in self.events(follow=False):
            if event.type in out and event.data:
                out[event.type] += event.data
            dropped = dropped or event.type == "dropped"
        return ExecResult(exit_code=done.exit_code if done.exit_code is not None else -1,
                          stdout=bytes(out["stdout"] or out["pty"]), stderr=bytes(out["stderr"]), truncated=dropped,
                          signal=done.signal, duration_s=max((done.ended_at or done.started_at) - done.started_at, 0))

    async def events(self, offsets: Mapping[str, int] | None = None, follow: bool = True
                     ) -> AsyncGenerator[ProcessEvent, None]:
        """Its output from ``offsets`` (bytes per stream already read; default: all that is kept) and, with
        ``follow``, as it comes, then its ``exit``. A ``dropped`` event says how much output before the kept
        buffer a late reader missed."""
        sb, at = self._sandbox, dict(offsets or {})
        stream = sb._api.process_output(sb.id, self.pid, at.get("stdout", 0), at.get("stderr", 0), at.get("pty", 0),
                                        follow)
        try:
            async for event in stream:
                yield event
        finally:
            await close_stream(stream)

    async def stdout(self) -> AsyncGenerator[bytes, None]:
        """Its standard output (its terminal's output, on one) from the start, as it comes, until it ends."""
        async for event in self.events():
            if event.type in ("stdout", "pty") and event.data:
                yield event.data

    async def stderr(self) -> AsyncGenerator[bytes, None]:
        """Its standard error from the start, as it comes, until it ends."""
        async for event in self.events():
            if event.type == "stderr" and event.data:
                yield event.data

    async def send_stdin(self, data: bytes | str) -> None:
        """Write to its standard input (its terminal's input, on one: what a user types)."""
        sb, pid, body = self._sandbox, self.pid, data.encode() if isinstance(data, str) else bytes(data)
        await sb._logged_call("process.stdin", {"pid": pid, "data": body},
                              lambda seq: sb._api.send_stdin(sb.id, pid, body, seq))

    async def close_stdin(self) -> None:
        """End its standard input (EOF; Ctrl-D on a terminal)."""
        sb, pid = self._sandbox, self.pid
        await sb._logged_call("process.close_stdin", {"pid": pid},
                              lambda seq: sb._api.close_stdin(sb.id, pid, seq))

    async def kill(self, signal: int = signals.SIGKILL, group: bool = True) -> None:
        """Send ``signal`` (default SIGKILL) to its process group (``group=False``: to it alone)."""
        sb, pid = self._sandbox, self.pid
        await sb._logged_call("process.signal", {"pid": pid, "signal": int(signal), "group": group},
                              lambda seq: sb._api.signal_process(sb.id, pid, int(signal), group, seq))

    async def resize(self, cols: int, rows: int) -> None:
        """Set its terminal's size (SIGWINCH to its foreground job)."""
        sb, pid = self._sandbox, self.pid
        try:
            size = PtySize(cols=cols, rows=rows)
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid terminal size: {exc.errors()[0]['msg']}") from None
        await sb._logged_call("process.resize", {"pid": pid, "cols": cols, "rows": rows},
                              lambda seq: sb._api.resize_process(sb.id, pid, size, seq))


class AsyncProcesses:
    """``sandbox.processes``: the processes the node keeps for this sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def start(self, command: str | Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
                    user: str | None = None, stdin: str | bytes | None = None, keep_stdin: bool = True,
                    tag: str | None = None, timeout: float | None = None) -> AsyncProcess:
        """Start ``command`` in the background (what ``exec(..., background=True)`` does)."""
        request = process_request(command=command if isinstance(command, str) else builtins.list(command), cwd=cwd,
                                  env=dict(env) if env is not None else None, user=user,
                                  stdin=stdin.encode() if isinstance(stdin, str) else stdin, keep_stdin=keep_stdin,
                                  tag=tag, timeout=timeout)
        return await self._start(request)

    async def _start(self, request: ProcessRequest) -> AsyncProcess:
        sb = self._sandbox
        info: ProcessInfo = await sb._logged_call(
            "process", request.model_dump(mode="python", exclude_none=True),
            lambda seq: sb._api.start_process(sb.id, request, seq))
        return AsyncProcess(sb, info)

    async def list(self) -> builtins.list[ProcessInfo]:
        """The sandbox's processes started through DSec, running and recently ended, by any client."""
        sb = self._sandbox
        return await sb._api.list_processes(sb.id)

    async def connect(self, pid: int) -> AsyncProcess:
        """A handle on a process started earlier (by this client or another); :class:`dsec.ProcessNotFound`
        when the sandbox has none with that pid."""
        sb = self._sandbox
        return AsyncProcess(sb, await sb._api.get_process(sb.id, pid))


class AsyncShell:
    """A persistent ``bash`` session of a sandbox: the working directory, exported variables and shell
    functions persist from one :meth:`run` to the next. ``async with`` closes it."""

    def __init__(self, sandbox: AsyncSandbox, info: ShellInfo) -> None:
        self._sandbox = sandbox
        self._info = info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self._info.id!r}, pid={self._info.pid})"

    @property
    def id(self) -> str:
        """The session's id."""
        return self._info.id

    @property
    def pid(self) -> int:
        """Its ``bash``'s pid inside the sandbox."""
        return self._info.pid

    async def run(self, command: str, timeout: float | None = 60, max_output: int = 16 * 1024 * 1024
                  ) -> ShellResult:
        """Run ``command`` as typed at the session's prompt: its exit status, stdout and stderr. Past ``timeout``
        seconds it is interrupted (Ctrl-C, then SIGKILL of its job: ``timed_out``) and the session goes on."""
        try:
            request = ShellRunRequest(command=command, timeout=timeout, max_output=max_output)
        except pydantic.ValidationError as exc:
            raise InvalidRequest(f"invalid shell command: {exc.errors()[0]['msg']}") from None
        sb, session = self._sandbox, self.id
        result: ShellResult = await sb._logged_call(
            "shell.run", {"session": session, **request.model_dump()},
            lambda seq: sb._api.run_shell(sb.id, session, request, seq))
        return result

    async def close(self) -> None:
        """End the session (its bash and its jobs)."""
        sb, session = self._sandbox, self.id
        await sb._logged_call("shell.close", {"session": session},
                              lambda seq: sb._api.close_shell(sb.id, session, seq))

    async def __aenter__(self) -> AsyncShell:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def shell_request(user: str | None, cwd: str | None, env: Mapping[str, str] | None) -> ShellRequest:
    """A :class:`ShellRequest`, refused locally when malformed."""
    try:
        return ShellRequest(user=user, cwd=cwd, env=dict(env) if env is not None else None)
    except pydantic.ValidationError as exc:
        raise InvalidRequest(f"invalid shell session: {exc.errors()[0]['msg']}") from None
