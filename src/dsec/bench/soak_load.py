"""The soak's load: what ``dsec bench soak``'s clients do to the node while its parts are killed.

``workers`` clients loop over episodes -- create, exec, write and read, snapshot and restore, fork, and every
third episode a trajectory rollout whose client is cut off at a random step and moment, then re-run -- on the
container and function backends; one more client does the same on the microvm backend, one guest at a time;
another imports a small image into the node's store and removes it again, every second. Each operation's
failure is classified into the :class:`Tally` (a named error met during a repair, a sandbox lost with or
without a reason, an exactly-once violation, a copy unlike its source, an image not served); the load goes on.

Owns the load, :class:`Node` (the private daemon's client, pid and restart) and the tally; it never injects a
fault and never reaches into the daemon's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec import (
    AsyncSandbox,
    AsyncTrajectory,
    Client,
    ConnectionFailed,
    DaemonStopping,
    DSecError,
    NotFound,
    SandboxLost,
    SandboxNotFound,
)
from dsec.bench.container import IMAGE
from dsec.config import Settings
from dsec.daemon import server
from dsec.images.image_store import ImageStore

__all__ = ["BACKENDS", "RECOVERY_BOUND", "VM_MEMORY", "Node", "Tally", "image_churn", "microvm_client", "worker"]

BACKENDS = ("container", "function")
"""The backends of the workers' episodes (microvm has a client of its own: one guest at a time)."""
RECOVERY_BOUND = 90.0
VM_MEMORY = "384Mi"


@dataclass
class Tally:
    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    """Named failures (DSec errors, by class) the load met, mostly while a fault was being repaired."""
    lost_with_reason: list[str] = field(default_factory=list)
    lost_without_reason: list[str] = field(default_factory=list)
    exactly_once_violations: list[str] = field(default_factory=list)
    copies_unlike_source: list[str] = field(default_factory=list)
    """Restored snapshots and forks that did not hold their source's files."""
    images_unserved: list[str] = field(default_factory=list)
    """Images imported into the store that the daemon then did not serve (by name and error)."""
    recoveries: dict[str, list[float]] = field(default_factory=dict)
    unrecovered: list[str] = field(default_factory=list)
    daemon_restarts: int = 0
    daemon_turns_passed: int = 0
    """The daemon's turns in the chaos list given to the next component (it had not lived ``daemon_every_s``)."""
    backends: tuple[str, ...] = BACKENDS
    """Backends the creates after a fault must work on (and microvm when its guests can boot here)."""

    def faulted(self, name: str) -> bool:
        """Whether component ``name`` was SIGKILLed (recovered or not) in this soak."""
        return name in self.recoveries or any(u.startswith(f"{name}:") for u in self.unrecovered)


class Node:
    """The private daemon: its client, its pid, and a restart after it was killed."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # a TCG boot on a loaded small host can pass the backend's default; the soak is about faults, not boots
        os.environ.setdefault("DSEC_MICROVM_BOOT_TIMEOUT", "600")
        self.pid = server.up(settings, timeout=120)
        self.client = Client(url=f"unix://{settings.socket_path}")
        self.probe_error: str | None = None
        """Why the last check that creates work failed (a backend, an exit code, the end of stderr)."""

    def age_s(self) -> float | None:
        """Seconds the daemon's process has lived (from its start time in /proc: not when ``up`` returned)."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            ticks = int(Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            return uptime - ticks / os.sysconf("SC_CLK_TCK")
        return None

    def rss_mib(self) -> float | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    async def component(self, name: str) -> Any:
        info = await self.client.health()
        return next((c for c in info.components if c.name == name), None)

    async def restart(self) -> None:
        self.pid = await asyncio.to_thread(server.up, self.settings, None, None, 120)


async def _close(tally: Tally, sb: AsyncSandbox, mine: set[str]) -> None:
    """Destroy ``sb`` as a client that means it does: again while the daemon is down or restarting (a sandbox
    whose destroy was lost to the outage lives on, re-adopted by the next daemon)."""
    await _until_reached(tally, "destroy", sb.close)


async def _until_reached(tally: Tally, what: str, work: Callable[[], Any]) -> None:
    deadline = time.monotonic() + RECOVERY_BOUND
    while True:
        try:
            await work()
        except (ConnectionFailed, DaemonStopping) as exc:
            tally.errors[type(exc).__name__] += 1
            if time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                continue
            return
        except DSecError as exc:
            tally.errors[type(exc).__name__] += 1
            return
        tally.ops[what] += 1
        return


