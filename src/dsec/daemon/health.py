"""The node's components and their health: what ``/v1/health`` lists and ``dsec doctor`` checks.

A component is a part of the node that sandboxes depend on and that can fail on its own: the lazy image
server, each image in use, the container backend's mount holder and exec helper, the microvm accelerator,
the image store, the trajectory store, the node's disk. Each has a state -- ``ok``, ``degraded`` (it
works in part, or is being repaired), ``down`` -- the last error and when the current state began. A
change of state is logged once, with the component's name and the error (a fault at warning level, a
recovery at info level with the time it took), so the daemon's log tells an operator when a fault began
and ended.

This module owns the registry; it never probes a component (``daemon/watchdog.py`` does) and never
touches a sandbox.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Component", "Health", "State"]

log = logging.getLogger(__name__)

State = Literal["ok", "degraded", "down"]


@dataclass
class Component:
    """One component's health now."""

    name: str
    state: State = "ok"
    error: str | None = None
    """What is wrong (None while ok)."""
    since: float = field(default_factory=time.time)
    """When the current state began (Unix seconds)."""
    detail: str | None = None
    """What it is or runs as (a pid, an address, ``kvm``/``tcg``), whatever its state."""
    faults: int = 0
    """Times it went from ok to degraded or down."""
    last_error: str | None = None
    """The last error it had, also once it is ok again."""
    recovery_seconds: list[float] = field(default_factory=list)
    """How long each of its faults lasted (the last 100)."""


class Health:
    """The registry (see the module docstring). Used from the event loop only."""

    def __init__(self) -> None:
        self._components: dict[str, Component] = {}

    def set(self, name: str, error: str | None, *, state: State | None = None, detail: str | None = None) -> None:
        """Record component ``name``'s state: ok when ``error`` is None, else ``state`` (default ``degraded``)."""
        new: State = "ok" if error is None else (state or "degraded")
        found = self._components.get(name)
        if found is None:
            found = self._components[name] = Component(name, detail=detail)
            if new == "ok":
                return
        if detail is not None:
            found.detail = detail
        if new == found.state:
            found.error = error
            if error is not None:
                found.last_error = error
            return
        now = time.time()
        fields = {"component": name, "error": error}
        if new == "ok":
            lasted = now - found.since
            found.recovery_seconds = [*found.recovery_seconds[-99:], lasted]
            log.info("%s recovered after %.1f s (was %s: %s)", name, lasted, found.state, found.error,
                     extra={"component": name})
        else:
            if found.state == "ok":
                found.faults += 1
            log.warning("%s is %s: %s", name, new, error, extra=fields)
        found.state, found.error, found.since = new, error, now
        if error is not None:
            found.last_error = error

    def healed(self, name: str, error: str, began: float, ended: float) -> None:
        """Record a fault of ``name`` that began and was repaired between two checks (by the code that met it:
        a create found the lazy server dead and started it again), as a fault and its recovery."""
        found = self._components.setdefault(name, Component(name))
        found.faults += 1
        found.last_error = error
        found.recovery_seconds = [*found.recovery_seconds[-99:], ended - began]
        log.info("%s recovered after %.1f s (was down: %s)", name, ended - began, error, extra={"component": name})

    def drop(self, name: str) -> None:
        """Forget a component that is gone on purpose (an image no longer in use)."""
        self._components.pop(name, None)

    def get(self, name: str) -> Component | None:
        """One component, or None if never reported."""
        return self._components.get(name)

    def components(self) -> list[Component]:
        """Every component, by name."""
        return [self._components[n] for n in sorted(self._components)]

    def status(self) -> State:
        """``ok`` when every component is; else the worst state."""
        states = {c.state for c in self._components.values()}
        return "down" if "down" in states else "degraded" if "degraded" in states else "ok"
