"""envd's Process service (``spec/envd/process/process.proto``) over DSec's exec.

Owns the translation of ``Start`` into a streamed DSec exec (``/bin/bash -l -c CMD`` as the SDK sends it,
its envs, cwd and the Connect deadline as the command's timeout) and of DSec's output and exit into
envd's start, data, keep-alive and end events. The calls that need DSec's process handles and terminals
(Connect, List, SendInput, StreamInput, SendSignal, CloseStdin, Update, PTYs, stdin) answer
``unimplemented`` naming what is missing. It must never keep processes of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.wire import Code, ConnectError, Oneof, RequestContext, process_pb
from dsec.errors import DSecError, NotFound, SandboxTimeout
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxInfo

__all__ = ["ProcessService", "Target", "current_target", "resolve_path"]

_NO_HANDLES = ("is not supported by this DSec version: it needs DSec's process handles and terminals "
               "(foreground commands work)")
_TEARDOWN_WAIT = 2.0
_MAX_OUTPUT = 1 << 40  # a streamed command's output is not captured: E2B has no cap on it


@dataclass
class Target:
    """The sandbox an envd request is for (set by the app once the access token checked out)."""

    info: SandboxInfo
    aborted: bool = False
    """Set when the sandbox went away mid-stream: the app then cuts the connection, as a dead envd would."""


current_target: ContextVar[Target] = ContextVar("dsec_e2b_target")


def resolve_path(info: SandboxInfo, path: str) -> str:
    """An envd path inside the sandbox: relative ones are below its working directory (E2B: the user's home)."""
    if not path:
        return info.spec.workdir or "/"
    if path.startswith("/"):
        return path
    if path == "~" or path.startswith("~/"):
        path = path[2:]
    base = (info.spec.workdir or "/").rstrip("/")
    return f"{base}/{path}"


def user_of(ctx: RequestContext[Any, Any]) -> str | None:
    """The user an envd call asks for (``Authorization: Basic base64(user:)``), None for the default."""
    import base64

    header = ctx.request_headers.get("authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        user = base64.b64decode(header[6:]).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "malformed Basic authorization header") from None
    return user or None


def _event(event: process_pb.ProcessEvent) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=event)


def _start(pid: int) -> process_pb.StartResponse:
    start: Oneof[Literal["start"], process_pb.ProcessEvent.StartEvent] = Oneof(
        "start", process_pb.ProcessEvent.StartEvent(pid=pid))
    return _event(process_pb.ProcessEvent(event=start))


def _data(kind: str, data: bytes) -> process_pb.StartResponse:
    stdout: Oneof[Literal["stdout"], bytes] = Oneof("stdout", data)
    stderr: Oneof[Literal["stderr"], bytes] = Oneof("stderr", data)
    output = stdout if kind == "stdout" else stderr
    event: Oneof[Literal["data"], process_pb.ProcessEvent.DataEvent] = Oneof(
        "data", process_pb.ProcessEvent.DataEvent(output=output))
    return _event(process_pb.ProcessEvent(event=event))


def _keepalive() -> process_pb.StartResponse:
    event: Oneof[Literal["keepalive"], process_pb.ProcessEvent.KeepAlive] = Oneof(
        "keepalive", process_pb.ProcessEvent.KeepAlive())
    return _event(process_pb.ProcessEvent(event=event))


def _end(result: ExecResult) -> process_pb.StartResponse:
    sig = result.signal
    if sig is not None:
        try:
            name = signal.Signals(sig).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(sig)
        end = process_pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    else:
        end = process_pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=True,
                                               status=f"exit status {result.exit_code}")
    if result.limit is not None:
        end.error = f"killed at DSec's {result.limit} limit"
    event: Oneof[Literal["end"], process_pb.ProcessEvent.EndEvent] = Oneof("end", end)
    return _event(process_pb.ProcessEvent(event=event))


async def _with_keepalive(events: AsyncIterator[ExecEvent], every: float | None) -> AsyncIterator[ExecEvent | None]:
    """``events``, with a None whenever ``every`` seconds pass without one (envd's keep-alive)."""
    if not every:
        async for event in events:
            yield event
        return
    pending: asyncio.Task[ExecEvent] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


