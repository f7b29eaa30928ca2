"""Tables for the CLI that read on an 80-column terminal.

A cell never breaks inside a word (``conta`` / ``iner``): short values (ids, names, numbers, states, times) stay
on one line, free text (labels, sources, details) wraps at spaces in a column at least :data:`_TEXT_MIN` wide
(only a longer token, a path or a digest, is folded). When the columns do not fit the terminal,
the least useful ones are left out (``--json``, or a wider terminal, shows everything) rather than every cell
cut short. The table is never wider than the terminal: a line wider than the terminal is broken by the
terminal itself, anywhere. Written to a pipe or a file, nothing wraps: tables are wide there.

Owns the column kinds, the fitting and the console the CLI's tables print on; it must never hold a command's
logic.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "console", "table"]

_GAP = 2
"""Spaces between two columns (rich's default padding of one on each side)."""
_TEXT_MIN = 16
"""Narrowest a free-text column is squeezed to before columns are left out."""


@dataclass(frozen=True)
class Column:
    """One column: its header, whether it is a short value (``key``) or free text (``text``), and how much it is
    wanted: when the terminal is too narrow, columns of the lowest ``rank`` go first (ties: the rightmost)."""

    header: str
    kind: Literal["key", "text"] = "key"
    rank: int = 0


def _plain(cell: str) -> str:
    return Text.from_markup(cell).plain


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, title: str | None = None) -> Table:
    """A borderless table of ``rows`` (rich markup, already escaped) that fits ``width`` columns."""
    natural = [max([len(c.header), *(max((len(line) for line in _plain(r[i]).splitlines()), default=0)
                                     for r in rows)]) for i, c in enumerate(columns)]

    def need(i: int) -> int:
        return natural[i] if columns[i].kind == "key" else min(natural[i], max(_TEXT_MIN, len(columns[i].header)))

    kept = list(range(len(columns)))
    while len(kept) > 1 and sum(need(i) for i in kept) + _GAP * (len(kept) - 1) > width:
        kept.remove(min(kept, key=lambda i: (columns[i].rank, -i)))
    out = Table(box=None, header_style="bold", title=title, pad_edge=False)
    for i in kept:
        if columns[i].kind == "key":
            out.add_column(columns[i].header, no_wrap=True, overflow="ellipsis")
        else:
            # wrapped at spaces; only a token longer than the column (a path, a digest) is folded
            out.add_column(columns[i].header, overflow="fold", min_width=need(i))
    for row in rows:
        out.add_row(*(row[i] for i in kept))
    return out


_PIPE_WIDTH = 200
"""Width of tables written to a pipe or a file (nothing wraps them there: every column is kept)."""


def console(stderr: bool = False) -> Console:
    """A console as wide as the terminal (or ``COLUMNS``); :data:`_PIPE_WIDTH` when the output is no terminal."""
    out = Console(stderr=stderr, highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, highlight=False, width=_PIPE_WIDTH)
    return out
