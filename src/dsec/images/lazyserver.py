"""The node's lazy image server process: started, adopted, checked and stopped for ``NodeImages``.

One server (``python -m dsec.images.lazyfs``) per ``DSEC_HOME``, mounted at ``lazy/blobs``; its pid goes to
``lazy/lazyfs.pid`` (written whole and renamed: a reader never sees it half-written and takes a live server
for a dead one). A server is known by its *generation*, ``<pid>-<start time>``: an image mount made through
one server reads through it for as long as it lives, so a mount whose server's generation is not the
running one is dead, whatever the mount table says.

:meth:`LazyServer.alive` is cheap (a poll of a pidfd and a read of its ``/proc`` state: no read of the mount
table, no request to the server) and is what a create checks; :meth:`LazyServer.answers` sends the server
one request (a lookup of a name that does not exist) from a thread, with a timeout, and is what the daemon's
watchdog checks.
This module owns that process and its mount point; it never mounts images.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dsec.errors import SandboxError
from dsec.isolation.procs import start_time

__all__ = ["LazyServer", "alive", "fs_types", "umount"]

log = logging.getLogger(__name__)

_START_TIMEOUT = 15.0
_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def fs_types() -> dict[str, str]:
    """Mount point -> filesystem type, from this process's mount table (the top mount of each point)."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            found[fields[4].replace("\\040", " ")] = fields[sep + 1]
    return found


