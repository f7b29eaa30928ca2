"""Housekeeping CPUs: the node's control path on CPUs of its own, the sandboxes on all of the node's.

With ``DSEC_CONTROL_CPUS`` set (a CPU list such as ``0`` or ``0-1,8``) the daemon pins every thread of its
process to those CPUs when it starts (:func:`pin_control`). Whatever it spawns inherits that mask: the exec
helper, the zygotes and crun stay on the housekeeping CPUs, which is the point (an exec's hops between the
client, the daemon, the helper and the command then wake each other on one CPU instead of waiting for a
busy one to notice, see docs/design/pools.md, "Busy vCPUs wake late"). What runs a sandbox's own work gets the node's
CPUs back as it starts, i.e. the mask the daemon had before it pinned itself (an operator's ``taskset`` of
the daemon is kept): ``dsec-nsenter`` and the zygote's call child set it just before they exec the command,
and QEMU sets it before it execs (its vCPU threads inherit it). A command still starts on the housekeeping
CPU it was spawned on and moves only when the scheduler balances it: a short one starts and ends there.

Without the option nothing here runs and nothing resets a mask: every process keeps the one it inherited.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["MAX_CPUS", "control_cpus", "cpu_list", "hex_mask", "node_cpus", "parse_cpu_list", "pin_control", "release",
           "sandbox_cpus"]

_lock = threading.Lock()
_sandbox_cpus: frozenset[int] | None = None
"""The node's CPUs while this process's control path is pinned (the mask it had before), else None."""


MAX_CPUS = 8192
"""Linux's largest NR_CPUS: no CPU number reaches it (checked before a range is expanded)."""


def parse_cpu_list(text: str, what: str = "DSEC_CONTROL_CPUS") -> frozenset[int]:
    """CPUs of a list in the kernel's format (``0``, ``0-3``, ``0,2-3``); ``ValueError`` names ``what``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, sep, high = part.partition("-")
        try:
            first = int(low, 10)
            last = int(high, 10) if sep else first
        except ValueError:
            raise ValueError(f"{what}={text!r}: {part!r} is not a CPU number or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"{what}={text!r}: {part!r} is not a CPU number or a range like 0-3")
        if last >= MAX_CPUS:
            raise ValueError(f"{what}={text!r}: CPU {last} is beyond any machine's ({MAX_CPUS} at most)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The kernel's list format of ``cpus`` (``0-3,8``), as ``Cpus_allowed_list`` prints it."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def hex_mask(cpus: frozenset[int] | None) -> str:
    """``cpus`` as the hexadecimal mask ``dsec-nsenter`` and ``dsec-zygote`` take, ``-`` for "leave it"."""
    return "-" if cpus is None else format(sum(1 << cpu for cpu in cpus), "x")


def _threads() -> list[int]:
    return [int(task.name) for task in Path("/proc/self/task").iterdir()]


def _set_all_threads(cpus: frozenset[int]) -> None:
    # sched_setaffinity(0) sets the calling thread only; threads made later inherit their creator's mask. A thread
    # made during a pass by one not yet set is caught by the next pass; /proc/self/task lists only our threads.
    os.sched_setaffinity(0, cpus)
    done: set[int] = set()
    for _ in range(100):
        todo = set(_threads()) - done
        if not todo:
            return
        for tid in todo:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cpus)
        done |= todo


def node_cpus() -> frozenset[int]:
    """The CPUs this process may use: its mask, or the one it had before :func:`pin_control`."""
    return _sandbox_cpus if _sandbox_cpus is not None else frozenset(os.sched_getaffinity(0))


def control_cpus(text: str | None, what: str = "DSEC_CONTROL_CPUS") -> frozenset[int] | None:
    """The housekeeping CPUs of a ``DSEC_CONTROL_CPUS`` value (None: unset), checked against the CPUs this
    process may run on; ``ValueError`` names the value, where it came from (``what``) and what is wrong with it."""
    if text is None or not text.strip():
        return None
    control = parse_cpu_list(text, what)
    node = node_cpus()
    outside = control - node
    if outside:
        raise ValueError(f"{what}={text!r}: CPU {cpu_list(outside)} is not one this daemon may run on "
                         f"(it may use {cpu_list(node)})")
    return control


def pin_control(control: frozenset[int]) -> frozenset[int]:
    """Pin every thread of this process to ``control`` (checked by :func:`control_cpus`); returns the node's
    CPUs (the mask it had before), which :func:`sandbox_cpus` reports until :func:`release`."""
    global _sandbox_cpus
    with _lock:
        node = node_cpus()
        _set_all_threads(control)
        _sandbox_cpus = node
        return node


def release() -> None:
    """Give every thread of this process the node's CPUs back (the daemon stopped); no-op when not pinned."""
    global _sandbox_cpus
    with _lock:
        if _sandbox_cpus is not None:
            _set_all_threads(_sandbox_cpus)
            _sandbox_cpus = None


def sandbox_cpus() -> frozenset[int] | None:
    """The CPUs a sandbox's processes get back as they start, or None when the control path is not pinned
    (they keep the mask they inherit)."""
    return _sandbox_cpus
