"""envd's Process service (``spec/envd/process/process.proto``) over DSec's process handles.

Owns the translation of envd's process calls onto the node API's processes: ``Start`` starts a process the
node keeps (``/bin/bash -l -c CMD`` as the SDK sends it, its envs, cwd, user, stdin, terminal, and the
Connect deadline as its timeout) and streams its output from the start; ``Connect`` streams a running one
from where it is now; ``List`` is the running ones; ``SendInput``/``StreamInput``/``CloseStdin``,
``SendSignal`` and ``Update`` (a terminal's size) act on one chosen by pid or tag. Output becomes envd's
start, data, keep-alive and end events. A client that hangs up leaves its process running (as envd does:
that is what ``background=True`` and ``commands.connect`` rely on). It must never keep processes of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import pydantic

from dsec.api.protocol import NodeAPI
from dsec.e2b import translate
from dsec.e2b.wire import Code, ConnectError, Oneof, RequestContext, process_pb
from dsec.errors import DSecError, NotFound, ProcessNotFound, SandboxTimeout
from dsec.models import SandboxInfo
from dsec.models.surface import ProcessEvent, ProcessInfo, ProcessRequest, PtySize

__all__ = ["ProcessService", "Target", "current_target", "resolve_path", "user_of"]

_TEARDOWN_WAIT = 2.0
_Event = TypeVar("_Event", process_pb.StartResponse, process_pb.ConnectResponse)


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
    header = ctx.request_headers.get("authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        user = base64.b64decode(header[6:]).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "malformed Basic authorization header") from None
    return user or None


def _start(pid: int) -> process_pb.ProcessEvent:
    start: Oneof[Literal["start"], process_pb.ProcessEvent.StartEvent] = Oneof(
        "start", process_pb.ProcessEvent.StartEvent(pid=pid))
    return process_pb.ProcessEvent(event=start)


def _data(kind: str, data: bytes) -> process_pb.ProcessEvent:
    output: Any = Oneof(kind, data)  # stdout, stderr or pty: the field names are DSec's stream names
    event: Oneof[Literal["data"], process_pb.ProcessEvent.DataEvent] = Oneof(
        "data", process_pb.ProcessEvent.DataEvent(output=output))
    return process_pb.ProcessEvent(event=event)


def _keepalive() -> process_pb.ProcessEvent:
    event: Oneof[Literal["keepalive"], process_pb.ProcessEvent.KeepAlive] = Oneof(
        "keepalive", process_pb.ProcessEvent.KeepAlive())
    return process_pb.ProcessEvent(event=event)


def _end(exit_code: int | None, sig: int | None) -> process_pb.ProcessEvent:
    if sig is not None:
        try:
            name = signal.Signals(sig).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(sig)
        end = process_pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    else:
        code = exit_code if exit_code is not None else -1
        end = process_pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")
    event: Oneof[Literal["end"], process_pb.ProcessEvent.EndEvent] = Oneof("end", end)
    return process_pb.ProcessEvent(event=event)


async def with_keepalive(events: AsyncIterator[Any], every: float | None) -> AsyncIterator[Any]:
    """``events``, with a None whenever ``every`` seconds pass without one (envd's keep-alive)."""
    if not every:
        async for event in events:
            yield event
        return
    pending: asyncio.Future[Any] | None = None
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


def keepalive_interval(ctx: RequestContext[Any, Any]) -> float | None:
    """The keep-alive interval the SDK asks for (``Keepalive-Ping-Interval``, seconds)."""
    value = ctx.request_headers.get("keepalive-ping-interval")
    return float(value) if value and value.isdigit() and int(value) > 0 else None


def _info(process: ProcessInfo) -> process_pb.ProcessInfo:
    config = process_pb.ProcessConfig(cmd=process.command[0], args=process.command[1:], envs=process.env,
                                      cwd=process.cwd)
    return process_pb.ProcessInfo(config=config, pid=process.pid, tag=process.tag)


def _not_found(exc: DSecError) -> ConnectError:
    if isinstance(exc, ProcessNotFound):
        return ConnectError(Code.NOT_FOUND, exc.message)
    return translate.connect_error(exc)


class ProcessService:
    """The Process service of one node API (the sandbox comes from :data:`current_target`)."""

    def __init__(self, api: NodeAPI) -> None:
        self.api = api

    # -- streams ------------------------------------------------------------------------------------------

    async def start(self, request: process_pb.StartRequest,
                    ctx: RequestContext[process_pb.StartRequest, process_pb.StartResponse]
                    ) -> AsyncIterator[process_pb.StartResponse]:
        """Start a process the node keeps, streaming envd's events from its start."""
        target = current_target.get()
        process_request = self._process_request(request, ctx)
        try:
            started = await self.api.start_process(target.info.id, process_request)
        except DSecError as exc:
            raise translate.connect_error(exc) from None
        events = self._follow(target, started.pid, {}, ctx, process_request.timeout)
        async for event in events:
            yield process_pb.StartResponse(event=event)

    async def connect(self, request: process_pb.ConnectRequest,
                      ctx: RequestContext[process_pb.ConnectRequest, process_pb.ConnectResponse]
                      ) -> AsyncIterator[process_pb.ConnectResponse]:
        """Stream a running process's events from now on (its earlier output went to whoever read it)."""
        target = current_target.get()
        process = await self._running(request.process)
        remaining = ctx.timeout_ms
        try:
            async with asyncio.timeout(None if remaining is None else remaining / 1000):
                async for event in self._follow(target, process.pid, process.output_bytes, ctx, None):
                    yield process_pb.ConnectResponse(event=event)
        except TimeoutError:
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"the connection to process {process.pid} ran past its "
                                                       "timeout (the process keeps running)") from None

    async def _follow(self, target: Target, pid: int, offsets: dict[str, int],
                      ctx: RequestContext[Any, Any], timeout: float | None) -> AsyncIterator[process_pb.ProcessEvent]:
        """envd's events of one process: start, its output from ``offsets``, keep-alives, and its end."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            stream = self.api.process_output(target.info.id, pid, stdout=offsets.get("stdout", 0),
                                             stderr=offsets.get("stderr", 0), pty=offsets.get("pty", 0))
        except DSecError as exc:
            raise _not_found(exc) from None
        yield _start(pid)
        try:
            async for event in with_keepalive(stream, keepalive_interval(ctx)):
                if event is None:
                    yield _keepalive()
                elif event.type in ("stdout", "stderr", "pty") and event.data:
                    yield _data(event.type, event.data)
                elif event.type == "exit":
                    yield await self._exit(target, event, deadline, timeout)
                    return
        except DSecError as exc:
            await self._check_alive(target, killed=True)
            raise _not_found(exc) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    async def _exit(self, target: Target, event: ProcessEvent, deadline: float | None, timeout: float | None
                    ) -> process_pb.ProcessEvent:
        killed = event.signal == signal.SIGKILL
        if killed and deadline is not None and asyncio.get_running_loop().time() >= deadline - 0.05:
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"the command ran past its timeout of {timeout:g} s and "
                                                       "was killed")
        await self._check_alive(target, killed=killed)
        return _end(event.exit_code, event.signal)

    async def _check_alive(self, target: Target, killed: bool = False) -> None:
        """A process cut short because its sandbox went away: the connection drops, as envd's would. A process
        SIGKILLed may be the first sign of its sandbox's teardown, which ends a moment later: wait for it."""
        deadline = asyncio.get_running_loop().time() + (_TEARDOWN_WAIT if killed else 0.0)
        while True:
            try:
                info = await self.api.get(target.info.id)
            except (NotFound, SandboxTimeout):
                info = None
            if info is None or info.state not in ("running", "paused"):
                target.aborted = True
                raise ConnectError(Code.UNAVAILABLE, f"sandbox {target.info.id} is gone")
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(0.05)

    def _process_request(self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]) -> ProcessRequest:
        config = request.process or process_pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        pty = None
        if request.pty is not None:
            size = request.pty.size or process_pb.PTY.Size(cols=80, rows=24)
            pty = PtySize(cols=size.cols or 80, rows=size.rows or 24)
        # envd's stdin is open unless the SDK says otherwise (older SDKs never say); a terminal always takes input.
        stdin = request.stdin if request.has_field("stdin") else True
        remaining = ctx.timeout_ms
        try:
            return ProcessRequest(
                command=[config.cmd, *config.args], env=dict(config.envs) or None, user=user_of(ctx),
                cwd=resolve_path(current_target.get().info, config.cwd) if config.has_field("cwd") else None,
                keep_stdin=bool(stdin) or pty is not None, pty=pty,
                tag=request.tag if request.has_field("tag") else None,
                timeout=max(remaining / 1000, 0.001) if remaining is not None else None)
        except pydantic.ValidationError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, "; ".join(e["msg"] for e in exc.errors())) from None

    # -- one process ---------------------------------------------------------------------------------------

    async def _running(self, selector: process_pb.ProcessSelector | None) -> ProcessInfo:
        """The running process a selector names (by pid or tag); NOT_FOUND as envd once it ended."""
        sandbox_id = current_target.get().info.id
        chosen = selector.selector if selector is not None else None
        if chosen is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "the process selector names no pid or tag")
        try:
            if chosen.field == "pid":
                process = await self.api.get_process(sandbox_id, int(chosen.value))
            else:
                tagged = [p for p in await self.api.list_processes(sandbox_id) if p.tag == chosen.value and p.running]
                if not tagged:
                    raise ConnectError(Code.NOT_FOUND, f"no running process is tagged {chosen.value!r}")
                process = tagged[-1]
        except DSecError as exc:
            raise _not_found(exc) from None
        if not process.running:
            raise ConnectError(Code.NOT_FOUND, f"process {process.pid} has ended (exit status {process.exit_code})")
        return process

    async def _act(self, selector: process_pb.ProcessSelector | None,
                   call: Callable[[str, int], Any]) -> None:
        process = await self._running(selector)
        try:
            await call(current_target.get().info.id, process.pid)
        except DSecError as exc:
            raise _not_found(exc) from None

    async def list(self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]
                   ) -> process_pb.ListResponse:
        """The running processes (envd forgets ended ones)."""
        try:
            processes = await self.api.list_processes(current_target.get().info.id)
        except DSecError as exc:
            raise translate.connect_error(exc) from None
        return process_pb.ListResponse(processes=[_info(p) for p in processes if p.running])

    async def update(self, request: process_pb.UpdateRequest, ctx: RequestContext[Any, Any]
                     ) -> process_pb.UpdateResponse:
        """Resize a process's terminal."""
        if request.pty is None or request.pty.size is None:
            return process_pb.UpdateResponse()
        size = PtySize(cols=request.pty.size.cols or 80, rows=request.pty.size.rows or 24)
        await self._act(request.process, lambda sandbox, pid: self.api.resize_process(sandbox, pid, size))
        return process_pb.UpdateResponse()

    async def send_input(self, request: process_pb.SendInputRequest, ctx: RequestContext[Any, Any]
                         ) -> process_pb.SendInputResponse:
        """Write to a process's stdin (or its terminal)."""
        await self._write(request.process, _input(request.input))
        return process_pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[process_pb.StreamInputRequest],
                           ctx: RequestContext[Any, Any]) -> process_pb.StreamInputResponse:
        """Input in order: a start event naming the process, then data events."""
        selector: process_pb.ProcessSelector | None = None
        async for message in request:
            event = message.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                selector = event.value.process
                await self._running(selector)
                continue
            if selector is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "the input stream must start with a start event")
            await self._write(selector, _input(event.value.input))
        return process_pb.StreamInputResponse()

    async def _write(self, selector: process_pb.ProcessSelector | None, data: bytes) -> None:
        await self._act(selector, lambda sandbox, pid: self.api.send_stdin(sandbox, pid, data))

    async def send_signal(self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
                          ) -> process_pb.SendSignalResponse:
        """Signal a process's group (envd's SIGTERM or SIGKILL)."""
        signo = int(getattr(request.signal, "value", request.signal) or signal.SIGKILL)
        await self._act(request.process, lambda sandbox, pid: self.api.signal_process(sandbox, pid, signo))
        return process_pb.SendSignalResponse()

    async def close_stdin(self, request: process_pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
                          ) -> process_pb.CloseStdinResponse:
        """End a process's stdin (EOF)."""
        await self._act(request.process, self.api.close_stdin)
        return process_pb.CloseStdinResponse()


def _input(given: process_pb.ProcessInput | None) -> bytes:
    if given is None or given.input is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "the input has neither stdin nor pty bytes")
    return bytes(given.input.value)
