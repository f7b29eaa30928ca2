"""Request and response models shared by the SDK, the node daemon and the gateway.

One definition per message: the HTTP API, the OpenAPI document and the SDK all come
from these classes. Binary fields (``stdout``, ``stdin``...) travel as base64 in JSON.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from dsec.accounts import parse_user
from dsec.errors import InvalidRequest

__all__ = [
    "AdmissionStatistics",
    "AuditEntry",
    "BackendName",
    "BatchCreateEvent",
    "BatchCreateRequest",
    "BatchDestroyRequest",
    "BatchDestroyResult",
    "CallRequest",
    "CallResult",
    "ComponentHealth",
    "CounterSample",
    "ExecEvent",
    "ExecRequest",
    "ExecResult",
    "FileEntry",
    "ForkRequest",
    "ImageBuildEvent",
    "ImageBuildRequest",
    "ImageConfig",
    "ImageInfo",
    "KeyboardRequest",
    "LifecycleEvent",
    "LimitHit",
    "LoggedCall",
    "MouseRequest",
    "NetworkEntry",
    "NetworkRequest",
    "NodeEndpoint",
    "NodeInfo",
    "NodeLoad",
    "NodeOverview",
    "NodeStatistics",
    "PoolConfig",
    "PoolStatistics",
    "SandboxInfo",
    "SandboxRecord",
    "SandboxSpec",
    "SandboxState",
    "SandboxStats",
    "SnapshotRef",
    "TimeoutRequest",
    "TrajectoryForkRequest",
    "TrajectoryInfo",
    "TrajectoryStatus",
    "check_mapping",
    "id_hash",
    "ids_digest",
    "parse_network",
    "parse_pairs",
    "parse_size",
]

BackendName = Literal["function", "container", "microvm", "vm"]
SandboxState = Literal["creating", "running", "paused", "stopped", "expired", "failed", "lost"]
LimitHit = Literal["time", "memory", "output", "pids", "disk"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Parse ``"1Gi"``, ``"512MiB"``, ``"4G"`` or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"not a size: {value!r} (use bytes or a string such as '512Mi', '1Gi', '4G')")
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


Size = Annotated[int, BeforeValidator(parse_size)]


_DOMAIN_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


class NetworkEntry(BaseModel):
    """One allowlist entry: a CIDR or a domain name (``*.`` allows its subdomains), optionally a port."""

    model_config = ConfigDict(frozen=True)

    cidr: str | None = None
    domain: str | None = None
    port: int | None = None

    def matches_name(self, name: str) -> bool:
        """True if DNS name ``name`` (no trailing dot, any case) is allowed by this domain entry."""
        if self.domain is None:
            return False
        name = name.rstrip(".").lower()
        if self.domain.startswith("*."):
            return name.endswith(self.domain[1:])
        return name == self.domain


def _parse_network_entry(entry: str) -> NetworkEntry:
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"network entry must be a non-empty string, got {entry!r}")
    text = entry.strip().lower()
    host, port = text, None
    if text.count(":") == 1:  # IPv4 or a name with a port; bare IPv6 is not supported in allowlists
        host, port_text = text.split(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"network entry {entry!r}: port must be 1-65535")
        port = int(port_text)
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        net = None
    if net is not None:
        if net.version != 4:
            raise ValueError(f"network entry {entry!r}: only IPv4 CIDRs are supported")
        return NetworkEntry(cidr=str(net), port=port)
    labels = host.removeprefix("*.").split(".")
    if len(host) > 253 or len(labels) < 2 or not all(_DOMAIN_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"network entry {entry!r} is neither an IPv4 CIDR[:port] nor a domain name[:port] "
                         f"(e.g. '10.0.0.0/8', '192.0.2.1:443', 'pypi.org', '*.pythonhosted.org:443')")
    return NetworkEntry(domain=host, port=port)


def parse_network(value: str | Sequence[str]) -> tuple[str, tuple[NetworkEntry, ...]]:
    """``("none" | "allow" | "list", entries)`` for a ``network=`` value; ValueError naming a bad entry."""
    if isinstance(value, str):
        if value in ("none", "allow"):
            return value, ()
        raise ValueError(f"network must be 'none', 'allow' or a list of allowlist entries, got {value!r}")
    entries = tuple(_parse_network_entry(e) for e in value)
    if len(entries) > 1024:
        raise ValueError(f"network allowlist has {len(entries)} entries; at most 1024")
    return "list", entries


def parse_pairs(items: Sequence[str], what: str) -> dict[str, str]:
    """``["k=v", ...]`` (CLI flags, query parameters) as a dict; a malformed item is an InvalidRequest."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"{what} must look like key=value, got {item!r}")
        out[key] = value
    return out


