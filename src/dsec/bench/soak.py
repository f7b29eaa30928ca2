"""``dsec bench soak``: mixed load on one node for N minutes while its parts are SIGKILLed in turn.

Against a private daemon (a process of its own, so it can be killed and started again), the load of
:mod:`dsec.bench.soak_load` runs -- ``workers`` clients' episodes on the container and function backends
(create, exec, files, snapshots, forks, trajectory rollouts cut off and re-run), one microvm guest at a time
(TCG guests on a small host: the load is the cycle, not the count), an image imported and removed every
second. Every ``fault_every_s`` seconds one component of the chaos list is SIGKILLed,
in turn: the exec helper, the mount holder, the lazy image server, a function sandbox's zygote, a container
sandbox's init, a microvm's QEMU, the daemon itself (at its turn only once it has lived ``daemon_every_s``:
otherwise the next component takes the turn). After each fault the soak measures the time until the
node recovered (the component counted the fault and is ``ok`` again; the victim sandbox works again or was
reported lost; the restarted daemon answers) and a create on each backend succeeds.

Invariants, counted throughout and reported (targets in the table): sandboxes lost without a reason (a
sandbox of ours gone with no ``SandboxLost`` naming why, or an error that is not a DSec error), exactly-once
violations (a re-run rollout whose commands ran more or fewer times than the log holds), copies (forks, restored
snapshots) that do not hold their source's files, images imported and then not served, leaks while it runs
(every ``census_every_s``, :class:`~dsec.bench.soak_watch.Census`: a sandbox's mounts, cgroups, network
namespaces or processes outliving it) and after the daemon stopped (anything of its home, before the bench
cleans up), images wedged (not ``ok`` in health past the recovery bound), and the daemon's RSS: at the start,
the end, and per daemon life the least-squares slope of its warm part (the worst judged life is the figure).

Owns the fault injection, the census' schedule and the report; it never reaches into the daemon's internals
(health, events and processes it started are all it looks at).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsec import AsyncSandbox, DSecError, SandboxLost
from dsec.bench.container import IMAGE, _cleanup_backend, _leaks, _private_settings, preflight
from dsec.bench.report import Row, Suite, summarize
from dsec.bench.soak_load import (
    BACKENDS,
    RECOVERY_BOUND,
    VM_MEMORY,
    Node,
    Tally,
    image_churn,
    microvm_client,
    worker,
)
from dsec.bench.soak_watch import JUDGED_AFTER, Census, footprint, lives_note, worst_life
from dsec.config import Settings
from dsec.daemon import server

__all__ = ["COMPONENTS", "SoakBench", "run"]

COMPONENTS = ("exec-helper", "mount-holder", "lazy-server", "zygote", "sandbox-init", "qemu", "daemon")
"""The chaos list, in the order faults are injected (then again from the start)."""
_RSS_GROWTH_TARGET = 20.0
"""MiB per hour of a daemon's life past its warm-up: more is a leak, not a cache filling."""


@dataclass(frozen=True)
class SoakBench:
    """How long and how hard one soak runs."""

    minutes: float = 60.0
    workers: int = 4
    fault_every_s: float = 30.0
    daemon_every_s: float = 1200.0
    """The daemon itself is SIGKILLed at its turn in the chaos list only once it has lived this long (its turn
    otherwise goes to the next component): its memory is judged over lives long enough to be past warm-up."""
    seed: int = 1
    census_every_s: float = 15.0
    """Seconds between two looks for leaks, wedged images and the daemon's RSS."""

    def scaled(self, factor: float) -> SoakBench:
        """The duration times ``factor`` (a soak always injects one round of faults, however short); the load's
        shape kept."""
        minutes = self.minutes * factor
        return replace(self, minutes=minutes)


def _procs(comm: str, needle: str) -> list[int]:
    """Pids of processes named ``comm`` whose cgroup mentions ``needle`` (a sandbox id)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip().startswith(comm) and (
                    needle in (entry / "cgroup").read_text()):
                found.append(int(entry.name))
    return found


def _qemu(sandbox_id: str) -> list[int]:
    """Pids of QEMU processes whose command line names the sandbox (what an operator would look for)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if b"qemu" in argv.split(b"\0")[0] and sandbox_id.encode() in argv:
                found.append(int(entry.name))
    return found




