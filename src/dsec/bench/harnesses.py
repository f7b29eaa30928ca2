"""``dsec bench inspect``: inspect-ai's own sandbox self-check suite, timed on DSec against inspect's ``local``
sandbox, in one run.

Owns the B3 measurement: each of inspect's checks (``inspect_ai/util/_sandbox/self_check.py``) runs as inspect's
test runner runs it: a fresh sample (``sample_init``), the check, ``sample_cleanup``. The ``dsec`` side uses a
private daemon (``dsec up`` on a temporary home, container backend, ``debian-python``, a non-root user as the
integration test does); the ``local`` side is inspect's own sandbox, processes in a temporary directory of this
host. Rounds alternate the two sides so drift hits both alike. ``test_exec_as_user`` is left out of both sides:
under ``local`` it would add a user to this host. A check's outcome is counted, never retried: the figure is
wall time, and the pass counts say what each side got through. It must never leave a daemon, sandbox or
temporary directory behind.
"""

from __future__ import annotations

import asyncio
import inspect as pyinspect
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dsec.bench.container import BenchUnavailable, _cleanup_backend, _daemon, _leaks, _private_settings, preflight
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings

__all__ = ["KILL_CHECKS", "SKIPPED", "run"]

SKIPPED = ("test_exec_as_user",)
"""Checks left out on both sides (``local`` would change this host)."""

KILL_CHECKS = ("test_exec_timeout_kills_process", "test_exec_timeout_kills_child_processes")
"""Checks whose time is mostly how a timeout ends ``sleep 30``: also reported without them."""

Check = Callable[[Any], Awaitable[None]]


def _checks() -> dict[str, Check]:
    try:
        from inspect_ai.util._sandbox import self_check
    except ImportError as e:
        raise BenchUnavailable(f"inspect-ai is not installed: pip install 'dsec[inspect]' ({e})") from None
    return {name: fn for name, fn in vars(self_check).items()
            if name.startswith("test_") and pyinspect.iscoroutinefunction(fn) and name not in SKIPPED}


async def _suite(env_class: Any, config: Any, checks: dict[str, Check]) -> tuple[float, dict[str, float], int]:
    """Every check on a sample of its own, as inspect's runner does: wall seconds, seconds per check, and how
    many passed."""
    passed = 0
    each: dict[str, float] = {}
    start = time.perf_counter()
    for name, check in checks.items():
        t0 = time.perf_counter()
        envs = await env_class.sample_init("bench", config, {})
        try:
            await check(envs["default"])
            passed += 1
        except Exception:  # a failing check is counted; the suite goes on
            pass
        finally:
            await env_class.sample_cleanup("bench", config, envs, interrupted=False)
        each[name] = time.perf_counter() - t0
    return time.perf_counter() - start, each, passed


async def _measure(url: str, rounds: int, progress: Callable[[str], None]) -> dict[str, Any]:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

    from dsec.integrations.inspect import DSecSandboxConfig, DSecSandboxEnvironment, DSecService

    checks = _checks()
    dsec_config = DSecSandboxConfig(url=url, services={"default": DSecService(image="debian-python", user="nobody")})
    sides = {"dsec": (DSecSandboxEnvironment, dsec_config), "local": (LocalSandboxEnvironment, None)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    times.update({f"{name}_without_kill_checks": [] for name in sides})
    passed: dict[str, int] = {}
    slowest: dict[str, dict[str, float]] = {}
    for i in range(rounds):
        for name, (env_class, config) in sides.items():
            progress(f"round {i + 1}/{rounds}: {len(checks)} checks on {name}")
            wall, each, passed[name] = await _suite(env_class, config, checks)
            times[name].append(wall)
            times[f"{name}_without_kill_checks"].append(wall - sum(each[c] for c in KILL_CHECKS if c in each))
            top = sorted(each.items(), key=lambda kv: -kv[1])[:5]
            slowest[name] = {check: round(seconds, 2) for check, seconds in top}
    return {"times": times, "passed": passed, "checks": len(checks), "slowest": slowest}


def run(rounds: int = 2, node: Settings | None = None, progress: Callable[[str], None] = lambda _: None) -> Suite:
    """The self-check suite ``rounds`` times on each side, alternating."""
    node = node or Settings()
    preflight(node)
    _checks()
    settings = _private_settings(node)
    started = time.perf_counter()
    try:
        progress(f"starting a private daemon in {settings.home}")
        with _daemon(settings, "process"):
            found = asyncio.run(_measure(f"unix://{settings.socket_path}", max(1, rounds), progress))
    finally:
        asyncio.run(_cleanup_backend(settings))
        leaks = _leaks(settings)
        shutil.rmtree(settings.home, ignore_errors=True)
    lat = {name: summarize(samples) for name, samples in found["times"].items()}
    n, passed = found["checks"], found["passed"]
    suite = Suite("inspect", latencies=lat)
    suite.rows = [
        Row(f"inspect self-check suite, {n} checks, a sample each (p50)", "s", lat["dsec"].p50, lat["local"].p50,
            "inspect `local` sandbox", target="reported",
            note=f"passed: dsec {passed['dsec']}/{n}, local {passed['local']}/{n}"),
        Row(f"the same without the {len(KILL_CHECKS)} kill-on-timeout checks (p50)", "s",
            lat["dsec_without_kill_checks"].p50, lat["local_without_kill_checks"].p50, "inspect `local` sandbox",
            target="reported"),
        Row("per check, sample_init to sample_cleanup (p50)", "ms", lat["dsec"].p50 / n * 1000,
            lat["local"].p50 / n * 1000, "inspect `local` sandbox", target="reported"),
    ]
    suite.extra = {
        "rounds": rounds, "checks": n, "left_out": list(SKIPPED), "kill_checks": list(KILL_CHECKS),
        "passed": passed, "slowest_checks_s": found["slowest"], "backend": "container", "image": "debian-python",
        "load": os.getloadavg()[0], "phases_s": {"all": round(time.perf_counter() - started, 1)}, "leaks": leaks}
    return suite
