"""The engine's trajectory side: binding sandboxes to trajectories, logged calls, leases and recovery.

Owns: opening a trajectory (create and bind, re-attach, or rebuild a lost sandbox from its latest
checkpoint), running a trajectory-bound sandbox's calls through :class:`~dsec.trajectory.replay.TrajectoryLog`
(matching, logging, flights that outlive their client), checkpoints (a logged ``snapshot`` call) and
lease expiry. It reaches sandboxes only through the engine's records and backends, and never speaks HTTP.

A call without a call number (``seq``) on a trajectory-bound sandbox is an operator's (``dsec exec``, ``dsec
files``, the dashboard), not the agent's: it runs outside the log, is recorded in the audit trail, and the
sandbox counts it (``TrajectoryStatus.outside_log``); the agent's re-run never sees it.

A live exec on a trajectory runs in a task of its own: the client that started it may die, and the
command still finishes and is logged; the same call re-issued (same ``seq``) waits for that task instead
of running the command again.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dsec.backends.base import Backend
from dsec.errors import DSecError, InvalidRequest, NotFound, ReplayDivergence, SandboxError
from dsec.models import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    SandboxInfo,
    SandboxRecord,
    SandboxSpec,
    TrajectoryInfo,
    TrajectoryStatus,
)
from dsec.trajectory.digest import call_identity, exec_args
from dsec.trajectory.replay import (
    STATE_CHANGING,
    Join,
    Live,
    OpenTrajectory,
    Replay,
    TrajectoryLog,
    decode_response,
)
from dsec.trajectory.store import Binding, Summary

if TYPE_CHECKING:
    from dsec.daemon.trajectory_host import TrajectoryHost

__all__ = ["TrajectoryBinding"]

log = logging.getLogger(__name__)

_MAX_NAME = 512
_FILE_OPS = frozenset({"mkdir", "remove", "rename", "chmod", "chown", "xattrs"})
_EFFECTS = frozenset({"exec", "write", "mouse", "keyboard", "reveal", "process", "process.stdin",
                      "process.close_stdin", "process.signal", "shell", "shell.run", *_FILE_OPS})
"""Logged calls that changed the sandbox: after the latest checkpoint, a rebuilt sandbox lacks their effects
unless they are re-run (exec, write, reveal and the file operations can be; input actions, processes and shell
sessions cannot, and are reported missing)."""


_FLIGHT_WAIT = 10.0
"""Seconds a delete, an end or a rebuild waits for calls on the gone sandbox still being logged."""


_PER_OPEN = frozenset({"trajectory", "snapshot", "lease", "rerun_missing", "timeout", "keep_logged_spec"})
"""Spec fields a re-open may change: the others must match the logged spec (a re-open is the same rollout)."""


def _spec_difference(logged: SandboxSpec, given: SandboxSpec) -> dict[str, tuple[Any, Any]]:
    """Fields (other than :data:`_PER_OPEN`) whose logged value differs from the given one: ``(logged, given)``."""
    old, new = logged.model_dump(mode="json"), given.model_dump(mode="json")
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in _PER_OPEN and old.get(k) != new.get(k)}


def _summary_info(summary: Summary) -> TrajectoryInfo:
    b = summary.binding
    return TrajectoryInfo(name=b.name, calls=summary.calls, sandbox_id=b.sandbox_id, checkpoint=b.checkpoint,
                          created_at=b.created_at, updated_at=summary.updated_at, ended_at=summary.ended_at)


def _stored(readable: str, body: bytes | None, cap: int) -> str:
    """The logged form of a call: its readable identity plus the body when small enough to re-run it."""
    if body is None or len(body) > cap:
        return readable
    data = json.loads(readable)
    data["body"] = base64.urlsafe_b64encode(body).decode()
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


_AUDIT_KIND: dict[str, Any] = {
    **{op: "file" for op in ("write", *_FILE_OPS)}, "mouse": "input", "keyboard": "input", "reveal": "reveal",
    **{op: "process" for op in STATE_CHANGING if op.startswith("process")},
    **{op: "shell" for op in STATE_CHANGING if op.startswith("shell")},
}
"""The audit trail's kind of an operator's state-changing call (an exec is audited as every exec is)."""


def _events(result: ExecResult) -> list[ExecEvent]:
    """A finished result as the stream a live run would have produced (output first, then exit)."""
    events = [ExecEvent(type=kind, data=data) for kind, data in (("stdout", result.stdout),
                                                                 ("stderr", result.stderr)) if data]
    events.append(ExecEvent(type="exit", result=result))
    return events


class TrajectoryBinding:
    """Trajectory-bound sandboxes of one engine."""

    def __init__(self, engine: TrajectoryHost, trajectories: TrajectoryLog) -> None:
        self.engine = engine
        self.log = trajectories
        self._opening: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        """Open the log store."""
        await self.log.store.start()

    async def adopt(self, records: builtins.list[SandboxRecord]) -> None:
        """After recovery: load the trajectories of re-adopted sandboxes, so their leases run again."""
        for record in records:
            if record.spec.trajectory is not None:
                t = await self.log.load(record.spec.trajectory)
                if t is not None and t.binding.sandbox_id == record.id:
                    t.lease = record.spec.lease
                    t.touch()  # the client had no way to renew while no daemon ran

    async def aclose(self) -> None:
        """Wait briefly for calls still being logged, then close the store."""
        flights = [f for t in self.log.all() for f in t.flights.values()]
        if flights:
            await asyncio.wait(flights, timeout=5)
        await self.log.store.aclose()

    # -- status and leases ----------------------------------------------------------------------------

    def _bound(self, record: SandboxRecord) -> OpenTrajectory | None:
        name = record.spec.trajectory
        t = self.log.by_name(name) if name is not None else None
        return t if t is not None and t.binding.sandbox_id == record.id else None

    def status(self, record: SandboxRecord) -> TrajectoryStatus | None:
        """``SandboxInfo.trajectory`` of a sandbox (None when not bound to a loaded trajectory)."""
        t = self._bound(record)
        return t.status().model_copy(update={"outside_log": record.outside_log}) if t is not None else None

    def lease_expired(self, record: SandboxRecord, now: float) -> bool:
        """True when ``record`` is bound to a trajectory whose lease ran out."""
        t = self._bound(record)
        return t is not None and t.lease_expired(now)

    def renew(self, record: SandboxRecord) -> None:
        """Renew ``record``'s lease (a heartbeat); :class:`InvalidRequest` when it is bound to no trajectory."""
        t = self._bound(record)
        if t is None:
            raise InvalidRequest(f"sandbox {record.id} is not bound to a trajectory: it has no lease to renew",
                                 sandbox=record.id)
        t.touch()

    def forget(self, record: SandboxRecord) -> None:
        """``record`` was destroyed: drop its trajectory from memory (the log stays in the store, and
        re-opening the trajectory rebuilds the sandbox), so a long-lived daemon does not grow. With a call still
        in flight, the call's landing does it (:meth:`_drop_if_unbound`)."""
        t = self._bound(record)
        if t is not None:
            self._drop_if_unbound(t)

    def _drop_if_unbound(self, t: OpenTrajectory) -> None:
        """Forget ``t`` if nothing needs it loaded: no call of it in flight, no open of it under way, and its
        sandbox gone from this node (destroyed, lost, or never built by a rebuild that failed)."""
        if t.flights or self.log.by_name(t.name) is not t:
            return
        lock = self._opening.get(t.name)
        if lock is not None and lock.locked():
            return  # being re-opened now: the opener rebinds it to a new sandbox, and needs it loaded
        if self.engine.find_record(t.binding.sandbox_id or "") is not None:
            return  # still this node's (a removal under way forgets it when done)
        self.log.forget(t.name)
        self._unlock(t.name)

    def _fly(self, t: OpenTrajectory, live: Live, task: asyncio.Task[Any]) -> None:
        """``task`` runs call ``live.seq``; when it lands after its sandbox went, ``t`` is forgotten then (the
        sandbox's removal could not: a call was in flight)."""
        self.log.fly(t, live, task)
        task.add_done_callback(lambda _: self._drop_if_unbound(t))  # (after fly's own: the flight is gone)

    # -- opening --------------------------------------------------------------------------------------

    async def open(self, spec: SandboxSpec) -> SandboxInfo:
        """Create and bind, re-attach, or recover the sandbox of ``spec.trajectory``."""
        name = spec.trajectory or ""
        if not name.strip() or len(name) > _MAX_NAME or "\0" in name:
            raise InvalidRequest(f"trajectory must be a non-empty name of at most {_MAX_NAME} characters "
                                 f"without NUL, got {name!r}")
        if spec.snapshot is not None:
            raise InvalidRequest("give either trajectory or snapshot: a trajectory restores its own checkpoints")
        try:
            return await self._open(name, spec)
        finally:  # failed or not: no lock stays for the name, nor a trajectory bound to no sandbox
            t = self.log.by_name(name)
            if t is not None:
                self._drop_if_unbound(t)
            self._unlock(name)

    async def _open(self, name: str, spec: SandboxSpec) -> SandboxInfo:
        async with self._opening.setdefault(name, asyncio.Lock()):
            if await self.log.store.ended_at(name) is not None:
                await self._erase(name)  # ended on purpose: the name starts a new trajectory
            kept = self.log.by_name(name) is not None  # a copy loaded earlier, rather than read just now
            t = await self.log.load(name)
            if t is not None:
                self._check_spec(t, spec)
            if t is None:
                info = await self.engine.create_unpooled(spec, None)
                try:
                    t = await self.log.create(Binding(name=name, spec=spec.model_dump_json(), sandbox_id=info.id))
                except BaseException:
                    await self.engine.destroy(info.id)
                    raise
                t.lease = spec.lease
                return await self.engine.get(info.id)
            record = self.engine.find_record(t.binding.sandbox_id or "")
            if record is not None and record.state in ("running", "paused"):
                t.lease = spec.lease
                t.touch()
                return self.engine.info_of(record)
            if kept and not t.flights:
                # Rebuilt here: from the log as the store has it now. A copy loaded earlier (this node owned
                # the trajectory once; in cluster mode another node may have logged on since) is stale.
                self.log.forget(name)
                t = await self.log.load(name)
                if t is None:
                    raise InvalidRequest(f"trajectory {name!r} is gone from the log", trajectory=name)
            t.lease = spec.lease
            t.touch()
            return await self._recover(t, spec)

    @staticmethod
    def _check_spec(t: OpenTrajectory, spec: SandboxSpec) -> None:
        """A re-open asking for another spec than the logged one is refused (unless ``keep_logged_spec``): the
        sandbox it re-attaches or rebuilds has the logged spec, which the caller did not ask for."""
        logged = SandboxSpec.model_validate_json(t.binding.spec)
        differ = _spec_difference(logged, spec)
        if not differ or spec.keep_logged_spec:
            return
        shown = "; ".join(f"{k}: logged {a!r}, given {b!r}" for k, (a, b) in differ.items())
        raise ReplayDivergence(
            f"trajectory {t.name!r} was opened with another spec ({shown}): re-open it with the logged spec, pass "
            "keep_logged_spec=True to go on with the logged one, or end it (close(end=True)) to start the name "
            "over", trajectory=t.name, logged=logged.model_dump(mode="json"), given=spec.model_dump(mode="json"),
            fields=sorted(differ))

    # -- ending, deleting, listing --------------------------------------------------------------------

    async def listing(self, prefix: str = "", limit: int = 1000) -> builtins.list[TrajectoryInfo]:
        """Trajectories in the log whose name starts with ``prefix``, by name."""
        return [_summary_info(s) for s in await self.log.store.summaries(prefix, limit)]

    async def info(self, name: str) -> TrajectoryInfo:
        """One trajectory; :class:`NotFound` when the log has none of that name."""
        found = [s for s in await self.log.store.summaries(name, 1) if s.binding.name == name]
        if not found:
            raise NotFound(f"no trajectory {name!r} in the log ({self.log.store.where})", trajectory=name)
        return _summary_info(found[0])

    async def end(self, name: str) -> TrajectoryInfo:
        """End a trajectory on purpose: its sandbox is destroyed and it is marked ended. Its log stays readable
        until the name is opened again, which starts a new trajectory in its place."""
        try:
            async with self._opening.setdefault(name, asyncio.Lock()):
                binding = await self._binding(name)
                await self._drop_sandbox(binding.sandbox_id, name)
                await self.log.store.end(name)
                self.log.forget(name)
        finally:
            self._unlock(name)
        log.info("trajectory %s ended (its sandbox %s destroyed)", name, binding.sandbox_id)
        return await self.info(name)

    async def delete(self, name: str) -> None:
        """Delete a trajectory: its sandbox, the checkpoints no other trajectory shares (a branch shares those
        before its branch point), and its log."""
        try:
            async with self._opening.setdefault(name, asyncio.Lock()):
                await self._binding(name)
                await self._erase(name)
        finally:
            self._unlock(name)

    async def _erase(self, name: str) -> None:
        binding = await self._binding(name)
        await self._drop_sandbox(binding.sandbox_id, name)
        snaps = [*await self.log.store.checkpoints(name), *([binding.checkpoint] if binding.checkpoint else [])]
        removed = []
        for snap in dict.fromkeys(snaps):
            if not await self.log.store.used_elsewhere(snap, name):
                await self.engine.remove_snapshot(snap)  # a failure keeps the log: try again
                removed.append(snap)
        await self.log.store.delete(name)
        self.log.forget(name)
        log.info("trajectory %s deleted (sandbox %s, checkpoints %s)", name, binding.sandbox_id, removed)

    async def _binding(self, name: str) -> Binding:
        binding = await self.log.store.get_binding(name)
        if binding is None:
            raise NotFound(f"no trajectory {name!r} in the log ({self.log.store.where})", trajectory=name)
        return binding

    async def _drop_sandbox(self, sandbox_id: str | None, name: str) -> None:
        """Destroy the trajectory's sandbox if it lives on this node, and wait for its calls to be logged."""
        t = self.log.by_name(name)
        record = self.engine.find_record(sandbox_id or "")
        if record is not None and record.spec.trajectory == name:
            await self.engine.destroy(record.id)
        if t is not None and t.flights:
            await asyncio.wait(builtins.list(t.flights.values()), timeout=_FLIGHT_WAIT)

    def _unlock(self, name: str) -> None:
        """Drop ``name``'s lock unless it is held or waited for (a waiter and a newcomer taking a new lock
        would run at once: a lock just released reads unlocked until its next holder runs)."""
        lock = self._opening.get(name)
        if lock is not None and not lock.locked() and not lock._waiters:
            del self._opening[name]

    # -- outside the log ------------------------------------------------------------------------------

    def _touched(self, record: SandboxRecord, op: str) -> None:
        """An operator changed a trajectory-bound sandbox outside its log: the sandbox counts it (kept across a
        daemon restart with the record), and ``info()`` shows it to the agent."""
        if op in STATE_CHANGING and op != "snapshot":
            record.outside_log += 1
            self.engine.save_record(record)
            log.warning("trajectory %s: %s on sandbox %s outside the log (an operator's call); the agent's re-run "
                        "does not see it", record.spec.trajectory, op, record.id)

    async def _outside(self, record: SandboxRecord, op: str, args: dict[str, Any], run: Callable[[], Awaitable[Any]]
                       ) -> Any:
        """Run an operator's call outside the log, recorded in the audit trail when it changes the sandbox."""
        self._touched(record, op)
        kind = _AUDIT_KIND.get(op)
        at, started = time.time(), time.monotonic()
        try:
            result = await run()
        except BaseException as exc:
            self._audit(record, kind, op, args, at, started, f"{type(exc).__name__}: {exc}")
            raise
        self._audit(record, kind, op, args, at, started, None)
        return result

    def _audit(self, record: SandboxRecord, kind: str | None, op: str, args: dict[str, Any], at: float,
               started: float, error: str | None) -> None:
        if kind is not None:
            self.engine.audit_command(record, kind, [op, call_identity(op, args)[1]], None, at,
                                      time.monotonic() - started, "ok" if error is None else "error", None, error)

    async def _recover(self, t: OpenTrajectory, spec: SandboxSpec) -> SandboxInfo:
        """The bound sandbox is gone: rebuild it from the latest checkpoint (or the image)."""
        if t.flights:
            # Calls cut off with the sandbox are still being logged: wait (bounded) so that each counts as
            # what it is, an effect the rebuild lacks (re-run if asked), rather than as running.
            await asyncio.wait(builtins.list(t.flights.values()), timeout=_FLIGHT_WAIT)
        original = SandboxSpec.model_validate_json(t.binding.spec)
        base = original.model_copy(update={"lease": spec.lease, "rerun_missing": spec.rerun_missing,
                                           "timeout": spec.timeout})
        info = await self._rebuild(t, base, len(t.ops))
        await self._bind(t, info)
        return await self.engine.get(info.id)

    async def _bind(self, t: OpenTrajectory, info: SandboxInfo) -> None:
        """Record ``info`` as ``t``'s sandbox; if that fails (or the call is cut off), the sandbox goes."""
        try:
            t.binding.sandbox_id = info.id
            await self.log.store.put_binding(t.binding)
        except BaseException:
            await self.engine.destroy(info.id)
            raise

    async def _rebuild(self, t: OpenTrajectory, spec: SandboxSpec, upto: int) -> SandboxInfo:
        """A sandbox with the state of ``t``'s latest checkpoint, plus (opt-in) calls up to ``upto`` re-run."""
        checkpoint = t.binding.checkpoint
        info = await self.engine.create_unpooled(spec, checkpoint or None)
        after = range(t.binding.checkpoint_seq, upto)
        missing = [seq for seq in after if t.ops[seq] in _EFFECTS]
        # A call still running past the wait is reported missing, not re-run: the answer logged when it lands is
        # its cut-off run's, and a re-run would be a second run of the same call.
        runnable = [seq for seq in missing if t.statuses[seq] != "running"]
        rerun: list[int] = []
        try:
            if spec.rerun_missing and runnable:
                start = t.binding.checkpoint_seq
                for entry in await self.log.store.entries(t.name, start, upto - start):
                    if entry.seq in runnable and await self._rerun(info.id, entry.op, json.loads(entry.request)):
                        rerun.append(entry.seq)
        except BaseException:  # failed or cut off half-way: no unbound sandbox stays (a retry builds another)
            await self.engine.destroy(info.id)
            raise
        t.restored_from = checkpoint
        t.rerun = rerun
        t.missing_effects = [seq for seq in missing if seq not in rerun]
        log.warning("trajectory %s: sandbox built as %s from %s; re-ran %s; effects missing for calls %s",
                    t.name, info.id, checkpoint or "its image", rerun, t.missing_effects)
        return info

    async def branch(self, name: str, at: int, rerun_missing: bool) -> SandboxInfo:
        """A new trajectory sharing ``name``'s calls ``< at``, bound to a sandbox rebuilt to that point
        (the latest checkpoint before ``at``, plus re-run calls if asked); ``name`` itself is untouched."""
        source = await self.log.peek(name)
        if source is None:
            raise InvalidRequest(f"no trajectory {name!r} on this node", trajectory=name)
        if not 0 <= at <= len(source.digests):
            raise InvalidRequest(f"cannot branch trajectory {name!r} at call {at}: its log has "
                                 f"{len(source.digests)} calls", trajectory=name, at=at)
        prefix = await self.log.store.entries(name, 0, at) if at else []
        checkpoint, checkpoint_seq = None, 0
        for entry in prefix:
            if entry.op == "snapshot" and entry.status == "done" and entry.response is not None:
                value = json.loads(entry.response)
                if isinstance(value, str):
                    checkpoint, checkpoint_seq = value, entry.seq + 1
        branch = f"{name}~{at}-{secrets.token_hex(3)}"
        original = SandboxSpec.model_validate_json(source.binding.spec)
        spec = original.model_copy(update={"trajectory": branch, "rerun_missing": rerun_missing})
        binding = Binding(name=branch, spec=spec.model_dump_json(), checkpoint=checkpoint,
                          checkpoint_seq=checkpoint_seq)
        await self.log.store.copy_prefix(name, branch, at)
        for entry in prefix:
            if entry.status == "running":  # nothing runs it on the branch: its effect is missing there
                await self.log.interrupt_copied(branch, entry)
        t = await self.log.create(binding, prefix)
        t.lease, t.forked_from, t.fork_point = spec.lease, name, at
        try:
            info = await self._rebuild(t, spec, at)
            await self._bind(t, info)
        except BaseException:
            self.log.forget(branch)
            raise
        t.touch()
        return await self.engine.get(info.id)

    async def _rerun(self, sandbox_id: str, op: str, stored: dict[str, Any]) -> bool:
        args = stored.get("args", {})
        body = base64.urlsafe_b64decode(stored["body"]) if "body" in stored else None
        try:
            if op == "exec":
                if isinstance(args.get("stdin"), dict) and body is None:
                    return False  # stdin was over the log's cap: it cannot be re-run
                request = ExecRequest.model_validate({**args, "stdin": body})
                record = self.engine.live_record(sandbox_id, allow_paused=False)
                await self.engine.exec_unlogged(record, request)
                return True
            if op == "reveal":
                record = self.engine.live_record(sandbox_id, allow_paused=False)
                await self.engine.backend_for(record).reveal(record)
                self.engine.save_record(record)
                return True
            if op in _FILE_OPS:
                return await self.engine.surface.rerun(self.engine.live_record(sandbox_id, allow_paused=True), op,
                                                       args)
            if op == "write" and body is not None:
                record = self.engine.live_record(sandbox_id, allow_paused=True)
                backend = self.engine.backend_for(record)
                await backend.write_file(record, args["path"], body, args.get("mode"))
                return True
        except DSecError:
            log.exception("re-running %s on %s failed", op, sandbox_id)
        return False

    # -- calls ----------------------------------------------------------------------------------------

    async def _open_for(self, record: SandboxRecord) -> OpenTrajectory:
        t = await self.log.load(record.spec.trajectory or "")
        if t is None or t.binding.sandbox_id != record.id:
            raise SandboxError(f"sandbox {record.id} is no longer the one bound to trajectory "
                               f"{record.spec.trajectory!r}", sandbox_id=record.id)
        return t

    async def call(
        self,
        record: SandboxRecord,
        seq: int | None,
        op: str,
        args: dict[str, Any],
        body: bytes | None,
        run: Callable[[int], Awaitable[Any]],
    ) -> Any:
        """One logged call other than exec: replayed, joined or run live (and then logged); without ``seq``, an
        operator's call, run outside the log."""
        if seq is None:
            return await self._outside(record, op, args, lambda: run(-1))
        t = await self._open_for(record)
        digest, readable = call_identity(op, args)
        stored = _stored(readable, body, self.log.cap)
        decision = await self.log.begin(t, seq, op, digest, stored)
        if isinstance(decision, Replay):
            assert decision.entry.response is not None
            return decode_response(op, decision.entry.response)
        if isinstance(decision, Join):
            return await asyncio.shield(decision.flight)

        async def live(at: int) -> Any:
            started = time.time()
            try:
                response: Any = await run(at)
            except DSecError as exc:
                response = exc
            except Exception as exc:  # a bug, not an answer: named, as an exec's (it was a bare HTTP 500)
                log.exception("trajectory %s: call %d (%s) failed", t.name, at, op)
                await self.log.interrupt(t, at)
                raise SandboxError(f"{op} failed: {type(exc).__name__}: {exc}") from exc
            except BaseException:
                await self.log.interrupt(t, at)
                raise
            return await self.log.finish(t, at, op, stored, digest, response, started)

        task = asyncio.create_task(live(decision.seq))
        self._fly(t, decision, task)
        return await asyncio.shield(task)

    async def exec(self, record: SandboxRecord, backend: Backend, request: ExecRequest, seq: int | None) -> ExecResult:
        """A logged exec whose caller wants only the result: as :meth:`exec_stream`, without relaying the
        events (the handler waits for the run's task once instead of once per event)."""
        if seq is None:
            self._touched(record, "exec")
            return await self.engine.exec_unlogged(record, request)
        t = await self._open_for(record)
        digest, readable = call_identity("exec", exec_args(request))
        stored = _stored(readable, request.stdin, self.log.cap)
        decision = await self.log.begin(t, seq, "exec", digest, stored)
        if isinstance(decision, Replay):
            assert decision.entry.response is not None
            replayed: ExecResult = decode_response("exec", decision.entry.response)
            return replayed
        if isinstance(decision, Join):
            joined = await asyncio.shield(decision.flight)
            if isinstance(joined, DSecError):
                raise joined
            return joined.model_copy(update={"replayed": True})  # type: ignore[no-any-return]
        task = asyncio.create_task(self._run_exec(t, decision.seq, record, backend, request, digest, stored, []))
        self._fly(t, decision, task)
        outcome = await asyncio.shield(task)  # the command runs on (and is logged) if this caller goes
        if isinstance(outcome, DSecError):
            raise outcome
        return outcome

    async def exec_stream(
        self, record: SandboxRecord, backend: Backend, request: ExecRequest, seq: int | None
    ) -> AsyncIterator[ExecEvent]:
        """A logged exec: replayed, joined, or run in a task that survives the client's disconnect (without
        ``seq``: an operator's exec, outside the log, killed if its client goes)."""
        if seq is None:
            self._touched(record, "exec")
            async for event in self.engine.exec_events(backend, record, request):
                yield event
            return
        t = await self._open_for(record)
        digest, readable = call_identity("exec", exec_args(request))
        stored = _stored(readable, request.stdin, self.log.cap)
        decision = await self.log.begin(t, seq, "exec", digest, stored)
        if isinstance(decision, Replay):
            assert decision.entry.response is not None
            for event in _events(decode_response("exec", decision.entry.response)):
                yield event
            return
        if isinstance(decision, Join):
            outcome = await asyncio.shield(decision.flight)
            if isinstance(outcome, DSecError):
                raise outcome
            for event in _events(outcome.model_copy(update={"replayed": True})):
                yield event
            return
        sink: list[asyncio.Queue[ExecEvent | DSecError]] = [asyncio.Queue()]
        task = asyncio.create_task(self._run_exec(t, decision.seq, record, backend, request, digest, stored, sink))
        self._fly(t, decision, task)
        try:
            while True:
                item = await sink[0].get()
                if isinstance(item, DSecError):
                    raise item
                yield item
                if item.type == "exit":
                    return
        finally:
            sink.clear()  # the client left: the command runs on and is logged, nobody listens

    async def _run_exec(
        self, t: OpenTrajectory, seq: int, record: SandboxRecord, backend: Backend, request: ExecRequest,
        digest: str, stored: str, sink: list[asyncio.Queue[ExecEvent | DSecError]],
    ) -> ExecResult | DSecError:
        started = time.time()
        result: ExecResult | None = None
        try:
            async for event in self.engine.exec_events(backend, record, request):
                if event.type == "exit":
                    result = event.result
                elif sink:
                    sink[0].put_nowait(event)
            if result is None:
                raise SandboxError("the command's stream ended without an exit event")
            final: ExecResult = await self.log.finish(t, seq, "exec", stored, digest, result, started)
        except DSecError as exc:
            try:
                await self.log.finish(t, seq, "exec", stored, digest, exc, started)
            except DSecError:
                pass
            except Exception:
                log.exception("trajectory %s: logging call %d failed", t.name, seq)
            if sink:
                sink[0].put_nowait(exc)
            return exc
        except Exception as exc:
            log.exception("trajectory %s: call %d failed", t.name, seq)
            await self.log.interrupt(t, seq)
            err = SandboxError(f"exec failed: {type(exc).__name__}: {exc}")
            if sink:
                sink[0].put_nowait(err)
            return err
        if sink:
            sink[0].put_nowait(ExecEvent(type="exit", result=final))
        return final

    # -- checkpoints ----------------------------------------------------------------------------------

    async def snapshot(self, record: SandboxRecord, seq: int | None) -> str:
        """A logged checkpoint: the snapshot becomes the trajectory's latest checkpoint (without ``seq``: an
        operator's snapshot, which is not)."""
        if seq is None:
            return await self.engine.take_snapshot(record)
        t = await self._open_for(record)

        async def take(at: int) -> str:
            snap_id = await self.engine.take_snapshot(record)
            t.binding.checkpoint = snap_id
            t.binding.checkpoint_seq = at + 1
            await self.log.store.put_binding(t.binding)
            return snap_id

        result: str = await self.call(record, seq, "snapshot", {}, None, take)
        return result