async def _guard(tally: Tally, what: str, mine: set[str], work: Callable[[], Any]) -> Any:
    """Run one operation of the load; classify its failure (the load goes on, after a pause while the daemon
    cannot be reached)."""
    try:
        result = await work()
    except SandboxLost as exc:
        tally.lost_with_reason.append(f"{what}: {exc.message}")
        return None
    except SandboxNotFound as exc:
        if exc.detail.get("sandbox_id") in mine or any(sid in exc.message for sid in mine):
            tally.lost_without_reason.append(f"{what}: {exc.message}")
        tally.errors[type(exc).__name__] += 1
        return None
    except DSecError as exc:
        tally.errors[type(exc).__name__] += 1
        if isinstance(exc, (ConnectionFailed, DaemonStopping)):
            await asyncio.sleep(0.5)  # the daemon is down or restarting: not a busy loop of refused calls
        return None
    except Exception as exc:  # not a DSec error: the node answered something no client can act on
        tally.lost_without_reason.append(f"{what}: {type(exc).__name__}: {exc}")
        return None
    tally.ops[what] += 1
    return result


async def _episode(node: Node, tally: Tally, worker: int, n: int, rng: random.Random) -> None:
    backend = BACKENDS[(worker + n) % len(BACKENDS)]
    if backend == "container" and n % 3 == 0:
        await _rollout(node, tally, f"soak/{worker}/{n}-{time.time_ns()}", rng)
        return
    client, mine = node.client, set[str]()
    labels = {"soak": f"episode-{worker}-{n}"}  # a sandbox left at the end names the episode that made it
    sb = await _guard(tally, f"create-{backend}", mine, lambda: AsyncSandbox.create(
        image=IMAGE, backend=backend, labels=labels, client=client))
    if sb is None:
        return
    mine.add(sb.id)
    try:
        await _use(tally, sb, mine, 3, 60)
        if backend == "container" and rng.random() < 0.2:
            await _restore(node, tally, sb, mine)
        if backend == "container" and rng.random() < 0.3:
            want = await _guard(tally, "read", mine, lambda: sb.files.read("/workspace/n"))
            kids = await _guard(tally, "fork", mine, lambda: sb.fork(1)) or []
            for kid in kids:
                await _holds(tally, mine, "fork", kid, want)
                await _close(tally, kid, mine)
    finally:
        await _close(tally, sb, mine)


async def _use(tally: Tally, sb: AsyncSandbox, mine: set[str], execs: int, timeout: float,
               then: str = "; python3 -c 'import json'") -> None:
    """What an episode does with a sandbox: ``execs`` commands (each one appends a line, ``then`` runs), a file
    written and one read."""
    for i in range(execs):
        await _guard(tally, "exec", mine, functools.partial(sb.exec, f"echo {i} >> /workspace/n{then}",
                                                            timeout=timeout))
    await _guard(tally, "write", mine, lambda: sb.files.write("/workspace/f", os.urandom(4096)))
    await _guard(tally, "read", mine, lambda: sb.files.read("/workspace/n"))


async def _restore(node: Node, tally: Tally, sb: AsyncSandbox, mine: set[str]) -> None:
    """Snapshot ``sb``, restore it into a new sandbox that must hold its files, then purge the snapshot (the
    store may be shared: its chunks are this run's alone)."""
    want = await _guard(tally, "read", mine, lambda: sb.files.read("/workspace/n"))
    snap = await _guard(tally, "snapshot", mine, sb.snapshot)
    if snap is None:
        return
    try:
        copy = await _guard(tally, "restore", mine, lambda: AsyncSandbox.create(snapshot=snap, client=node.client))
        if copy is not None:
            mine.add(copy.id)
            await _holds(tally, mine, "restored snapshot", copy, want)
            await _close(tally, copy, mine)
    finally:
        store = ImageStore(node.settings.images, node.settings.snapshot_store)
        with contextlib.suppress(DSecError, OSError):
            await asyncio.to_thread(store.remove_snapshot, snap, True)


async def _holds(tally: Tally, mine: set[str], what: str, copy: AsyncSandbox, want: bytes | None) -> None:
    """A copy (a fork, a restored snapshot) must hold the file its source held when it was copied."""
    mine.add(copy.id)
    got = await _guard(tally, "exec", mine, functools.partial(copy.exec, "cat /workspace/n"))
    if want is not None and got is not None and got.exit_code == 0 and got.stdout != want:
        tally.copies_unlike_source.append(f"{what} {copy.id}: {got.stdout!r}, its source held {want!r}")


