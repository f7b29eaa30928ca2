"""The janitor's hand-over of the home's lock from a dying daemon (:mod:`dsec.daemon.janitor`)."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from dsec.config import Settings
from dsec.daemon import janitor
from dsec.daemon.startup import write_lock_owner


def held_by(settings: Settings, role: str) -> int:
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(settings.run_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    write_lock_owner(fd, role)
    return fd


def test_the_dying_daemons_lock_is_waited_for(tmp_path: Path) -> None:
    """End-of-file on the pipe can come before the dead daemon's lock is released: the lock file still names it,
    and the janitor must wait for it rather than take it for a new daemon and leave everything behind."""
    settings = Settings(home=tmp_path)
    fd = held_by(settings, "daemon")  # names this process: the "dead" daemon of the test
    releaser = threading.Timer(0.3, os.close, (fd,))
    releaser.start()
    lock = janitor._lock(settings, dead=os.getpid())
    releaser.join()
    assert lock is not None
    assert (settings.run_dir / "daemon.lock").read_text().split() == ["janitor", str(os.getpid())]
    os.close(lock)


def test_a_new_daemon_holding_the_lock_sends_the_janitor_away(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    fd = held_by(settings, "daemon")
    try:
        assert janitor._lock(settings, dead=os.getpid() + 1) is None
    finally:
        os.close(fd)
