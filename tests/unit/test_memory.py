"""``DSEC_TRACEMALLOC``: the daemon's opt-in allocation trace names what grew since its baseline."""

from __future__ import annotations

import re
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
