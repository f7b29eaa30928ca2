"""Operator commands of ``dsec``: ``ps``, ``top``, ``inspect``, ``logs``, ``audit`` and ``events``.

Terminal output only: every answer comes from the SDK's :class:`dsec.Client` (``/v1/sandboxes``,
``/v1/overview``, ``/v1/audit``, ``/v1/events``). Everything a sandbox controls (commands, output, labels)
is printed with rich markup escaped, so an agent cannot paint the operator's terminal. Every command has
``--json`` for scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import click
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from dsec._term import Column, console
from dsec._term import table as fit_table
from dsec.errors import InvalidRequest
from dsec.models import LifecycleKind, parse_pairs

if TYPE_CHECKING:
    from dsec._sdk.client import Client
    from dsec.models import AuditEntry, LifecycleEvent, NodeOverview, SandboxInfo, SandboxStats

__all__ = ["age", "register"]

T = TypeVar("T")
_JOB_LABEL = "dsec.job"


def _run(work: Callable[[Client], Coroutine[Any, Any, T]]) -> T:
    """Run ``work`` with a client of ``DSEC_URL`` / ``DSEC_TOKEN`` on a private event loop."""
    from dsec._sdk.client import Client

    async def main() -> T:
        async with Client() as client:
            return await work(client)

    return asyncio.run(main())


def age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _command(command: str | list[str]) -> str:
    return command if isinstance(command, str) else " ".join(command)


def _dump(items: Any) -> None:
    if isinstance(items, list):
        click.echo(json.dumps([i.model_dump(mode="json") for i in items], indent=2))
    else:
        click.echo(items.model_dump_json(indent=2))


def _when(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


# ----- ps ---------------------------------------------------------------------------------------------


def _list(labels: dict[str, str], backend: str | None, state: str | None, image: str | None, job: str | None
          ) -> Callable[[Client], Coroutine[Any, Any, list[SandboxInfo]]]:
    from dsec._sdk.sandbox import list_infos

    if job is not None:
        labels = {**labels, _JOB_LABEL: job}

    async def work(client: Client) -> list[SandboxInfo]:
        infos = await list_infos(labels=labels, backend=backend, state=state, client=client)
        return [i for i in infos if image is None or i.image == image]

    return work


_PS_COLUMNS = (Column("ID", rank=9), Column("BACKEND", rank=8), Column("IMAGE", rank=6), Column("STATE", rank=7),
               Column("AGE", rank=3), Column("EXPIRES", rank=2), Column("NODE", rank=1))
_USAGE_COLUMNS = (Column("CPU s", rank=4), Column("MEMORY", rank=5), Column("PIDS", rank=2))
_TAIL_COLUMNS = (Column("TRAJECTORY", "text", rank=3), Column("LABELS", "text", rank=5))


def _sandbox_table(infos: list[SandboxInfo], width: int, stats: dict[str, SandboxStats] | None = None) -> Table:
    """The sandboxes, fitted to ``width`` columns (the least useful columns go first on a narrow terminal)."""
    columns = [*_PS_COLUMNS, *(_USAGE_COLUMNS if stats is not None else ()), *_TAIL_COLUMNS]
    rows = []
    now = time.time()
    for i in infos:
        row = [i.id, i.backend, escape(i.image or "-"), i.state, age(now - i.created_at),
               "in " + age(i.expires_at - now), escape(i.node)]
        if stats is not None:
            s = stats.get(i.id)
            row += ["-", "-", "-"] if s is None else [f"{s.cpu_seconds:.1f}", _bytes(s.memory_bytes), str(s.pids)]
        trajectory = _trajectory_text(i, now)
        labels = " ".join(f"{k}={v}" for k, v in sorted(i.labels.items())) or "-"
        rows.append([*row, escape(trajectory), escape(labels)])
    return fit_table(columns, rows, width)


def _trajectory_text(info: SandboxInfo, now: float) -> str:
    t = info.trajectory
    if t is None:
        return "-"
    lease = "lease ends in " + age(max(0.0, t.lease_expires_at - now))
    return f"{t.name} ({t.calls} calls, {'ORPHANED, ' if t.orphaned else ''}{lease})"


_filters = [
    click.option("--label", "-l", "labels", multiple=True, metavar="K=V", help="Only sandboxes with this label."),
    click.option("--backend", type=click.Choice(["function", "container", "microvm", "vm"]), help="Only this backend."),
    click.option("--state", type=click.Choice(["creating", "running", "paused", "failed"]), help="Only this state."),
    click.option("--image", help="Only sandboxes of this image."),
    click.option("--job", help="Only sandboxes of this job (its token's dsec.job label)."),
]


def _with_filters(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_filters):
        f = option(f)
    return f


@click.command()
@_with_filters
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ps(labels: tuple[str, ...], backend: str | None, state: str | None, image: str | None, job: str | None,
       as_json: bool) -> None:
    """List live sandboxes (filters combine)."""
    infos = _run(_list(parse_pairs(labels, "--label"), backend, state, image, job))
    if as_json:
        _dump(infos)
        return
    out = console()
    out.print(_sandbox_table(infos, out.width))


# ----- top --------------------------------------------------------------------------------------------


async def _frame(client: Client, list_them: Callable[[Client], Coroutine[Any, Any, list[SandboxInfo]]],
                 rows: int) -> tuple[NodeOverview, list[SandboxInfo], dict[str, SandboxStats]]:
    from dsec._sdk.sandbox import AsyncSandbox

    overview, infos = await asyncio.gather(client.overview(), list_them(client))
    infos.sort(key=lambda i: i.created_at, reverse=True)
    infos = infos[:rows]

    async def one(info: SandboxInfo) -> SandboxStats | None:
        try:
            return await AsyncSandbox(info, client).stats()
        except Exception:  # gone meanwhile, or a backend without stats: shown as "-"
            return None

    found = await asyncio.gather(*(one(i) for i in infos))
    return overview, infos, {i.id: s for i, s in zip(infos, found, strict=True) if s is not None}


def _header(now: NodeOverview, before: NodeOverview | None, width: int) -> Table:
    columns = (Column("NODE", rank=9), Column("SANDBOXES", rank=8), Column("LOAD", rank=5), Column("MEMORY", rank=6),
               Column("CREATES/s", rank=7), Column("EXECS/s", rank=7), Column("EXEC ms", rank=6),
               Column("FAILURES", "text", rank=4))
    rates = ["-", "-", "-"]
    if before is not None and now.at > before.at:
        dt = now.at - before.at
        execs = now.exec_count - before.exec_count
        mean = 1000 * (now.exec_seconds_sum - before.exec_seconds_sum) / execs if execs else 0.0
        rates = [f"{(now.created - before.created) / dt:.1f}", f"{execs / dt:.1f}", f"{mean:.1f}"]
    failures = ", ".join(f"{k} {v}" for k, v in sorted(now.failures.items(), key=lambda kv: -kv[1])) or "none"
    rows = []
    for node in now.nodes:
        load = " ".join(f"{x:.2f}" for x in node.load) or "-"
        memory = "-"
        if node.memory_total_bytes:
            memory = f"{_bytes(node.memory_used_bytes)} / {_bytes(node.memory_total_bytes)}"
        rows.append([escape(node.node) + ("" if node.alive else " (dead)"), str(node.sandboxes), load, memory,
                     *rates, escape(failures)])
    return fit_table(columns, rows, width)


@click.command()
@_with_filters
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds per refresh.")
@click.option("--rows", type=click.IntRange(1, 10_000), default=40, show_default=True, help="Sandboxes shown (newest).")
@click.option("--once", is_flag=True, help="Print one frame and exit (no live view).")
@click.option("--json", "as_json", is_flag=True, help="One snapshot (overview, sandboxes, stats) as JSON, then exit.")
def top(labels: tuple[str, ...], backend: str | None, state: str | None, image: str | None, job: str | None,
        interval: float, rows: int, once: bool, as_json: bool) -> None:
    """A live view of the node: load, create/exec rates, failures, and the sandboxes with their usage."""
    from rich.live import Live

    list_them = _list(parse_pairs(labels, "--label"), backend, state, image, job)
    out = console()
    if as_json:
        overview, infos, stats = _run(lambda c: _frame(c, list_them, rows))
        click.echo(json.dumps({"overview": overview.model_dump(mode="json"),
                               "sandboxes": [i.model_dump(mode="json") for i in infos],
                               "stats": {k: v.model_dump(mode="json") for k, v in stats.items()}}, indent=2))
        return

    def frame(overview: NodeOverview, before: NodeOverview | None, infos: list[SandboxInfo],
              stats: dict[str, SandboxStats]) -> Group:
        return Group(_header(overview, before, out.width), _sandbox_table(infos, out.width, stats))

    async def snapshots(client: Client) -> None:
        """Not a terminal (a pipe, a file, a log), or ``--once``: plain frames one after the other, each under its
        time."""
        before: NodeOverview | None = None
        while True:
            overview, infos, stats = await _frame(client, list_them, rows)
            if not once:
                out.print(f"--- {_when(overview.at)}")
            out.print(frame(overview, before, infos, stats))
            sys.stdout.flush()
            if once:
                return
            before = overview
            await asyncio.sleep(interval)

    async def live(client: Client) -> None:
        before: NodeOverview | None = None
        with Live(console=out, auto_refresh=False, screen=False) as view:
            while True:
                overview, infos, stats = await _frame(client, list_them, rows)
                view.update(frame(overview, before, infos, stats), refresh=True)
                before = overview
                await asyncio.sleep(interval)

    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _run(live if out.is_terminal and not once else snapshots)


# ----- inspect, logs, audit ---------------------------------------------------------------------------


@click.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(sandbox_id: str, as_json: bool) -> None:
    """Everything about one sandbox: its spec, state, trajectory, usage now and its latest commands."""
    from dsec._sdk.sandbox import AsyncSandbox

    async def work(client: Client) -> tuple[SandboxInfo, SandboxStats | None, list[AuditEntry]]:
        sb = await AsyncSandbox.connect(sandbox_id, client=client)
        info = await sb.info()
        stats = await sb.stats() if info.state in ("running", "paused") else None
        return info, stats, await client.sandbox_logs(sandbox_id, limit=5)

    info, stats, recent = _run(work)
    if as_json:
        click.echo(json.dumps({"info": info.model_dump(mode="json"),
                               "stats": stats.model_dump(mode="json") if stats else None,
                               "recent_commands": [e.model_dump(mode="json") for e in recent]}, indent=2))
        return
    console = Console(width=200, highlight=False)
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    spec = info.spec
    now = time.time()
    rows: list[tuple[str, str]] = [
        ("id", info.id), ("state", info.state + (f" ({info.reason})" if info.reason else "")),
        ("backend", info.backend), ("image", info.image or "-"), ("node", info.node),
        ("created", f"{age(now - info.created_at)} ago"), ("expires", f"in {age(info.expires_at - now)}"),
        ("limits", f"cpu {spec.cpu:g}, memory {_bytes(spec.memory)}, disk {_bytes(spec.disk)}"),
        ("network", json.dumps(spec.network)), ("workdir", spec.workdir or "-"),
        ("labels", ", ".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "-"),
    ]
    if info.trajectory is not None:
        t = info.trajectory
        rows.append(("trajectory", f"{t.name}: {t.calls} calls, lease ends in {age(t.lease_expires_at - now)}"
                                   + (", ORPHANED" if t.orphaned else "")))
    if stats is not None:
        rows.append(("usage", f"cpu {stats.cpu_seconds:.2f} s, memory {_bytes(stats.memory_bytes)} "
                              f"(peak {_bytes(stats.memory_peak_bytes)}), {stats.pids} pids, disk "
                              f"{_bytes(stats.disk_bytes)}" + (", OOM kills " + str(stats.oom_kills)
                                                               if stats.oom_kills else "")))
    for key, value in rows:
        table.add_row(key, escape(value))
    console.print(table)
    if recent:
        console.print("[bold]latest commands[/bold]")
        console.print(_audit_table(recent, with_sandbox=False))


def _audit_table(entries: list[AuditEntry], *, with_sandbox: bool) -> Table:
    table = Table(box=None, header_style="bold")
    columns = ["#", "WHEN", *(["SANDBOX"] if with_sandbox else []), "WHO", "JOB", "COMMAND", "EXIT", "LIMIT", "MS"]
    for column in columns:
        table.add_column(column, overflow="fold")
    for e in entries:
        code = "-" if e.exit_code is None else str(e.exit_code)
        code = code if e.outcome in ("ok", "nonzero", "limit") else e.outcome
        row = [str(e.id), _when(e.at), *([e.sandbox_id] if with_sandbox else []), escape(e.who),
               escape(e.job or "-"), escape(_command(e.command)), code, e.limit or "-", f"{e.duration_s * 1000:.1f}"]
        table.add_row(*row)
    return table


@click.command()
@click.argument("sandbox_id", required=False)
@click.option("--limit", "-n", type=click.IntRange(1, 100_000), default=100, show_default=True,
              help="Latest commands (or daemon log lines) shown.")
@click.option("--no-output", is_flag=True, help="Commands only, without the head of their output.")
@click.option("--daemon", "daemon_log", is_flag=True,
              help="The node daemon's own log (starts, faults, recoveries, refusals) instead of a sandbox's commands; "
                   "with SANDBOX_ID, only its lines.")
@click.option("--component", help="With --daemon: only lines about this component (lazy-server, mount-holder, ...).")
@click.option("--level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default="INFO", show_default=True, help="With --daemon: the lowest level shown.")
@click.option("--follow", "-f", is_flag=True, help="With --daemon: keep printing new lines.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (newest first; --daemon: oldest first).")
def logs(sandbox_id: str | None, limit: int, no_output: bool, daemon_log: bool, component: str | None, level: str,
         follow: bool, as_json: bool) -> None:
    """A sandbox's command history and outputs, from the audit trail (outside the sandbox; also once it is gone);
    or, with --daemon, the node daemon's log.

    Oldest first; each command's output is its first 4 KiB per stream.
    """
    if daemon_log:
        _daemon_log(sandbox_id, component, level.upper(), limit, follow, as_json)
        return
    if sandbox_id is None:
        raise click.UsageError("give a SANDBOX_ID, or --daemon for the daemon's own log")
    entries = _run(lambda c: c.sandbox_logs(sandbox_id, limit=limit))
    if as_json:
        _dump(entries)
        return
    console = Console(highlight=False, soft_wrap=True)
    for e in reversed(entries):
        status = f"exit {e.exit_code}" if e.exit_code is not None else e.outcome
        if e.limit:
            status += f", {e.limit} limit"
        console.print(f"[bold]#{e.id} {_when(e.at)} {escape(e.who)}[/bold] $ {escape(_command(e.command))}  "
                      f"[dim]({status}, {e.duration_s * 1000:.1f} ms)[/dim]")
        if e.error:
            console.print(f"[red]{escape(e.error)}[/red]")
        if not no_output:
            if e.stdout:
                console.print(escape(e.stdout.rstrip("\n")))
            if e.stderr:
                console.print(f"[yellow]{escape(e.stderr.rstrip(chr(10)))}[/yellow]")
            if e.output_bytes > len(e.stdout) + len(e.stderr):
                console.print(f"[dim]... {e.output_bytes} bytes of output in all[/dim]")


_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


def _daemon_log(sandbox_id: str | None, component: str | None, level: str, limit: int, follow: bool,
                as_json: bool) -> None:
    """Print the daemon's log file (``DSEC_HOME/log/dsec.log``), filtered."""
    import collections
    import json

    from dsec.config import Settings
    from dsec.daemon.logs import LogLine, read_lines

    path = Settings().log_file
    if not path.exists():
        raise click.ClickException(f"no daemon log at {path} (DSEC_HOME={Settings().home}): has a daemon run here?")

    def wanted(line: LogLine) -> bool:
        return (_LEVELS.get(line.level, 0) >= _LEVELS[level]
                and (component is None or line.fields.get("component") == component)
                and (sandbox_id is None or line.fields.get("sandbox") == sandbox_id or sandbox_id in line.message))

    def show(line: LogLine) -> None:
        if as_json:
            click.echo(json.dumps({"at": line.at, "level": line.level, "logger": line.logger,
                                   "message": line.message, **line.fields, "more": line.more}))
        else:
            click.echo(line.text())

    lines = read_lines(path, follow=follow)
    for line in collections.deque((x for x in lines if wanted(x)), maxlen=limit) if not follow else []:
        show(line)
    if follow:
        for line in lines:
            if wanted(line):
                show(line)


