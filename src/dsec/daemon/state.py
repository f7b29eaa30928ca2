"""Durable sandbox records: one JSON file per sandbox under ``Settings.state_dir``.

Owns the on-disk format of :class:`~dsec.models.SandboxRecord` and nothing else: it never talks to
backends, never decides what a record means, and never raises on a corrupt file (a daemon that cannot
start because one record is damaged would orphan every other sandbox).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

from pydantic import ValidationError

from dsec.models import SandboxRecord

__all__ = ["StateStore"]

log = logging.getLogger(__name__)

# Ids become file names: anything else (a "/", "..") would let a record land outside the directory.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class StateStore:
    """Reads and writes sandbox records atomically in one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id) or ".." in sandbox_id:
            raise ValueError(f"not a valid sandbox id for a record file: {sandbox_id!r}")
        return self.root / f"{sandbox_id}.json"

    def save(self, record: SandboxRecord) -> None:
        """Write (or replace) a record atomically: readers see the old or the new file, never half of one."""
        path = self._path(record.id)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        data = record.model_dump_json()
        try:
            try:
                tmp.write_text(data, encoding="utf-8")
            except FileNotFoundError:  # the first record (no mkdir per save: claims write one record each)
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
                tmp.write_text(data, encoding="utf-8")
            # No fsync: records must survive a daemon SIGKILL (the page cache keeps the data and
            # os.replace is atomic for other processes), not a host crash -- after a host crash
            # every sandbox is dead anyway and cleanup_orphans reclaims what is left.
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def load(self, sandbox_id: str) -> SandboxRecord | None:
        """One record, or None if absent or unreadable."""
        path = self._path(sandbox_id)
        try:
            return SandboxRecord.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError, ValueError):
            log.exception("cannot read sandbox record %s", path)
            return None

    def load_all(self) -> list[SandboxRecord]:
        """Every readable record; corrupt files are logged and moved aside to ``*.corrupt``."""
        if not self.root.is_dir():
            return []
        records: list[SandboxRecord] = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                # Left by a daemon killed between write and replace: the old record (if any) is intact.
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            try:
                record = SandboxRecord.model_validate_json(path.read_bytes())
                if f"{record.id}.json" != path.name:
                    raise ValueError(f"record id {record.id!r} does not match its file name")
            except (OSError, ValidationError, ValueError) as exc:
                aside = path.with_name(path.name + ".corrupt")
                log.error("corrupt sandbox record %s (%s); moved to %s", path, exc, aside)
                try:
                    os.replace(path, aside)
                except OSError:
                    log.exception("cannot move corrupt record %s aside", path)
                continue
            records.append(record)
        return records

    def delete(self, sandbox_id: str) -> None:
        """Remove a record; absent records are fine."""
        self._path(sandbox_id).unlink(missing_ok=True)
