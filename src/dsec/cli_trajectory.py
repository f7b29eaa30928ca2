"""``dsec trajectory``: list, inspect, end and delete trajectories (``ls``, ``log``, ``end``, ``rm``).

Terminal output only, through the SDK (:class:`dsec.AsyncTrajectory`, ``/v1/trajectories``). Names and logged
calls are the agent's text: printed with rich markup escaped. ``rm`` asks before it deletes (``--yes`` does
not). It never reads the log's database itself.
"""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec.cli_ops import _run, age

__all__ = ["register"]


@click.group()
def trajectory() -> None:
    """Trajectories in the node's log: list, read, end and delete them."""


@trajectory.command(name="ls")
@click.option("--prefix", default="", help="Only names starting with this (e.g. a job: 'job-17/').")
@click.option("--limit", "-n", type=click.IntRange(1, 10_000), default=1000, show_default=True, help="Rows shown.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ls(prefix: str, limit: int, as_json: bool) -> None:
    """Trajectories by name: calls logged, sandbox, latest checkpoint, and whether each ended."""
    found = _run(lambda c: c.api.list_trajectories(prefix=prefix, limit=limit))
    if as_json:
        click.echo(json.dumps([t.model_dump(mode="json") for t in found], indent=2))
        return
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "CALLS", "SANDBOX", "CHECKPOINT", "CREATED", "STATE"):
        table.add_column(column)
    now = time.time()
    for t in found:
        state = f"ended {age(now - t.ended_at)} ago" if t.ended_at is not None else "open"
        table.add_row(escape(t.name), str(t.calls), t.sandbox_id or "-", t.checkpoint or "-",
                      f"{age(now - t.created_at)} ago", state)
    Console(width=200, highlight=False).print(table)


@trajectory.command(name="log")
@click.argument("name")
@click.option("--start", type=click.IntRange(0), default=0, show_default=True, help="First call shown.")
@click.option("--limit", "-n", type=click.IntRange(1, 10_000), default=100, show_default=True, help="Calls shown.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def log(name: str, start: int, limit: int, as_json: bool) -> None:
    """The logged calls of trajectory NAME, in order."""
    calls = _run(lambda c: c.api.trajectory_log(name, start, limit))
    if as_json:
        click.echo(json.dumps([call.model_dump(mode="json") for call in calls], indent=2))
        return
    console = Console(width=200, highlight=False, soft_wrap=True)
    for call in calls:
        console.print(f"{call.seq:>5} {call.op:<10} {call.status:<11} {escape(call.request or '')}")


@trajectory.command(name="end")
@click.argument("name")
def end(name: str) -> None:
    """End trajectory NAME: destroy its sandbox; its log stays until the name is opened again."""
    info = _run(lambda c: c.api.end_trajectory(name))
    click.echo(f"ended {info.name} ({info.calls} calls logged)")


@trajectory.command(name="rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def rm(names: tuple[str, ...], yes: bool) -> None:
    """Delete trajectories: each one's sandbox, log and the checkpoints no branch shares."""
    if not yes:
        shown = ", ".join(repr(n) for n in names)
        click.confirm(f"delete trajectory {shown} (its sandbox, its log and its checkpoints)?", abort=True, err=True)
    for name in names:
        _run(lambda c, n=name: c.api.delete_trajectory(n))  # type: ignore[misc]
        click.echo(name)


def register(group: click.Group) -> None:
    """Add ``dsec trajectory`` to the ``dsec`` group."""
    group.add_command(trajectory)
