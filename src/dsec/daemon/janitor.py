"""The daemon's janitor: a small process that outlives its daemon only to clean up after a crash.

A daemon that is SIGKILLed or crashes runs none of its own cleanup. Most of what it started dies with it by
itself (``PR_SET_PDEATHSIG``: the exec helper, zygotes, the accelerator probe's QEMU), and sandboxes are meant
to outlive it (the next daemon re-adopts them). Two helpers serve those sandboxes and so outlive a daemon on
purpose: the container backend's mount holder, and the lazy image server with the image mounts it serves.
With no sandbox left, nothing would ever end them; the janitor does.

The daemon starts it with the read end of a pipe whose write end only the daemon holds (close-on-exec). It
writes ``clean`` before it exits by itself (its own close released everything); end-of-file without it means
the daemon died. The janitor then takes the home's lock (a new daemon that took it first cleans up by itself:
the janitor leaves), ends what nobody will re-adopt (the QEMU of a template boot or of a create the daemon left
unfinished), and if the home holds no sandbox record, ends the mount holder, unmounts the images, stops the lazy
image server and removes the directories and cgroups the daemon's own close would have removed. A running or
paused sandbox and what it needs are never touched: the next daemon re-adopts them.

This module owns that cleanup and the janitor's process; it must never touch a home whose lock another
process holds, nor anything of a sandbox that has a record.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import logging
import os
import subprocess
import sys
import time
from typing import get_args

from dsec.config import Settings
from dsec.daemon.startup import lock_holder, write_lock_owner
from dsec.isolation.procs import start_time
from dsec.models import BackendName

__all__ = ["CLEAN", "Janitor", "clean_up", "main"]

log = logging.getLogger("dsec.daemon.janitor")

CLEAN = b"clean"
"""What the daemon writes when it closed down by itself."""
LOCK_WAIT_SECONDS = 30.0
"""How long the janitor waits for the home's lock (a dying daemon releases it at once)."""


class Janitor:
    """The daemon's side: start it, and tell it the daemon closed down by itself."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.start_time = start_time(proc.pid) or ""
        self._pipe = pipe

    @classmethod
    def spawn(cls, settings: Settings) -> Janitor:
        read, write = os.pipe2(os.O_CLOEXEC)
        env = dict(os.environ, DSEC_HOME=str(settings.home), DSEC_IMAGES=str(settings.images))
        try:
            # Its own session: a terminal's ^C to the daemon's process group must not end it with the daemon.
            # Its output goes where the daemon's does (the log file under `dsec up`).
            proc = subprocess.Popen([sys.executable, "-m", "dsec.daemon.janitor", "--fd", str(read),
                                     "--daemon", str(os.getpid())],
                                    stdin=subprocess.DEVNULL, pass_fds=(read,), env=env, start_new_session=True,
                                    cwd="/")
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        return cls(proc, write)

    def release(self, timeout: float = 10.0) -> None:
        """The daemon closed down by itself: the janitor has nothing to do and exits."""
        if self._pipe >= 0:
            with contextlib.suppress(OSError):
                os.write(self._pipe, CLEAN)
            os.close(self._pipe)
            self._pipe = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the janitor (pid %d) did not exit within %g s", self.pid, timeout)


def _lock(settings: Settings, dead: int) -> int | None:
    """The home's lock, once the dead daemon (pid ``dead``) released it; None if a new daemon took it first.

    The pipe's end-of-file can come before the dying daemon's lock is released (its files close one by one), so
    the lock file naming the dead daemon means "wait", not "a new daemon runs here"."""
    fd = os.open(settings.run_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_lock_owner(fd, "janitor")
            return fd
        except BlockingIOError:
            holder = lock_holder(settings)
            if (holder is not None and holder[0] == "daemon" and holder[1] != dead) or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def clean_up(settings: Settings) -> list[str]:
    """For a daemon that died: end what nobody will re-adopt (the unfinished creates' QEMUs), and with no sandbox
    record left, what its own close releases; returns what was done. Call with the home's lock held."""
    from dsec.daemon.node_backends import backend_class
    from dsec.daemon.state import StateStore

    records = StateStore.peek(settings.state_db) if settings.state_db.exists() else {}
    live = {r.id for r in records.values() if r.state in ("running", "paused")}
    done = []
    for name in get_args(BackendName):
        module, cls_name = backend_class(name)
        try:
            backend = getattr(importlib.import_module(module), cls_name)(settings)
            done += [f"{name}: {what}" for what in backend.release_host(live)]
        except Exception as exc:  # one backend's leftovers must not keep the others'
            done.append(f"{name}: cleanup failed: {type(exc).__name__}: {exc}")
    if records:
        return [*done, f"{len(records)} sandbox record(s) left for the next daemon: the helpers they need stay"]
    if (settings.home / "lazy").exists():
        from dsec.images.node import NodeImages

        try:
            NodeImages(settings).aclose_sync(unmount=True)
            done.append("image mounts and the lazy image server removed")
        except Exception as exc:
            done.append(f"images: cleanup failed: {type(exc).__name__}: {exc}")
    for path in (settings.socket_path, settings.pid_file, settings.run_dir / "startup.json"):
        if path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)
            done.append(f"removed {path}")
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.daemon.janitor --fd N --daemon PID``: wait for its daemon, clean up if it died."""
    parser = argparse.ArgumentParser(prog="python -m dsec.daemon.janitor")
    parser.add_argument("--fd", type=int, required=True, help="read end of the daemon's pipe")
    parser.add_argument("--daemon", type=int, required=True, help="the pid of the daemon that started it")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    said = b""
    while chunk := os.read(args.fd, 64):
        said += chunk
    os.close(args.fd)
    if said == CLEAN:
        return 0
    settings = Settings()
    lock = _lock(settings, args.daemon)
    if lock is None:
        log.info("the daemon of %s died; a new daemon runs there, nothing to clean up", settings.home)
        return 0
    try:
        done = clean_up(settings)
    finally:
        os.close(lock)
    log.info("the daemon of %s died; cleaned up after it: %s", settings.home, "; ".join(done) or "nothing left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
