"""The daemon's watchdog: checks every component the node depends on, repairs what it can, reports the rest.

Every second (``tick``) it checks, cheaply and without blocking the event loop:

- the backends' node-level helpers (``Backend.components``: the container backend's exec helper and mount
  holder, the microvm accelerator) and restarts a helper that died (``Backend.repair``);
- the lazy image server and every image mount (``NodeImages.check``, in a thread; a request to the server
  every few seconds): a dead server is started again and its images mounted afresh;
- every running sandbox, every two seconds: one whose processes died (its init killed, its QEMU gone) or
  whose image mount died is revived where its backend can do so without losing state (a function sandbox
  gets a new zygote), and otherwise reported ``lost`` with the reason (an event, a log line, and
  ``SandboxLost`` for its next call) and its leftovers destroyed;
- every ten seconds, the image store (one lookup) and the trajectory store (one durable write);
- the node's disk (``statvfs`` of ``DSEC_HOME``): below :data:`DISK_FLOOR` free, creates are refused.

What it finds goes to the :class:`~dsec.daemon.health.Health` registry (``/v1/health``, ``dsec doctor``),
which logs each fault and recovery. It reaches the engine only through :class:`Watched`; it never speaks HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from dsec.backends.base import Backend
from dsec.config import Settings
from dsec.daemon.health import Health
from dsec.errors import DSecError
from dsec.models import SandboxRecord

__all__ = ["DISK_FLOOR", "Watchdog", "Watched"]

log = logging.getLogger(__name__)

DISK_FLOOR = 64 * 1024 * 1024
"""Bytes free on ``DSEC_HOME``'s disk below which the node refuses creates (records, logs and the image cache
live there; a create that half-wrote its record would be worse than one refused with the reason)."""
_DEEP_EVERY = 5.0
_SANDBOXES_EVERY = 2.0
_STORES_EVERY = 10.0
_STORE_TIMEOUT = 15.0


class Watched(Protocol):
    """What the watchdog needs of the engine."""

    settings: Settings
    images: Any
    components: Health

    def watched_backends(self) -> dict[str, Backend]:
        """The backends that started."""
        ...

    def running(self) -> list[SandboxRecord]:
        """Sandboxes running now (not creating, paused or being destroyed)."""
        ...

    def image_roots(self, sandbox_id: str) -> list[Path]:
        """The image and snapshot-layer mounts the sandbox was made on."""
        ...

    async def revive(self, record: SandboxRecord) -> bool:
        """Ask the sandbox's backend to bring it back (on its image mounted afresh if its own died)."""
        ...

    async def lose(self, record: SandboxRecord, reason: str, component: str) -> None:
        """Report the sandbox lost with ``reason`` and destroy what is left of it."""
        ...

    async def probe_trajectories(self) -> str | None:
        """None if the trajectory store takes a durable write now, else why not."""
        ...


