"""Matching a client's calls against a trajectory log: the daemon side of fast-forward.

Owns, per open trajectory: the in-memory mirror of the log (digest, status and operation of every call),
the calls running live right now ("flights"), the lease clock, and the rules that decide what a call
with sequence number ``seq`` gets:

- ``seq`` inside the log, same digest, call done: the logged response (:class:`Replay`);
- same digest, the call still running on this daemon (its client died and re-issued it): wait for that
  run and answer with its result (:class:`Join`) -- it never runs twice;
- same digest, its outcome unknown (``interrupted``: a daemon died while it ran; or its answer never
  reached the log): an exec answers with an "outcome unknown" result and is not run again, nor is a mouse
  or keyboard action (its error says so); a read, listing, write, screenshot or snapshot runs again if it
  is the log's last call, and answers "outcome unknown" (a SandboxError) once later calls have run: run
  now, a write would undo theirs and a read would see their state;
- ``seq`` at the end of the log: logged as ``running`` (durably, before it runs), then live (:class:`Live`);
- a different digest: :class:`~dsec.errors.ReplayDivergence` with both calls;
- ``seq`` past the end: :class:`~dsec.errors.InvalidRequest` (calls must come in order).

It never runs a call or touches a sandbox: the engine does, and reports back with :meth:`finish`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from dsec.errors import DSecError, InvalidRequest, ReplayDivergence, SandboxError, error_from_payload
from dsec.models import ExecResult, FileEntry, LoggedCall, TrajectoryStatus
from dsec.models.surface import FileStat, ProcessInfo, ShellInfo, ShellResult
from dsec.trajectory.store import Binding, Entry, TrajectoryStore

__all__ = ["DEFAULT_CAP", "Join", "Live", "OpenTrajectory", "Replay", "TrajectoryLog", "decode_response"]

DEFAULT_CAP = 1024 * 1024
"""Bytes of output (per stream) or file body stored per call; the rest is dropped and the cut recorded."""
STATE_CHANGING = frozenset({
    "exec", "write", "snapshot", "mouse", "keyboard", "reveal", "mkdir", "remove", "rename", "chmod", "chown",
    "xattrs", "process", "process.stdin", "process.close_stdin", "process.signal", "process.resize", "shell",
    "shell.run", "shell.close",
})
"""Operations whose log entry must be durable before they run (their response is logged in the next batch)."""
NOT_RERUN = frozenset({"exec", "mouse", "keyboard", "process", "process.stdin", "process.signal", "shell.run"})
"""Operations that are never run twice: one interrupted by a daemon's death answers with "outcome unknown"
(a command may have half-run; input events may have reached the guest)."""
ORPHAN_AFTER = 60.0
"""Seconds without a call (and none running; at most half the lease) after which a trajectory sandbox
counts as orphaned in ``dsec ps``."""
_INTERRUPTED_INPUT = (
    "the node daemon stopped while this {op} action was sent (trajectory {name}, call {seq}): the guest may "
    "or may not have received it, and it was not sent again"
)
_INTERRUPTED = (
    "dsec: the node daemon stopped while this command ran, or its result could not be logged (trajectory {name}, "
    "call {seq}); its outcome is unknown and it was not run again\n"
)
_SUPERSEDED = (
    "the node daemon stopped while this {op} call ran, or its answer could not be logged (trajectory {name}, call "
    "{seq}), and later calls have run since: its outcome is unknown, and run again now it would not do or see "
    "what it did then, so it was not"
)


@dataclass
class Replay:
    """Answer with the logged entry."""

    entry: Entry


@dataclass
class Join:
    """The same call is running live on this daemon: wait for it."""

    flight: asyncio.Future[Any]


@dataclass
class Live:
    """Run the call now (in a task handed to :meth:`TrajectoryLog.fly`); report with :meth:`TrajectoryLog.finish`.
    ``flight`` stands for the run from the moment the call is decided: the same call issued again meanwhile
    (its client died while the call was being logged) joins it instead of running it a second time."""

    seq: int
    flight: asyncio.Future[Any]


@dataclass
class OpenTrajectory:
    """A trajectory loaded on this daemon."""

    binding: Binding
    digests: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    flights: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    last_activity: float = field(default_factory=time.time)
    lease: float = 1800.0
    restored_from: str | None = None
    missing_effects: list[int] = field(default_factory=list)
    rerun: list[int] = field(default_factory=list)
    forked_from: str | None = None
    fork_point: int | None = None

    @property
    def name(self) -> str:
        return self.binding.name

    def touch(self) -> None:
        """A call arrived: renew the lease."""
        self.last_activity = time.time()

    def lease_expired(self, now: float) -> bool:
        """True when the lease ran out with no call running."""
        return not self.flights and self.last_activity + self.lease <= now

    def status(self) -> TrajectoryStatus:
        """What clients see in ``SandboxInfo.trajectory``."""
        return TrajectoryStatus(
            name=self.name, calls=len(self.digests), lease_expires_at=self.last_activity + self.lease,
            last_activity=self.last_activity,
            orphaned=not self.flights and time.time() - self.last_activity > min(ORPHAN_AFTER, self.lease / 2),
            restored_from=self.restored_from, missing_effects=list(self.missing_effects),
            rerun=list(self.rerun), forked_from=self.forked_from, fork_point=self.fork_point,
        )


def decode_response(op: str, response: str) -> Any:
    """A logged response as the object the engine returns (ExecResult, bytes, entries, snapshot id)."""
    if op == "exec" and not response.startswith('{"__error__"'):
        result = ExecResult.model_validate_json(response)  # the hot path of fast-forward: no json.loads
        result.replayed = True
        return result
    data = json.loads(response)
    if isinstance(data, dict) and "__error__" in data:
        raise error_from_payload({"error": data["__error__"]})
    if op in ("read", "screenshot"):
        return base64.urlsafe_b64decode(data)
    if op == "list":
        return [FileEntry.model_validate(item) for item in data]
    model = _MODELS.get(op)
    if model is not None and isinstance(data, dict):
        return model.model_validate(data)
    return data


_MODELS: dict[str, type[BaseModel]] = {
    "stat": FileStat, "mkdir": FileStat, "rename": FileStat, "chmod": FileStat, "chown": FileStat, "xattrs": FileStat,
    "process": ProcessInfo, "process.wait": ProcessInfo, "shell": ShellInfo, "shell.run": ShellResult,
}
"""The response model of each logged surface call (its JSON is what the log keeps)."""


class TrajectoryLog:
    """Every trajectory opened on this node, over one :class:`TrajectoryStore`."""

    def __init__(self, store: TrajectoryStore, cap: int = DEFAULT_CAP) -> None:
        self.store = store
        self.cap = cap
        self._open: dict[str, OpenTrajectory] = {}
        self._loading: dict[str, asyncio.Lock] = {}

    def by_name(self, name: str) -> OpenTrajectory | None:
        """An already loaded trajectory."""
        return self._open.get(name)

    def all(self) -> list[OpenTrajectory]:
        """Every loaded trajectory."""
        return list(self._open.values())

    async def load(self, name: str) -> OpenTrajectory | None:
        """The trajectory (loaded from the store on first use), or None if it was never opened.

        Calls left ``running`` by a previous daemon are marked ``interrupted`` here: nothing runs them now.
        """
        loaded = self._open.get(name)
        if loaded is not None:
            return loaded
        lock = self._loading.setdefault(name, asyncio.Lock())
        async with lock:
            try:
                loaded = self._open.get(name)
                if loaded is not None:
                    return loaded
                opened = await self._read(name, interrupt=True)
                if opened is not None:
                    self._open[name] = opened
                return opened
            finally:  # loaded, not found or failed: the lock is needed no longer, unless another load waits
                if self._loading.get(name) is lock and not lock._waiters:
                    del self._loading[name]

    async def peek(self, name: str) -> OpenTrajectory | None:
        """The trajectory as the store has it now, for a look (its log, a branch's source): the loaded one, else
        read without being kept and without marking anything interrupted. In cluster mode the log is shared:
        a node that loaded a trajectory only to answer a log fetch kept a copy that went stale as its owner
        logged on, then served a resumed job from it (calls run again), and marked the owner's running calls
        interrupted."""
        loaded = self._open.get(name)
        return loaded if loaded is not None else await self._read(name, interrupt=False)

    async def _read(self, name: str, interrupt: bool) -> OpenTrajectory | None:
        """The trajectory from the store (None: never opened); ``interrupt``: mark calls left ``running`` by a
        previous daemon ``interrupted`` (nothing runs them now)."""
        binding = await self.store.get_binding(name)
        if binding is None:
            return None
        read = OpenTrajectory(binding)
        for seq, op, digest, status in await self.store.index(name):
            if interrupt and status == "running":
                await self._interrupt(name, await self.store.entry(name, seq))
                status = "interrupted"
            read.digests.append(digest)
            read.statuses.append(status)
            read.ops.append(op)
        return read

    async def _interrupt(self, name: str, entry: Entry, superseded: bool = False) -> None:
        """Log ``entry`` as interrupted, with the "outcome unknown" answer of an operation never run twice (and,
        ``superseded``, of any other: later calls have run since)."""
        entry.status = "interrupted"
        if entry.op == "exec":
            result = ExecResult(exit_code=255, stderr=_INTERRUPTED.format(name=name, seq=entry.seq).encode())
            entry.response = result.model_dump_json()
        elif entry.op in NOT_RERUN or superseded:
            text = _INTERRUPTED_INPUT if entry.op in NOT_RERUN else _SUPERSEDED
            error = SandboxError(text.format(op=entry.op, name=name, seq=entry.seq), trajectory=name, seq=entry.seq)
            entry.response = json.dumps({"__error__": error.to_payload()["error"]})
        await self.store.put_entry(name, entry)

    async def create(self, binding: Binding, prefix: list[Entry] | None = None) -> OpenTrajectory:
        """Record a new trajectory (durably) and open it; ``prefix``: calls it starts with (a branch's)."""
        await self.store.put_binding(binding)
        opened = OpenTrajectory(binding)
        for entry in prefix or []:
            opened.digests.append(entry.digest)
            opened.statuses.append(entry.status)
            opened.ops.append(entry.op)
        self._open[binding.name] = opened
        return opened

    def forget(self, name: str) -> None:
        """Drop a trajectory from memory (its log stays in the store)."""
        self._open.pop(name, None)
        lock = self._loading.get(name)
        if lock is not None and not lock.locked() and not lock._waiters:
            del self._loading[name]

    # -- matching -----------------------------------------------------------------------------------

    async def begin(
        self, t: OpenTrajectory, seq: int | None, op: str, digest: str, request: str
    ) -> Replay | Join | Live:
        """Decide what call ``seq`` gets (see the module docstring); a live call is logged first."""
        t.touch()
        length = len(t.digests)
        if seq is None:
            seq = length
        if seq < 0 or seq > length:
            raise InvalidRequest(
                f"call {seq} on trajectory {t.name!r}, whose log has {length} calls: a client issues its "
                f"calls in order, numbered from 0", trajectory=t.name, seq=seq, logged=length)
        if seq < length:
            if t.digests[seq] != digest:
                raise await self.divergence(t, seq, request)
            flight = t.flights.get(seq)
            if flight is not None and not flight.done():
                return Join(flight)
            entry = await self.store.entry(t.name, seq)
            status = t.statuses[seq]
            if entry.response is not None and status in ("done", "interrupted"):
                return Replay(entry)  # (an interrupted call's answer says its outcome is unknown)
            if status == "done" and entry.status == "done" and entry.truncated:
                return self._live(t, seq)  # a read or listing over the log's cap: read again
            # Its outcome is unknown: interrupted, or its answer never reached the log (a failed write of the
            # log). Only an idempotent call that is still the log's last runs again.
            if op in NOT_RERUN or seq < length - 1:
                await self._interrupt(t.name, entry, superseded=True)
                t.statuses[seq] = "interrupted"
                return Replay(entry)
            return self._live(t, seq)
        t.digests.append(digest)
        t.statuses.append("running")
        t.ops.append(op)
        live = self._live(t, seq)  # before the write below yields: the same call issued meanwhile joins it
        entry = Entry(seq=seq, op=op, digest=digest, request=request)
        try:
            await self.store.put_entry(t.name, entry, durable=op in STATE_CHANGING)
        except BaseException as exc:
            if t.flights.get(seq) is live.flight:
                del t.flights[seq]
            error = exc if isinstance(exc, DSecError) else SandboxError(
                f"trajectory {t.name!r} call {seq}: logging it failed ({type(exc).__name__}), so it did not run; "
                "issue it again", trajectory=t.name, seq=seq)
            _settle(live.flight, error=error)
            if len(t.digests) == seq + 1:  # nothing was appended after us: take the slot back
                del t.digests[seq], t.statuses[seq], t.ops[seq]
            raise
        return live

    @staticmethod
    def _live(t: OpenTrajectory, seq: int) -> Live:
        flight: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        t.flights[seq] = flight
        return Live(seq, flight)

    @staticmethod
    def fly(t: OpenTrajectory, live: Live, run: asyncio.Task[Any]) -> None:
        """``run`` is call ``live.seq``'s run: whoever joined the call gets its outcome."""

        def landed(task: asyncio.Task[Any]) -> None:
            if t.flights.get(live.seq) is live.flight:
                del t.flights[live.seq]
            if task.cancelled():
                _settle(live.flight, error=SandboxError(f"trajectory {t.name!r} call {live.seq} was cut off",
                                                        trajectory=t.name, seq=live.seq))
            elif task.exception() is not None:
                _settle(live.flight, error=task.exception())
            else:
                _settle(live.flight, result=task.result())

        run.add_done_callback(landed)

    async def divergence(self, t: OpenTrajectory, seq: int, request: str) -> ReplayDivergence:
        """The error for a call that differs from the log, showing both calls."""
        logged = (await self.store.entry(t.name, seq)).request
        return ReplayDivergence(
            f"trajectory {t.name!r} call {seq} differs from the log:\n  logged: {_shown(logged)}\n"
            f"  now:    {_shown(request)}", trajectory=t.name, seq=seq, logged=json.loads(logged),
            given=json.loads(request))

    async def interrupt_copied(self, name: str, entry: Entry) -> None:
        """A call copied into a new branch's log while it was ``running`` (on the source's node, or left so by a
        dead daemon): on the branch it is interrupted (counted among the effects its rebuild lacks)."""
        await self._interrupt(name, entry)

    async def interrupt(self, t: OpenTrajectory, seq: int) -> None:
        """A live call failed without an answer (not a DSec error): nothing will run it again."""
        entry = await self.store.entry(t.name, seq)
        if entry.status == "running":
            await self._interrupt(t.name, entry)
            t.statuses[seq] = "interrupted"

    async def finish(
        self, t: OpenTrajectory, seq: int, op: str, request: str, digest: str, response: Any, started: float
    ) -> Any:
        """Log a live call's response (durably for state-changing calls); returns what the caller gets.

        ``response`` may be a :class:`~dsec.errors.DSecError`: the caller saw an error, and a replay
        raises the same one.
        """
        text: str | None
        if isinstance(response, DSecError):
            text, truncated, original = json.dumps({"__error__": response.to_payload()["error"]}), False, 0
        else:
            text, truncated, original = self._encode(op, response)
        entry = Entry(seq=seq, op=op, digest=digest, request=request, status="done", response=text,
                      truncated=truncated, original_bytes=original, started_at=started,
                      duration_s=time.time() - started)
        if seq < len(t.statuses):
            t.statuses[seq] = "done"
        # Not awaited durable: committed with the next batch, right after the response goes out (any read
        # of the log, and any later durable write, commits it first). A daemon killed in between leaves the
        # call `running`, which reads as interrupted after a restart: never run again, outcome unknown.
        await self.store.put_entry(t.name, entry, durable=False)
        t.touch()
        if isinstance(response, DSecError):
            raise response
        if op == "exec" and truncated:
            return response.model_copy(update={"log_truncated": True})
        return response

    def _encode(self, op: str, response: Any) -> tuple[str | None, bool, int]:
        cap = self.cap
        if op == "exec":
            result: ExecResult = response
            original = len(result.stdout) + len(result.stderr)
            truncated = len(result.stdout) > cap or len(result.stderr) > cap
            stored = result.model_copy(update={"stdout": result.stdout[:cap], "stderr": result.stderr[:cap],
                                               "log_truncated": truncated})
            return stored.model_dump_json(), truncated, original
        if op in ("read", "screenshot"):
            data: bytes = response
            if len(data) > cap:
                return None, True, len(data)  # replayed by reading again: a cut file would be wrong data
            return json.dumps(base64.urlsafe_b64encode(data).decode()), False, len(data)
        if op == "list":
            text = json.dumps([e.model_dump(mode="json") for e in response])
            if len(text) > cap:
                return None, True, len(text)
            return text, False, len(text)
        if isinstance(response, ShellResult):
            original = len(response.stdout) + len(response.stderr)
            cut = len(response.stdout) > cap or len(response.stderr) > cap
            kept = response.model_copy(update={"stdout": response.stdout[:cap], "stderr": response.stderr[:cap],
                                               "truncated": response.truncated or cut})
            return kept.model_dump_json(), cut, original
        if isinstance(response, BaseModel):
            text = response.model_dump_json()
            return text, False, len(text)
        return json.dumps(response), False, 0

    async def logged(self, name: str, start: int, limit: int) -> list[LoggedCall]:
        """Completed calls from ``start`` (what the SDK fetches to fast-forward on its own)."""
        t = self._open.get(name)
        if t is not None:
            t.touch()
        elif await self.store.get_binding(name) is None:
            raise InvalidRequest(f"no trajectory {name!r} on this node", trajectory=name)
        return [
            LoggedCall.model_validate({"seq": e.seq, "op": e.op, "digest": e.digest, "status": e.status,
                                       "response": e.response, "truncated": e.truncated,
                                       "request": e.request, "started_at": e.started_at, "duration_s": e.duration_s})
            for e in await self.store.entries(name, start, limit)
        ]


def _settle(flight: asyncio.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a call's flight (once); an error nobody joined for is not reported as never retrieved."""
    if flight.done():
        return
    if error is None:
        flight.set_result(result)
        return
    flight.set_exception(error)
    flight.exception()  # retrieved: joiners (if any) still get it


def _shown(request: str, limit: int = 400) -> str:
    data = json.loads(request)
    data.pop("body", None)
    text = json.dumps(data, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."
