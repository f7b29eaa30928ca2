"""The daemon's memory: glibc's malloc arenas capped, and an opt-in trace of what grows over a long life.

The daemon's threads (the event loop, the default executor's, the stores' writers) would each get a malloc
arena of their own (up to 8 per core): freed memory stays spread over them, and the RSS of a daemon under a
steady load climbs for minutes before it levels. :func:`cap_malloc_arenas` caps them at
:data:`ARENAS` (what ``MALLOC_ARENA_MAX`` would, unless the operator set that). Within an arena, pages freed
below its top stay resident until glibc is asked for them back: :class:`HeapTrim` calls ``malloc_trim`` every
``DSEC_MALLOC_TRIM`` seconds (default :data:`TRIM_EVERY`; 0: never), so the daemon's RSS follows what it holds
rather than its churn's high-water mark.

``DSEC_TRACEMALLOC=SECONDS`` (in the daemon's environment) starts :mod:`tracemalloc` and, every SECONDS,
appends to ``memtrace-<pid>.txt`` (in ``DSEC_TRACEMALLOC_DIR``, by default the home's ``run/``) the allocation
sites that grew most since the first look (taken one period after the start, so the warm-up's imports and
caches are the baseline, not the growth), with the process's RSS (its anonymous and file-backed parts, from
``smaps_rollup``) beside the traced total -- the gap between the two is the allocator's (arenas,
fragmentation) and C libraries', not Python objects' -- and the object types the garbage collector tracks
whose count grew most (a record kept per sandbox shows as its class, however small).

Owns the arena cap, the heap trim thread, and the trace thread and its file; the trace must never run unless
asked (tracing slows every allocation).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import linecache
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

__all__ = ["ARENAS", "ENV", "TRIM_ENV", "TRIM_EVERY", "HeapTrim", "MemTrace", "cap_malloc_arenas", "malloc_trim",
           "start_from_env", "trim_from_env"]

ENV = "DSEC_TRACEMALLOC"
TRIM_ENV = "DSEC_MALLOC_TRIM"
TRIM_EVERY = 60.0
"""Seconds between two returns of the heap's free pages to the kernel (a trim that frees 75 MiB takes ~10 ms,
one that finds little to free ~2 ms; the GIL is not held meanwhile)."""
ARENAS = 2
"""malloc arenas the daemon's threads share."""
_M_ARENA_MAX = -8
"""mallopt's parameter number for the arena cap (glibc's malloc.h)."""
_FRAMES = 12
_TOP = 25


class MemTrace:
    """Snapshots every ``every`` seconds, each compared with the first; stopped by :meth:`stop`."""

    def __init__(self, out: Path, every: float) -> None:
        self.out = out
        self.every = every
        self._stop = threading.Event()
        self._base: tracemalloc.Snapshot | None = None
        self._base_types: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="dsec-memtrace", daemon=True)

    def start(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(_FRAMES)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every):
            with contextlib.suppress(OSError):
                self.look(time.monotonic() - started)

    def look(self, age: float) -> str:
        """Compare now with the baseline (taking it on the first call); the report is appended to the file."""
        snap = _filtered(tracemalloc.take_snapshot())
        types = _types()
        if self._base is None:
            self._base, self._base_types = snap, types
            text = f"== baseline at {age:.0f} s: traced {_mib(tracemalloc.get_traced_memory()[0])}, rss {_rss()}\n"
        else:
            stats = snap.compare_to(self._base, "traceback")
            traced = tracemalloc.get_traced_memory()[0]
            lines = [f"== {age:.0f} s: traced {_mib(traced)}, rss {_rss()}, growth since baseline "
                     f"{_mib(sum(s.size_diff for s in stats))}"]
            grown = sorted(((n - self._base_types[t], t) for t, n in types.items() if n > self._base_types[t]),
                           reverse=True)[:_TOP]
            lines.append("objects grown by type: " + (", ".join(f"{t} {d:+d}" for d, t in grown) or "none"))
            for stat in stats[:_TOP]:
                lines.append(f"{stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks), now "
                             f"{stat.size / 1024:.1f} KiB")
                lines += [f"    {frame}" for frame in stat.traceback.format()[-2 * _FRAMES:]]
            text = "\n".join(lines) + "\n"
        with self.out.open("a") as f:
            f.write(text)
        return text


def _filtered(snap: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    # the trace's own cost (the snapshots, the source lines its reports read) is not the daemon's growth
    return snap.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__),
                               tracemalloc.Filter(False, __file__, all_frames=True),
                               tracemalloc.Filter(False, linecache.__file__),
                               tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _types() -> collections.Counter[str]:
    """Objects the garbage collector tracks, by type name."""
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def _rss() -> str:
    """The process's RSS, with its anonymous part (the heap) and the rest (mapped files, shared memory)."""
    kib: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            kib[key] = int(value.split()[0])
    if "Rss" not in kib:
        return "?"
    anon = kib.get("Anonymous", 0)
    return f"{_mib(kib['Rss'] * 1024)} (anon {_mib(anon * 1024)}, file {_mib((kib['Rss'] - anon) * 1024)})"


def start_from_env(run_dir: Path) -> MemTrace | None:
    """The trace the environment asks for, started; None when it asks for none."""
    every = os.environ.get(ENV, "").strip()
    if not every:
        return None
    try:
        seconds = float(every)
    except ValueError:
        raise ValueError(f"{ENV}={every!r} is not a number of seconds (e.g. {ENV}=60)") from None
    if seconds <= 0:
        raise ValueError(f"{ENV}={every!r} must be a positive number of seconds")
    out = Path(os.environ.get(f"{ENV}_DIR") or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = MemTrace(out / f"memtrace-{os.getpid()}.txt", seconds)
    trace.start()
    return trace


def cap_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas at :data:`ARENAS` unless ``MALLOC_ARENA_MAX`` is set; True if capped (False
    too on a libc without ``mallopt``, e.g. musl, whose allocator has no per-thread arenas)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, ARENAS))


class HeapTrim:
    """Calls ``trim`` every ``every`` seconds in a thread of its own until :meth:`stop`."""

    def __init__(self, every: float, trim: Callable[[], bool]) -> None:
        self.every = every
        self.trim = trim
        self.trims = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-heap-trim", daemon=True)

    def start(self) -> HeapTrim:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.trim()
            self.trims += 1


def malloc_trim() -> bool:
    """Return the malloc heap's free pages to the kernel (glibc); True if any were. False on a libc without it."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))  # ctypes releases the GIL meanwhile: the daemon's threads go on


def trim_from_env() -> HeapTrim | None:
    """The heap trim the environment asks for (every :data:`TRIM_EVERY` s unless ``DSEC_MALLOC_TRIM`` says
    otherwise), started; None when it is turned off (0) or the libc has no ``malloc_trim``."""
    raw = os.environ.get(TRIM_ENV, "").strip()
    try:
        every = float(raw) if raw else TRIM_EVERY
    except ValueError:
        raise ValueError(f"{TRIM_ENV}={raw!r} is not a number of seconds (e.g. {TRIM_ENV}=60; 0 turns it off)") \
            from None
    if every < 0:
        raise ValueError(f"{TRIM_ENV}={raw!r} must be a number of seconds, 0 or more (0 turns it off)")
    try:
        ctypes.CDLL(None).malloc_trim  # noqa: B018 -- present or not: musl has none
    except (OSError, AttributeError):
        return None
    return HeapTrim(every, malloc_trim).start() if every > 0 else None
