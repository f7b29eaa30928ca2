"""The soak's invariants while it runs: what one node's home holds on the host, sandbox by sandbox, and the
census that turns it into leaks, wedged images and the daemon's memory curve.

A node's footprint is read from the host, as an operator would: mounts (``/proc/self/mountinfo``), cgroups
(``dsec-<tag>*`` in each cgroup tree), container state directories (``/dev/shm/dsec-<tag>``), microvm network
namespaces (``/run/netns/dsvm-<tag>-*``) and processes (in the home's cgroups, QEMU naming the home's run
directory, servers naming the home on their command line). Whatever names a sandbox id is that sandbox's; the
rest is the home's own (the lazy server, the mount holder, image mounts).

Owns reading the host and judging it against what the daemon lists; must never change anything it reads (it
runs beside the daemon under test) nor look inside the daemon's process.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.qemu.backend import home_tag
from dsec.config import Settings

__all__ = ["JUDGED_AFTER", "WARM_S", "Census", "Item", "Life", "footprint", "lives_note", "worst_life"]

_SANDBOX = re.compile(r"sb-[0-9a-f]{12}")
_PERSIST = 3
"""Censuses in a row a sandbox's resource must outlive the sandbox before it counts as a leak (creates and
destroys in flight hold resources the daemon does not list yet, or any more)."""
JUDGED_AFTER = 600.0
"""Seconds a daemon life's warm part (past :data:`WARM_S` of its age) must span for its RSS slope to be judged
(a shorter life's is only reported)."""
WARM_S = 300.0
"""Seconds of a daemon process's age before its RSS counts towards growth: its first minutes fill what is
meant to fill (the imports' lazy parts, the event history, the allocator's heap up to the load's peak
concurrency); what it gains after that is judged."""


@dataclass(frozen=True, order=True)
class Item:
    """One host resource of the home: ``kind`` (mount, cgroup, state, netns, process), what names it, and the
    sandbox it belongs to (None: the home's own)."""

    kind: str
    name: str
    sandbox: str | None


def _owner(text: str) -> str | None:
    found = _SANDBOX.search(text)
    return found.group(0) if found else None


def footprint(settings: Settings) -> set[Item]:
    """Every host resource of ``settings``' home now (pid-keyed names: a restarted server is a new item)."""
    tag, home = home_tag(settings), str(settings.home.resolve())
    found: set[Item] = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(f"/run/dsec/{tag}/") or point.startswith(home + "/"):
            found.add(Item("mount", point, _owner(point)))
    root = Path("/sys/fs/cgroup")  # v2: the unified tree; v1: one tree per controller
    for parent in [*root.glob(f"dsec-{tag}*"), *root.glob(f"*/dsec-{tag}*")]:
        with contextlib.suppress(OSError):  # a cgroup removed while it is walked
            for cg in [parent, *parent.rglob("*")]:
                if cg.is_dir() and not cg.is_symlink():
                    found.add(Item("cgroup", str(cg), _owner(cg.name)))
    with contextlib.suppress(OSError):
        for state in Path("/dev/shm").glob(f"dsec-{tag}/*/sb-*"):
            found.add(Item("state", str(state), _owner(state.name)))
    with contextlib.suppress(OSError):
        for netns in Path("/run/netns").glob(f"dsvm-{tag}-*"):
            found.add(Item("netns", netns.name, _owner(netns.name)))
    found |= _processes(tag, home)
    return found


def _processes(tag: str, home: str) -> set[Item]:
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie holds nothing: it waits for whichever pid 1 adopted it
            comm = (proc / "comm").read_text().strip()
            cgroups = (proc / "cgroup").read_text()
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            name = f"{comm} pid {proc.name}"
            if f"/dsec-{tag}/" in cgroups or f"/dsec-{tag}-fn/" in cgroups:
                found.add(Item("process", name, _owner(cgroups)))
            elif f"/run/dsec-vm/{tag}/" in argv:  # a microvm's QEMU (its cgroup may be the home's)
                found.add(Item("process", name, _owner(argv)))
            elif home in argv or (comm == "dsec-mntns" and f" {tag}" in argv):
                found.add(Item("process", name, None))  # the home's servers: lazy server, mount holder
    return found


@dataclass
class Census:
    """Periodic looks at the node: sandbox resources outliving their sandbox, images not ``ok`` for longer
    than ``wedged_after`` seconds, and the daemon's RSS (sampled per daemon process)."""

    settings: Settings
    wedged_after: float
    leaks: dict[str, str] = field(default_factory=dict)
    """Leaked resource -> the sandbox it belonged to, seen outliving it for :data:`_PERSIST` censuses."""
    wedged: dict[str, str] = field(default_factory=dict)
    """Image component -> its error, for images stuck not ``ok``."""
    rss: list[tuple[float, int, float, float]] = field(default_factory=list)
    """(seconds since the census began, daemon pid, MiB, the daemon's age in seconds)."""
    looks: int = 0
    _strikes: dict[Item, int] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic)

    def look(self, listed: set[str], components: list[tuple[str, str, float, str | None]], pid: int,
             rss_mib: float | None, age_s: float | None = None) -> None:
        """One census: ``listed`` the sandbox ids the daemon lists now, ``components`` its health (name, state,
        since, error); ``rss_mib`` the daemon's resident memory and ``age_s`` how long its process has lived
        (None: unknown, no sample)."""
        self.looks += 1
        orphans = {item for item in footprint(self.settings) if item.sandbox and item.sandbox not in listed}
        self._strikes = {item: self._strikes.get(item, 0) + 1 for item in orphans}
        for item, strikes in self._strikes.items():
            if strikes >= _PERSIST and item.sandbox:
                self.leaks.setdefault(f"{item.kind} {item.name}", item.sandbox)
        now = time.time()
        for name, state, since, error in components:
            if name.startswith("image:") and state != "ok" and now - since > self.wedged_after:
                self.wedged.setdefault(name, f"{state} for {now - since:.0f} s: {error}")
        if rss_mib is not None and age_s is not None:
            self.rss.append((round(time.monotonic() - self._t0, 1), pid, rss_mib, round(age_s, 1)))

    def lives(self, judged_after: float) -> list[Life]:
        """The RSS curve of each daemon process sampled, in the order they lived; a life is judged when its
        warm part (samples past :data:`WARM_S` of its age) spans at least ``judged_after`` seconds."""
        found = []
        for pid in dict.fromkeys(p for _, p, _, _ in self.rss):
            mine = [(age, mib) for _, p, mib, age in self.rss if p == pid]
            warm = [(age, mib) for age, mib in mine if age >= WARM_S]
            span = warm[-1][0] - warm[0][0] if len(warm) >= 2 else 0.0
            found.append(Life(pid=pid, lived_s=round(mine[-1][0], 1), samples=len(mine), warm_s=round(span, 1),
                              rss_first_mib=mine[0][1], rss_warm_mib=warm[0][1] if warm else None,
                              rss_last_mib=mine[-1][1], slope_mib_per_h=_slope(warm),
                              judged=span >= judged_after and _slope(warm) is not None))
        return found


