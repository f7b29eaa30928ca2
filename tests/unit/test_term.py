"""CLI tables at 80 columns (dsec._term): never wider than the terminal, no word broken across lines, the least
useful columns left out first; and the tables of ``dsec ps``, ``top`` and ``doctor`` built with it."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from dsec import doctor
from dsec._term import Column, table

COLUMNS = (Column("ID", rank=9), Column("BACKEND", rank=8), Column("IMAGE", rank=6), Column("STATE", rank=7),
           Column("NODE", rank=1), Column("LABELS", "text", rank=5))
ROWS = [["sb-0123456789ab", "container", "debian-python", "running", "node-a",
         "team=rl-infra experiment=grpo-7 owner=someone"],
        ["sb-0123456789ac", "microvm", "debian-python", "paused", "node-b", "-"]]


def render(tbl: object, width: int) -> list[str]:
    console = Console(width=width, record=True)
    console.print(tbl)
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [60, 80, 120])
def test_no_line_is_wider_than_the_terminal_and_no_word_is_broken(width: int) -> None:
    lines = render(table(COLUMNS, ROWS, width), width)
    assert all(len(line) <= width for line in lines), lines
    shown = " ".join(lines)
    for word in {w for row in ROWS for cell in row for w in cell.split()}:
        # shown whole, or not at all (its column left out): never its head on one line and its tail on the next
        assert word in shown or word[:4] not in shown, (word, lines)
    for must in ("sb-0123456789ab", "container", "debian-python", "running"):
        assert must in shown, lines


def test_the_least_useful_columns_go_first() -> None:
    narrow = render(table(COLUMNS, ROWS, 60), 60)[0].split()
    assert narrow[:4] == ["ID", "BACKEND", "IMAGE", "STATE"] and "NODE" not in narrow
    wide = render(table(COLUMNS, ROWS, 200), 200)[0].split()
    assert wide == ["ID", "BACKEND", "IMAGE", "STATE", "NODE", "LABELS"]


def test_doctor_reads_at_80_columns() -> None:
    checks = [doctor.Check("kvm", False, "microvm and vm accelerator: TCG: KVM could not boot the guest kernel "
                           "within 8 s (no output); using TCG", "none needed: TCG works, only slower", False),
              doctor.Check("tool: crun", True, "crun version 1.8.1 (/usr/bin/crun)")]
    lines = render(doctor.table(checks, 80), 80)
    assert all(len(line) <= 80 for line in lines)
    text = " ".join(lines)
    for word in ("accelerator:", "could", "guest", "kernel", "slower", "crun", "version", "(/usr/bin/crun)"):
        assert re.search(rf"(^|\s){re.escape(word)}(\s|$)", text), (word, lines)