class _Unrecovered(Exception):
    """A fault the node did not recover from within the bound: what the soak waited for, the last thing seen."""

    def __init__(self, waited_for: str, last: str, bound: float) -> None:
        super().__init__(f"waited {bound:g} s for {waited_for}; last seen: {last}")


async def _until(check: Callable[[], Any], waited_for: str, bound: float = RECOVERY_BOUND) -> None:
    """Return once ``check()`` is true; :class:`_Unrecovered` naming ``waited_for`` and the last answer (a false
    check's ``last`` attribute, or its error) after ``bound`` seconds."""
    deadline, last = time.monotonic() + bound, "no answer yet"
    while time.monotonic() < deadline:
        try:
            if await check():
                return
            last = getattr(check, "last", None) or "not yet"
        except (DSecError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.2)
    raise _Unrecovered(waited_for, last[-400:], bound)


async def _creates_work(node: Node, backends: tuple[str, ...] = BACKENDS) -> bool:
    for backend in backends:
        sized: dict[str, Any] = {"memory": VM_MEMORY} if backend == "microvm" else {}
        try:
            sb = await AsyncSandbox.create(image=IMAGE, backend=backend, labels={"soak": "probe"},
                                           client=node.client, **sized)
        except DSecError as exc:
            node.probe_error = f"{backend}: create: {type(exc).__name__}: {exc}"
            raise
        try:
            # a TCG guest on an oversubscribed host can take minutes to start Python
            ran = await sb.exec("python3 -c 'print(1)'", timeout=600 if backend == "microvm" else 120)
            if ran.exit_code != 0:
                node.probe_error = f"{backend}: exit {ran.exit_code}, {ran.stderr[-300:].decode(errors='replace')}"
                return False
        except DSecError as exc:
            node.probe_error = f"{backend}: exec: {type(exc).__name__}: {exc}"
            raise
        finally:
            await sb.close()
    return True


def _probe(node: Node, backends: tuple[str, ...] = BACKENDS) -> Callable[[], Any]:
    """A check that a create and an exec work on each of ``backends``; its ``last`` is why one did not."""

    async def check() -> bool:
        node.probe_error = None
        ok = await _creates_work(node, backends)
        check.last = node.probe_error  # type: ignore[attr-defined]
        return ok

    return check


async def _inject(node: Node, name: str, tally: Tally) -> float | None:
    """SIGKILL ``name``; seconds until the node recovered from it, None when no process of it was found;
    :class:`_Unrecovered` (what was waited for, the last thing seen) when it did not recover within the bound."""
    if name in ("exec-helper", "mount-holder", "lazy-server"):
        before = await node.component(name)
        if before is None or not (before.detail or "").startswith("pid "):
            return None
        started = time.monotonic()
        os.kill(int(before.detail.split()[1]), signal.SIGKILL)

        async def healed() -> bool:
            now = await node.component(name)
            healed.last = f"health: {now}"  # type: ignore[attr-defined]
            return bool(now is not None and now.faults > before.faults and now.state == "ok")

        await _until(healed, f"health to count the fault of {name} and say ok")
        await _until(_probe(node), "a create and an exec to work on each backend")
        return time.monotonic() - started
    if name == "daemon":
        started = time.monotonic()
        os.kill(node.pid, signal.SIGKILL)
        await node.restart()
        tally.daemon_restarts += 1
        await _until(_probe(node, tally.backends), "a create and an exec to work on each backend")
        return time.monotonic() - started
    return await _kill_victim(node, name, tally)


