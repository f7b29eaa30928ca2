"""``DSEC_TRACEMALLOC``: the daemon's opt-in allocation trace names what grew since its baseline."""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import pytest

from dsec.daemon import memory

_kept: list[bytes] = []


class Kept:
    pass


_records: list[Kept] = []


def test_the_trace_names_the_site_that_grew(tmp_path: Path) -> None:
    trace = memory.MemTrace(tmp_path / "memory.txt", every=3600)
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start(memory._FRAMES)
    try:
        assert trace.look(1).startswith("== baseline at 1 s: traced ")
        _kept.extend(bytes(4096) + bytes([i % 256]) for i in range(256))  # ~1 MiB that stays
        _records.extend(Kept() for _ in range(300))  # small objects kept, one per "sandbox"
        report = trace.look(2)
    finally:
        _kept.clear()
        _records.clear()
        if not was_tracing:
            tracemalloc.stop()
    head, kinds, first = report.splitlines()[:3]
    assert re.fullmatch(r"== 2 s: traced [\d.]+ MiB, rss [\d.]+ MiB \(anon [\d.]+ MiB, file [\d.]+ MiB\), "
                        r"growth since baseline [\d.]+ MiB", head), head
    assert re.match(r"objects grown by type: .*\bKept \+300\b", kinds), kinds  # by the garbage collector's count
    assert first.startswith("+10") and "KiB (+256 blocks)" in first, report  # ~1040 KiB, the largest growth
    assert "test_memory.py" in report.split("\n+")[1]  # the site of that growth, by file and line
    assert [line[:8] for line in (tmp_path / "memory.txt").read_text().splitlines() if line.startswith("==")] \
        == ["== basel", "== 2 s: "]


def test_the_environment_asks_for_it_or_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ENV, raising=False)
    assert memory.start_from_env(tmp_path) is None
    for bad in ("often", "0"):
        monkeypatch.setenv(memory.ENV, bad)
        with pytest.raises(ValueError, match=f"DSEC_TRACEMALLOC={bad!r}"):
            memory.start_from_env(tmp_path)


def test_malloc_arenas_are_capped_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert memory.cap_malloc_arenas() is False  # the operator's choice stands
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert memory.cap_malloc_arenas() is True  # glibc (this platform's libc) took the cap


def _rss_kib() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS:")).split()[1])


def test_a_trim_returns_the_heaps_free_pages_below_its_top() -> None:
    """Blocks freed under ones still held stay resident (glibc trims only the heap's top by itself) until
    ``malloc_trim``: what the daemon's trim thread calls every minute."""
    blocks = [bytearray(2000) for _ in range(40_000)]  # ~80 MiB of glibc malloc (above pymalloc's 512 B)
    kept = blocks[::16]  # one block in 16 stays: every page's neighbours free, the heap's top held
    del blocks
    before = _rss_kib()
    took = time.perf_counter()
    assert memory.malloc_trim() is True
    took = time.perf_counter() - took
    after = _rss_kib()
    assert before - after > 40 * 1024, (before, after)  # most of the ~75 MiB freed goes back to the kernel
    assert len(kept) == 2500 and took < 1.0, took


def test_the_trim_thread_runs_until_stopped_and_the_environment_can_turn_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    trim = memory.HeapTrim(0.01, lambda: calls.append(time.monotonic()) is None).start()
    deadline = time.monotonic() + 30
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    trim.stop()
    stopped = len(calls)
    time.sleep(0.05)
    assert stopped >= 3 and len(calls) == stopped == trim.trims
    monkeypatch.setenv(memory.TRIM_ENV, "0")
    assert memory.trim_from_env() is None
    for bad in ("often", "-1"):
        monkeypatch.setenv(memory.TRIM_ENV, bad)
        with pytest.raises(ValueError, match=f"DSEC_MALLOC_TRIM={bad!r}"):
            memory.trim_from_env()
    monkeypatch.delenv(memory.TRIM_ENV)
    started = memory.trim_from_env()  # glibc: on by default, every minute
    assert started is not None and started.every == memory.TRIM_EVERY
    started.stop()
