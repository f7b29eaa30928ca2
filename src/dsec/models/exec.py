"""The wire models of running a command: exec and call requests, their results and streamed events.

Owns ``ExecRequest``/``ExecResult``, ``CallRequest``/``CallResult``, ``CallBatch``/``CallBatchResult``,
``ExecEvent`` and ``FileEntry``.
Must never describe a sandbox's lifecycle or a node; no I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from dsec.models.common import Cwd, Env, LimitHit, Model, Size, User, check_command


class ExecRequest(Model):
    """One command to run in a sandbox."""

    command: str | list[str]
    """A shell string (run by ``/bin/sh -c``) or an argv list (run directly)."""
    timeout: float | None = Field(60.0, gt=0)
    """Seconds before the command's process group is killed (``None``: no limit)."""
    cwd: Cwd = None
    """Working directory, absolute or relative to the sandbox's ``workdir`` (default: ``workdir``)."""
    env: Env = None
    """Extra environment, merged over the sandbox's."""
    stdin: bytes | None = None
    """Bytes fed to the command's standard input (closed afterwards)."""
    max_output: int = Field(16 * 1024 * 1024, ge=0)
    """Captured bytes per stream; past it the command is killed and the result is ``truncated``."""
    user: User = None
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
    def _command(cls, v: str | list[str]) -> str | list[str] | None:
        return check_command(v)

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


class CallOptions(Model):
    """How a Python callable runs in a function sandbox: what :class:`CallRequest` and :class:`CallBatch` share."""

    client_python: str = Field(pattern=r"^\d+\.\d+$")
    """The caller's ``major.minor`` Python version; the image's must match (cloudpickle's bytecode)."""
    timeout: float | None = Field(60.0, gt=0)
    """Seconds before the call is killed (verdict ``time``)."""
    max_result_bytes: int = Field(16 * 1024 * 1024, ge=1, le=1024**3)
    """Largest pickled return value; a bigger one is refused inside the sandbox with a clear error."""
    python: str = "python3"
    """The image's interpreter (name on ``PATH`` or absolute path)."""
    env: Env = None
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

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not v or "\0" in v:
            raise ValueError(f"python must be a non-empty interpreter name or path, got {v!r}")
        return v


class CallRequest(CallOptions):
    """A Python callable to run in a function sandbox (``sb.call``); built by the SDK."""

    payload: bytes
    """``cloudpickle.dumps((func, args, kwargs))``."""


MAX_BATCH = 1024
"""Items of one :class:`CallBatch` at most."""


class CallBatch(CallOptions):
    """One Python callable on many inputs (``sb.map``), in one request: each item is a call of its own (a fresh
    process forked for it, its own limits and verdict), run one after another; built by the SDK."""

    function: bytes
    """``cloudpickle.dumps(func)``, pickled once for every item."""
    items: list[bytes] = Field(min_length=1, max_length=MAX_BATCH)
    """``cloudpickle.dumps((args, kwargs))`` of each call: the loader reads the function, then these."""


class CallResult(Model):
    """What a call left: the loader's reply (decoded by the SDK, never by the daemon) and how it ended."""

    reply: bytes
    """The loader's pickled reply; empty when the call ended without one (killed at a limit, crashed)."""
    result: ExecResult
    """Exit status, verdict, CPU time, peak memory and stderr (the callable's prints) of the call."""


class CallOutcome(Model):
    """One item of a :class:`CallBatch`: its call's result (a value, a raised exception or a verdict, all decoded
    by the SDK), or the failure of the sandbox that kept it from running (never both)."""

    result: CallResult | None = None
    """What the call left, as :class:`CallResult`."""
    error: dict[str, Any] | None = None
    """The sandbox's failure, as in HTTP errors (``type``, ``message``, ``detail``): never the call's verdict."""


class CallBatchResult(Model):
    """The outcomes of a :class:`CallBatch`, in the order of its items."""

    outcomes: list[CallOutcome]
    """One per item run: fewer than the items when the replies grew past the node's bound for one answer (32
    MiB); the items past them did not run, and the client sends them again."""


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