def umount(path: Path, detach: bool = False) -> None:
    """Unmount ``path`` (a no-op when nothing is mounted there)."""
    if _libc.umount2(os.fsencode(path), _MNT_DETACH if detach else 0) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not mounted; ENOENT: gone
            raise OSError(err, f"umount {path}: {os.strerror(err)}")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, our own child not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _zombie_status(pid: int) -> int | None:
    """The exit status of ``pid``'s exited main thread as ``Popen.returncode`` gives it (``-signal`` when
    killed), from ``/proc/PID/stat`` (its last field, a wait status); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z":
        return None
    status = int(fields[-1])
    return -(status & 0x7F) if status & 0x7F else status >> 8


class LazyServer:
    """This home's lazy blob filesystem server (see the module docstring). Not thread-safe: the caller
    (``NodeImages``) serialises :meth:`ensure` and :meth:`stop` under its lock; :meth:`alive` may be called
    from any thread."""

    def __init__(self, base: Path, log_path: Path, args: Callable[[], list[str]]) -> None:
        self.blobs_dir = base / "blobs"
        self.pid_file = base / "lazyfs.pid"
        self.log_path = log_path
        self._args = args
        self.started_here = False
        """Whether this process started the running server (a CLI stops only a server it started)."""
        self._pid = 0
        self._generation: str | None = None
        self._pidfd = -1
        self._proc: subprocess.Popen[bytes] | None = None  # the server, when this instance started it
        self._reaper: threading.Thread | None = None
        self._checked = False
        self._probe: threading.Thread | None = None
        self.unanswered = 0
        """:meth:`answers` calls in a row that the running server did not answer in time (hung, or very busy)."""
        self.restarts = 0
        """Servers this instance started after an earlier one (its own or adopted) died."""

    # ------------------------------------------------------------------ identity
    def pid(self) -> int | None:
        """Pid of this home's running server, or None. The pid file outlives its server (a reboot, a crash, a
        SIGKILL): the pid counts only while it is still this home's server, never a process that was given
        the number since (it would be signalled)."""
        try:
            pid = int(self.pid_file.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            return None
        if b"dsec.images.lazyfs" not in argv or os.fsencode(self.blobs_dir) not in argv or not alive(pid):
            return None
        return pid

    @property
    def generation(self) -> str | None:
        """``<pid>-<start time>`` of the server this instance started or adopted, while it runs; else None."""
        return self._generation if self.alive() else None

    def alive(self) -> bool:
        """Whether the server this instance knows still runs: a poll of its pidfd, then its main thread's state.
        A pidfd turns readable only once every thread has ended, and a killed server's other threads can take a
        while (under load, seconds) while its main thread is already a zombie and reads through its mount fail:
        a create in that window was handed the dead mount."""
        if self._pidfd < 0:
            return False
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return not poller.poll(0) and alive(self._pid)

    def _track(self, pid: int) -> None:
        before = self._generation
        self._forget()
        started = start_time(pid)
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            return  # gone already: alive() says so
        if start_time(pid) != started or started is None:  # the pid was reused between the two reads
            self._forget()
            return
        self._pid = pid
        self._generation = f"{pid}-{started}"
        if self._generation != before:
            self._new_probes()

    def _new_probes(self) -> None:
        """Start the hung count afresh: it belongs to one server, and a probe still stuck on a replaced one (its
        I/O never ends) would count as a miss of its successor's, which was then replaced at its first slow
        answer (all container sandboxes on its images lost), or every check while that probe stayed stuck."""
        self.unanswered = 0
        self._probe = None

    def _forget(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
        self._pidfd, self._pid, self._generation = -1, 0, None

    # ------------------------------------------------------------------ start, adopt, stop
    def ensure(self) -> str:
        """Adopt the running server or start one; returns its generation. A server that died (or a stale pid
        file, or a mount of a dead server) is replaced."""
        if self.alive() and fs_types().get(str(self.blobs_dir), "").startswith("fuse"):
            assert self._generation is not None
            return self._generation
        pid = self.pid()
        if pid is not None and fs_types().get(str(self.blobs_dir), "").startswith("fuse"):
            self._track(pid)
            if self._generation is not None:
                self._check_args(pid)
                return self._generation
        had = self._generation is not None or pid is not None
        self.stop()  # a dead server leaves a stale mount ("transport endpoint is not connected")
        self._start()
        if had:
            self.restarts += 1
        assert self._generation is not None
        return self._generation

    def _start(self) -> None:
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read, write = os.pipe()
        argv = [sys.executable, "-m", "dsec.images.lazyfs", *self._args(), "--ready-fd", str(write)]
        with open(self.log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(write,),
                                    start_new_session=True, close_fds=True)
        os.close(write)
        try:
            ready = _read_with_timeout(read, _START_TIMEOUT)
        finally:
            os.close(read)
        if not ready:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            tail = self.log_path.read_text(errors="replace")[-1500:]
            raise SandboxError(f"the lazy image filesystem did not start (see {self.log_path}): {tail}",
                               component="lazy-server")
        tmp = self.pid_file.with_name(f".{self.pid_file.name}.{secrets.token_hex(4)}")
        tmp.write_text(str(proc.pid))
        os.replace(tmp, self.pid_file)
        self.started_here = True
        self._proc = proc
        self._track(proc.pid)
        log.info("lazy image server started (pid %d)", proc.pid, extra={"component": "lazy-server"})
        # Not waited for: it outlives a daemon restart. A reaper thread keeps it from staying a zombie.
        self._reaper = threading.Thread(target=proc.wait, daemon=True, name="lazyfs-reaper")
        self._reaper.start()

    def _check_args(self, pid: int) -> None:
        """Once per instance, for an adopted server: it cannot be restarted under live sandboxes (their mounts
        read through it), so say which of this daemon's settings it does not have."""
        if self._checked:
            return
        self._checked = True
        with contextlib.suppress(OSError, ValueError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            running = argv[argv.index("dsec.images.lazyfs") + 1:]
            if "--ready-fd" in running:
                at = running.index("--ready-fd")
                del running[at:at + 2]
            if running != self._args():
                log.warning("the lazy image server %d (kept from an earlier daemon) runs with %s, not %s: settings "
                            "such as DSEC_IMAGE_STORE or DSEC_IMAGE_CACHE_MAX take effect once it is restarted "
                            "(`dsec down --destroy`, or a reboot)", pid, running, self._args())

    def stop(self) -> None:
        """Unmount the blob filesystem and end its server (SIGTERM, then SIGKILL)."""
        pid = self.pid() or (self._pid if self._pid and alive(self._pid) else None)
        # From the mount table, never a stat: on the mount of a dead server that fails (ENOTCONN).
        if fs_types().get(str(self.blobs_dir), "").startswith("fuse"):
            with contextlib.suppress(OSError):
                umount(self.blobs_dir, detach=pid is None)
        if pid is not None:
            _end(pid)
        self._forget()
        self._new_probes()
        self.pid_file.unlink(missing_ok=True)

    def death(self) -> str:
        """Why the server this instance knew stopped running (its exit status when it was this process's
        child)."""
        if not self._pid:
            return "the lazy image server is not running"
        what = f"the lazy image server (pid {self._pid})"
        if self._proc is not None and self._proc.pid == self._pid:
            if self._reaper is not None:
                self._reaper.join(2)  # it collects the exit status
            code = self._proc.returncode
            if code is None:  # its main thread ended, the others are still ending: the status is in /proc
                code = _zombie_status(self._pid)
            if code is not None and code < 0:
                return f"{what} was killed by {signal.Signals(-code).name}"
            if code is not None:
                return f"{what} exited with status {code} (see {self.log_path})"
        return f"{what} died (see {self.log_path})"

    # ------------------------------------------------------------------ probes
    def answers(self, timeout: float = 5.0) -> str | None:
        """None if the server answers a request within ``timeout`` seconds, else what is wrong. Sends one
        lookup of a name that exists nowhere (never cached by the kernel), from a thread of its own: a
        server that hangs holds that thread, not the caller."""
        if not self.alive():
            return f"the lazy image server{f' (pid {self._pid})' if self._pid else ''} is not running"
        if self._probe is not None and self._probe.is_alive():  # the last one still waits: it is not answering
            self.unanswered += 1
            return f"the lazy image server (pid {self._pid}) did not answer a lookup sent {timeout:g}+ s ago"
        probe = self.blobs_dir / f"probe-{secrets.token_hex(8)}"
        outcome: list[BaseException | None] = []

        def look() -> None:
            try:
                os.stat(probe)
                outcome.append(None)
            except FileNotFoundError:
                outcome.append(None)
            except OSError as exc:
                outcome.append(exc)

        thread = self._probe = threading.Thread(target=look, daemon=True, name="lazyfs-probe")
        thread.start()
        thread.join(timeout)
        if not outcome:
            self.unanswered += 1
            return f"the lazy image server (pid {self._pid}) did not answer a lookup within {timeout:g} s"
        self.unanswered = 0
        if outcome[0] is not None:
            return f"the lazy image server (pid {self._pid}) failed a lookup: {outcome[0]}"
        return None

    def close(self) -> None:
        """Forget the server (it keeps running)."""
        self._forget()


def _end(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.02)
    if alive(pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # stuck in the kernel (a hung NFS store): not waited for forever
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if alive(pid):
            log.error("lazy image server %d did not die of SIGKILL within 10 s (stuck in I/O?); left", pid,
                      extra={"component": "lazy-server"})


def _read_with_timeout(fd: int, timeout: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready) and os.read(fd, 1) == b"1"
