"""The wire models of a sandbox's trajectory (the logged calls a rollout can replay and fork).

Owns ``TrajectoryStatus``, ``TrajectoryInfo``, ``TrajectoryForkRequest`` and ``LoggedCall``. Must never
hold the trajectory store's logic (``dsec.trajectory``); no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsec.models.common import Model


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
