"""CPU per operation by side (the bench's client, the daemon, everything under the daemon), from ``/proc``:
the figure that holds up on a shared 2-core VM, where rates and latencies follow other people's load."""

from __future__ import annotations

import os

from dsec.config import Settings

__all__ = ["CpuWindow", "daemon_pid", "host_cpu", "tree_cpu"]


def tree_cpu(root: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``root`` itself, and of its descendants with everything they
    and ``root`` reaped (the exec helper, the commands it ran); processes that vanish are skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[int]] = {}
    times: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = [int(x) for x in fields[11:15]]  # utime stime cutime cstime
    own = sum(times.get(root, [0, 0])[:2])
    rest = sum(times.get(root, [0, 0, 0, 0])[2:])
    todo = list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        rest += sum(times.get(pid, [0]))
        todo += parents.get(pid, [])
    return own / tick, rest / tick


def host_cpu() -> tuple[float, float]:
    """CPU seconds every CPU of the host has been busy since boot (user, nice, system, irq and softirq; not
    idle or iowait): kernel threads and processes outside any one tree included; and the seconds the
    hypervisor gave to other guests instead (steal)."""
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()  # "cpu" user nice system idle iowait irq softirq steal (guest in user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class CpuWindow:
    """CPU spent by this process (the bench's client), the daemon, and the daemon's helpers with the commands
    they ran, between :meth:`start` and :meth:`stop`: who pays for an exec on these two shared cores. And the
    whole host's busy time (``host``): it also holds what no tree accounts for, the kernel's worker threads
    (a network namespace's or a cgroup's teardown), a container init reparented away from the daemon, and any
    other load on the host; with the time the hypervisor took away from the host's CPUs (``steal``).

    The host is read next to this process (after the scan of ``/proc`` at the start, before it at the end):
    the daemon's window is then wider than the host's by part of two scans (a few ms in all), so the host's
    time less the client's and the daemon's errs low, never high."""

    def __init__(self, daemon_pid: int | None) -> None:
        self.daemon_pid = daemon_pid
        self.start_at = (0.0, 0.0, 0.0, 0.0, 0.0)

    def _tree(self) -> tuple[float, float]:
        return tree_cpu(self.daemon_pid) if self.daemon_pid else (0.0, 0.0)

    @staticmethod
    def _own() -> float:
        usage = os.times()
        return usage.user + usage.system

    def start(self) -> None:
        # The scan of /proc (tens of thousands of processes on a busy node) is this process's own CPU: it
        # happens before the window opens and after it closes, never inside it.
        daemon, helpers = self._tree()
        self.start_at = (self._own(), daemon, helpers, *host_cpu())

    def stop(self, calls: int) -> dict[str, float]:
        """Milliseconds of CPU per call, by side, and the number of CPUs the host has (``cpus``)."""
        own, host = self._own(), host_cpu()
        end = (own, *self._tree(), *host)
        names = ("client", "daemon", "helpers", "host", "steal")
        per_call = {f"cpu_ms_{n}": (b - a) * 1e3 / max(calls, 1)
                    for n, a, b in zip(names, self.start_at, end, strict=True)}
        return {**per_call, "cpus": os.cpu_count() or 1}


def daemon_pid(settings: Settings) -> int | None:
    try:
        return int(settings.pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