@click.command()
@click.option("--sandbox", "sandbox_id", help="Only this sandbox.")
@click.option("--who", help="Only commands sent with this token name (`local`: the unix socket).")
@click.option("--job", help="Only sandboxes of this job.")
@click.option("--outcome", type=click.Choice(["ok", "nonzero", "limit", "error", "cancelled"]),
              help="Only this outcome.")
@click.option("--since", type=float, metavar="SECONDS", help="Only the last SECONDS.")
@click.option("--limit", "-n", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Rows shown.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (newest first).")
def audit(sandbox_id: str | None, who: str | None, job: str | None, outcome: str | None, since: float | None,
          limit: int, as_json: bool) -> None:
    """The node's audit trail: every command run in every sandbox (admin token on TCP)."""
    if since is not None and since <= 0:
        raise InvalidRequest(f"--since must be a positive number of seconds, got {since:g}")
    start = None if since is None else time.time() - since
    entries = _run(lambda c: c.audit(sandbox_id=sandbox_id, who=who, job=job, outcome=outcome, since=start,
                                     limit=limit))
    if as_json:
        _dump(entries)
        return
    Console(width=200, highlight=False).print(_audit_table(entries, with_sandbox=True))


# ----- events -----------------------------------------------------------------------------------------


@click.command()
@click.option("--since", type=click.IntRange(0), help="First replay the kept events after this sequence number "
                                                       "(0: all kept).")
@click.option("--count", "-n", type=click.IntRange(1), help="Exit after this many events.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (NDJSON).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(get_args(LifecycleKind)),
              help="Only events of this kind (repeatable); a 'lagged' notice of dropped events always shows.")
def events(since: int | None, count: int | None, as_json: bool, kinds: tuple[str, ...]) -> None:
    """Stream lifecycle events: sandboxes' (created, destroyed, expired, paused, resumed, create_failed...) and
    the node's own (``node``: its images and whether it is stopping, when they change)."""
    console = Console(highlight=False, soft_wrap=True)

    def show(e: LifecycleEvent) -> None:
        if as_json:
            click.echo(e.model_dump_json())
            return
        what = " ".join(x for x in (e.sandbox_id, e.backend, e.image) if x)
        extra = f" ({e.reason})" if e.reason else ""
        console.print(f"{e.seq:>6} {_when(e.at)} {e.kind:<13} {escape(what)}{escape(extra)}")

    async def follow(client: Client) -> None:
        seen = 0
        stream = client.events(since)
        try:
            async for event in stream:
                if kinds and event.kind not in kinds and event.kind != "lagged":
                    continue
                show(event)
                sys.stdout.flush()
                seen += 1
                if count is not None and seen >= count:
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    with contextlib.suppress(KeyboardInterrupt):
        _run(follow)


def register(group: click.Group) -> None:
    """Add the operator commands to the ``dsec`` group."""
    for command in (ps, top, inspect, logs, audit, events):
        group.add_command(command)
