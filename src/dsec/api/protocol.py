"""The node API: every operation a DSec node offers, with its types, its meaning and its HTTP route.

:class:`NodeAPI` is implemented by the node's engine (in process), by :class:`~dsec.api.client.NodeClient`
(over HTTP, for the SDK and the gateway) and by the cluster gateway; the daemon's routes are bound from it
(:mod:`dsec.api.binding`) and one conformance suite (:mod:`dsec.testing.node_api`) checks all three. A
method's docstring is its documentation in the OpenAPI document. Owns the contract; must never hold logic
(bodies never run: see :class:`~dsec.api.operations.Declared`).

To add an operation, declare it here (signature, docstring, ``@operation`` route), implement it in the engine,
and add it to the conformance suite: the client, the server route, the OpenAPI document (``scripts/gen-openapi``)
and the gateway's forwarding of a sandbox's calls follow. ``docs/api.md`` says more.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from typing import IO, Annotated, Protocol

from dsec.models import (
    AuditEntry,
    AuditOutcome,
    BatchCreateEvent,
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    CallBatch,
    CallBatchResult,
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkRequest,
    ImageBuildEvent,
    ImageBuildRequest,
    ImageInfo,
    ImagePullRequest,
    KeyboardRequest,
    LifecycleEvent,
    LoggedCall,
    MouseRequest,
    NetworkRequest,
    NodeInfo,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
    TrajectoryForkRequest,
    TrajectoryInfo,
)
from dsec.models.surface import (
    ExposeRequest,
    FileEvent,
    FileStat,
    MkdirRequest,
    PortInfo,
    ProcessEvent,
    ProcessInfo,
    ProcessRequest,
    PtySize,
    RenameRequest,
    ShellInfo,
    ShellRequest,
    ShellResult,
    ShellRunRequest,
    SignalRequest,
    WatchInfo,
    WatchRequest,
    XattrRequest,
)

from .codecs import BUILD_REQUEST, OCTAL, pairs
from .operations import NDJSON, OCTET, Declared, Param, operation

__all__ = ["Labels", "Mode", "NodeAPI", "Seq", "User"]

Seq = Annotated[int | None, Param(
    ge=0, description="Call number on a trajectory-bound sandbox (the SDK sends it); without it, the call is an "
                      "operator's: run outside the log and recorded in the audit trail")]
"""A call's number on a trajectory-bound sandbox: the SDK numbers its calls so the daemon can match them to the log.
A call without one (``dsec exec``, the dashboard) is not the agent's and never enters its log."""
Mode = Annotated[int | None, Param(codec=OCTAL, description="octal permission bits, e.g. `644`")]
User = Annotated[str | None, Param(description="act as this user of the sandbox (`name`, `uid`, `name:group`, "
                                               "`uid:gid`; default: the sandbox's user)")]
"""Who a call acts as: permissions are checked as that user, and what it creates is the user's."""
Path = Annotated[str, Param(description="absolute, or relative to the sandbox's working directory")]
Offset = Annotated[int, Param(ge=0, description="bytes of that stream already read")]
Labels = Annotated[Mapping[str, str] | None, Param(
    alias="label", codec=pairs("label filter"), description="`key=value`; repeat to require several")]
Limit = Annotated[int, Param(ge=1, le=10_000)]
After = Annotated[str | None, Param(description="only sandboxes whose id sorts after this one (the cursor of "
                                                "the next page: the last id of the previous)")]
PageLimit = Annotated[int | None, Param(ge=1, le=100_000, description="at most this many, in id order")]
UnixTime = Annotated[float | None, Param(description="Unix seconds")]
Since = Annotated[int | None, Param(ge=0, description="first replay the kept events after this `seq`")]
BuildRequest = Annotated[ImageBuildRequest, Param(codec=BUILD_REQUEST,
                                                  description="the `ImageBuildRequest` as JSON (no password)")]
BuildContext = Annotated[IO[bytes], Param(le=8 * 1024**3, description="add a .dockerignore to leave files out")]
"""A build context: a tar of at most 8 GiB."""


