"""Commands and files: exec (streamed or to completion), the pickled-callable call, and file reads, writes
and listings, each audited, counted and, on a trajectory-bound sandbox, logged.

Owns the audit record of each command (:meth:`Commands.audit_command`), the exec and limit metrics, and the
routing of a call through its trajectory's log. Must never reach a sandbox except through its backend and
never reach the engine beyond :class:`~dsec.daemon.engine_parts.EngineParts`.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator
from typing import Any

from dsec.backends.base import Backend, collect_exec
from dsec.daemon.audit import OUTPUT_HEAD_BYTES, caller
from dsec.daemon.auth import JOB_LABEL
from dsec.daemon.engine_parts import EngineParts
from dsec.errors import DSecError, InvalidRequest, SandboxError
from dsec.models import (
    AuditOutcome,
    CallBatch,
    CallBatchResult,
    CallOutcome,
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    SandboxRecord,
)

__all__ = ["BATCH_REPLY_BYTES", "MAX_FILE_BYTES", "Commands"]

MAX_FILE_BYTES = 1024**3
"""Largest file body read or written through the API (1 GiB)."""
BATCH_REPLY_BYTES = 32 * 1024 * 1024
"""A call batch runs no more items once its replies and prints hold this much: one answer stays bounded."""


class Commands(EngineParts):
    """The engine's command and file operations."""

    def exec_stream(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> AsyncIterator[ExecEvent]:
        """Start streaming a command's events. Lookup errors raise here, before the first event.

        Closing the returned iterator early kills the command (the backend's contract), except on a
        trajectory-bound sandbox, where the command runs on and is logged (``seq``: its call number).
        """
        record = self.records.live(sandbox_id, allow_paused=False)
        backend = self.backends.get(record.spec.backend)
        if record.spec.trajectory is not None:
            return self.trajectories.exec_stream(record, backend, request, seq)
        return self.exec_events(backend, record, request)

    async def exec_unlogged(self, record: SandboxRecord, request: ExecRequest) -> ExecResult:
        """Run a command on a sandbox without its trajectory log (recovery re-runs logged calls this way)."""
        return await collect_exec(self.exec_events(self.backends.get(record.spec.backend), record, request))

    async def exec_events(
        self, backend: Backend, record: SandboxRecord, request: ExecRequest
    ) -> AsyncIterator[ExecEvent]:
        name = record.spec.backend
        at, started = time.time(), time.monotonic()
        outcome: AuditOutcome = "cancelled"
        result: ExecResult | None = None
        error: str | None = None
        user = None
        if request.user is not None or record.spec.user is not None:
            user = await self.surface.identity(record, backend, request.user)
        if request.cwd is not None and not request.cwd.startswith("/"):
            request = request.model_copy(update={"cwd": self.surface.path(record, request.cwd)})
        stream = backend.exec_stream(record, request, user)
        try:
            async for event in stream:
                if event.type == "exit" and event.result is not None:
                    result = event.result
                    outcome = "ok" if result.exit_code == 0 else "limit" if result.limit else "nonzero"
                    if result.limit is not None:
                        self.metrics.limit_hits.labels(name, result.limit).inc()
                elif event.type == "error":
                    outcome = "error"
                    error = str((event.error or {}).get("message", ""))
                yield event
        except Exception as exc:
            outcome, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # Metrics and the audit record first: the awaits below may be cancelled when the client hung up.
            elapsed = time.monotonic() - started
            self.metrics.exec_done(name, outcome, elapsed)
            self.audit_command(record, "exec", request.command, request.cwd, at, elapsed, outcome, result, error)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def exec(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> ExecResult:
        """Run a command to completion."""
        record = self.records.live(sandbox_id, allow_paused=False)
        if record.spec.trajectory is None:
            return await collect_exec(self.exec_stream(sandbox_id, request, seq))
        return await self.trajectories.exec(record, self.backends.get(record.spec.backend), request, seq)

    async def call(self, sandbox_id: str, request: CallRequest) -> CallResult:
        """Run a pickled Python callable; the reply goes back undecoded (the daemon never unpickles it)."""
        record = self.records.live(sandbox_id, allow_paused=False)
        backend = self.backends.get(record.spec.backend)
        name = record.spec.backend
        at, started = time.time(), time.monotonic()
        outcome: AuditOutcome = "error"
        result: ExecResult | None = None
        error: str | None = None
        try:
            out = await backend.call(record, request)
            result = out.result
            outcome = "ok" if result.exit_code == 0 else "limit" if result.limit else "nonzero"
            if result.limit is not None:
                self.metrics.limit_hits.labels(name, result.limit).inc()
            return out
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            elapsed = time.monotonic() - started
            self.metrics.exec_done(name, outcome, elapsed)
            self.audit_command(record, "call", [request.python, "<pickled callable>"], None, at, elapsed, outcome,
                               result, error)

    async def call_many(self, sandbox_id: str, batch: CallBatch) -> CallBatchResult:
        """Each item as :meth:`call` (audited and counted one by one), one after another, while one more item's
        largest reply still fits in :data:`BATCH_REPLY_BYTES` (the first always runs). A sandbox error is the
        item's outcome; any other error would be every item's (no such sandbox, no calls on this backend, limits
        over the sandbox's): raised if no item ran, else the answer ends before that item. The client sends the
        items past an answer's end again."""
        options = batch.model_dump(exclude={"function", "items"})
        largest = batch.max_result_bytes + batch.max_output
        outcomes: builtins.list[CallOutcome] = []
        answered = 0
        for item in batch.items:
            if outcomes and answered + largest > BATCH_REPLY_BYTES:
                break
            # Validated as the batch: only the payload is new.
            request = CallRequest.model_construct(payload=batch.function + item, **options)
            try:
                out = await self.call(sandbox_id, request)
            except SandboxError as exc:
                outcomes.append(CallOutcome(error=exc.to_payload()["error"]))
                continue
            except DSecError:
                if not outcomes:
                    raise
                break  # the items that ran keep their outcomes; the client meets the error when it sends the rest
            outcomes.append(CallOutcome(result=out))
            answered += len(out.reply) + len(out.result.stderr)
        return CallBatchResult(outcomes=outcomes)

    def audit_command(self, record: SandboxRecord, op: str, command: str | builtins.list[str], cwd: str | None,
                      at: float, elapsed: float, outcome: AuditOutcome, result: ExecResult | None,
                      error: str | None) -> None:
        """Queue the audit record of one command (in memory; the audit log's flusher writes it)."""
        spec = record.spec
        # A plain tuple in audit.COLUMNS order: the flusher decodes and serialises it off the event loop.
        who, job, node = caller.get(), spec.labels.get(JOB_LABEL), self.settings.node
        if result is None:
            self.audit.record((at, record.id, node, spec.backend, who, job, op, command, cwd, outcome, None, None,
                               elapsed, b"", b"", 0, spec.trajectory, error))
        else:
            self.audit.record((at, record.id, node, spec.backend, who, job, op, command, cwd, outcome,
                               result.exit_code, result.limit, elapsed, result.stdout[:OUTPUT_HEAD_BYTES],
                               result.stderr[:OUTPUT_HEAD_BYTES], len(result.stdout) + len(result.stderr),
                               spec.trajectory, error))

    async def read_file(self, sandbox_id: str, path: str, seq: int | None = None, *,
                        max_bytes: int = MAX_FILE_BYTES, user: str | None = None) -> bytes:
        """A file's bytes (``path`` absolute or relative to the sandbox's workdir; as ``user``; a file larger
        than ``max_bytes`` is refused)."""
        record = self.records.live(sandbox_id, allow_paused=True)
        backend = self.backends.get(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> bytes:
            return await backend.read_file(record, path, max_bytes, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            return await run()
        args: dict[str, Any] = {"path": path} if user is None else {"path": path, "user": user}
        data: bytes = await self.trajectories.call(record, seq, "read", args, None, lambda _: run())
        return data

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int | None = None, seq: int | None = None,
        user: str | None = None,
    ) -> None:
        """Create or replace a file (parents created; as ``user``)."""
        if mode is not None and not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"file mode must be between 0 and 0o7777, got {mode:o}")
        record = self.records.live(sandbox_id, allow_paused=True)
        backend = self.backends.get(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> None:
            await backend.write_file(record, path, data, mode, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            await run()
            return
        args: dict[str, Any] = {"path": path, "mode": mode, "data": data}
        if user is not None:
            args["user"] = user
        await self.trajectories.call(record, seq, "write", args, data, lambda _: run())

    async def list_files(self, sandbox_id: str, path: str, seq: int | None = None, user: str | None = None
                         ) -> builtins.list[FileEntry]:
        """A directory's entries (as ``user``)."""
        record = self.records.live(sandbox_id, allow_paused=True)
        backend = self.backends.get(record.spec.backend)
        path = self.surface.path(record, path)

        async def run() -> builtins.list[FileEntry]:
            return await backend.list_files(record, path, await self.surface.identity(record, backend, user))

        if record.spec.trajectory is None:
            return await run()
        args: dict[str, Any] = {"path": path} if user is None else {"path": path, "user": user}
        entries: builtins.list[FileEntry] = await self.trajectories.call(record, seq, "list", args, None,
                                                                     lambda _: run())
        return entries