async def _kill_victim(node: Node, name: str, tally: Tally) -> float | None:
    """SIGKILL one process of a sandbox made for it: a zygote, a container's init or a microvm's QEMU."""
    backend, comm = {"zygote": ("function", "dsec-zygote"), "qemu": ("microvm", "qemu-system")}.get(
        name, ("container", "dsec-init"))
    sized: dict[str, Any] = {"memory": VM_MEMORY} if backend == "microvm" else {}
    victim = await AsyncSandbox.create(image=IMAGE, backend=backend, labels={"soak": f"victim-{name}"},
                                       client=node.client, **sized)
    try:
        await victim.exec("echo kept > /workspace/state", timeout=120)
        pids = _qemu(victim.id) if name == "qemu" else _procs(comm, victim.id)
        if not pids:
            return None
        started = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)

        async def settled() -> bool:  # revived with its state, or reported lost with the reason
            try:
                ran = await victim.exec("cat /workspace/state")
            except SandboxLost as exc:
                tally.lost_with_reason.append(f"{name} victim: {exc.message}")
                return True
            except DSecError as exc:
                settled.last = f"exec on the victim: {type(exc).__name__}: {exc}"  # type: ignore[attr-defined]
                return False
            settled.last = f"exec on the victim: exit {ran.exit_code}, {ran.stdout[-200:]!r}"  # type: ignore[attr-defined]
            return ran.stdout == b"kept\n"

        backends = tally.backends if name == "qemu" else BACKENDS
        await _until(settled, f"victim {victim.id} (pid {pids[0]} killed) to be revived or reported lost")
        await _until(_probe(node, backends), "a create and an exec to work on each backend")
        return time.monotonic() - started
    finally:
        with contextlib.suppress(DSecError):
            await victim.close()


async def _faults(node: Node, tally: Tally, cfg: SoakBench, deadline: float, done: asyncio.Event,
                  progress: Callable[[str], None]) -> None:
    """A fault every ``fault_every_s`` until the deadline, and at least one of each component; then ``done``. The
    daemon's turn goes to the next component while the daemon is younger than ``daemon_every_s``."""
    chaos = [c for c in COMPONENTS if c != "qemu" or "microvm" in tally.backends]
    i = 0
    try:
        while i < len(chaos) or time.monotonic() + cfg.fault_every_s < deadline:
            name, i = chaos[i % len(chaos)], i + 1
            if name == "daemon" and not _daemon_due(node.age_s(), tally.faulted("daemon"),
                                                    deadline - time.monotonic(), cfg, len(chaos)):
                tally.daemon_turns_passed += 1
                name, i = chaos[i % len(chaos)], i + 1
            await _fault(node, tally, cfg, name, progress)
        if not tally.faulted("daemon"):  # the repairs took so long its last turn never came: killed once now
            await _fault(node, tally, cfg, "daemon", progress)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        done.set()


def _daemon_due(age: float | None, killed: bool, left: float, cfg: SoakBench, turns: int) -> bool:
    """Whether the daemon, ``age`` seconds old, is SIGKILLed at its turn: once it lived ``daemon_every_s``, or
    when it never was and its next turn (``turns`` faults away) would fall past the deadline, ``left`` seconds
    away (every soak kills it at least once)."""
    if age is None or age >= cfg.daemon_every_s:
        return True
    return not killed and left < turns * cfg.fault_every_s


async def _fault(node: Node, tally: Tally, cfg: SoakBench, name: str, progress: Callable[[str], None]) -> None:
    await asyncio.sleep(cfg.fault_every_s)
    progress(f"SIGKILL {name}")
    try:
        took = await _inject(node, name, tally)
    except _Unrecovered as exc:
        tally.unrecovered.append(f"{name}: {exc}")
        progress(f"{name}: not recovered: {exc}")
        return
    except (DSecError, server.ServeError) as exc:  # no victim could be made, or the daemon did not start again
        tally.unrecovered.append(f"{name}: {type(exc).__name__}: {exc}")
        progress(f"{name}: failed: {exc}")
        return
    if took is None:  # nothing to kill (no such process): counted, named
        tally.unrecovered.append(f"{name}: no process of it was found to kill")
        progress(f"{name}: no process found")
    else:
        tally.recoveries.setdefault(name, []).append(took)
        progress(f"{name}: recovered in {took:.1f} s")


