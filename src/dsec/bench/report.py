"""Statistics and output of a benchmark run: percentiles, the comparison table and the JSON file.

Pure functions over numbers already measured: nothing here starts a process or reads a clock, so the
unit tests drive it with fake samples. A *ratio* is always "how many times better DSec is than the
peer": peer time / DSec time for latencies, DSec rate / peer rate for throughputs (> 1 means DSec wins).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

__all__ = ["Row", "Suite", "Summary", "default_json_path", "percentile", "render_latencies", "render_summary",
           "render_table", "summarize", "to_json", "write_json"]

Better = Literal["lower", "higher"]


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Latency samples in seconds, summarised."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float


def summarize(samples: Sequence[float]) -> Summary:
    """p50/p90/p99, mean, min and max of ``samples`` (at least one)."""
    if not samples:
        raise ValueError("summarize needs at least one sample")
    return Summary(n=len(samples), mean=sum(samples) / len(samples), p50=percentile(samples, 50),
                   p90=percentile(samples, 90), p99=percentile(samples, 99), min=min(samples),
                   max=max(samples))


@dataclass
class Row:
    """One line of the table: a DSec figure, optionally against a peer and a target."""

    metric: str
    unit: str
    """``"ms"``, ``"/s"``, ``"MiB"``, ``"s"``: how ``dsec`` and ``peer`` are shown."""
    dsec: float | None
    peer: float | None = None
    peer_name: str | None = None
    better: Better = "lower"
    target: str | None = None
    """Human-readable target, e.g. ``"≤ 50 ms"``."""
    passed: bool | None = None
    """Whether the DSec target is met; None when the row carries no target."""
    note: str | None = None
    """Why a figure is missing (peer skipped) or how to read it."""

    @property
    def ratio(self) -> float | None:
        """How many times better DSec is than the peer (> 1: DSec wins)."""
        if self.dsec is None or self.peer is None or self.dsec <= 0 or self.peer <= 0:
            return None
        return self.peer / self.dsec if self.better == "lower" else self.dsec / self.peer


@dataclass
class Suite:
    """Everything one suite measured."""

    name: str
    rows: list[Row] = field(default_factory=list)
    latencies: dict[str, Summary] = field(default_factory=dict)
    """Full summaries (seconds) keyed by measurement, for the JSON file."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other figures and facts (phase times, failures, skipped peers, machine)."""


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"
    if unit == "/s":
        return f"{value:.1f}/s"
    if unit == "MiB":
        return f"{value:.2f} MiB"
    if unit == "%":
        return f"{value:+.1f}%"
    if not unit:
        return f"{value:g}"
    return f"{value:.2f} {unit}"


def _short(note: str, limit: int = 48) -> str:
    first = note.splitlines()[0] if note else note
    return first if len(first) <= limit else first[: limit - 1] + "…"


def render_table(suite: Suite) -> Table:
    """The comparison table printed to the terminal."""
    table = Table(title=f"dsec bench {suite.name}", title_justify="left")
    for column in ("metric", "DSec", "peer", "ratio", "target", ""):
        table.add_column(column, justify="left" if column in ("metric", "peer", "target") else "right")
    for row in suite.rows:
        if row.peer_name is None:
            peer = ""
        elif row.peer is None:
            peer = f"{row.peer_name}: {_short(row.note or 'skipped')}"
        else:
            peer = f"{row.peer_name} {_fmt(row.peer, row.unit)}"
        ratio = row.ratio
        mark = {True: "[green]PASS[/green]", False: "[red]FAIL[/red]", None: ""}[row.passed]
        metric = row.metric if row.peer_name is not None or not row.note else f"{row.metric} ({_short(row.note)})"
        table.add_row(metric, _fmt(row.dsec, row.unit), peer, f"{ratio:.1f}x" if ratio else "",
                      row.target or "", mark)
    return table


def render_summary(suites: Sequence[Suite], failed: Mapping[str, str] | None = None) -> Table:
    """One table of every suite's rows that carry a target or a peer (the figures the issues ask for)."""
    table = Table(title="dsec bench: summary", title_justify="left")
    for column in ("suite", "metric", "DSec", "peer", "ratio", "target", ""):
        table.add_column(column, justify="left" if column in ("suite", "metric", "peer", "target") else "right")
    for suite in suites:
        for row in suite.rows:
            if row.target is None and row.peer_name is None:
                continue
            peer = "" if row.peer_name is None else f"{row.peer_name} {_fmt(row.peer, row.unit)}"
            mark = {True: "[green]PASS[/green]", False: "[red]FAIL[/red]", None: ""}[row.passed]
            table.add_row(suite.name, row.metric, _fmt(row.dsec, row.unit), peer,
                          f"{row.ratio:.1f}x" if row.ratio else "", row.target or "", mark)
    for name, why in (failed or {}).items():
        table.add_row(name, f"[red]did not run[/red]: {_short(why, 80)}", "", "", "", "", "")
    return table


def render_latencies(suite: Suite) -> Table:
    """Every latency distribution of the suite (ms)."""
    table = Table(title="latencies (ms)", title_justify="left")
    table.add_column("measurement")
    for column in ("n", "p50", "p90", "p99", "mean", "min", "max"):
        table.add_column(column, justify="right")
    for name, s in suite.latencies.items():
        table.add_row(name, str(s.n), *(f"{_ms:.2f}" for _ms in (v * 1000 for v in (
            s.p50, s.p90, s.p99, s.mean, s.min, s.max))))
    return table


def to_json(suites: Sequence[Suite], started: float) -> dict[str, Any]:
    """The JSON document of a run (seconds for latencies, as measured; ms in the rows as shown)."""
    return {
        "started_at": started,
        "suites": {
            s.name: {
                "rows": [{**asdict(r), "ratio": r.ratio} for r in s.rows],
                "latencies_s": {k: asdict(v) for k, v in s.latencies.items()},
                **s.extra,
            }
            for s in suites
        },
    }


def default_json_path(suite: str, now: float | None = None, root: Path = Path("bench/results")) -> Path:
    """``bench/results/<suite>-<UTC timestamp>.json``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return root / f"{suite}-{stamp}.json"


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