async def _rollout(node: Node, tally: Tally, name: str, rng: random.Random) -> None:
    """A trajectory rollout whose client is cut off at a random step and moment (before the call reached the
    daemon, while it runs, or as it answers), then re-run: every command runs exactly once."""
    client, mine = node.client, set[str]()
    sb = await _guard(tally, "create-rollout", mine, lambda: AsyncSandbox.create(image=IMAGE, trajectory=name,
                                                                                  client=client))
    if sb is None:
        return
    mine.add(sb.id)
    steps = ["sleep 0.1; echo a >> ran", "sleep 0.2; echo b >> ran", "sleep 0.3; echo c >> ran"]
    at = rng.randrange(len(steps))
    try:
        for step in steps[:at]:
            if await _guard(tally, "exec", mine, functools.partial(sb.exec, step)) is None:
                return
        cut = asyncio.create_task(sb.exec(steps[at]))
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        cut.cancel()  # the client dies: the daemon finishes and logs what it received
        with contextlib.suppress(BaseException):
            await cut
        # A sandbox lost meanwhile (a fault) is rebuilt from its image with the logged commands re-run there:
        # the rebuilt sandbox must then also hold each command's line once.
        again = await _guard(tally, "reopen", mine, lambda: AsyncSandbox.create(image=IMAGE, trajectory=name,
                                                                                rerun_missing=True, client=client))
        if again is None:
            return
        mine.add(again.id)
        bound = await _guard(tally, "info", mine, again.info)
        if bound is not None and bound.trajectory is None:  # its calls would run outside the log, unnumbered
            tally.exactly_once_violations.append(f"{name}: re-opened as {again.id}, not bound to its log")
            return
        if bound is not None and bound.trajectory is not None and bound.trajectory.missing_effects:
            tally.ops["rollout-rebuilt-missing"] += 1  # reported in its info: what the file holds is not counted
            return
        if bound is not None and bound.trajectory is not None and bound.trajectory.rerun:
            tally.ops["rollout-rebuilt"] += 1
        for step in steps:
            replayed = await _guard(tally, "replay", mine, functools.partial(again.exec, step))
            if replayed is None:
                return
            if b"outcome is unknown" in replayed.stderr:  # the daemon died while it ran: at most once, not counted
                tally.ops["rollout-interrupted"] += 1
                return
        counted = await _guard(tally, "exec", mine, lambda: again.exec("wc -l < ran"))
        if counted is not None and counted.exit_code == 0 and counted.stdout.strip() != b"3":
            tally.exactly_once_violations.append(f"{name}: {counted.stdout.strip().decode()} runs of 3 commands")
    finally:
        await _delete(tally, name, client, mine)


async def _delete(tally: Tally, name: str, client: Client, mine: set[str]) -> None:
    """Delete a rollout's trajectory (its sandbox with it), again while the daemon cannot be reached."""
    await _until_reached(tally, "delete-trajectory", lambda: _gone(name, client))


async def _gone(name: str, client: Client) -> None:
    with contextlib.suppress(NotFound):
        await AsyncTrajectory(name, client).delete()


async def image_churn(node: Node, tally: Tally, done: asyncio.Event) -> None:
    """Import a small image into the node's store and remove it again, over and over (what ``dsec image import``
    and ``rm`` do from another shell): the node must keep serving the images in use meanwhile."""
    settings = node.settings
    store = ImageStore(settings.images, settings.image_store)
    tree = settings.home / "soak-image"
    (tree / "etc").mkdir(parents=True, exist_ok=True)
    n = 0
    while not done.is_set():
        name = f"soak-{os.getpid()}-{n}"
        (tree / "etc" / "generation").write_text(f"{n}\n")
        made = await _guard(tally, "image-import", set(), functools.partial(
            asyncio.to_thread, store.import_dir, name, tree, settings.uid_shift))
        if made is not None:
            await _served(node, tally, name)
            await _guard(tally, "image-remove", set(), functools.partial(asyncio.to_thread, store.remove, name))
        n += 1
        await asyncio.sleep(1.0)


async def _served(node: Node, tally: Tally, name: str) -> None:
    """The daemon serves an image just imported into its store (while it is up)."""
    try:
        await node.client.api.get_image(name)
    except (ConnectionFailed, DaemonStopping) as exc:
        tally.errors[type(exc).__name__] += 1
        return
    except DSecError as exc:
        tally.images_unserved.append(f"{name}: {exc.message}")
        return
    tally.ops["image-get"] += 1


async def microvm_client(node: Node, tally: Tally, done: asyncio.Event) -> None:
    """One guest at a time: create, exec, write and read, destroy, over and over."""
    n = 0
    while not done.is_set():
        await _vm_episode(node, tally, n)
        n += 1


async def _vm_episode(node: Node, tally: Tally, n: int) -> None:
    mine, labels = set[str](), {"soak": f"episode-microvm-{n}"}
    vm = await _guard(tally, "create-microvm", mine, lambda: AsyncSandbox.create(
        image=IMAGE, backend="microvm", memory=VM_MEMORY, labels=labels, client=node.client))
    if vm is None:
        return
    mine.add(vm.id)
    try:
        await _use(tally, vm, mine, 2, 120, then="")  # shell only: a TCG guest runs Python slowly
    finally:
        await _close(tally, vm, mine)


async def worker(node: Node, tally: Tally, worker: int, done: asyncio.Event, rng: random.Random) -> None:
    n = 0
    while not done.is_set():
        await _episode(node, tally, worker, n, rng)
        n += 1