def check_mapping(v: dict[str, str]) -> dict[str, str]:
    """Environment-style keys: non-empty, no '=' or NUL; values without NUL (execve cannot carry them)."""
    for key, val in v.items():
        if not key or "\0" in key or "=" in key or "\0" in val:
            raise ValueError(f"invalid entry {key!r}: keys must be non-empty without '=' or NUL, values without NUL")
    return v


class Model(BaseModel):
    """Base of every wire model: unknown fields are an error, bytes are base64 in JSON."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        ser_json_bytes="base64",
        val_json_bytes="base64",
        populate_by_name=True,
    )


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


class ExecRequest(Model):
    """One command to run in a sandbox."""

    command: str | list[str]
    """A shell string (run by ``/bin/sh -c``) or an argv list (run directly)."""
    timeout: float | None = Field(60.0, gt=0)
    """Seconds before the command's process group is killed (``None``: no limit)."""
    cwd: str | None = None
    """Working directory, absolute or relative to the sandbox's ``workdir`` (default: ``workdir``)."""
    env: dict[str, str] | None = None
    """Extra environment, merged over the sandbox's."""
    stdin: bytes | None = None
    """Bytes fed to the command's standard input (closed afterwards)."""
    max_output: int = Field(16 * 1024 * 1024, ge=0)
    """Captured bytes per stream; past it the command is killed and the result is ``truncated``."""
    user: str | None = None
    """Run as this user: ``name``, ``uid``, ``name:group`` or ``uid:gid``, resolved in the sandbox's own
    ``/etc/passwd`` and ``/etc/group`` (default: the sandbox's user, ``SandboxSpec.user`` or the image's)."""
    pristine: bool = False
    """Run with the image's original, untouched root (a fresh mount namespace over the read-only image, the
    working directory bind-mounted from the sandbox, a fresh ``/tmp``): a grader that runs ``bash`` or
    ``python3`` gets the image's, whatever the agent replaced. Container and microvm; on the function backend
    every call already runs on the read-only image."""
    warm_python: bool = False
    """Function backend: run ``command`` (``[python, script, arg...]``, ``python`` the image's interpreter by
    name) forked from the sandbox's warm Python interpreter instead of a fresh one, with the same namespaces,
    cgroup, limits and verdicts but no interpreter start. A command it cannot run as a fresh process would
    (interpreter options, ``PYTHON*`` variables, another user, a non-UTF-8 locale) runs fresh, as it does on the
    other backends."""

    @field_validator("command")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("command must not be empty")
        if any("\0" in part for part in ([v] if isinstance(v, str) else v)):
            raise ValueError("command must not contain NUL bytes")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else check_mapping(v)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        if v is not None and (not v or "\0" in v):
            raise ValueError(f"cwd must be a non-empty path without NUL bytes (absolute, or relative to the "
                             f"sandbox's working directory), got {v!r}")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None:
            parse_user(v)
        return v

    def argv(self) -> list[str]:
        """The argv actually executed."""
        return ["/bin/sh", "-c", self.command] if isinstance(self.command, str) else list(self.command)


