"""How fast this machine wakes a task on another CPU, idle and busy: the floor under the busy-neighbour figure.

An exec crosses several processes (client, daemon, exec helper, the command, and back); each wakeup that
the scheduler places on another CPU needs that CPU to preempt what it runs. On hardware, and on most
virtual machines, the rescheduling interrupt arrives within microseconds. On some (a paravirtual KVM)
a vCPU that is running a task acts on it only at its next tick, up to 4 ms
later, whatever the running task's class, SCHED_IDLE included; no priority inside the guest can fix that.
The pools suite runs this probe beside its busy-neighbour phase so the two figures are read together.

Run as ``python -m dsec.bench.wakeup [CPULIST] [--rounds N]`` (a fresh single-threaded process, since it forks;
on the first two CPUs of CPULIST, default those it may use; N round trips per phase, default 200): prints one
JSON object,
``{"idle_ms": [p50, p90], "busy_ms": [p50, p90], "cpus": [waker, wakee]}``, or ``{"skipped": why}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable

from dsec.bench.report import percentile

PR_SET_PDEATHSIG = 1
ROUNDS = 200
GAP_S = 0.002
"""Pause between round trips, so the partner is asleep (not spinning in its read) when it is woken."""


def _child(fn: Callable[..., None], *args: int) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            fn(*args)
        finally:
            os._exit(0)
    return pid


def _hog(cpu: int) -> None:  # pragma: no cover - runs in the child
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlives the probe
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def _echo(cpu: int, rd: int, wr: int, *parents: int) -> None:  # pragma: no cover - runs in the child
    for fd in parents:  # the parent's ends: the read below must see EOF once the parent closes its own
        os.close(fd)
    os.sched_setaffinity(0, {cpu})
    while os.read(rd, 1):
        os.write(wr, b".")


def _round_trips(waker: int, wakee: int, rounds: int = ROUNDS) -> list[float]:
    to_r, to_w = os.pipe()
    back_r, back_w = os.pipe()
    pid = _child(_echo, wakee, to_r, back_w, to_w, back_r)
    os.close(to_r)
    os.close(back_w)
    os.sched_setaffinity(0, {waker})
    took: list[float] = []
    try:
        for _ in range(rounds):
            time.sleep(GAP_S)
            t0 = time.perf_counter()
            os.write(to_w, b".")
            os.read(back_r, 1)
            took.append((time.perf_counter() - t0) * 1e3)
    finally:
        os.close(to_w)
        os.close(back_r)
        os.waitpid(pid, 0)
    return took


def probe(allowed: set[int] | frozenset[int] | None = None, rounds: int = ROUNDS) -> dict[str, object]:
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if len(cpus) < 2:
        return {"skipped": f"needs two CPUs, this process may use {len(cpus)}"}
    waker, wakee = cpus[0], cpus[1]
    idle = _round_trips(waker, wakee, rounds)
    hog = _child(_hog, wakee)
    try:
        time.sleep(0.2)
        busy = _round_trips(waker, wakee, rounds)
    finally:
        os.kill(hog, signal.SIGKILL)
        os.waitpid(hog, 0)

    def pct(xs: list[float]) -> list[float]:
        return [round(percentile(xs, 50), 3), round(percentile(xs, 90), 3)]

    return {"idle_ms": pct(idle), "busy_ms": pct(busy), "cpus": [waker, wakee]}


if __name__ == "__main__":
    from dsec.isolation.affinity import parse_cpu_list

    args = sys.argv[1:]
    rounds = ROUNDS
    if "--rounds" in args:
        at = args.index("--rounds")
        try:
            rounds = int(args[at + 1])
        except (IndexError, ValueError):
            sys.exit("python -m dsec.bench.wakeup: --rounds takes a number")
        del args[at:at + 2]
    try:
        allowed = parse_cpu_list(args[0], "CPULIST") if args else None
    except ValueError as exc:
        sys.exit(f"python -m dsec.bench.wakeup: {exc}")
    json.dump(probe(allowed, rounds), sys.stdout)
    sys.stdout.write("\n")