class ProcessService:
    """The Process service of one node API (the sandbox comes from :data:`current_target`)."""

    def __init__(self, api: NodeAPI) -> None:
        self.api = api

    async def start(self, request: process_pb.StartRequest,
                    ctx: RequestContext[process_pb.StartRequest, process_pb.StartResponse]
                    ) -> AsyncIterator[process_pb.StartResponse]:
        """Run a command, streaming envd's events."""
        target = current_target.get()
        exec_request = self._exec_request(request, ctx)
        keepalive = ctx.request_headers.get("keepalive-ping-interval")
        every = float(keepalive) if keepalive and keepalive.isdigit() and int(keepalive) > 0 else None
        try:
            stream = self.api.exec_stream(target.info.id, exec_request)
        except DSecError as exc:
            raise translate.connect_error(exc) from None
        yield _start(0)
        try:
            async for event in _with_keepalive(stream, every):
                if event is None:
                    yield _keepalive()
                elif event.type in ("stdout", "stderr") and event.data:
                    yield _data(event.type, event.data)
                elif event.type == "exit" and event.result is not None:
                    if event.result.limit == "time":
                        raise ConnectError(Code.DEADLINE_EXCEEDED,
                                           f"the command ran past its timeout of {exec_request.timeout:g} s and "
                                           "was killed")
                    await self._check_alive(target, killed=event.result.signal == signal.SIGKILL)
                    yield _end(event.result)
                    return
                elif event.type == "error":
                    await self._check_alive(target, killed=True)
                    raise ConnectError(Code.INTERNAL, str((event.error or {}).get("message", "exec failed")))
        except DSecError as exc:
            await self._check_alive(target, killed=True)
            raise translate.connect_error(exc) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    async def _check_alive(self, target: Target, killed: bool = False) -> None:
        """A command cut short because its sandbox went away: the connection drops, as envd's would. A command
        SIGKILLed may be the first sign of its sandbox's teardown, which ends a moment later: wait for it."""
        deadline = asyncio.get_running_loop().time() + (_TEARDOWN_WAIT if killed else 0.0)
        while True:
            try:
                await self.api.get(target.info.id)
            except (NotFound, SandboxTimeout):
                target.aborted = True
                raise ConnectError(Code.UNAVAILABLE, f"sandbox {target.info.id} is gone") from None
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(0.05)

    def _exec_request(self, request: process_pb.StartRequest,
                      ctx: RequestContext[process_pb.StartRequest, process_pb.StartResponse]) -> ExecRequest:
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "a terminal (pty) " + _NO_HANDLES)
        if request.stdin:
            raise ConnectError(Code.UNIMPLEMENTED, "a command with stdin=True " + _NO_HANDLES)
        user = user_of(ctx)
        if user is not None:
            raise ConnectError(Code.UNIMPLEMENTED, f"user={user!r} " + _NO_HANDLES.replace("process handles and "
                                                                                          "terminals", "users"))
        config = request.process or process_pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        remaining = ctx.timeout_ms
        try:
            return ExecRequest(
                command=[config.cmd, *config.args], env=dict(config.envs) or None,
                cwd=resolve_path(current_target.get().info, config.cwd) if config.has_field("cwd") else None,
                timeout=max(remaining / 1000, 0.001) if remaining is not None else None, max_output=_MAX_OUTPUT)
        except pydantic.ValidationError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, "; ".join(e["msg"] for e in exc.errors())) from None

    async def _unsupported(self, what: str) -> None:
        raise ConnectError(Code.UNIMPLEMENTED, f"{what} " + _NO_HANDLES)

    async def list(self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]
                   ) -> process_pb.ListResponse:
        """Listing processes needs process handles."""
        await self._unsupported("commands.list")
        raise AssertionError  # unreachable

    def connect(self, request: process_pb.ConnectRequest, ctx: RequestContext[Any, Any]
                ) -> AsyncIterator[process_pb.ConnectResponse]:
        """Reconnecting to a process needs process handles."""
        raise ConnectError(Code.UNIMPLEMENTED, "commands.connect " + _NO_HANDLES)

    async def update(self, request: process_pb.UpdateRequest, ctx: RequestContext[Any, Any]
                     ) -> process_pb.UpdateResponse:
        """Resizing a terminal needs terminals."""
        await self._unsupported("pty.resize")
        raise AssertionError

    async def stream_input(self, request: AsyncIterator[process_pb.StreamInputRequest],
                           ctx: RequestContext[Any, Any]) -> process_pb.StreamInputResponse:
        """Input to a running process needs process handles."""
        await self._unsupported("streamed stdin")
        raise AssertionError

    async def send_input(self, request: process_pb.SendInputRequest, ctx: RequestContext[Any, Any]
                         ) -> process_pb.SendInputResponse:
        """Input to a running process needs process handles."""
        await self._unsupported("send_stdin")
        raise AssertionError

    async def send_signal(self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
                          ) -> process_pb.SendSignalResponse:
        """Signalling a process needs process handles."""
        await self._unsupported("kill of a command")
        raise AssertionError

    async def close_stdin(self, request: process_pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
                          ) -> process_pb.CloseStdinResponse:
        """Closing stdin needs process handles."""
        await self._unsupported("close_stdin")
        raise AssertionError