class Watchdog:
    """See the module docstring."""

    def __init__(self, node: Watched, interval: float = 1.0) -> None:
        self.node = node
        self.health = node.components
        self.interval = interval
        self._due: dict[str, float] = {}
        self._remounts = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.disk_free: int | None = None
        """Bytes free on the home's disk at the last check."""

    def start(self) -> None:
        """Run :meth:`tick` every ``interval`` seconds until :meth:`aclose`."""
        self._stopping = False
        self._task = asyncio.create_task(self._forever(), name="dsec-watchdog")

    async def aclose(self) -> None:
        """Stop checking."""
        if self._task is not None:
            # The flag as well as the cancel: a cancel can be lost in a wait (asyncio.wait_for on 3.11 returns
            # an inner result landing in the same loop pass), and the loop must end regardless.
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _forever(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except Exception:
                log.exception("watchdog pass failed")
            await asyncio.sleep(self.interval)

    def _is_due(self, what: str, every: float) -> bool:
        now = time.monotonic()
        if now < self._due.get(what, 0.0):
            return False
        self._due[what] = now + every
        return True

    async def tick(self) -> None:
        """One pass over everything that is due."""
        self.check_disk()
        await self.check_backends()
        healed = await self.check_images(deep=self._is_due("deep", _DEEP_EVERY))
        if healed or self._is_due("sandboxes", _SANDBOXES_EVERY):
            await self.check_sandboxes()
        if self._is_due("stores", _STORES_EVERY):
            await self.check_stores()

    # ------------------------------------------------------------------ the parts
    def check_disk(self) -> None:
        """``DSEC_HOME``'s free space."""
        home = self.node.settings.home
        try:
            st = os.statvfs(home)
        except OSError as exc:
            self.health.set("node-disk", f"cannot read the free space of {home}: {exc}")
            return
        free = self.disk_free = st.f_bavail * st.f_frsize
        detail = f"{free / 2**30:.1f} GiB free of {st.f_blocks * st.f_frsize / 2**30:.1f} GiB at {home}"
        error = None if free >= DISK_FLOOR else (
            f"the disk of {home} is full ({free // 2**20} MiB free, below {DISK_FLOOR // 2**20} MiB): creates are "
            "refused until space is freed")
        self.health.set("node-disk", error, state="down", detail=detail)

    async def check_backends(self) -> None:
        """Each backend's helpers; a broken one is restarted."""
        seen: set[str] = set()
        for backend in self.node.watched_backends().values():
            for name, why, began, ended in backend.take_healed():
                self.health.healed(name, why, began, ended)
            for name, check in backend.components().items():
                if name in seen:
                    continue
                seen.add(name)
                if check.error is None:
                    self.health.set(name, None, detail=check.detail)
                    continue
                self.health.set(name, check.error, state=check.state, detail=check.detail)
                if check.state == "degraded":
                    continue  # it works in part, or will by itself: nothing to restart
                try:
                    await backend.repair(name)
                except Exception as exc:
                    log.error("%s: restarting it failed: %s", name, exc, extra={"component": name, "error": str(exc)})
                    self.health.set(name, f"{check.error}; restarting it failed: {exc}", state="down")
                    continue
                again = backend.components().get(name)
                if again is not None:
                    self.health.set(name, again.error, state="down", detail=again.detail)

    async def check_images(self, deep: bool) -> bool:
        """The lazy server and the image mounts (healed in place); True if a mount was made afresh."""
        check: Callable[[bool], dict[str, str | None]] | None = getattr(self.node.images, "check", None)
        if check is None:
            return False
        try:
            report = await asyncio.to_thread(check, deep)
        except Exception as exc:  # the heal itself failed (the server does not start): reported, tried again
            log.exception("checking the image mounts failed")
            report = {"lazy-server": f"{type(exc).__name__}: {exc}"}
        take: Callable[[], list[tuple[str, float, float]]] | None = getattr(self.node.images, "take_healed", None)
        for why, began, ended in take() if take is not None else []:
            self.health.healed("lazy-server", why, began, ended)
        for name, error in report.items():
            self.health.set(name, error, detail=self._server_detail() if name == "lazy-server" else None)
        for component in self.health.components():
            if component.name.startswith("image:") and component.name not in report:
                self.health.drop(component.name)
        remounts = int(getattr(self.node.images, "remounts", 0))
        healed, self._remounts = remounts != self._remounts, remounts
        return healed

    def _server_detail(self) -> str | None:
        server = getattr(self.node.images, "server", None)
        generation = getattr(server, "generation", None)
        return f"pid {generation.split('-')[0]}" if generation else "not running (no image mounted)"

    async def check_sandboxes(self) -> None:
        """Running sandboxes whose processes or image mount died: revived, or reported lost."""
        backends = self.node.watched_backends()
        stale: Callable[[Path], str | None] | None = getattr(self.node.images, "stale", None)
        for record in self.node.running():
            backend = backends.get(record.spec.backend)
            if backend is None:
                continue
            reason, component = None, "sandbox"
            if backend.reads_image and stale is not None:
                for root in self.node.image_roots(record.id):
                    why = stale(root)
                    if why is not None:
                        reason, component = f"its image mount died: {why}", "lazy-server"
                        break
            if reason is None:
                reason = backend.lost(record)
            if reason is None:
                continue
            if await self._guarded(self.node.revive(record), f"reviving sandbox {record.id}", False):
                log.info("sandbox %s revived (%s)", record.id, reason,
                         extra={"component": component, "sandbox": record.id})
                continue
            await self._guarded(self.node.lose(record, reason, component), f"reporting {record.id} lost", None)

    async def check_stores(self) -> None:
        """The image store answers a lookup; the trajectory store takes a write."""
        store = getattr(getattr(self.node.images, "store", None), "blobs", None)
        if store is not None:
            error = await self._guarded(_within(asyncio.to_thread(_probe_store, store), _STORE_TIMEOUT),
                                        "probing the image store", f"the image store {store.url} did not answer "
                                        f"a lookup within {_STORE_TIMEOUT:g} s")
            self.health.set("image-store", error, detail=store.url)
        error = await self._guarded(_within(self.node.probe_trajectories(), _STORE_TIMEOUT),
                                    "probing the trajectory store",
                                    f"the trajectory store did not take a write within {_STORE_TIMEOUT:g} s")
        self.health.set("trajectory-store", error, detail=self._trajectory_detail())

    def _trajectory_detail(self) -> str | None:
        where = self.node.settings.trajectory_log
        return where.split("@")[-1] if "://" in where else where  # (a DSN's password never shown)

    @staticmethod
    async def _guarded(work: Awaitable[Any], what: str, fallback: Any) -> Any:
        """``await work``; on a timeout or an unexpected error, ``fallback`` (logged)."""
        try:
            return await work
        except TimeoutError:
            return fallback
        except Exception:
            log.exception("%s failed", what)
            return fallback


async def _within(work: Awaitable[Any], seconds: float) -> Any:
    """``await work``, TimeoutError after ``seconds``. Unlike ``asyncio.wait_for`` on 3.11, a cancel is never
    traded for a result that lands with it."""
    async with asyncio.timeout(seconds):
        return await work


def _probe_store(store: Any) -> str | None:
    try:
        store.has("tags/.dsec-health")
    except DSecError as exc:
        return f"the image store {store.url} cannot be reached: {exc.message}"
    except OSError as exc:
        return f"the image store {store.url} cannot be read: {exc}"
    return None