async def _census(node: Node, census: Census, every: float, done: asyncio.Event) -> None:
    """Look for leaks, wedged images and the daemon's RSS every ``every`` seconds (not while the daemon is
    down: what it lists is the census' reference)."""
    while not done.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), every)
        try:
            listed = {info.id for info in await node.client.api.list()}
            health = await node.client.health()
        except DSecError:  # down, restarting, or too busy to answer: no reference to judge against
            continue
        await asyncio.to_thread(census.look, listed, [(c.name, c.state, c.since, c.error) for c in health.components],
                                node.pid, node.rss_mib(), node.age_s())


def _microvm_available(tally: Tally, results: dict[str, Any]) -> None:
    """microvm joins the load where its guests can boot (a kernel and QEMU); otherwise the report says why."""
    from dsec.guest.kernel import default_guest_dir, find_kernel

    try:
        find_kernel(default_guest_dir())
    except DSecError as exc:
        results["microvm"] = f"not in the load: {exc.message}"
        return
    tally.backends = (*BACKENDS, "microvm")
    results["microvm"] = "in the load"


async def _soak(cfg: SoakBench, settings: Settings, results: dict[str, Any], tally: Tally, census: Census,
                progress: Callable[[str], None]) -> None:
    node = Node(settings)
    rng = random.Random(cfg.seed)
    try:
        _microvm_available(tally, results)
        if not await _creates_work(node, tally.backends):  # warm: the image mounted, the helpers started
            raise RuntimeError(f"the node could not create a sandbox before the soak ({node.probe_error})")
        results["rss_start_mib"] = node.rss_mib()
        deadline, done = time.monotonic() + cfg.minutes * 60, asyncio.Event()
        progress(f"{cfg.workers} workers on {', '.join(tally.backends)} for {cfg.minutes:g} min, "
                 f"a SIGKILL every {cfg.fault_every_s:g} s (the daemon's once it lived {cfg.daemon_every_s:g} s)")
        vm = [microvm_client(node, tally, done)] if "microvm" in tally.backends else []
        await asyncio.gather(_faults(node, tally, cfg, deadline, done, progress), image_churn(node, tally, done),
                             _census(node, census, cfg.census_every_s, done), _load_sampler(results, done), *vm,
                             *(worker(node, tally, w, done, random.Random(rng.random()))
                               for w in range(cfg.workers)))
        results["rss_end_mib"] = node.rss_mib()
        # every episode closes what it made: one still here is a leak (its labels name the episode)
        results["sandboxes_left"] = [f"{i.id} {i.state} {i.spec.labels} {i.spec.trajectory or ''}".strip()
                                     for i in await node.client.api.list()]
    finally:
        await node.client.aclose()
        try:
            await asyncio.to_thread(server.down, settings, True)
        except server.ServeError as exc:  # sandboxes it could not destroy: counted, the report still made
            results["stop_error"] = str(exc)
        # nothing the daemon started may outlive it: what is left now is its leak, not the bench's to hide
        results["left_after_stop"] = sorted(f"{i.kind} {i.name}" for i in footprint(settings))


