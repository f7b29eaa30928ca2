"""``dsec.AsyncSandbox``: the single source of truth of the SDK.

Every sandbox operation is written here once, as a coroutine (or an async generator for streams); the
blocking ``dsec.Sandbox`` is generated from this class by ``_sdk/sync.py``. Requests are validated locally
with the shared wire models, so a bad argument raises :class:`dsec.InvalidRequest` before any HTTP call,
and sent through the node API (``Client.api``, :class:`dsec.api.NodeClient`): this module never spells a
route. It must never block the event loop, hold a connection of its own, or retry a call (a retried exec
could run a command twice). Validation, routing and a trajectory handle's logged calls live in its private
base, :mod:`dsec._sdk.handle`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import socket
import warnings
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import pydantic

from dsec.api.operations import close_stream
from dsec.errors import (
    DSecError,
    InvalidRequest,
    NotFound,
    NotSupported,
    ReplayDivergence,
    SandboxNotFound,
)
from dsec.models import (
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    CallRequest,
    ExecEvent,
    ExecResult,
    ForkRequest,
    ImageInfo,
    KeyboardRequest,
    MouseRequest,
    NetworkRequest,
    SandboxInfo,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
)
from dsec.models.surface import ExposeRequest, PortInfo, ShellInfo
from dsec.trajectory.digest import exec_args

from .calls import client_python, decode_reply, encode_arguments, encode_call, encode_function
from .client import Client, default_client
from .files import AsyncFiles
from .handle import LoggedHandle
from .handle import data_plane as _data_plane
from .handle import exec_request as _exec_request
from .handle import heartbeat_interval as heartbeat_interval
from .handle import invalid as _invalid
from .handle import spec as _spec
from .mapping import map_calls
from .processes import AsyncProcess, AsyncProcesses, AsyncShell, process_request, shell_request
from .replay import Cursor

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["AsyncFiles", "AsyncSandbox", "list_infos"]

_LIST_PAGE = 5_000
"""Sandboxes per page of ``list``."""
_CLOSE_CHUNK = 10_000
"""Sandboxes one batch destroy request of ``close_many`` names at most (a request of a few hundred KiB)."""
_DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
_CALL_MAX_OUTPUT = 1024 * 1024


class AsyncSandbox(LoggedHandle):
    """One isolated sandbox on a DSec node, driven with ``await``.

    Make one with :meth:`create`, :meth:`create_many` or :meth:`connect`; ``async with`` closes (destroys)
    it on exit. ``files`` reads and writes its files.
    """

    def __init__(self, info: SandboxInfo, client: Client) -> None:
        self._info = info
        self._client = client
        self._api = _data_plane(info, client)
        self.files = AsyncFiles(self)
        """The sandbox's files."""
        self.processes = AsyncProcesses(self)
        """The processes the node keeps for this sandbox (``exec(..., background=True)``, ``pty()``)."""
        # Set by create(trajectory=...): this handle numbers its calls and fast-forwards through the log.
        self._cursor: Cursor | None = None
        self._on_divergence = "raise"
        self._rerun_missing = False
        self._heartbeat: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        info = self._info
        return f"{type(self).__name__}(id={info.id!r}, backend={info.backend!r}, image={info.image!r})"

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self._info.id

    # ----- lifecycle -------------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        image: str | None = None,
        backend: str = "container",
        cpu: float = 1.0,
        memory: int | str = "1Gi",
        disk: int | str = "4Gi",
        timeout: float = 3600,
        network: str | Sequence[str] = "none",
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        workdir: str | None = None,
        trajectory: str | None = None,
        snapshot: str | None = None,
        pids: int = 1024,
        client: Client | None = None,
        lease: float = 1800,
        rerun_missing: bool = False,
        on_divergence: str = "raise",
        protected: Sequence[str] = (),
        hidden: Sequence[str] = (),
        landlock: bool = True,
        user: str | None = None,
        keep_logged_spec: bool = False,
        allow_privilege_escalation: bool = False,
    ) -> AsyncSandbox:
        """Create and start a sandbox; the arguments are those of :class:`dsec.SandboxSpec`.

        With ``trajectory``, a new trajectory creates and binds a sandbox; an existing one re-attaches its
        live sandbox (or rebuilds a lost one from its latest checkpoint), and this handle's calls are
        matched in order against the log: logged calls return their logged response without running,
        the first call past the log runs live, a different call raises :class:`dsec.ReplayDivergence`
        (with ``on_divergence="fork"``, the handle instead moves to a new branch of the trajectory, whose
        sandbox is rebuilt to the last matching call, and the call runs there; ``info().trajectory`` names
        the branch). Issue a trajectory handle's calls one at a time, in the rollout's order. Re-opening a
        trajectory with a spec other than its logged one raises :class:`dsec.ReplayDivergence` naming the
        fields (``keep_logged_spec=True``: go on with the logged spec); ``close(end=True)`` ends a trajectory
        so that its name starts a new one.
        """
        if on_divergence not in ("raise", "fork"):
            raise InvalidRequest(f"on_divergence must be 'raise' or 'fork', got {on_divergence!r}")
        spec = _spec(
            image=image, backend=backend, cpu=cpu, memory=memory, disk=disk, timeout=timeout,
            network=network if isinstance(network, str) else list(network), env=dict(env or {}),
            labels=dict(labels or {}), workdir=workdir, trajectory=trajectory, snapshot=snapshot, pids=pids,
            lease=lease, rerun_missing=rerun_missing, protected=list(protected), hidden=list(hidden),
            landlock=landlock, user=user, keep_logged_spec=keep_logged_spec,
            allow_privilege_escalation=allow_privilege_escalation,
        )
        client = client or default_client()
        sandbox = cls(await client.api.create(spec), client)
        status = sandbox._info.trajectory
        if status is not None:
            sandbox._cursor = Cursor(client, status.name, status.calls)
            sandbox._on_divergence, sandbox._rerun_missing = on_divergence, rerun_missing
            sandbox._start_heartbeat()
        return sandbox

    @classmethod
    async def build_image(
        cls,
        name: str,
        context: str | os.PathLike[str] = ".",
        *,
        dockerfile: str | os.PathLike[str] | None = None,
        build_args: Mapping[str, str] | None = None,
        target: str | None = None,
        network: str = "private",
        no_cache: bool = False,
        insecure: bool = False,
        username: str | None = None,
        password: str | None = None,
        replace: bool = False,
        output: Callable[[str], None] | None = None,
        client: Client | None = None,
    ) -> ImageInfo:
        """Build image ``name`` from a Dockerfile on the node, as ``docker build`` would, and store it there.

        ``context`` is the build context directory (sent to the node; its ``.dockerignore`` is honoured by
        the builder); ``dockerfile`` defaults to ``CONTEXT/Dockerfile`` (a path, like ``docker build -f``).
        ``FROM`` may name an image of the node's store or of a registry the node is configured for
        (``insecure``: plain HTTP; ``username``/``password``: its credentials). ``output`` gets each line the
        builder prints. Raises :class:`dsec.BuildFailed` naming the failing step; nothing is stored then.
        """
        from .images import build_image

        return await build_image(client or default_client(), context, dockerfile, {
            "name": name, "build_args": dict(build_args or {}), "target": target, "network": network,
            "no_cache": no_cache, "insecure": insecure, "username": username, "password": password, "replace": replace,
        }, output)

    @classmethod
    async def pull_image(cls, reference: str, *, name: str | None = None, insecure: bool = False,
                         username: str | None = None, password: str | None = None, replace: bool = False,
                         client: Client | None = None) -> ImageInfo:
        """Pull ``reference`` (``[host[:port]/]repo[:tag][@sha256:...]``) from an OCI registry into the node's
        store as ``name`` (default: the repository's last part, plus ``-TAG``); returns when it is ready."""
        from .images import pull_image

        return await pull_image(client or default_client(), reference, name=name, insecure=insecure,
                                username=username, password=password, replace=replace)

    @classmethod
    async def create_many(
        cls,
        n: int,
        image: str | None = None,
        backend: str = "container",
        cpu: float = 1.0,
        memory: int | str = "1Gi",
        disk: int | str = "4Gi",
        timeout: float = 3600,
        network: str | Sequence[str] = "none",
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        workdir: str | None = None,
        trajectory: str | None = None,
        snapshot: str | None = None,
        pids: int = 1024,
        client: Client | None = None,
        protected: Sequence[str] = (),
        hidden: Sequence[str] = (),
        landlock: bool = True,
        user: str | None = None,
        allow_privilege_escalation: bool = False,
    ) -> builtins.list[AsyncSandbox]:
        """Create ``n`` sandboxes from one spec in one request (all or nothing)."""
        spec = _spec(
            image=image, backend=backend, cpu=cpu, memory=memory, disk=disk, timeout=timeout,
            network=network if isinstance(network, str) else list(network), env=dict(env or {}),
            labels=dict(labels or {}), workdir=workdir, trajectory=trajectory, snapshot=snapshot, pids=pids,
            protected=list(protected), hidden=list(hidden), landlock=landlock, user=user,
            allow_privilege_escalation=allow_privilege_escalation,
        )
        try:
            batch = BatchCreateRequest(count=n, spec=spec)
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "batch request") from None
        client = client or default_client()
        # Streamed: each node's share comes as it is made, so a job's batch of thousands keeps the answer
        # moving (no time-out while it lasts); an error item raises, and the batch was undone.
        events = client.api.create_many_stream(batch)
        try:
            return [cls(event.sandbox, client) async for event in events if event.sandbox is not None]
        finally:
            await close_stream(events)  # a caller that left mid-batch: the server undoes it

    @classmethod
    async def close_many(cls, sandboxes: Sequence[AsyncSandbox | str], client: Client | None = None
                         ) -> BatchDestroyResult:
        """Destroy many sandboxes (or ids) in as few requests as their number allows (a job's batch at its end):
        each on its own, so one that fails keeps nobody else alive. Returns which were destroyed, which were
        already gone (``missing``: closing twice is fine) and which failed, with why (destroying those again
        may succeed); nothing is raised for a sandbox that failed."""
        ids = [s if isinstance(s, str) else s.id for s in sandboxes]
        for sandbox in sandboxes:
            if isinstance(sandbox, AsyncSandbox) and sandbox._heartbeat is not None:
                sandbox._heartbeat.cancel()
                sandbox._heartbeat = None
        client = client or (next((s._client for s in sandboxes if isinstance(s, AsyncSandbox)), None)
                            or default_client())
        result = BatchDestroyResult()
        for start in range(0, len(ids), _CLOSE_CHUNK):
            try:
                request = BatchDestroyRequest(ids=ids[start:start + _CLOSE_CHUNK])
            except pydantic.ValidationError as exc:
                raise _invalid(exc, "batch destroy") from None
            done = await client.api.destroy_many(request)
            result.destroyed += done.destroyed
            result.missing += done.missing
            result.failed.update(done.failed)
        return result

    @classmethod
    async def connect(cls, sandbox_id: str, client: Client | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox by id (raises SandboxNotFound)."""
        client = client or default_client()
        return cls(await client.api.get(sandbox_id), client)

    @classmethod
    async def list(
        cls,
        labels: Mapping[str, str] | None = None,
        backend: str | None = None,
        client: Client | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """Live sandboxes on the daemon, filtered by every given label and by backend."""
        client = client or default_client()
        return [cls(info, client) for info in await list_infos(labels, backend, client)]

    async def info(self) -> SandboxInfo:
        """Fresh state of the sandbox (state, expiry, spec, node). On a trajectory, warns (``UserWarning``) when
        state-changing calls were made on the sandbox outside its log since the handle last looked (an
        operator's ``dsec exec``): its state may differ from what the logged calls made."""
        before = self._info.trajectory.outside_log if self._info.trajectory is not None else 0
        self._info = await self._client.api.get(self.id)
        self._api = _data_plane(self._info, self._client)
        status = self._info.trajectory
        if status is not None and status.outside_log > before:
            warnings.warn(f"sandbox {self.id} of trajectory {status.name!r}: {status.outside_log - before} "
                          "state-changing call(s) were made on it outside the log (an operator's exec or file "
                          "change; see the audit trail): a re-run of the log will not repeat them",
                          UserWarning, stacklevel=2)
        return self._info

    async def stats(self) -> SandboxStats:
        """Resource usage now (memory, cpu, pids, disk)."""
        return await self._api.stats(self.id)

    async def pause(self, release_memory: bool = False) -> SandboxInfo:
        """Freeze every process of the sandbox (execs are refused until resume). ``release_memory=True``
        also saves it to disk and gives its memory back to the host (microvm; resume restores it with the
        same processes and files); backends that cannot raise :class:`~dsec.NotSupported`."""
        self._info = self._keep_endpoint(await self._api.pause(self.id, release_memory))
        return self._info

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox."""
        self._info = self._keep_endpoint(await self._api.resume(self.id))
        return self._info

    async def set_timeout(self, timeout: float) -> SandboxInfo:
        """Destroy the sandbox ``timeout`` seconds from now instead of at its current deadline (sooner or later)."""
        try:
            request = TimeoutRequest(timeout=timeout)
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "timeout") from None
        self._info = self._keep_endpoint(await self._client.api.set_timeout(self.id, request.timeout))
        return self._info

    async def reveal(self) -> SandboxInfo:
        """Make the paths hidden at creation (``hidden=[...]``) visible to the sandbox, read-only: the
        grading phase begins (container, function and microvm backends). On a trajectory it is a logged
        call (replayed from the log when fast-forwarding, re-run on a rebuilt sandbox)."""
        answer = await self._logged_call("reveal", {}, lambda seq: self._api.reveal(self.id, seq))
        if isinstance(answer, SandboxInfo):
            self._info = self._keep_endpoint(answer)
        return self._info

    async def set_network(self, network: str | Sequence[str]) -> SandboxInfo:
        """Replace the network policy: ``"none"``, ``"allow"`` or an allowlist of ``CIDR[:port]`` and
        domain names (``"pypi.org"``, ``"*.pythonhosted.org:443"``). Takes effect at once, e.g. to cut
        the network after set-up and before the graded phase."""
        try:
            request = NetworkRequest.model_validate({"network": network if isinstance(network, str) else list(network)})
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "network policy") from None
        self._info = self._keep_endpoint(await self._api.set_network(self.id, request.network))
        return self._info

    async def screenshot(self) -> bytes:
        """The display as PNG bytes (``backend="vm"``; other backends raise NotSupported). On a trajectory it
        is a logged call (replayed from the log when fast-forwarding)."""
        return bytes(await self._logged_call("screenshot", {}, lambda seq: self._api.screenshot(self.id, seq)))

    async def mouse(self, x: int, y: int, button: str = "left", action: str = "click") -> None:
        """Move the pointer to pixel (``x``, ``y``) of the display, then act: ``"click"``, ``"double_click"``,
        ``"down"``, ``"up"``, ``"move"``, ``"scroll_up"`` or ``"scroll_down"``, with ``button`` ``"left"``,
        ``"middle"`` or ``"right"`` (``backend="vm"``; a logged call on a trajectory)."""
        try:
            request = MouseRequest.model_validate({"x": x, "y": y, "button": button, "action": action})
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "mouse action") from None
        await self._logged_call("mouse", request.model_dump(mode="json"),
                                lambda seq: self._api.mouse(self.id, request, seq))

    async def keyboard(self, text: str | None = None, keys: Sequence[str] | None = None) -> None:
        """Type ``text`` (US layout; ``\n`` is Enter) or press ``keys`` in order, each a key or a combo:
        ``["ctrl+c", "enter"]`` (``backend="vm"``; a logged call on a trajectory)."""
        try:
            request = KeyboardRequest(text=text, keys=None if keys is None else list(keys))
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "keyboard input") from None
        await self._logged_call("keyboard", request.model_dump(mode="json", exclude_none=True),
                                lambda seq: self._api.keyboard(self.id, request, seq))

    async def snapshot(self) -> str:
        """Save the sandbox's writable state; the id restores it with ``create(snapshot=...)``, on this
        node or on another sharing the snapshot store. On a trajectory it is also the latest checkpoint."""
        try:
            answer = await self._logged_call("snapshot", {}, lambda seq: self._api.snapshot(self.id, seq))
        except DSecError as exc:
            if type(exc) is DSecError:
                # A daemon without the route answers a bare 404/405, not a DSec error payload.
                raise NotSupported("this daemon cannot snapshot sandboxes yet") from exc
            raise
        return answer.snapshot if isinstance(answer, SnapshotRef) else str(answer)

    async def fork(self, n: int) -> builtins.list[AsyncSandbox]:
        """``n`` independent sandboxes with this one's current state (taken while it is frozen).

        The copies are plain sandboxes: not bound to this one's trajectory. Close each when done.
        """
        try:
            request = ForkRequest(count=n)
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "fork request") from None
        return [type(self)(info, self._client) for info in await self._client.api.fork(self.id, request.count)]

    async def close(self, end: bool = False) -> None:
        """Destroy the sandbox and everything in it. Closing twice (or a sandbox already gone) is fine.

        A trajectory's sandbox closed this way is rebuilt by the next ``create(trajectory=...)`` of its name,
        which replays the log; with ``end=True`` the trajectory ends instead: its log stays readable
        (:class:`dsec.AsyncTrajectory`) until the name is opened again, which starts a new trajectory."""
        if end and self._info.trajectory is None:
            raise InvalidRequest(f"close(end=True): sandbox {self.id} is not bound to a trajectory; use close()")
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if end:
            assert self._info.trajectory is not None
            await self._client.api.end_trajectory(self._info.trajectory.name)
            return
        with contextlib.suppress(SandboxNotFound):
            await self._client.api.destroy(self.id)

    async def aclose(self) -> None:
        """Same as :meth:`close`; lets ``contextlib.aclosing(sandbox)`` work."""
        await self.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ----- Python callables (function backend) --------------------------------------------------------

    async def call(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` inside the sandbox and return its value (see :meth:`call_with`)."""
        return await self.call_with(func, args, kwargs)

    async def call_with(
        self,
        func: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = 60,
        max_result_bytes: int = _DEFAULT_MAX_OUTPUT,
        trusted: bool = False,
        python: str = "python3",
        env: Mapping[str, str] | None = None,
        memory: int | str | None = None,
        pids: int | None = None,
        disk: int | str | None = None,
        max_output: int = _CALL_MAX_OUTPUT,
    ) -> Any:
        """Run ``func(*args, **kwargs)`` in a fresh process of the sandbox, forked from an interpreter of the image
        that has cloudpickle already imported (the image's Python must have this interpreter's minor version).

        Each call has its own ``memory``, ``pids`` and ``disk`` (its ``/tmp``) limits: the sandbox's unless
        lower ones are given here; another call's use never counts against them. Raises :class:`dsec.RemoteError`
        with the remote type and traceback when it raises, :class:`dsec.CallFailed` when it ends at a limit
        (``detail["limit"]``: time, memory, pids, disk or output; prints past ``max_output`` bytes are the
        output limit), crashes, or returns more than ``max_result_bytes``; errors of the sandbox itself
        (:class:`dsec.SandboxError`, :class:`dsec.InvalidRequest` for an image without Python) are never a
        call's verdict. The value is rebuilt as plain data only unless ``trusted``."""
        return await self._call(encode_call(func, tuple(args), dict(kwargs or {})), timeout=timeout,
                                max_result_bytes=max_result_bytes, trusted=trusted, python=python, env=env,
                                memory=memory, pids=pids, disk=disk, max_output=max_output)

    async def _call(self, payload: bytes, *, timeout: float | None, max_result_bytes: int, trusted: bool, python: str,
                    env: Mapping[str, str] | None, memory: int | str | None, pids: int | None, disk: int | str | None,
                    max_output: int) -> Any:
        try:
            request = CallRequest(payload=payload, client_python=client_python(), timeout=timeout,
                                  max_result_bytes=max_result_bytes, python=python,
                                  env=dict(env) if env is not None else None, memory=memory, pids=pids, disk=disk,
                                  max_output=max_output)
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "call") from None
        return decode_reply(await self._api.call(self.id, request), trusted=trusted)

    async def map(
        self,
        func: Callable[[Any], Any],
        inputs: Iterable[Any],
        *,
        concurrency: int = 8,
        timeout: float | None = 60,
        trusted: bool = False,
        return_exceptions: bool = False,
        memory: int | str | None = None,
        pids: int | None = None,
        disk: int | str | None = None,
        max_output: int = _CALL_MAX_OUTPUT,
    ) -> builtins.list[Any]:
        """``[func(x) for x in inputs]``, each in its own call (with its own limits, as :meth:`call_with`),
        ``concurrency`` at a time; results in input order. The items travel in batches (the function pickled once,
        up to 64 items a request), each item still a fresh process with its own verdict. With ``return_exceptions``
        a failed call's error takes its place instead of being raised; without it the first error is raised and
        the calls still running are killed."""
        if concurrency < 1:
            raise InvalidRequest(f"concurrency must be at least 1, got {concurrency}")
        items = [encode_arguments(func, (x,), {}) for x in inputs]
        options = {"client_python": client_python(), "timeout": timeout, "max_result_bytes": _DEFAULT_MAX_OUTPUT,
                   "python": "python3", "memory": memory, "pids": pids, "disk": disk, "max_output": max_output}
        return await map_calls(self._api, self.id, encode_function(func), items, concurrency=concurrency,
                               trusted=trusted, return_exceptions=return_exceptions, options=options)

    # ----- commands --------------------------------------------------------------------------------

    @overload
    async def exec(
        self, command: str | Sequence[str], timeout: float | None = 60, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: str | bytes | None = None, max_output: int = _DEFAULT_MAX_OUTPUT,
        pristine: bool = False, user: str | None = None, background: Literal[False] = False,
    ) -> ExecResult: ...

    @overload
    async def exec(
        self, command: str | Sequence[str], timeout: float | None = 60, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: str | bytes | None = None, max_output: int = _DEFAULT_MAX_OUTPUT,
        pristine: bool = False, user: str | None = None, *, background: Literal[True],
    ) -> AsyncProcess: ...

    async def exec(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        max_output: int = _DEFAULT_MAX_OUTPUT,
        pristine: bool = False,
        user: str | None = None,
        background: bool = False,
    ) -> ExecResult | AsyncProcess:
        """Run a command to completion: a shell string (``/bin/sh -c``) or an argv list, as ``user`` (``name``,
        ``uid``, ``name:group``, ``uid:gid`` of the sandbox; default: the sandbox's user); ``cwd`` absolute or
        relative to the sandbox's working directory.

        ``pristine=True`` runs it on the image's untouched root with the working directory mounted in
        (for graders: the agent cannot have replaced the binaries it uses). ``background=True`` does not wait:
        it returns an :class:`AsyncProcess` (its stdin stays open, ``timeout`` is None unless given) that
        outlives this call and this client."""
        if background:
            return await self.processes.start(command, cwd=cwd, env=env, user=user, stdin=stdin,
                                              timeout=None if timeout == 60 else timeout)
        request = _exec_request(command, timeout, cwd, env, stdin, max_output, pristine, user)
        seq, hit, cached = await self._logged("exec", lambda: exec_args(request))
        if hit:
            result: ExecResult = cached
            return result
        try:
            # One request, one answer (no stream): the output arrives with the exit status anyway.
            return await self._api.exec(self.id, request, seq)
        except (ReplayDivergence, InvalidRequest) as exc:
            # The daemon answers a divergence before running anything: the call can move to a branch. A call
            # numbered past the log's end is numbered again.
            moved = await self._branch(exc) if isinstance(exc, ReplayDivergence) else self._resync(exc, seq)
            if not moved:
                raise
            return await self.exec(command, timeout=timeout, cwd=cwd, env=env, stdin=stdin, max_output=max_output,
                                   pristine=pristine, user=user)

    async def exec_stream(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        max_output: int = _DEFAULT_MAX_OUTPUT,
        pristine: bool = False,
        user: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run a command (as ``user``) and yield ``stdout``/``stderr`` chunks as they arrive, then one ``exit``
        event.

        Leaving the loop early closes the stream, and the daemon kills the command.
        """
        request = _exec_request(command, timeout, cwd, env, stdin, max_output, pristine, user)
        seq, hit, cached = await self._logged("exec", lambda: exec_args(request))
        if hit:
            for kind, data in (("stdout", cached.stdout), ("stderr", cached.stderr)):
                if data:
                    yield ExecEvent(type=kind, data=data)
            yield ExecEvent(type="exit", result=cached)
            return
        started = False
        events = self._exec_events(request, seq)
        try:
            async for event in events:
                started = True
                yield event
        except (ReplayDivergence, InvalidRequest) as exc:
            # The daemon answers a divergence (or a call numbered past the log's end) before any output: the call
            # can move to a branch (or its number) whole.
            if started:
                raise
            moved = await self._branch(exc) if isinstance(exc, ReplayDivergence) else self._resync(exc, seq)
            if not moved:
                raise
            retry = self.exec_stream(command, timeout=timeout, cwd=cwd, env=env, stdin=stdin, max_output=max_output,
                                     pristine=pristine, user=user)
            try:
                async for event in retry:
                    yield event
            finally:
                await retry.aclose()
        finally:
            await events.aclose()  # leaving early closes the HTTP stream now, and the daemon kills the command

    # ----- terminals, shell sessions, ports ----------------------------------------------------------

    async def pty(self, cols: int = 80, rows: int = 24, user: str | None = None, cwd: str | None = None,
                  env: Mapping[str, str] | None = None, command: str | Sequence[str] | None = None) -> AsyncProcess:
        """A terminal of ``cols`` x ``rows`` running ``command`` (default: the user's login shell) as ``user``:
        ``send_stdin`` is what is typed, ``stdout()`` what the terminal shows, ``resize`` changes its size.
        ``tmux`` and other full-screen programs run there."""
        request = process_request(command=command if command is None or isinstance(command, str)
                                  else builtins.list(command), cwd=cwd, env=dict(env) if env is not None else None,
                                  user=user, pty={"cols": cols, "rows": rows})
        return await self.processes._start(request)

    async def shell(self, user: str | None = None, cwd: str | None = None, env: Mapping[str, str] | None = None
                    ) -> AsyncShell:
        """A new persistent ``bash`` session (several per sandbox): ``run(command)`` one command at a time;
        ``cd``, exported variables and functions persist. Close it when done (``async with`` does)."""
        request = shell_request(user, cwd, env)
        info: ShellInfo = await self._logged_call("shell", request.model_dump(exclude_none=True),
                                                  lambda seq: self._api.start_shell(self.id, request, seq))
        return AsyncShell(self, info)

    async def expose(self, port: int, protocol: str = "http") -> PortInfo:
        """Make ``port`` inside the sandbox reachable from here: the node listens and forwards. ``http``: a
        ``url`` (plain HTTP and WebSocket; send ``headers``, or open ``authenticated_url`` once in a browser);
        ``tcp``: ``host:host_port`` for any TCP stream whose first line is ``DSEC <token>`` (:meth:`connect_port`
        sends it). Works with ``network="none"``; ends with :meth:`unexpose` or the sandbox. Never logged."""
        try:
            request = ExposeRequest(port=port, protocol=protocol)
        except pydantic.ValidationError as exc:
            raise _invalid(exc, "port") from None
        return await self._api.expose_port(self.id, request)

    async def get_url(self, port: int) -> str:
        """The URL of an exposed ``http`` port (exposing it first if it is not); send :attr:`PortInfo.headers`
        with each request, or the token as ``?dsec_token=`` once."""
        try:
            info = await self._api.get_port(self.id, port)
        except NotFound:
            info = await self.expose(port)
        if info.url is None:
            raise InvalidRequest(f"port {port} is exposed as raw tcp ({info.address}), not http: it has no URL")
        return info.url

    async def ports(self) -> builtins.list[PortInfo]:
        """The sandbox's exposed ports."""
        return await self._api.list_ports(self.id)

    async def unexpose(self, port: int) -> None:
        """Stop forwarding ``port`` (its open connections end)."""
        await self._api.unexpose_port(self.id, port)

    async def connect_port(self, port: int) -> socket.socket:
        """A connected (blocking) socket to ``port`` inside the sandbox, through its exposure (made ``tcp`` if it
        is not), its ``DSEC <token>`` line already sent: read and write the server's bytes."""
        current = {p.port: p for p in await self.ports()}.get(port)
        info = current if current is not None and current.protocol == "tcp" else await self.expose(port, "tcp")

        def connect() -> socket.socket:
            sock = socket.create_connection((info.host, info.host_port), timeout=30)
            sock.sendall(f"DSEC {info.token}\n".encode())
            sock.settimeout(None)
            return sock

        return await asyncio.to_thread(connect)

async def list_infos(
    labels: Mapping[str, str] | None = None, backend: str | None = None, client: Client | None = None,
    state: str | None = None,
) -> list[SandboxInfo]:
    """What ``AsyncSandbox.list`` returns, as plain records (for tools such as ``dsec ps``), read a page at a
    time (a gateway holding hundreds of thousands answers each page quickly)."""
    api = (client or default_client()).api
    found: list[SandboxInfo] = []
    while True:
        page = await api.list(labels, backend, state, after=found[-1].id if found else None, limit=_LIST_PAGE)
        found += page
        if len(page) < _LIST_PAGE:
            return found

