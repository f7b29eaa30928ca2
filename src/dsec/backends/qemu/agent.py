"""Operations through a QEMU guest's agent: commands, a new sandbox's identity and confinement, revealing.

Owns the host side of exec over the agent protocol (output limits, the deadline, the exit), and what a
freshly started guest is told before its first command (IDENTITY, its workdir, CONFINE); must never manage
the QEMU process itself (:mod:`~dsec.backends.qemu.machine` does) and never decide confinement on its own:
the machine profile says which sandboxes are confined and how.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

from dsec.accounts import ROOT, Identity
from dsec.backends.base import collect_exec, default_identity, workdir_of
from dsec.backends.qemu.machine import MachineHost
from dsec.backends.qemu.profile import MachineProfile
from dsec.backends.surface import ProcessIO, ProcessSink, ProcessSpec
from dsec.errors import InvalidRequest, NotSupported, SandboxError
from dsec.guest.protocol import EXT_PRISTINE, AgentClient, AgentGone, T, parse_exit
from dsec.guest.surface import GuestSurface, creds_of
from dsec.isolation.exec_client import check_exec_size
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxRecord

__all__ = ["DEFAULT_PATH", "GuestAgent"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _NotRun(SandboxError):
    """The agent could not start the command (nothing to kill)."""


class GuestAgent:
    """The agents of one backend's guests (``machines``), confined as ``profile`` says."""

    def __init__(self, machines: MachineHost, profile: MachineProfile) -> None:
        self.machines = machines
        self.profile = profile
        self.surface = GuestSurface(machines.client, machines.why_gone)
        """Processes, files as a sandbox user, watches and ports (:mod:`dsec.guest.surface`)."""

    def client(self, record: SandboxRecord) -> AgentClient:
        return self.machines.client(record)

    async def exec(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        """Run a command as the sandbox's commands run (its user, environment and confinement)."""
        return await collect_exec(self.exec_stream(record, request))

    async def system_exec(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        """Run the backend's own upkeep command in the guest: as root, never confined (a vm's clock, its disk's
        growth), whatever the sandbox's commands may do."""
        return await collect_exec(self.exec_stream(record, request, system=True))

    async def prepare(self, record: SandboxRecord) -> None:
        """A new sandbox's fresh identity (a clone's is its template's), its workdir and confinement."""
        client = self.client(record)
        await client.identity(record.id[:63], uuid.uuid4().hex, os.urandom(64))
        await self.surface.make_workdir(record, workdir_of(record))
        if self.profile.confines(record):
            try:
                hidden = await client.confine(record.spec.protected, record.spec.hidden,
                                              self.profile.confine_extra(record))
            except InvalidRequest as e:  # a path the image lacks, or one through a symlink: the spec's fault
                raise InvalidRequest(str(e).replace("guest agent refused the request: ", "")) from None
            record.backend_state["hidden"] = hidden  # until reveal()
        await self.profile.prepared(record, self)

    async def reveal(self, record: SandboxRecord) -> None:
        """Uncover the hidden paths (the agent unmounts their covers in the commands' mount namespace and
        leaves them read-only)."""
        if not record.backend_state.get("hidden"):
            return
        try:
            await self.client(record).reveal()
        except AgentGone as e:
            raise SandboxError(f"sandbox {record.id}: {await self.machines.why_gone(record.id, e)}") from None
        record.backend_state["hidden"] = []

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        identity = user or default_identity(record)
        env = {"PATH": DEFAULT_PATH, "HOME": identity.home if user else record.backend_state.get("home", "/root"),
               **({"TERM": "xterm-256color"} if spec.pty else {}), **record.backend_state.get("image_env", {}),
               **record.spec.env, **spec.env}
        check_exec_size(spec.argv, env)
        return await self.surface.start(record, spec.argv, env, spec.cwd or workdir_of(record), identity, sink,
                                        spec.pty, spec.pty_stdin, spec.timeout)

    async def exec_stream(self, record: SandboxRecord, request: ExecRequest, system: bool = False,
                          user: Identity | None = None) -> AsyncIterator[ExecEvent]:
        """A command's output as it comes, then its exit (``system``: unconfined root, see :meth:`system_exec`)."""
        refusal = self.profile.pristine_refusal(record) if request.pristine else None
        if refusal:
            raise NotSupported(refusal)
        client = self.client(record)
        if system:
            # Unconfined root: nothing of the sandbox's may steer it (a PATH or LD_* of the spec's env, a
            # planted binary in the workdir), so neither the spec's nor the image's environment nor its user.
            env, cwd, identity = {"PATH": DEFAULT_PATH, "HOME": "/root", **(request.env or {})}, "/", ROOT
        else:
            identity = user or default_identity(record)
            env = {"PATH": DEFAULT_PATH, "HOME": identity.home if user else record.backend_state.get("home", "/root"),
                   **record.backend_state.get("image_env", {}), **record.spec.env, **(request.env or {})}
            cwd = request.cwd or workdir_of(record)
        check_exec_size(request.argv(), env)
        start = time.monotonic()
        if identity.groups:  # supplementary groups: the extended request
            channel = await client.start_ext(request.argv(), env, cwd, creds_of(identity),
                                             EXT_PRISTINE if request.pristine else 0)
        else:
            channel = await client.start_exec(request.argv(), env, cwd, identity.uid, identity.gid,
                                              pristine=request.pristine, system=system)
        finished = False
        # Stdin streams while the output is read (and capped): a command may answer as it reads.
        feeding = asyncio.create_task(self._feed(client, channel, request.stdin))
        try:
            try:
                async for event in self._frames(record, client, channel, request, start):
                    finished = event.type == "exit"
                    yield event
            except _NotRun as e:
                finished = True
                raise SandboxError(str(e)) from None
        finally:
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError, AgentGone):
                await feeding
            if not finished:
                await client.signal(channel, signal.SIGKILL)
            client.close_channel(channel)

    @staticmethod
    async def _feed(client: AgentClient, channel: int, stdin: bytes | None) -> None:
        """A command's stdin, within its channel's window, then its end."""
        if stdin and not await client.stdin(channel, stdin):
            return  # it exited first: the rest is moot
        await client.end_stdin(channel)

    async def _frames(self, record: SandboxRecord, client: AgentClient, channel: int, request: ExecRequest,
                      start: float) -> AsyncIterator[ExecEvent]:
        """The events of a started command, killing it at its deadline or output limit."""
        captured = {T.STDOUT: bytearray(), T.STDERR: bytearray()}
        limit = None
        deadline = None if request.timeout is None else start + request.timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 and limit is None:
                limit = "time"
                await client.signal(channel, signal.SIGKILL)
                left = None
            try:
                frame = await client.next_frame(channel, left if limit is None else 30.0)
            except TimeoutError:
                if limit is None:
                    continue  # the deadline passed: loop to kill
                raise SandboxError("the guest agent did not report a killed command's exit") from None
            except AgentGone as e:
                raise SandboxError(f"sandbox {record.id}: {await self.machines.why_gone(record.id, e)}") from None
            if frame.type in captured:
                buf = captured[frame.type]
                room = request.max_output - len(buf)
                data = frame.payload[:max(room, 0)]
                if data:
                    buf += data
                    yield ExecEvent(type="stdout" if frame.type == T.STDOUT else "stderr", data=data)
                if len(frame.payload) > room and limit is None:
                    limit = "output"
                    await client.signal(channel, signal.SIGKILL)
            elif frame.type == T.EXIT:
                code, sig, oom = parse_exit(frame.payload)
                if oom and code != 0 and limit is None:
                    limit = "memory"
                yield ExecEvent(type="exit", result=ExecResult(
                    exit_code=code, stdout=bytes(captured[T.STDOUT]), stderr=bytes(captured[T.STDERR]),
                    duration_s=time.monotonic() - start, truncated=limit == "output", signal=sig,
                    limit=limit))
                return
            elif frame.type == T.ERROR:
                detail = frame.payload[4:300].decode(errors="replace")
                if frame.payload[:4] == errno.ENOBUFS.to_bytes(4, "big"):
                    # only an agent without stdin credit buffers until it refuses (the host then sends freely)
                    raise SandboxError(
                        f"sandbox {record.id}'s guest agent is older than this DSec: it takes at most 8 MiB of "
                        f"stdin its command has not read yet, and this command's exceeded that ({detail}); "
                        f"recreate the sandbox from its image (its snapshot or template predates stdin flow "
                        f"control) or pass the data as a file")
                raise _NotRun(f"guest agent could not run the command: {detail}")
