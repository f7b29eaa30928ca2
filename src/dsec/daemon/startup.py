"""A node daemon as seen from outside its process: how far its start has got, and which process it is.

The daemon writes its start-up phase to ``run/startup.json`` as it enters each one (and logs it at info level),
so ``dsec up`` waits as long as it makes progress and, if it stalls, names the phase. A running daemon is found
whoever started it (``dsec serve``, a unit file, ``dsec up``): through its socket (the peer credentials of the
process listening on it), then its lock (the lock file holds the pid of the process that holds the lock), and
only then ``dsec up``'s pid file.

Owns the status file and the lock file's content; must never signal or stop a process (``server`` does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.config import Settings
from dsec.isolation.procs import start_time

__all__ = ["SERVING", "Phases", "Status", "find_daemon", "is_dsec", "lock_holder", "read_status", "write_lock_owner"]

log = logging.getLogger(__name__)

SERVING = "serving"
"""The phase of a daemon that has started."""


@dataclass(frozen=True)
class Status:
    """The last phase a daemon reported."""

    pid: int
    phase: str
    since: float
    """Wall-clock time it entered the phase."""
    janitor: tuple[int, str] | None = None
    """Its janitor (pid, start time), which cleans up if it dies (:mod:`dsec.daemon.janitor`)."""


def _status_path(settings: Settings) -> Path:
    return settings.run_dir / "startup.json"


class Phases:
    """The daemon's side: ``phases("opening the audit trail")`` logs the phase and records it for ``dsec up``."""

    def __init__(self, settings: Settings, janitor: tuple[int, str] | None = None) -> None:
        self.path = _status_path(settings)
        self.janitor = janitor
        self.current = ""

    def __call__(self, what: str) -> None:
        if what == self.current:
            return
        self.current = what
        log.info("start-up phase: %s", what)
        data = {"pid": os.getpid(), "phase": what, "since": time.time(),
                "janitor": list(self.janitor) if self.janitor else None}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError as e:  # the log still has it
            log.warning("cannot record the start-up phase in %s: %s", self.path, e)

    def remove(self) -> None:
        """The daemon stops after it served: its phase no longer says anything. A start that failed keeps its
        last phase for ``dsec up`` to name (another daemon's status is left alone)."""
        if self.current != SERVING:
            return
        status = _read_status(self.path)
        if status is not None and status.pid == os.getpid():
            self.path.unlink(missing_ok=True)


def _read_status(path: Path) -> Status | None:
    try:
        data = json.loads(path.read_text())
        janitor = data.get("janitor")
        return Status(pid=int(data["pid"]), phase=str(data["phase"]), since=float(data["since"]),
                      janitor=(int(janitor[0]), str(janitor[1])) if janitor else None)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def read_status(settings: Settings) -> Status | None:
    """The phase the home's daemon last reported (None if none did)."""
    return _read_status(_status_path(settings))


def is_dsec(pid: int) -> bool:
    """Guard against a recycled pid: only a process whose command line names DSec counts."""
    try:
        return b"dsec" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _socket_peer(path: Path) -> int | None:
    """The pid of the process listening on the unix socket ``path`` (SO_PEERCRED: whoever called listen)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(str(path))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else None


def lock_holder(settings: Settings) -> tuple[str, int] | None:
    """Who holds the home's lock now, as its lock file says: ``("daemon", pid)``, or ``("janitor", pid)`` while a
    dead daemon's janitor cleans up after it; None when nobody holds it."""
    path = settings.run_dir / "daemon.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            with contextlib.suppress(OSError, ValueError):
                role, pid = os.pread(fd, 64, 0).decode().split()
                return role, int(pid)
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def find_daemon(settings: Settings) -> int | None:
    """The pid of the home's running daemon however it was started (socket, lock, then pid file), or None."""
    holder = lock_holder(settings)
    candidates = [_socket_peer(settings.socket_path) if settings.socket_path.exists() else None,
                  holder[1] if holder is not None and holder[0] == "daemon" else None]
    with contextlib.suppress(OSError, ValueError):
        candidates.append(int(settings.pid_file.read_text().strip()))
    for pid in candidates:
        if pid is not None and pid != os.getpid() and start_time(pid) is not None and is_dsec(pid):
            return pid
    return None


def write_lock_owner(fd: int, role: str) -> None:
    """Say in the lock file (open as ``fd``, its lock held) who holds it: ``role`` (daemon, janitor) and pid."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{role} {os.getpid()}\n".encode(), 0)