async def _load_sampler(results: dict[str, Any], done: asyncio.Event) -> None:
    """The host's load average at the run's middle (the machine may be shared: figures are read with it)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(done.wait(), results["config"]["minutes"] * 30)
    results.setdefault("load_middle", os.getloadavg())


async def run(cfg: SoakBench, node: Settings | None = None, progress: Callable[[str], None] = lambda _: None
              ) -> Suite:
    """Soak a private daemon; ``progress`` is told each fault and its recovery."""
    node = node or Settings()
    preflight(node)
    settings = _private_settings(node)
    suite = Suite(name="soak")
    tally = Tally()
    census = Census(settings, wedged_after=RECOVERY_BOUND)
    results: dict[str, Any] = {"config": asdict(cfg), "home": str(settings.home), "load": os.getloadavg()}
    started = time.monotonic()
    try:
        await _soak(cfg, settings, results, tally, census, progress)
    finally:
        await _cleanup_backend(settings)
        results["leaks"] = sorted({*results.get("left_after_stop", []), *_leaks(settings)})
        shutil.rmtree(settings.home, ignore_errors=True)
    lives = census.lives(JUDGED_AFTER)
    worst = worst_life(lives)
    results.update(leaks_while_running=census.leaks, wedged_images=census.wedged, censuses=census.looks,
                   rss_lives=[asdict(life) for life in lives], rss_samples=census.rss,
                   rss_growth_mib_per_h=worst.slope_mib_per_h if worst else None,
                   rss_judged=bool(worst and worst.judged))
    results.update(seconds=time.monotonic() - started, load_end=os.getloadavg(), ops=dict(tally.ops),
                   errors=dict(tally.errors), lost_with_reason=tally.lost_with_reason,
                   lost_without_reason=tally.lost_without_reason, unrecovered=tally.unrecovered,
                   exactly_once_violations=tally.exactly_once_violations, daemon_restarts=tally.daemon_restarts,
                   daemon_turns_passed=tally.daemon_turns_passed,
                   copies_unlike_source=tally.copies_unlike_source, images_unserved=tally.images_unserved,
                   recoveries_s=tally.recoveries)
    for name, took in tally.recoveries.items():
        suite.latencies[f"recovery_{name}"] = summarize(took)
    suite.extra = results
    suite.rows = _rows(results, tally)
    return suite


def _rows(results: dict[str, Any], tally: Tally) -> list[Row]:
    injected = sum(len(v) for v in tally.recoveries.values()) + len(tally.unrecovered)
    rows = [
        Row("operations done", "", float(sum(tally.ops.values())), better="higher",
            note=f"{sum(tally.errors.values())} refused with a named error during repairs"),
        Row("faults recovered / injected", "", float(injected - len(tally.unrecovered)), float(injected), "injected",
            better="higher", target="all", passed=not tally.unrecovered),
    ]
    for name in COMPONENTS:
        took = tally.recoveries.get(name)
        if took:
            rows.append(Row(f"recovery after SIGKILL {name}, p50", "s", summarize(took).p50,
                            note=f"max {max(took):.1f} s over {len(took)}"))
    rows += [
        Row("sandboxes lost with a reason", "", float(len(tally.lost_with_reason))),
        Row("sandboxes lost without a reason", "", float(len(tally.lost_without_reason)), target="0",
            passed=not tally.lost_without_reason),
        Row("exactly-once violations (rollouts)", "", float(len(tally.exactly_once_violations)), target="0",
            passed=not tally.exactly_once_violations),
        Row("leaks while running (a sandbox's resources outliving it)", "", float(len(results["leaks_while_running"])),
            target="0", passed=not results["leaks_while_running"], note=f"{results['censuses']} censuses"),
        Row("leaks after stop", "", float(len(results["leaks"]) + len(results.get("sandboxes_left", []))),
            target="0", passed=not results["leaks"] and not results.get("sandboxes_left") and
            not results.get("stop_error"), note=results.get("stop_error")),
        Row("images wedged (not ok past the recovery bound, or imported and not served)", "",
            float(len(results["wedged_images"]) + len(tally.images_unserved)), target="0",
            passed=not results["wedged_images"] and not tally.images_unserved),
        Row("copies (forks, restored snapshots) unlike their source", "", float(len(tally.copies_unlike_source)),
            target="0", passed=not tally.copies_unlike_source),
        Row("daemon RSS, start -> end", "MiB", results.get("rss_end_mib"), results.get("rss_start_mib"), "at start",
            note=f"{tally.daemon_restarts} daemon restart(s) in between"),
        Row("daemon RSS growth per hour of warm life, worst life (least-squares slope)", "MiB/h",
            results["rss_growth_mib_per_h"], target=f"<= {_RSS_GROWTH_TARGET:g}",
            passed=None if not results["rss_judged"] else results["rss_growth_mib_per_h"] <= _RSS_GROWTH_TARGET,
            note=lives_note(results["rss_lives"])),
    ]
    return rows