@dataclass(frozen=True)
class Life:
    """One daemon process's RSS over its life, as the census sampled it (MiB; seconds of its age)."""

    pid: int
    lived_s: float
    """Its age at the last sample."""
    samples: int
    warm_s: float
    """Seconds its warm samples (age past :data:`WARM_S`) span."""
    rss_first_mib: float
    rss_warm_mib: float | None
    """At its first warm sample."""
    rss_last_mib: float
    slope_mib_per_h: float | None
    """The least-squares slope of RSS over age through its warm samples (None with fewer than three)."""
    judged: bool


def _slope(points: list[tuple[float, float]]) -> float | None:
    """MiB per hour: the least-squares line through ``(seconds, MiB)`` points (a start -> end difference would
    turn on two samples' noise: a heap trimmed, a burst in flight)."""
    if len(points) < 3 or points[-1][0] - points[0][0] <= 0:
        return None
    return statistics.linear_regression([t for t, _ in points], [m for _, m in points]).slope * 3600


def worst_life(lives: list[Life]) -> Life | None:
    """The life whose warm RSS slope is steepest: among the judged ones, else among those with a slope."""
    for pool in ([x for x in lives if x.judged], [x for x in lives if x.slope_mib_per_h is not None]):
        if pool:
            return max(pool, key=lambda x: x.slope_mib_per_h or 0.0)
    return None


def lives_note(lives: list[dict[str, Any]]) -> str:
    """The report's note on the RSS row: how many lives were judged, over how long, and each one's slope."""
    judged = [x for x in lives if x["judged"]]
    if not judged:
        return f"{len(lives)} daemon li{'fe' if len(lives) == 1 else 'ves'}, none warm for {JUDGED_AFTER:g} s"
    slopes = ", ".join(f"{x['slope_mib_per_h']:.1f}" for x in judged)
    warm = min(x["warm_s"] for x in judged) / 60
    return f"{len(judged)} of {len(lives)} daemon lives judged (each warm {warm:.0f}+ min): {slopes} MiB/h"
