"""The wire models of a node: its info and health, pools, admission, audit, lifecycle events, load, overview.

Owns what ``/v1/info``, ``/v1/pools``, ``/v1/audit``, ``/v1/events`` and ``/v1/overview`` answer. Must
never define a per-sandbox request; no I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from dsec.errors import InvalidRequest
from dsec.models.common import BackendName, LimitHit, Model, Size

ComponentState = Literal["ok", "degraded", "down"]


class ComponentHealth(Model):
    """One part of the node that sandboxes depend on, and how it is now."""

    name: str
    """``lazy-server``, ``mount-holder``, ``exec-helper``, ``accelerator``, ``image-store``, ``trajectory-store``,
    ``node-disk``, or ``image:<name>`` for each image mounted."""
    state: ComponentState
    """``ok``; ``degraded`` (works in part, or is being repaired); ``down``."""
    error: str | None = None
    """What is wrong (None while ok)."""
    since: float
    """When the current state began (Unix seconds)."""
    detail: str | None = None
    """What it is or runs as (a pid, a store's address, ``kvm``/``tcg``), whatever its state."""
    faults: int = 0
    """Times it went wrong since the daemon started."""
    last_error: str | None = None
    """The last error it had, also once it is ok again."""


class NodeInfo(Model):
    """Health and identity of a node daemon."""

    node: str
    """Node name."""
    version: str
    """DSec version."""
    backends: dict[str, str]
    """Backend name -> ``"ok"``, ``"pending: <what it still decides>"`` (creates wait for it, with a bound) or why
    it is unavailable."""
    sandboxes: int
    """Live sandboxes."""
    images: dict[str, int] = Field(default_factory=dict)
    """Images this node's cache holds: name -> bytes of it cached locally (cluster placement prefers a
    node that holds a sandbox's image)."""
    stopping: str | None = None
    """Why the daemon is stopping (it refuses creates and is about to close), or None while it serves: a
    cluster gateway places nothing on the node until it answers None again."""
    status: ComponentState = "ok"
    """The worst state of its components."""
    components: list[ComponentHealth] = Field(default_factory=list)
    """Each component the node's sandboxes depend on, with its state and last error."""
    placed: int | None = None
    """Live sandboxes that carry a job label (made through a cluster gateway); None from a node that does
    not count them."""
    digest: str | None = None
    """:func:`ids_digest` of those sandboxes' ids: a gateway whose records of the node have the same count
    and digest needs no listing to reconcile them."""


class PoolConfig(Model):
    """A warm pool: sandboxes of one shape (image, backend, limits, workdir, with or without a network device)
    created ahead of demand.

    A create whose spec has this shape claims a ready sandbox; its labels, env, timeout and network policy
    are applied at the claim. Specs bound to a trajectory or restored from a snapshot never come from a pool.
    """

    image: str
    """Image name."""
    backend: BackendName = "container"
    """Isolation substrate."""
    cpu: float = Field(1.0, gt=0, le=512)
    """CPU cores of the pooled sandboxes (part of the shape a create must match)."""
    memory: Size = 1024**3
    """Memory limit in bytes (part of the shape)."""
    disk: Size = 4 * 1024**3
    """Writable-layer size in bytes (part of the shape)."""
    pids: int = Field(1024, ge=8, le=1_000_000)
    """Process limit (part of the shape)."""
    workdir: str | None = None
    """Working directory (part of the shape; None: the image's)."""
    network: Literal["none", "allow"] | list[str] = "none"
    """The network policy members are made with. Whether it is ``"none"`` is part of the shape: a member made
    without a network device serves only ``network="none"`` creates, one made with a device serves every other
    policy (the claim's own is applied to it), exactly as a sandbox created with that policy would be."""
    min: int = Field(0, ge=0, le=100_000)
    """Ready sandboxes kept even without demand (the floor)."""
    max: int = Field(16, ge=0, le=100_000)
    """Ready sandboxes never exceeded however high the demand (the ceiling)."""

    @field_validator("max")
    @classmethod
    def _ceiling(cls, v: int, info: Any) -> int:
        floor = info.data.get("min", 0)
        if v < floor:
            raise ValueError(f"pool max ({v}) must be >= min ({floor})")
        return v

    @classmethod
    def parse(cls, text: str) -> PoolConfig:
        """``IMAGE:BACKEND[:k=v,...]`` (keys: min, max, cpu, memory, disk, pids, workdir, network: ``none`` or
        ``allow``), as ``dsec serve --pool``."""
        parts = text.split(":", 2)
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise InvalidRequest(f"pool {text!r}: expected IMAGE:BACKEND[:min=N,max=N,cpu=C,memory=M,...]")
        fields: dict[str, Any] = {"image": parts[0], "backend": parts[1]}
        for item in filter(None, (parts[2] if len(parts) > 2 else "").split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in {"min", "max", "cpu", "memory", "disk", "pids", "workdir", "network"}:
                raise InvalidRequest(f"pool {text!r}: {item!r} is not one of min=, max=, cpu=, memory=, disk=, "
                                     "pids=, workdir=, network=")
            fields[key] = value
        try:
            return cls.model_validate(fields)
        except ValueError as exc:
            raise InvalidRequest(f"pool {text!r}: {exc}") from None


class PoolStatistics(Model):
    """One warm pool now."""

    config: PoolConfig
    """The pool's shape and bounds."""
    ready: int
    """Sandboxes ready to be claimed."""
    filling: int
    """Sandboxes being created for it."""
    target: int
    """How many ready sandboxes the refill aims for (recent demand, within min..max)."""
    hits: int
    """Creates served from the pool."""
    misses: int
    """Creates of this shape that found the pool empty (created fresh)."""
    created: int
    """Sandboxes the refill created."""
    failures: int
    """Refill creates that failed."""
    last_error: str | None = None
    """The latest refill failure, if any."""


class AdmissionStatistics(Model):
    """The node's create admission: how many creates run, wait, and why."""

    slots: int
    """Creates allowed to run at once."""
    running: int
    """Creates running now."""
    waiting: int
    """Creates queued now."""
    admitted: int
    """Creates admitted so far."""
    queued: int
    """Creates that had to wait at all."""
    queue_seconds: float
    """Total seconds creates spent queued."""
    shortage: str | None = None
    """What the node is short of right now (memory, pids), or None."""


class NodeStatistics(Model):
    """``statistics()`` of a node: its warm pools and its admission queue."""

    pools: list[PoolStatistics]
    """Every declared pool."""
    admission: AdmissionStatistics
    """The create admission queue."""
    teardowns: int = 0
    """Destroyed pooled sandboxes whose teardown is still running in the background."""


AuditOutcome = Literal["ok", "nonzero", "limit", "error", "cancelled"]


class AuditEntry(Model):
    """One command run in a sandbox, as the node's audit trail keeps it (outside the sandbox)."""

    id: int = 0
    """Position in the node's audit trail (grows by one per command; older rows are evicted past the cap)."""
    at: float
    """When the command started (Unix seconds)."""
    sandbox_id: str
    """The sandbox it ran in."""
    node: str = ""
    """The node that ran it."""
    backend: str
    """The sandbox's backend."""
    who: str
    """Who ran it: the token's name (``admin`` for the daemon's token, ``local`` on the unix socket,
    ``sandbox-token`` for a gateway's sandbox-scoped token)."""
    job: str | None = None
    """The job that owns the sandbox (its ``dsec.job`` label), if any."""
    op: Literal["exec", "call", "file", "process", "shell", "input", "reveal"] = "exec"
    """``exec`` (a command), ``call`` (a Python callable on the function backend), or a state-changing call
    made outside a trajectory's log on a trajectory-bound sandbox: ``file`` (a write, mkdir, remove, rename,
    chmod or chown), ``process``, ``shell``, ``input`` (mouse, keyboard) or ``reveal``; its ``command`` is then
    ``[operation, arguments as JSON]``."""
    command: str | list[str]
    """The shell string or argv as asked."""
    cwd: str | None = None
    """Working directory asked for (``None``: the sandbox's workdir)."""
    outcome: AuditOutcome
    """``ok`` (exit 0), ``nonzero``, ``limit`` (ended by a limit), ``error`` (failed to run) or ``cancelled``
    (the client hung up)."""
    exit_code: int | None = None
    """Exit status, when the command ended."""
    limit: LimitHit | None = None
    """The limit that ended it, if any."""
    duration_s: float = 0.0
    """Wall-clock seconds."""
    stdout: str = ""
    """The first bytes of its standard output (UTF-8, undecodable bytes replaced; see ``output_bytes``)."""
    stderr: str = ""
    """The first bytes of its standard error."""
    output_bytes: int = 0
    """Bytes of captured output before the audit trail's per-command cap."""
    trajectory: str | None = None
    """The trajectory the sandbox is bound to, if any."""
    error: str | None = None
    """Why it failed to run (outcome ``error``)."""


LifecycleKind = Literal["created", "destroyed", "expired", "lost", "paused", "resumed", "create_failed", "lagged",
                        "node"]


class LifecycleEvent(Model):
    """One lifecycle event of a node's sandboxes (``GET /v1/events`` streams them)."""

    seq: int
    """Position in the node's event stream (pass it as ``since`` to resume after it)."""
    at: float
    """When it happened (Unix seconds)."""
    kind: LifecycleKind
    """What happened; ``lagged``: this subscriber was too slow and ``detail.dropped`` events were skipped;
    ``node``: the node's own state changed (``detail.images``: its image cache as ``health`` reports it,
    ``detail.stopping``: why it stops, or None)."""
    sandbox_id: str | None = None
    """The sandbox, if the event is about one."""
    backend: str | None = None
    """Its backend."""
    image: str | None = None
    """Its image."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Its labels."""
    node: str = ""
    """The node it happened on."""
    reason: str | None = None
    """Why (expiry, failure message)."""
    detail: dict[str, Any] = Field(default_factory=dict)
    """Anything else (``pooled``, ``seconds``, ``dropped``)."""


class NodeLoad(Model):
    """One node as the dashboard shows it."""

    node: str
    """Node name."""
    alive: bool = True
    """Answering (cluster mode: Ray's view)."""
    sandboxes: int = 0
    """Live sandboxes on it."""
    by_backend: dict[str, int] = Field(default_factory=dict)
    """Live sandboxes per backend."""
    load: list[float] = Field(default_factory=list)
    """The host's 1, 5 and 15 minute load averages (empty when unknown)."""
    cpus: int = 0
    """CPUs of the host (0 when unknown)."""
    memory_used_bytes: int = 0
    """Host memory in use (total minus available)."""
    memory_total_bytes: int = 0
    """Host memory."""


class CounterSample(Model):
    """The node's counters at one moment (the overview keeps a recent series of them for the charts)."""

    at: float
    """When (Unix seconds)."""
    created: int = 0
    """Sandboxes created so far."""
    create_seconds_sum: float = 0.0
    """Sum of their creation latencies."""
    exec_count: int = 0
    """Commands run so far."""
    exec_seconds_sum: float = 0.0
    """Sum of their wall times."""
    failures: int = 0
    """Failed creations and commands ended by a limit so far."""


class NodeOverview(Model):
    """Everything the dashboard polls in one answer: nodes, counters, failures, images, pools, audit size.

    Counters are totals since the daemon started: rates are their differences between two polls."""

    at: float
    """When this was taken (Unix seconds)."""
    nodes: list[NodeLoad]
    """This node (or, on the gateway, every node)."""
    created: int = 0
    """Sandboxes created."""
    create_seconds_sum: float = 0.0
    """Sum of creation latencies (``/ created`` is the mean)."""
    execs: dict[str, int] = Field(default_factory=dict)
    """Commands run, by outcome."""
    exec_seconds_sum: float = 0.0
    """Sum of command wall times."""
    exec_count: int = 0
    """Commands timed."""
    failures: dict[str, int] = Field(default_factory=dict)
    """Failed creations by reason (error type), plus ``limit:<name>`` for commands ended by a limit."""
    images: dict[str, Any] = Field(default_factory=dict)
    """The image cache's statistics (empty when the node has none)."""
    pools: list[PoolStatistics] = Field(default_factory=list)
    """Warm pools."""
    audit: dict[str, int] = Field(default_factory=dict)
    """The audit trail's statistics (rows kept, cap, pending, dropped)."""
    history: list[CounterSample] = Field(default_factory=list)
    """The counters every few seconds over the last half hour, oldest first (rates over time are the
    differences between neighbours)."""