class ExecResult(Model):
    """How a command ended and what it printed."""

    exit_code: int
    """Exit status; ``128 + N`` when killed by signal N (as a shell reports it)."""
    stdout: bytes = b""
    """Captured standard output (at most ``max_output`` bytes)."""
    stderr: bytes = b""
    """Captured standard error (at most ``max_output`` bytes)."""
    duration_s: float = 0.0
    """Wall-clock seconds from start to exit."""
    truncated: bool = False
    """True when output was cut at ``max_output``."""
    signal: int | None = None
    """Signal that killed the command, if any."""
    limit: LimitHit | None = None
    """Which limit ended the command: ``time``, ``memory``, ``output``, ``pids`` or ``disk`` (a command that
    failed while the writable layer was full)."""
    replayed: bool = False
    """Served from the trajectory log without running (fast-forward)."""
    log_truncated: bool = False
    """The trajectory log kept only the first bytes of this output (its per-call cap): what a replay returns."""
    cpu_s: float | None = None
    """CPU seconds (user + system) of the command and the children it waited for, when the backend measures
    it (``function``)."""
    memory_peak_bytes: int | None = None
    """Peak resident memory of the largest single process of the command, when the backend measures it
    (``function``)."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0

    @property
    def timed_out(self) -> bool:
        """True when the command was killed at its timeout."""
        return self.limit == "time"


class CallRequest(Model):
    """A Python callable to run in a function sandbox (``sb.call``); built by the SDK."""

    payload: bytes
    """``cloudpickle.dumps((func, args, kwargs))``."""
    client_python: str = Field(pattern=r"^\d+\.\d+$")
    """The caller's ``major.minor`` Python version; the image's must match (cloudpickle's bytecode)."""
    timeout: float | None = Field(60.0, gt=0)
    """Seconds before the call is killed (verdict ``time``)."""
    max_result_bytes: int = Field(16 * 1024 * 1024, ge=1, le=1024**3)
    """Largest pickled return value; a bigger one is refused inside the sandbox with a clear error."""
    python: str = "python3"
    """The image's interpreter (name on ``PATH`` or absolute path)."""
    env: dict[str, str] | None = None
    """Extra environment for the call."""
    memory: Size | None = Field(None, ge=16 * 1024**2)
    """This call's memory limit (its processes and the files it writes), at most the sandbox's; default the
    sandbox's. Every call has its own: another call's use never counts against it."""
    pids: int | None = Field(None, ge=2, le=1_000_000)
    """This call's process limit, at most the sandbox's; default the sandbox's."""
    disk: Size | None = Field(None, ge=1024**2)
    """Size of this call's ``/tmp``, at most the sandbox's ``disk``; default the sandbox's, at most half of the
    call's memory (the files live in memory)."""
    max_output: int = Field(1024 * 1024, ge=1, le=1024**3)
    """Largest output the callable may print (its stdout and stderr, both sent to stderr); past it the call is
    killed (verdict ``output``)."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else check_mapping(v)

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not v or "\0" in v:
            raise ValueError(f"python must be a non-empty interpreter name or path, got {v!r}")
        return v


class CallResult(Model):
    """What a call left: the loader's reply (decoded by the SDK, never by the daemon) and how it ended."""

    reply: bytes
    """The loader's pickled reply; empty when the call ended without one (killed at a limit, crashed)."""
    result: ExecResult
    """Exit status, verdict, CPU time, peak memory and stderr (the callable's prints) of the call."""


class ExecEvent(Model):
    """One item of a streamed exec: output chunks, then exactly one ``exit`` (or ``error``)."""

    type: Literal["stdout", "stderr", "exit", "error"]
    """Kind of event."""
    data: bytes | None = None
    """Output chunk for ``stdout``/``stderr``."""
    result: ExecResult | None = None
    """Final result for ``exit`` (its stdout/stderr hold the capped capture)."""
    error: dict[str, Any] | None = None
    """Error payload (as in HTTP errors) for ``error``."""


class FileEntry(Model):
    """One entry of a directory listing."""

    name: str
    """Base name."""
    path: str
    """Absolute path inside the sandbox."""
    type: Literal["file", "dir", "symlink", "other"]
    """Kind of entry (symlinks are not followed)."""
    size: int
    """Size in bytes."""
    mode: int
    """Permission bits."""
    mtime: float
    """Modification time (Unix seconds)."""


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


class TrajectoryStatus(Model):
    """A trajectory-bound sandbox's log and lease, as seen when it was opened or looked up."""

    name: str
    """Trajectory name."""
    calls: int
    """Calls in the log (the next live call gets this sequence number)."""
    lease_expires_at: float
    """When the sandbox is destroyed unless a call renews the lease (Unix seconds)."""
    last_activity: float
    """Time of the latest call (Unix seconds)."""
    orphaned: bool = False
    """No call for a minute (or half the lease, if shorter) and none running: its client is probably gone."""
    restored_from: str | None = None
    """Snapshot id the sandbox was rebuilt from, when it had been lost."""
    missing_effects: list[int] = Field(default_factory=list)
    """Logged calls (by seq) after that snapshot whose effects on the sandbox are not there (not re-run)."""
    rerun: list[int] = Field(default_factory=list)
    """Logged calls (by seq) re-run to rebuild the sandbox (``rerun_missing=True``)."""
    forked_from: str | None = None
    """Trajectory this one branched from (``on_divergence="fork"``); its log shares calls ``< fork_point``."""
    fork_point: int | None = None
    """Sequence number of the first call after the branch point."""
    outside_log: int = 0
    """State-changing calls made on this sandbox outside the log (an operator's ``dsec exec``, ``dsec files``,
    the dashboard: calls without a call number), recorded in the audit trail: its state may differ from what
    the logged calls made."""


class TrajectoryInfo(Model):
    """A trajectory in the log store (``dsec trajectory ls``)."""

    name: str
    """Trajectory name."""
    calls: int
    """Calls in its log."""
    sandbox_id: str | None = None
    """The sandbox last bound to it (it may be gone: re-opening the trajectory rebuilds it)."""
    checkpoint: str | None = None
    """Snapshot id of its latest checkpoint."""
    created_at: float
    """When it was first opened (Unix seconds)."""
    updated_at: float
    """When its binding last changed (a rebuild, a checkpoint)."""
    ended_at: float | None = None
    """When it was ended (``close(end=True)``); re-opening its name then starts a new trajectory."""


class TrajectoryForkRequest(Model):
    """Branch a trajectory at a call: a new trajectory sharing the log before it, on a rebuilt sandbox."""

    name: str
    """Trajectory to branch."""
    at: int = Field(ge=0)
    """First call not shared: the branch's log holds calls ``< at``."""
    rerun_missing: bool = False
    """Re-run the state-changing calls between the latest checkpoint before ``at`` and ``at``."""


class LoggedCall(Model):
    """One completed call of a trajectory log, as the SDK fetches it to fast-forward."""

    seq: int
    """Sequence number."""
    op: Literal["exec", "read", "write", "list", "snapshot", "screenshot", "mouse", "keyboard", "reveal", "stat",
                "mkdir", "remove", "rename", "chmod", "chown", "xattrs", "process", "process.stdin",
                "process.close_stdin", "process.signal", "process.resize", "process.wait", "shell", "shell.run",
                "shell.close"]
    """Operation."""
    digest: str
    """sha256 identity of the call (``dsec.trajectory.digest``)."""
    status: Literal["running", "done", "interrupted"]
    """Only ``done`` calls can be served by the SDK; others go to the daemon."""
    response: str | None = None
    """The logged response as JSON text."""
    truncated: bool = False
    """The stored output was cut at the log's per-call cap."""
    request: str | None = None
    """The call in readable JSON (large bodies replaced by their size and digest), for people reading it."""
    started_at: float | None = None
    """When it started (Unix seconds)."""
    duration_s: float | None = None
    """How long it ran."""


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


class ImageConfig(Model):
    """Defaults an image gives its sandboxes."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment (``PATH`` etc.)."""
    workdir: str | None = None
    """Working directory."""
    user: str | None = None
    """User to run as (``uid[:gid]``)."""
    entrypoint: list[str] | None = None
    """OCI entrypoint (kept for reference)."""
    cmd: list[str] | None = None
    """OCI cmd (kept for reference)."""


class ImagePullRequest(Model):
    """Pull an image from an OCI registry into the node's store."""

    reference: str = Field(min_length=1, max_length=1024)
    """``[host[:port]/]repo[:tag][@sha256:...]``."""
    name: str | None = None
    """Name in the store (default: the repository's last part, plus ``-TAG``)."""
    insecure: bool = False
    """Plain HTTP (a registry on loopback without TLS)."""
    username: str | None = None
    """Registry user (basic or token auth)."""
    password: str | None = Field(None, repr=False)
    """Registry password; never logged or stored."""
    replace: bool = False
    """Replace an existing image of that name."""


class ImageInfo(Model):
    """An image in the node's store."""

    name: str
    """Name used by ``Sandbox.create(image=...)``."""
    created_at: float
    """Import time (Unix seconds)."""
    size_bytes: int
    """Bytes of file data."""
    files: int
    """Number of filesystem entries."""
    source: str
    """Where it came from (``dir:/path``, ``mmdebstrap:...``)."""
    uid_shift: int
    """Host uid that the image's uid 0 is stored as (user-namespace shift)."""
    config: ImageConfig = Field(default_factory=ImageConfig)
    """Sandbox defaults."""


class ImageBuildRequest(Model):
    """Build an image from a Dockerfile into the node's store (the build context travels beside it)."""

    name: str = Field(min_length=1, max_length=128)
    """Name in the store."""
    dockerfile: str = "Dockerfile"
    """The Dockerfile's path inside the context (ignored when ``dockerfile_text`` is given)."""
    dockerfile_text: str | None = Field(None, max_length=1024 * 1024)
    """The Dockerfile itself, for one that lives outside the context (``docker build -f ../Dockerfile``)."""
    build_args: dict[str, str] = Field(default_factory=dict)
    """``ARG`` values (``--build-arg K=V``)."""
    target: str | None = None
    """The stage to build (``--target``); default the last."""
    network: Literal["private", "none"] = "private"
    """``RUN`` steps' network: a private one with outbound access and no route to the host's loopback, or
    none at all."""
    no_cache: bool = False
    """Build every step again instead of reusing the layer cache."""
    insecure: bool = False
    """Pull ``FROM`` images over plain HTTP / without TLS verification (a registry on loopback)."""
    username: str | None = None
    """Registry user for ``FROM`` images of a registry that needs one."""
    password: str | None = Field(None, repr=False)
    """Registry password; never logged, stored, or put on a command line."""
    replace: bool = False
    """Replace an existing image of that name."""

    @field_validator("build_args")
    @classmethod
    def _args(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"build arg {key!r} is not a valid ARG name")
        return v


class ImageBuildEvent(Model):
    """One item of a streamed build: the builder's output lines, then exactly one ``done`` (or ``error``)."""

    type: Literal["output", "done", "error"]
    """Kind of event."""
    line: str | None = None
    """A line of the builder's output (``output``)."""
    image: ImageInfo | None = None
    """The image as stored (``done``)."""
    error: dict[str, Any] | None = None
    """Error payload (as in HTTP errors) for ``error``."""


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


def id_hash(sandbox_id: str) -> int:
    """A sandbox id's 64-bit hash; :func:`ids_digest` XORs them, so a digest is kept up to date one id at a time."""
    return int.from_bytes(hashlib.blake2b(sandbox_id.encode(), digest_size=8).digest(), "big")


def ids_digest(sandbox_ids: Iterable[str]) -> str:
    """The order-free digest of a set of sandbox ids, as :attr:`NodeInfo.digest` reports it (16 hex digits)."""
    value = 0
    for sandbox_id in sandbox_ids:
        value ^= id_hash(sandbox_id)
    return f"{value:016x}"


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


SandboxInfo.model_rebuild()
