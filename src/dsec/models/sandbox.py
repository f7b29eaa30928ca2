"""The wire models of a sandbox's life: its spec, batch create and destroy, its info, stats and record.

Owns ``SandboxSpec`` (what ``Sandbox.create`` takes), ``SandboxInfo`` (what a client sees), forks and
snapshots, and the small GUI, network and timeout requests. Must never hold exec, image or node models
(those live in their own modules) nor do I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dsec.accounts import parse_user
from dsec.models.common import BackendName, Model, SandboxState, Size, check_mapping, parse_network
from dsec.models.trajectory import TrajectoryStatus


class SandboxSpec(Model):
    """What to create: the arguments of ``Sandbox.create``."""

    image: str | None = None
    """Image name in the node's image store (required unless ``snapshot`` is given)."""
    backend: BackendName = "container"
    """Isolation substrate."""
    cpu: float = Field(1.0, gt=0, le=512)
    """CPU cores (a CFS quota; fractions allowed)."""
    memory: Size = 1024**3
    """Memory limit in bytes; accepts strings such as ``"1Gi"``."""
    disk: Size = Field(4 * 1024**3, ge=1024**2)
    """Writable-layer size in bytes (at least 1 MiB); accepts strings such as ``"4Gi"``. Past it writes fail
    with ENOSPC inside the sandbox and the command's result says ``limit="disk"``."""
    pids: int = Field(1024, ge=8, le=1_000_000)
    """Maximum number of processes and threads alive at once."""
    timeout: float = Field(3600.0, gt=0, le=30 * 86400)
    """Wall-clock lifetime in seconds; the sandbox is destroyed after it."""
    network: Literal["none", "allow"] | list[str] = "none"
    """``"none"`` (default), ``"allow"``, or an allowlist of ``CIDR[:port]`` / domain entries."""

    @field_validator("network")
    @classmethod
    def _network(cls, v: str | list[str]) -> str | list[str]:
        parse_network(v)
        return v
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for every exec (merged over the image's)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form labels for ``Sandbox.list(labels=...)``."""
    workdir: str | None = None
    """Default working directory of execs; created if missing (default: the image's ``WorkingDir``, else
    ``/workspace``)."""
    user: str | None = None
    """Default user of execs, processes and file calls (``name``, ``uid``, ``name:group``, ``uid:gid``, looked
    up in the image; default: the image's ``User``, else root). A call's own ``user=`` overrides it."""
    trajectory: str | None = None
    """Trajectory log to bind this sandbox to (``"job/rollout"``)."""
    snapshot: str | None = None
    """Snapshot to restore from instead of a fresh image."""
    lease: float = Field(1800.0, gt=0, le=30 * 86400)
    """Seconds a trajectory-bound sandbox outlives its last call (renewed by every call)."""
    rerun_missing: bool = False
    """Recovering a lost trajectory sandbox: re-run the logged calls made after its latest checkpoint
    (default: only report them as ``missing_effects``)."""
    keep_logged_spec: bool = False
    """Re-opening a trajectory whose logged spec differs from this one: go on with the logged spec (default:
    raise :class:`~dsec.errors.ReplayDivergence` showing both)."""

    landlock: bool = True
    """Confine every command with Landlock (container: one rule on the root, no device nodes, no access to the
    sandbox's init, and ``/proc`` and ``/dev`` mounted read-only but for ``/dev``'s shared-memory, mqueue and
    pts mounts and null-like nodes; function: writes in the workspace and ``/tmp`` only, always on).
    ``False`` turns it off for a container whose tools must write there."""
    allow_privilege_escalation: bool = False
    """Let setuid and file-capability binaries (``sudo``, ``su``, ``ping``) raise a command's privileges: its
    commands run without ``no_new_privs`` (as Kubernetes' ``allowPrivilegeEscalation``). They can reach no more
    than the sandbox's own root, which ``user="root"`` already gives: the capability bounding set, the seccomp
    filter, Landlock and the mounts hold after a setuid exec (docs/security.md). Container backend; a vm without
    ``protected``/``hidden`` paths allows it anyway (the guest is the boundary); function and microvm refuse it."""
    protected: list[str] = Field(default_factory=list, max_length=256)
    """Absolute paths the sandbox may read but never change: each is bind-mounted read-only over itself at
    creation (writes, renames, unlinks, clones and extent swaps fail). Each must exist in the image and must
    not pass through a symbolic link. Container, function and microvm backends (microvm: the guest agent makes
    the binds and runs commands without the capabilities that would undo them; vm refuses it)."""

    hidden: list[str] = Field(default_factory=list, max_length=64)
    """Absolute directories the sandbox cannot see until ``sb.reveal()``: each is covered by an empty
    read-only mount at creation (created if missing). The files API reads and writes beneath the cover, so
    a grader can put its tests there; ``reveal()`` removes the covers and leaves the paths read-only.
    Container, function and microvm backends (function: created in the workspace if missing; elsewhere the
    image must have them; vm refuses it)."""

    @field_validator("protected", "hidden")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for path in v:
            parts = path.split("/")
            if not path.startswith("/") or path == "/" or "\0" in path or ".." in parts or "." in parts:
                raise ValueError(f"protected and hidden paths must be absolute, normalised and not '/', got {path!r}")
        return [p.rstrip("/") for p in v]

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None:
            parse_user(v)
        return v

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError(f"workdir must be an absolute path, got {v!r}")
        return v

    @field_validator("env", "labels")
    @classmethod
    def _no_nul(cls, v: dict[str, str]) -> dict[str, str]:
        return check_mapping(v)


class BatchCreateRequest(Model):
    """Create ``count`` sandboxes from one spec."""

    count: int = Field(ge=1, le=100_000)
    """How many sandboxes (one RL job's batch: a cluster gateway places them in one decision)."""
    spec: SandboxSpec
    """The spec every sandbox is created from."""


class BatchCreateEvent(Model):
    """One item of a streamed batch create: each sandbox as its node answers, then exactly one ``done`` (or
    ``error``: the batch failed and was undone, the sandboxes sent before included)."""

    type: Literal["sandbox", "done", "error"]
    """Kind of event."""
    sandbox: SandboxInfo | None = None
    """A sandbox of the batch (``sandbox``)."""
    error: dict[str, Any] | None = None
    """Error payload (as in HTTP errors) for ``error``."""


class BatchDestroyRequest(Model):
    """Destroy these sandboxes in one request (a job's batch at its end): each on its own, so one that fails
    does not keep the others alive."""

    ids: list[str] = Field(min_length=1, max_length=100_000)
    """The sandboxes' ids (each at most once)."""
    job: str | None = None
    """Only sandboxes of this job (``dsec.job`` label); the others count as ``missing``. A job's token always
    sends its own job (the node's token guard sets it)."""

    @model_validator(mode="after")
    def _distinct(self) -> BatchDestroyRequest:
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("ids must be distinct: name each sandbox once")
        return self


class BatchDestroyResult(Model):
    """What a batch destroy did, sandbox by sandbox."""

    destroyed: list[str] = Field(default_factory=list)
    """Destroyed now."""
    missing: list[str] = Field(default_factory=list)
    """Not there (never made, already destroyed or expired, or another job's): nothing to do."""
    failed: dict[str, str] = Field(default_factory=dict)
    """Id -> why it could not be destroyed (still there; destroying it again may succeed)."""


class MouseRequest(Model):
    """A pointer action on a sandbox's display (``vm`` backend): move to pixel (``x``, ``y``), then act."""

    x: int = Field(ge=0)
    y: int = Field(ge=0)
    button: Literal["left", "middle", "right"] = "left"
    action: Literal["click", "double_click", "down", "up", "move", "scroll_up", "scroll_down"] = "click"


class KeyboardRequest(Model):
    """Keys for a sandbox's display (``vm`` backend): ``text`` typed on a US layout, or ``keys``, combos pressed
    in order (``["ctrl+c", "enter"]``). Exactly one of the two."""

    text: str | None = Field(default=None, max_length=4096)
    keys: list[str] | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one(self) -> KeyboardRequest:
        if (self.text is None) == (self.keys is None):
            raise ValueError("give exactly one of text or keys")
        return self


class NetworkRequest(Model):
    """A new network policy for a live sandbox."""

    network: Literal["none", "allow"] | list[str]
    """``"none"``, ``"allow"``, or an allowlist of ``CIDR[:port]`` / domain entries."""

    @field_validator("network")
    @classmethod
    def _network(cls, v: str | list[str]) -> str | list[str]:
        parse_network(v)
        return v


class TimeoutRequest(Model):
    """A new lifetime for a live sandbox, counted from now."""

    timeout: float = Field(gt=0, le=30 * 86400)
    """Seconds from now until the sandbox is destroyed (it replaces the deadline set at create)."""


class SandboxStats(Model):
    """Resource usage of a live sandbox."""

    memory_bytes: int = 0
    """Memory charged to the sandbox now."""
    memory_peak_bytes: int = 0
    """Highest memory charge seen."""
    cpu_seconds: float = 0.0
    """CPU time consumed."""
    pids: int = 0
    """Processes and threads alive."""
    oom_kills: int = 0
    """Processes killed for exceeding the memory limit."""
    disk_bytes: int = 0
    """Bytes in the sandbox's writable layer."""
    disk_limit_bytes: int | None = None
    """Size of the writable layer (``spec.disk``) where the backend enforces it."""
    disk_full: bool = False
    """The writable layer is full (blocks or inodes): writes fail with ENOSPC."""


class SandboxInfo(Model):
    """What a client sees of a sandbox."""

    id: str
    """Sandbox id."""
    backend: BackendName
    """Isolation substrate."""
    image: str | None
    """Image it was created from."""
    state: SandboxState
    """Lifecycle state."""
    created_at: float
    """Creation time (Unix seconds)."""
    expires_at: float
    """When the wall-clock timeout destroys it (Unix seconds)."""
    labels: dict[str, str]
    """Labels given at creation."""
    spec: SandboxSpec
    """The full creation spec."""
    node: str
    """Name of the node that owns it."""
    reason: str | None = None
    """Why it is ``failed``/``expired``/``stopped``."""
    trajectory: TrajectoryStatus | None = None
    """The trajectory this sandbox is bound to, its lease and what a recovery could not restore."""
    pooled: bool = False
    """Claimed from a warm pool (only in the answer to the create that claimed it)."""
    queue_seconds: float = 0.0
    """Seconds the create waited for admission (node short of memory, pids or create slots) before it
    started; not part of the create time itself (only in the answer to the create)."""
    endpoint: NodeEndpoint | None = None
    """Cluster mode: where the SDK sends this sandbox's exec and file calls (the owning node, with a
    token valid for this sandbox only); None from a node daemon, which is itself the endpoint."""


class NodeEndpoint(Model):
    """The owning node's address and a credential scoped to one sandbox (answered by the gateway)."""

    url: str
    """``http://host:port`` of the node daemon."""
    token: str
    """Bearer token that the node accepts for this sandbox's routes only."""


class ForkRequest(Model):
    """Make ``count`` independent copies of a live sandbox."""

    count: int = Field(ge=1, le=256)
    """How many copies."""


class SnapshotRef(Model):
    """A saved sandbox state."""

    snapshot: str
    """Snapshot id, for ``Sandbox.create(snapshot=...)``."""


class SandboxRecord(Model):
    """The daemon's durable record of a sandbox (never sent to clients as is)."""

    id: str
    spec: SandboxSpec
    state: SandboxState
    created_at: float
    expires_at: float
    reason: str | None = None
    backend_state: dict[str, Any] = Field(default_factory=dict)
    """Whatever the backend needs to find, re-adopt or clean up the sandbox (pids, paths, cgroups)."""
    layers: list[str] = Field(default_factory=list)
    """Snapshot layers (manifest digests, top first) the sandbox was restored onto; pinned while it lives."""
    pooled: bool = False
    """Claimed from a warm pool: its destroy answers at once and the teardown runs in the background."""
    image_digest: str | None = None
    """The image version (manifest digest, hex) the sandbox was made of, which a restarted daemon pins again
    (its tag may name another version by then); None for a directory image or a backend's own."""
    outside_log: int = 0
    """On a trajectory: state-changing calls made outside its log (``TrajectoryStatus.outside_log``)."""


SandboxInfo.model_rebuild()
