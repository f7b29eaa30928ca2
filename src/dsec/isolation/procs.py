"""Facts about host processes that the backends keep to find their own processes again."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import time

__all__ = ["SEALS", "die_with_parent", "ended", "meminfo", "read_small", "reap", "sealed_executable", "start_time"]

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
"""The seals of :func:`sealed_executable`'s copy: exactly these, which crun and runc take as "already a safe
copy of myself" (any other set, F_SEAL_EXEC added included, and they copy themselves again)."""

_MFD_EXEC = 0x0010  # linux/memfd.h (6.3+): executable even where vm.memfd_noexec defaults memfds to noexec


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """``preexec_fn`` of a helper that must never outlive the daemon (an accelerator probe, a build step): the
    kernel SIGKILLs it when its parent dies, however the parent ends (SIGKILL included). The kernel ties the
    signal to the spawning *thread*: spawn from a thread that lives as long as the helper may run. A parent
    that died before the prctl took effect has reparented the child already: it exits at once."""
    parent = os.getppid()
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def meminfo(*keys: str, path: str = "/proc/meminfo") -> dict[str, int]:
    """Fields of the host's ``/proc/meminfo``, in bytes; RuntimeError naming any that is missing."""
    found = {}
    with open(path, encoding="ascii") as f:
        for line in f:  # MemTotal, MemFree, MemAvailable... first: stop once every key is read
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0]) * 1024
                if len(found) == len(set(keys)):
                    break
    if missing := set(keys) - set(found):
        raise RuntimeError(f"no {', '.join(sorted(missing))} in {path}")
    return found


def mem_available() -> int:
    """The host's ``MemAvailable``, in bytes."""
    return meminfo("MemAvailable")["MemAvailable"]


def read_small(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of a small kernel file with a bare open/read/close, or None if it cannot be read.

    Hot-path reads (every exec checks its sandbox's init and limit counters) skip a text file object's
    four more syscalls (fstat, ioctl, lseek, a second read) per read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a live process from a recycled pid.

    None when the process is gone.
    """
    data = read_small(f"/proc/{pid}/stat", 4096)  # every container exec checks its sandbox's init this way
    if data is None:
        return None
    try:
        return data.rsplit(b")", 1)[1].split()[19].decode()
    except IndexError:
        return None


def ended(pid: int, started: str | None) -> str | None:
    """None while process ``pid`` (started at ``started``, see :func:`start_time`) runs; else how it ended:
    ``killed by SIGKILL``, ``exited with status 1`` (read without reaping it when it is this process's unreaped
    child, else just ``gone``). One read of its stat while it runs."""
    data = read_small(f"/proc/{pid}/stat", 4096)
    fields = data.rsplit(b")", 1)[1].split() if data else []
    if len(fields) < 20 or fields[19].decode() != started:
        return "gone"
    if fields[0] != b"Z":
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "gone"
    if info is None:
        return "gone"
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        import signal

        return f"killed by {signal.Signals(info.si_status).name}"
    return f"exited with status {info.si_status}"


def reap(pid: int, within: float, pending: bool = False) -> bool:
    """Reap child ``pid`` once it exits, waiting up to ``within`` seconds; True when it is gone (reaped, or not
    our child). ``pending``: it may not be our child yet (the kernel hands a dead helper's or zygote's children
    to the daemon, a child subreaper, a moment after it died), so a pid that is not ours is waited for too."""
    deadline = time.monotonic() + within
    pause = 0.001
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            if not pending:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def sealed_executable(path: str, name: str) -> int:
    """A close-on-exec fd of a sealed in-memory copy of the executable ``path`` (a memfd named ``name``),
    which nobody can write to any more, not even through ``/proc/<pid>/exe`` of a process running it.

    It is what crun and runc make of themselves at every start (against CVE-2019-5736, a container
    overwriting the host's runtime through ``/proc/self/exe``): a runtime executed from this copy finds
    itself already sealed and skips the copy and its second exec (~1 ms of CPU per run here). OSError if the
    kernel refuses (e.g. ``vm.memfd_noexec=2``) or ``path`` is no ELF binary (a script could not run from a
    close-on-exec fd: its interpreter opens it by name): the caller then runs ``path`` itself.
    """
    with open(path, "rb") as src:  # one open: the bytes checked are the bytes copied
        if os.pread(src.fileno(), 4, 0) != b"\x7fELF":
            raise OSError(errno.ENOEXEC, f"{path} is not an ELF binary")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | _MFD_EXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a kernel before 6.3: memfds are executable there anyway
                raise
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = os.fstat(src.fileno()).st_size
            copied = 0
            while copied < size:
                n = os.sendfile(fd, src.fileno(), copied, size - copied)
                if n == 0:
                    raise OSError(errno.EIO, f"{path} shrank while it was copied")
                copied += n
            os.fchmod(fd, 0o555)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
    return fd