def _prometheus_text() -> str:
    """Prometheus' text exposition format, as the installed client library writes it (imported when served)."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return str(CONTENT_TYPE_LATEST)


class NodeAPI(Protocol):
    """The operations of one DSec node (or of a cluster gateway, which answers as one big node).

    Errors are :class:`dsec.DSecError` subclasses, the same in process and over HTTP. A gateway answers
    ``statistics`` and ``declare_pool`` with :class:`~dsec.NotSupported` (warm pools and admission are per
    node), and ``overview``, ``audit_log`` and ``subscribe`` only to its admin token."""

    # -- node -----------------------------------------------------------------------------------------------

    @operation("GET", "/v1/health", tags=["node"])
    async def health(self) -> NodeInfo:
        """Identity, version and backend availability (no token needed)."""
        raise Declared

    @operation("GET", "/v1/statistics", tags=["node"])
    async def statistics(self) -> NodeStatistics:
        """Warm pools (ready, target, hits, misses) and the create admission queue."""
        raise Declared

    @operation("POST", "/v1/pools", tags=["node"])
    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Declare a warm pool, or change the bounds of the pool of that shape."""
        raise Declared

    # -- sandboxes ------------------------------------------------------------------------------------------

    @operation("POST", "/v1/sandboxes", tags=["sandboxes"], status=201, fast=True, no_read_timeout=True)
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create a sandbox."""
        raise Declared

    @operation("POST", "/v1/sandboxes/batch", tags=["sandboxes"], status=201, no_read_timeout=True)
    async def create_many(self, request: BatchCreateRequest) -> builtins.list[SandboxInfo]:
        """Create many sandboxes from one spec; all or nothing."""
        raise Declared

    @operation("POST", "/v1/sandboxes/batch/stream", tags=["sandboxes"], media_type=NDJSON,
               description="One JSON `BatchCreateEvent` per line: each sandbox as its node answers, then one "
                           "`done` (or `error`: the batch was undone).")
    def create_many_stream(self, request: BatchCreateRequest) -> AsyncIterator[BatchCreateEvent]:
        """Create many sandboxes from one spec, each sent as its node answers (a job's batch of thousands:
        progress all along, and no time-out while it lasts); all or nothing: on failure the sandboxes sent
        are destroyed and an ``error`` ends the stream."""
        raise Declared

    @operation("GET", "/v1/sandboxes", tags=["sandboxes"], name="list_sandboxes")
    async def list(self, labels: Labels = None, backend: str | None = None, state: str | None = None, *,
                   after: After = None, limit: PageLimit = None) -> builtins.list[SandboxInfo]:
        """Sandboxes matching every filter; with ``after`` or ``limit``, a page of them in id order (fewer than
        ``limit``: the last page; the next starts after the last id of this one)."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox."""
        raise Declared

    @operation("DELETE", "/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], fast=True)
    async def destroy(self, sandbox_id: str) -> None:
        """Destroy a sandbox (idempotent)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/destroy", tags=["sandboxes"], no_read_timeout=True)
    async def destroy_many(self, request: BatchDestroyRequest) -> BatchDestroyResult:
        """Destroy many sandboxes in one request, each on its own (idempotent: one already gone is ``missing``,
        one that fails is in ``failed`` and the others are destroyed all the same)."""
        raise Declared

    # -- commands -------------------------------------------------------------------------------------------

    @operation("POST", "/v1/sandboxes/{sandbox_id}/exec", tags=["commands"], name="exec_", runs_command=True,
               media_type=NDJSON,
               description="One JSON `ExecEvent` per line: output chunks, then one `exit` or `error`.")
    def exec_stream(self, sandbox_id: str, request: ExecRequest, seq: Seq = None) -> AsyncIterator[ExecEvent]:
        """Run a command, streaming its output; hanging up kills it (not on a trajectory: it is logged)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/exec/result", tags=["commands"], name="exec_result", fast=True,
               runs_command=True, no_read_timeout=True)
    async def exec(self, sandbox_id: str, request: ExecRequest, seq: Seq = None) -> ExecResult:
        """Run a command to completion and answer its result in one response: the cheap round trip for short
        commands (what ``sb.exec`` uses); hanging up kills it (not on a trajectory: it is logged)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/call", tags=["commands"], fast=True, runs_command=True,
               no_read_timeout=True)
    async def call(self, sandbox_id: str, request: CallRequest) -> CallResult:
        """Run a pickled Python callable (function backend); the reply is decoded by the client. A grader makes
        thousands (the fast path); hanging up kills it; it takes as long as its timeout, stretched while the
        node gives it no CPU."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/call/batch", tags=["commands"], fast=True, runs_command=True,
               no_read_timeout=True)
    async def call_many(self, sandbox_id: str, batch: CallBatch) -> CallBatchResult:
        """Run one pickled Python callable on many inputs (``sb.map``), each item a call of its own, one after
        another; an item the sandbox failed to run has its error in its outcome, and a failure that is no item's
        own (no such sandbox, a backend without calls, limits over the sandbox's) is raised. Hanging up kills
        the running call and runs no more."""
        raise Declared

    # -- files ----------------------------------------------------------------------------------------------

    @operation("GET", "/v1/sandboxes/{sandbox_id}/files", tags=["files"], media_type=OCTET,
               description="The file's bytes")
    async def read_file(self, sandbox_id: str, path: Path, seq: Seq = None, *, user: User = None) -> bytes:
        """Read a file (checked as ``user``, default the sandbox's)."""
        raise Declared

    @operation("PUT", "/v1/sandboxes/{sandbox_id}/files", tags=["files"])
    async def write_file(self, sandbox_id: str, path: Path, data: bytes, mode: Mode = None, seq: Seq = None,
                         user: User = None) -> None:
        """Create or replace a file (parents created; as ``user``, default the sandbox's)."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/files/list", tags=["files"])
    async def list_files(self, sandbox_id: str, path: Path, seq: Seq = None, user: User = None
                         ) -> builtins.list[FileEntry]:
        """List a directory."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/files/stat", tags=["files"])
    async def stat_file(self, sandbox_id: str, path: Path, user: User = None, seq: Seq = None) -> FileStat:
        """What ``lstat`` says of a path: kind, size, mode, owner (with names), mtime, a symlink's target."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/mkdir", tags=["files"], status=201)
    async def make_dir(self, sandbox_id: str, request: MkdirRequest, user: User = None, seq: Seq = None
                       ) -> FileStat:
        """Create a directory (``parents``: its missing parents too, and an existing one is fine)."""
        raise Declared

    @operation("DELETE", "/v1/sandboxes/{sandbox_id}/files", tags=["files"])
    async def remove_file(self, sandbox_id: str, path: Path, recursive: bool = False, user: User = None,
                          seq: Seq = None) -> None:
        """Remove a file, a symlink or an empty directory (``recursive``: a directory and all below it)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/rename", tags=["files"])
    async def rename_file(self, sandbox_id: str, request: RenameRequest, user: User = None, seq: Seq = None
                          ) -> FileStat:
        """Move a file or directory within the sandbox's filesystem."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/chmod", tags=["files"])
    async def chmod_file(self, sandbox_id: str, path: Path, mode: Annotated[int, Param(codec=OCTAL,
                         description="octal permission bits, e.g. `755`")], user: User = None,
                         seq: Seq = None) -> FileStat:
        """Set a path's permission bits (a symlink's target's)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/chown", tags=["files"])
    async def chown_file(self, sandbox_id: str, path: Path, owner: Annotated[str, Param(
                         description="`user`, `uid`, `user:group` or `uid:gid` of the sandbox")],
                         user: User = None, seq: Seq = None) -> FileStat:
        """Give a path (a symlink's target) to another user of the sandbox (root may; others may not)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/xattrs", tags=["files"])
    async def set_xattrs(self, sandbox_id: str, request: XattrRequest, user: User = None, seq: Seq = None
                         ) -> FileStat:
        """Set and remove a path's (a symlink's target's) extended attributes of the ``user.`` namespace, as
        ``user`` (who needs write permission); ``stat_file`` reads them back. Container and function backends."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/files/watches", tags=["files"], status=201)
    async def watch_files(self, sandbox_id: str, request: WatchRequest, user: User = None) -> WatchInfo:
        """Start watching a directory; read its events with ``watch_events`` (any client, any number of times)."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/files/watches", tags=["files"])
    async def list_watches(self, sandbox_id: str) -> builtins.list[WatchInfo]:
        """The sandbox's file watches."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/files/watches/{watch_id}/events", tags=["files"],
               media_type=NDJSON, description="One JSON `FileEvent` per line (create, modify, delete, move, chmod).")
    def watch_events(self, sandbox_id: str, watch_id: str, since: Annotated[int, Param(
                     ge=0, description="the first event's number (`FileEvent.number`)")] = 0,
                     follow: bool = True) -> AsyncIterator[FileEvent]:
        """A watch's events from a number on; ``follow``: then as they come, until the watch is stopped."""
        raise Declared

    @operation("DELETE", "/v1/sandboxes/{sandbox_id}/files/watches/{watch_id}", tags=["files"])
    async def unwatch(self, sandbox_id: str, watch_id: str) -> None:
        """Stop a file watch."""
        raise Declared

    # -- processes, terminals, shell sessions ----------------------------------------------------------------

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes", tags=["processes"], status=201)
    async def start_process(self, sandbox_id: str, request: ProcessRequest, seq: Seq = None) -> ProcessInfo:
        """Start a process the node keeps (a background command, or one on a terminal): it outlives the request
        and the client, and dies with the sandbox."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/processes", tags=["processes"])
    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        """The sandbox's processes started through DSec (running, and the most recently ended)."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/processes/{pid}", tags=["processes"])
    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        """One process."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/processes/{pid}/output", tags=["processes"], media_type=NDJSON,
               description="One JSON `ProcessEvent` per line: output (with its offset), `dropped`, then `exit`.")
    def process_output(self, sandbox_id: str, pid: int, stdout: Offset = 0, stderr: Offset = 0, pty: Offset = 0,
                       follow: bool = True) -> AsyncIterator[ProcessEvent]:
        """A process's output from the given offsets (bytes since it started); ``follow``: then as it comes, and
        its exit. A reader behind the kept buffer first gets a ``dropped`` event saying how much it missed."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin", tags=["processes"])
    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, seq: Seq = None) -> None:
        """Write to a process's standard input (its terminal's input when it has one)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin/close", tags=["processes"])
    async def close_stdin(self, sandbox_id: str, pid: int, seq: Seq = None) -> None:
        """End a process's standard input (EOF; Ctrl-D on a terminal)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes/{pid}/signal", tags=["processes"], body=SignalRequest)
    async def signal_process(self, sandbox_id: str, pid: int, signal: int = 15, group: bool = True,
                             seq: Seq = None) -> None:
        """Send a signal to a process's group (or the process alone)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes/{pid}/resize", tags=["processes"])
    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize, seq: Seq = None) -> None:
        """Set a process's terminal size."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/processes/{pid}/wait", tags=["processes"], no_read_timeout=True)
    async def wait_process(self, sandbox_id: str, pid: int, timeout: Annotated[float | None, Param(
                           ge=0, description="seconds to wait at most (default: until it ends)")] = None,
                           seq: Seq = None) -> ProcessInfo:
        """A process's info once it ended, or when ``timeout`` passed (``running`` says which)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/shells", tags=["processes"], status=201)
    async def start_shell(self, sandbox_id: str, request: ShellRequest, seq: Seq = None) -> ShellInfo:
        """Start a persistent ``bash`` session: cwd, variables and functions persist from command to command."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/shells", tags=["processes"])
    async def list_shells(self, sandbox_id: str) -> builtins.list[ShellInfo]:
        """The sandbox's shell sessions."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/shells/{session_id}/run", tags=["processes"],
               no_read_timeout=True)
    async def run_shell(self, sandbox_id: str, session_id: str, request: ShellRunRequest, seq: Seq = None
                        ) -> ShellResult:
        """Run one command in a shell session; past its timeout it is interrupted and the session stays usable."""
        raise Declared

    @operation("DELETE", "/v1/sandboxes/{sandbox_id}/shells/{session_id}", tags=["processes"])
    async def close_shell(self, sandbox_id: str, session_id: str, seq: Seq = None) -> None:
        """End a shell session and its jobs."""
        raise Declared

    # -- ports ------------------------------------------------------------------------------------------------

    @operation("POST", "/v1/sandboxes/{sandbox_id}/ports", tags=["ports"], status=201)
    async def expose_port(self, sandbox_id: str, request: ExposeRequest) -> PortInfo:
        """Make a port inside the sandbox reachable from the client's side: the node listens and forwards each
        connection carrying the sandbox's port token (works with ``network="none"``: inbound only)."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/ports", tags=["ports"])
    async def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        """The sandbox's exposed ports."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/ports/{port}", tags=["ports"])
    async def get_port(self, sandbox_id: str, port: int) -> PortInfo:
        """How to reach one exposed port."""
        raise Declared

    @operation("DELETE", "/v1/sandboxes/{sandbox_id}/ports/{port}", tags=["ports"])
    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        """Stop forwarding a port (its open connections end)."""
        raise Declared

    # -- one sandbox ----------------------------------------------------------------------------------------

    @operation("GET", "/v1/sandboxes/{sandbox_id}/stats", tags=["sandboxes"])
    async def stats(self, sandbox_id: str) -> SandboxStats:
        """Resource usage now."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/pause", tags=["sandboxes"])
    async def pause(self, sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Freeze every process of the sandbox; `release_memory`: also save it to disk and release its RAM."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/resume", tags=["sandboxes"])
    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/timeout", tags=["sandboxes"], body=TimeoutRequest)
    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        """Destroy the sandbox `timeout` seconds from now instead of at its current deadline."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/screenshot", tags=["computer use"], media_type="image/png",
               description="the display as PNG")
    async def screenshot(self, sandbox_id: str, seq: Seq = None) -> bytes:
        """The sandbox's display as a PNG (``vm`` backend; others answer 501 NotSupported)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/mouse", tags=["computer use"])
    async def mouse(self, sandbox_id: str, request: MouseRequest, seq: Seq = None) -> None:
        """Move the pointer to a pixel of the display and click, press, release or scroll there."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/keyboard", tags=["computer use"])
    async def keyboard(self, sandbox_id: str, request: KeyboardRequest, seq: Seq = None) -> None:
        """Type text (US layout) or press key combos on the display."""
        raise Declared

    @operation("PUT", "/v1/sandboxes/{sandbox_id}/network", tags=["sandboxes"], body=NetworkRequest)
    async def set_network(self, sandbox_id: str, network: str | builtins.list[str]) -> SandboxInfo:
        """Replace the sandbox's network policy (enforced outside the sandbox, effective at once)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/reveal", tags=["sandboxes"])
    async def reveal(self, sandbox_id: str, seq: Seq = None) -> SandboxInfo:
        """Make the sandbox's hidden paths visible, read-only (for grading; a logged call on a trajectory)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/snapshot", tags=["sandboxes"])
    async def snapshot(self, sandbox_id: str, seq: Seq = None) -> SnapshotRef:
        """Save the sandbox's writable state (a checkpoint of its trajectory, if bound to one)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/lease", tags=["trajectories"])
    async def renew_lease(self, sandbox_id: str) -> SandboxInfo:
        """Renew the lease of a trajectory-bound sandbox (the SDK's heartbeat while its client is idle)."""
        raise Declared

    @operation("POST", "/v1/sandboxes/{sandbox_id}/fork", tags=["sandboxes"], status=201, body=ForkRequest)
    async def fork(self, sandbox_id: str, count: int) -> builtins.list[SandboxInfo]:
        """Make independent copies of a live sandbox's state; all or nothing."""
        raise Declared

    # -- trajectories ---------------------------------------------------------------------------------------

    @operation("POST", "/v1/trajectories/fork", tags=["trajectories"], status=201, shared=True)
    async def branch_trajectory(self, request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch a trajectory at a call: a new trajectory sharing the calls before it, on a rebuilt sandbox."""
        raise Declared

    @operation("GET", "/v1/trajectories", tags=["trajectories"], shared=True)
    async def list_trajectories(self, prefix: Annotated[str, Param(
            description="Only trajectories whose name starts with this")] = "", limit: Limit = 1000
    ) -> builtins.list[TrajectoryInfo]:
        """Trajectories in the log, by name (`dsec trajectory ls`)."""
        raise Declared

    @operation("POST", "/v1/trajectories/end", tags=["trajectories"])
    async def end_trajectory(self, name: str) -> TrajectoryInfo:
        """End a trajectory: destroy its sandbox; its log stays readable until the name is opened again, which
        starts a new trajectory (the SDK's `close(end=True)`)."""
        raise Declared

    @operation("DELETE", "/v1/trajectories", tags=["trajectories"])
    async def delete_trajectory(self, name: str) -> None:
        """Delete a trajectory: its sandbox, its log, and the checkpoints no other trajectory shares."""
        raise Declared

    @operation("GET", "/v1/trajectories/log", tags=["trajectories"], shared=True)
    async def trajectory_log(self, name: str, start: Annotated[int, Param(ge=0)] = 0,
                             limit: Limit = 1000) -> builtins.list[LoggedCall]:
        """Logged calls of a trajectory from `start` (the SDK fast-forwards through them)."""
        raise Declared

    # -- images ---------------------------------------------------------------------------------------------

    @operation("GET", "/v1/images", tags=["images"], shared=True)
    async def list_images(self) -> builtins.list[ImageInfo]:
        """Images in the node's store."""
        raise Declared

    @operation("POST", "/v1/images/pull", tags=["images"], shared=True, no_read_timeout=True)
    async def pull_image(self, request: ImagePullRequest) -> ImageInfo:
        """Pull an image from an OCI registry into the node's store (returns when it is ready)."""
        raise Declared

    @operation("POST", "/v1/images/build", tags=["images"], shared=True, media_type=NDJSON,
               description="One JSON `ImageBuildEvent` per line: the builder's output, then one `done` or `error`.")
    def build_image(self, request: BuildRequest, context: BuildContext) -> AsyncIterator[ImageBuildEvent]:
        """Build an image from a Dockerfile; the body is the build context as a tar. Hanging up cancels it."""
        raise Declared

    @operation("GET", "/v1/images/{name}", tags=["images"], shared=True)
    async def get_image(self, name: str) -> ImageInfo:
        """One image."""
        raise Declared

    # -- operator views -------------------------------------------------------------------------------------

    @operation("GET", "/v1/overview", tags=["node"])
    async def overview(self) -> NodeOverview:
        """Counters, load, failures by reason, image cache, pools and audit trail in one answer (the dashboard
        polls it; rates are differences between two polls)."""
        raise Declared

    @operation("GET", "/v1/audit", tags=["audit"], name="audit")
    async def audit_log(
        self,
        *,
        sandbox_id: str | None = None,
        who: Annotated[str | None, Param(description="token name (`local` on the unix socket)")] = None,
        job: str | None = None,
        outcome: AuditOutcome | None = None,
        since: UnixTime = None,
        until: UnixTime = None,
        before: Annotated[int | None, Param(ge=1, description="only entries with a smaller `id` (paging)")] = None,
        limit: Limit = 100,
    ) -> builtins.list[AuditEntry]:
        """Commands run in this node's sandboxes, newest first, matching every filter given."""
        raise Declared

    @operation("GET", "/v1/sandboxes/{sandbox_id}/logs", tags=["audit"])
    async def sandbox_logs(self, sandbox_id: str, limit: Limit = 100,
                           before: Annotated[int | None, Param(ge=1)] = None) -> builtins.list[AuditEntry]:
        """A sandbox's command history with the head of each command's output, newest first (kept outside the
        sandbox; still there after it is destroyed)."""
        raise Declared

    @operation("GET", "/v1/events", tags=["node"], name="events", media_type=NDJSON,
               description="One JSON `LifecycleEvent` per line, as they happen; the stream does not end.")
    def subscribe(self, since: Since = None, node_state: Annotated[bool, Param(
                  description="first the node's state now, as a `node` event")] = False
                  ) -> AsyncIterator[LifecycleEvent]:
        """Stream sandbox lifecycle events (created, destroyed, expired, paused, resumed, create_failed) and
        ``node`` events when the node's image cache or drain changes (a gateway follows them instead of polling
        ``health``)."""
        raise Declared

    @operation("GET", "/metrics", tags=["node"], name="metrics", media_type=_prometheus_text,
               description="Prometheus text format")
    async def metrics_text(self) -> bytes:
        """Prometheus metrics of this node."""
        raise Declared
