"""``dsec demo``: one agent-style rollout per available backend, through the public SDK only.

The rollout is what an RL coding episode does: put buggy code and its test in a fresh sandbox, run the
test (it fails), apply a fix by writing a file, run the test again (it passes), close the sandbox. The
demo owns only this script and its printout; it must never reach past ``dsec``'s public API, so it
doubles as an end-to-end check of SDK + daemon + backend on a freshly set-up host.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

import dsec

__all__ = ["IMAGE", "Rollout", "rollout", "run"]

IMAGE = "debian-python"
"""The one image of every rollout, on all four backends: the vm backend boots a disk derived from it
(``scripts/setup`` derives it; the first vm create boots it and saves its template, a minute or more under
TCG)."""

BUGGY = '''\
def mean(values):
    """Arithmetic mean of a non-empty list."""
    return sum(values) / (len(values) + 1)
'''

FIXED = '''\
def mean(values):
    """Arithmetic mean of a non-empty list."""
    return sum(values) / len(values)
'''

TEST = '''\
import unittest

from stats import mean


class MeanTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)


if __name__ == "__main__":
    unittest.main()
'''


@dataclass
class Rollout:
    """What happened on one backend."""

    backend: str
    steps: list[tuple[str, float, str]] = field(default_factory=list)
    """(step, seconds, outcome) in order."""
    before: int | None = None
    """Exit code of the test before the fix."""
    after: int | None = None
    """Exit code of the test after the fix."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the test went from failing to passing."""
        return self.error is None and self.before not in (None, 0) and self.after == 0


async def rollout(backend: str, client: dsec.Client, console: Console) -> Rollout:
    """Run the fail -> fix -> pass episode on one backend."""
    result = Rollout(backend)

    def step(name: str, started: float, outcome: str) -> None:
        result.steps.append((name, time.perf_counter() - started, outcome))

    t = time.perf_counter()
    async with await dsec.AsyncSandbox.create(image=IMAGE, backend=backend, client=client) as sb:
        step("create sandbox", t, sb.id)
        t = time.perf_counter()
        await sb.files.write("/workspace/stats.py", BUGGY)
        await sb.files.write("/workspace/test_stats.py", TEST)
        step("write code + test", t, "2 files")

        t = time.perf_counter()
        first = await sb.exec("python3 test_stats.py", timeout=60)
        result.before = first.exit_code
        step("run test", t, f"exit {first.exit_code} ({'fails as expected' if not first.ok else 'passed?!'})")
        console.print(f"[dim]{backend}: test output before the fix:[/dim]")
        console.print(first.stderr.decode(errors="replace").rstrip(), markup=False, highlight=False)

        t = time.perf_counter()
        await sb.files.write("/workspace/stats.py", FIXED)
        step("apply fix", t, "stats.py rewritten")

        t = time.perf_counter()
        second = await sb.exec("python3 test_stats.py", timeout=60)
        result.after = second.exit_code
        step("run test again", t, f"exit {second.exit_code} ({'passes' if second.ok else 'still fails'})")
        t = time.perf_counter()
    step("close sandbox", t, "destroyed")
    return result


def _usable(status: str) -> bool:
    return status == "ok" or status.startswith("pending:")


async def _main(backends: Sequence[str] | None, console: Console) -> list[Rollout]:
    async with dsec.Client() as client:
        if backends is None:
            health = await client.health()
            # a pending backend is usable: its creates wait for what it still decides (KVM or TCG)
            backends = [name for name, status in sorted(health.backends.items()) if _usable(status)]
            skipped = {n: s for n, s in health.backends.items() if not _usable(s)}
            for name, why in sorted(skipped.items()):
                console.print(f"[yellow]skipping backend {name}: {why}[/yellow]")
        results = []
        for backend in backends:
            try:
                results.append(await rollout(backend, client, console))
            except dsec.DSecError as exc:
                results.append(Rollout(backend, error=f"{type(exc).__name__}: {exc.message}"))
        return results


def _summary(results: list[Rollout]) -> Table:
    table = Table(title="dsec demo: fail -> fix -> pass", header_style="bold")
    for column in ("backend", "step", "time", "outcome"):
        table.add_column(column)
    for r in results:
        if r.error:
            table.add_row(r.backend, "[red]error[/red]", "", r.error)
        for name, seconds, outcome in r.steps:
            table.add_row(r.backend, name, f"{seconds * 1000:.0f} ms", outcome)
        verdict = "[green]fail -> pass[/green]" if r.ok else "[red]did not go fail -> pass[/red]"
        total = sum(s for _, s, _ in r.steps)
        table.add_row(r.backend, "[bold]rollout[/bold]", f"{total * 1000:.0f} ms", verdict, end_section=True)
    return table


def run(backends: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Run the demo on ``backends`` (default: every backend the daemon reports as ok); 0 on success."""
    console = console or Console()
    results = asyncio.run(_main(backends, console))
    if not results:
        console.print("[red]error: the daemon reports no usable backend; run `dsec doctor`[/red]")
        return 1
    console.print(_summary(results))
    return 0 if all(r.ok for r in results) else 1
