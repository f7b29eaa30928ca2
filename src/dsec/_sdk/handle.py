"""What every ``AsyncSandbox`` handle does beneath its public calls: validation, routing, the trajectory log.

Owns the local validation of requests (so a bad argument is an ``InvalidRequest`` before any HTTP call),
where a sandbox's data calls go (its node or the client's daemon), and a trajectory handle's logged calls:
numbering, answering from the log, branching on a divergence, renewing the lease. Must never define a
public sandbox operation (``dsec._sdk.sandbox.AsyncSandbox`` does, and the blocking SDK is derived from
that class alone), spell a route, or block the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic

from dsec.api.client import NodeClient
from dsec.api.operations import close_stream
from dsec.errors import (
    ConnectionFailed,
    DSecError,
    InvalidRequest,
    ReplayDivergence,
    SandboxNotFound,
    SandboxTimeout,
)
from dsec.models import (
    ExecEvent,
    ExecRequest,
    SandboxInfo,
    SandboxSpec,
    TrajectoryForkRequest,
)

from .client import Client
from .replay import Cursor

log = logging.getLogger(__name__)

T = TypeVar("T")


def invalid(exc: pydantic.ValidationError, what: str) -> InvalidRequest:
    """Name the offending field(s) the way the server would, so local and remote errors read alike."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or what}: {err['msg']}" for err in exc.errors()
    )
    return InvalidRequest(f"invalid {what}: {problems}", errors=[
        {"loc": [str(p) for p in err["loc"]], "msg": err["msg"]} for err in exc.errors()
    ])


def exec_request(
    command: str | Sequence[str], timeout: float | None, cwd: str | None, env: Mapping[str, str] | None,
    stdin: str | bytes | None, max_output: int, pristine: bool = False, user: str | None = None,
) -> ExecRequest:
    try:
        return ExecRequest(
            command=command if isinstance(command, str) else builtins.list(command),
            timeout=timeout, cwd=cwd, env=dict(env) if env is not None else None,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin, max_output=max_output,
            pristine=pristine, user=user,
        )
    except pydantic.ValidationError as exc:
        raise invalid(exc, "exec request") from None


def spec(**fields: Any) -> SandboxSpec:
    try:
        return SandboxSpec(**fields)
    except pydantic.ValidationError as exc:
        raise invalid(exc, "sandbox spec") from None


def data_plane(info: SandboxInfo, client: Client) -> NodeClient:
    """Where a sandbox's data calls go: the owning node when a cluster gateway named one (with the token it
    gave, scoped to the sandbox), else the client's daemon."""
    endpoint = info.endpoint
    return client.api if endpoint is None else client.api.at(endpoint.url, endpoint.token)


def heartbeat_interval(lease: float) -> float:
    """Seconds between the SDK's lease renewals for a trajectory lease of ``lease`` seconds."""
    return min(max(lease / 3, 0.5), 300.0)


async def renew_lease(ref: weakref.ref[LoggedHandle], interval: float) -> None:
    """The heartbeat of one trajectory handle (see :meth:`AsyncSandbox._start_heartbeat`)."""
    while True:
        await asyncio.sleep(interval)
        sandbox = ref()
        if sandbox is None:
            return
        api, sandbox_id = sandbox._client.api, sandbox._info.id
        del sandbox  # not held across the request: a dropped handle must be collectable
        try:
            await api.renew_lease(sandbox_id)
        except (SandboxNotFound, SandboxTimeout, InvalidRequest):
            return  # gone, expired, or a daemon that has no lease for it: nothing left to renew
        except DSecError as exc:  # daemon restarting, network blip: try again next beat
            log.debug("lease renewal of %s failed: %s", sandbox_id, exc)


