"""The daemon's own log: one structured line per event, in ``$DSEC_HOME/log/dsec.log``, and reading it back.

A line is ``<time> <LEVEL> <logger>: <message>`` followed by the fields an operator filters on, as
``key=value`` (quoted when they hold spaces): ``component`` (``lazy-server``, ``mount-holder``,
``exec-helper``, ``trajectory-store`` ...), ``sandbox``, ``image``, ``error``. Starts, faults, recoveries and
refusals are logged at info level or above with those fields (``logging``'s ``extra=``), so
``dsec logs --daemon --component lazy-server`` finds them. The file is rotated at 20 MB (three kept).

This module owns the format and the file handler; it never decides what is logged.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FIELDS", "LogLine", "StructuredFormatter", "parse_line", "read_lines", "setup"]

FIELDS = ("component", "sandbox", "image", "error")
"""The structured fields a log call may carry (``extra={...}``), in the order they are written."""
_MAX_BYTES = 20 * 1024 * 1024
_LINE = re.compile(r"^(\S+ \S+) (\w+) ([\w.\-]+): (.*)$")
_FIELD = re.compile(r' (component|sandbox|image|error)=("(?:[^"\\]|\\.)*"|\S+)')


class StructuredFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> key=value ...``; tracebacks follow on their own lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        head, _, rest = text.partition("\n")
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                head += f" {name}={_quote(str(value))}"
        return head + ("\n" + rest if rest else "")


def _quote(value: str) -> str:
    value = " ".join(value.split())  # one line per event
    return json.dumps(value) if not value or any(c in value for c in ' "=\\') else value


def setup(log_file: Path, level: str = "INFO") -> None:
    """Log the daemon's records to ``log_file`` (rotated) and to stderr, in the structured format. When stderr is
    that file already (``dsec up`` sends the daemon's output there), it is written once."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    formatter = StructuredFormatter()
    for handler in list(root.handlers):  # basicConfig's or an earlier setup's
        root.removeHandler(handler)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(formatter)
    root.addHandler(stderr)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        same = os.path.samestat(os.fstat(sys.stderr.fileno()), os.stat(log_file))
    except (OSError, ValueError, AttributeError):
        same = False
    if not same:
        handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=_MAX_BYTES, backupCount=3)
        handler.setFormatter(formatter)
        root.addHandler(handler)


@dataclass
class LogLine:
    """One line of the daemon's log, parsed."""

    at: str
    level: str
    logger: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)
    more: list[str] = field(default_factory=list)
    """Lines that followed it (a traceback)."""

    def text(self) -> str:
        """The line as it was written (with what followed it)."""
        extra = "".join(f" {k}={_quote(v)}" for k, v in self.fields.items())
        return "\n".join([f"{self.at} {self.level} {self.logger}: {self.message}{extra}", *self.more])


def parse_line(text: str) -> LogLine | None:
    """A structured line, or None for anything else (a traceback's lines, a child's output)."""
    found = _LINE.match(text)
    if found is None:
        return None
    at, level, logger, rest = found.groups()
    fields: dict[str, str] = {}
    tail = rest
    for match in reversed(list(_FIELD.finditer(rest))):
        if match.end() != len(tail):
            break
        raw = match.group(2)
        fields[match.group(1)] = json.loads(raw) if raw.startswith('"') else raw
        tail = tail[:match.start()]
    return LogLine(at, level, logger, tail, dict(reversed(list(fields.items()))))


def read_lines(log_file: Path, *, follow: bool = False, poll: float = 0.5) -> Iterator[LogLine]:
    """The log's lines, oldest first (the rotated file before the current one); with ``follow``, then the new
    ones as they are written, forever. Lines that are not structured join the line before them."""
    files = [p for p in (log_file.with_name(log_file.name + ".1"), log_file) if p.exists()]
    pending: LogLine | None = None
    for path in files:
        with path.open(errors="replace") as f:
            for raw in f:
                pending, done = _join(pending, raw.rstrip("\n"))
                if done is not None:
                    yield done
    if not follow:
        if pending is not None:
            yield pending
        return
    position = log_file.stat().st_size if log_file.exists() else 0
    while True:
        if pending is not None:
            yield pending
            pending = None
        time.sleep(poll)
        try:
            size = log_file.stat().st_size
        except FileNotFoundError:
            continue
        if size < position:  # rotated
            position = 0
        with log_file.open(errors="replace") as f:
            f.seek(position)
            for raw in f:
                pending, done = _join(pending, raw.rstrip("\n"))
                if done is not None:
                    yield done
            position = f.tell()


def _join(pending: LogLine | None, raw: str) -> tuple[LogLine | None, LogLine | None]:
    """(the line now pending, a finished line to yield or None)."""
    parsed = parse_line(raw)
    if parsed is None:
        if pending is None:
            return LogLine("", "", "", raw), None
        pending.more.append(raw)
        return pending, None
    return parsed, pending