class LoggedHandle:
    """The private base of ``AsyncSandbox``: a trajectory handle's numbering, replay and lease renewal."""

    _info: SandboxInfo
    _client: Client
    _api: NodeClient
    _cursor: Cursor | None
    _on_divergence: str
    _rerun_missing: bool
    _heartbeat: asyncio.Task[None] | None

    async def _branch(self, exc: ReplayDivergence) -> bool:
        """With ``on_divergence="fork"``: move this handle onto a branch of its trajectory at the call that
        diverged (the daemon rebuilds a sandbox to that point); False when the policy is to raise."""
        if self._cursor is None or self._on_divergence != "fork" or not isinstance(exc.detail.get("seq"), int):
            return False
        at = int(exc.detail["seq"])
        request = TrajectoryForkRequest(name=self._cursor.name, at=at, rerun_missing=self._rerun_missing)
        self._info = await self._client.api.branch_trajectory(request)
        self._api = data_plane(self._info, self._client)
        assert self._info.trajectory is not None
        self._cursor = Cursor(self._client, self._info.trajectory.name, at)
        self._cursor.next_seq = at
        return True

    def _resync(self, exc: InvalidRequest, seq: int | None) -> bool:
        """The daemon refused call ``seq`` as past the end of the log: calls numbered before it never reached the
        log (refused at connect while the daemon restarted, or a read answered just before it was killed), so
        every later call would be refused too. Number this one at the log's end, where the daemon is; False for
        any other refusal."""
        logged = exc.detail.get("logged")
        if (self._cursor is None or exc.detail.get("trajectory") != self._cursor.name or not isinstance(logged, int)
                or not isinstance(seq, int) or not 0 <= logged < seq):
            return False
        self._cursor.next_seq = logged
        return True

    async def _logged(
        self, op: str, args: dict[str, Any] | Callable[[], dict[str, Any]]
    ) -> tuple[int | None, bool, Any]:
        """On a trajectory handle: number the call and answer it from the log if it can: ``(seq, hit, answer)``."""
        if self._cursor is None:
            return None, False, None
        seq = self._cursor.take()
        if seq >= self._cursor.logged:
            return seq, False, None
        hit, answer = await self._cursor.cached(seq, op, args() if callable(args) else args)
        return seq, hit, answer

    async def _logged_call(self, op: str, args: dict[str, Any], send: Callable[[int | None], Awaitable[T]]) -> T:
        """A logged data-plane call: the logged answer when the log answers it, else ``send(seq)``'s. A divergence
        moves the handle onto a branch (``on_divergence="fork"``, a sandbox of its own), where the call is
        numbered and sent again."""
        while True:
            seq, hit, cached = await self._logged(op, args)
            if hit:
                answer: T = cached
                return answer
            try:
                return await send(seq)
            except ReplayDivergence as exc:
                if not await self._branch(exc):
                    raise
            except InvalidRequest as exc:
                if not self._resync(exc, seq):
                    raise

    def _keep_endpoint(self, info: SandboxInfo) -> SandboxInfo:
        """A node answers without the endpoint the gateway gave us: keep ours."""
        if info.endpoint is None and self._info.endpoint is not None:
            return info.model_copy(update={"endpoint": self._info.endpoint})
        return info

    def _start_heartbeat(self) -> None:
        """Renew the trajectory lease in the background while this handle lives (every third of the lease,
        at most every 5 minutes): a live client that is idle (thinking, training) keeps its sandbox. The task
        holds the handle weakly: a handle that is dropped (or closed) stops renewing and the lease runs out."""
        interval = heartbeat_interval(self._info.spec.lease)
        self._heartbeat = asyncio.get_running_loop().create_task(renew_lease(weakref.ref(self), interval))

    async def _exec_events(self, request: ExecRequest, seq: int | None) -> AsyncGenerator[ExecEvent, None]:
        exited = False
        events = self._api.exec_stream(self._info.id, request, seq)
        try:
            # Read on to the end after the exit event (the server closes the stream right away): a stream left
            # unread costs its keep-alive connection, and the next call would pay a new connect.
            async for event in events:
                exited = exited or event.type == "exit"
                yield event
        finally:
            await close_stream(events)
        if not exited:
            raise ConnectionFailed("the exec stream ended without an exit event (daemon stopped mid-call?)")
