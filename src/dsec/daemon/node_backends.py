"""The backends of one node: which are loaded, which can be used, and why the others cannot.

Owns the registry from a backend name (:data:`dsec.models.BackendName`) to its class, loading each, starting
and closing them, and the ``name -> reason`` of every backend that cannot be used (failed to import, to
construct, to start, or says it is not available here). Must never create or destroy sandboxes and never
keep records: the engine asks it for the backend a record names.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import assert_never, get_args

from dsec.backends.base import Backend
from dsec.config import Settings
from dsec.errors import BackendUnavailable
from dsec.models import BackendName

__all__ = ["NodeBackends", "backend_class"]

log = logging.getLogger(__name__)


def backend_class(name: BackendName) -> tuple[str, str]:
    """The module and class of backend ``name`` (the names are :data:`dsec.models.BackendName`'s: a node loads
    each, and one that fails to import or construct is reported unavailable)."""
    match name:
        case "container":
            return "dsec.backends.container", "ContainerBackend"
        case "microvm":
            return "dsec.backends.microvm", "MicroVMBackend"
        case "vm":
            return "dsec.backends.vm", "VMBackend"
        case "function":
            return "dsec.backends.function", "FunctionBackend"
        case _:
            assert_never(name)


class NodeBackends:
    """``loaded`` backends by name; ``unavailable``: name -> why it cannot be used."""

    def __init__(self, loaded: Mapping[str, Backend], unavailable: Mapping[str, str] | None = None) -> None:
        self.loaded: dict[str, Backend] = dict(loaded)
        self.unavailable: dict[str, str] = dict(unavailable or {})

    @classmethod
    def load(cls, settings: Settings) -> NodeBackends:
        """Every backend that imports and constructs; the others with the reason they do not."""
        loaded: dict[str, Backend] = {}
        unavailable: dict[str, str] = {}
        for name in get_args(BackendName):
            module, cls_name = backend_class(name)
            try:
                backend_cls = getattr(importlib.import_module(module), cls_name)
                loaded[name] = backend_cls(settings)
            except Exception as exc:
                unavailable[name] = f"cannot load the {name} backend: {type(exc).__name__}: {exc}"
        return cls(loaded, unavailable)

    def get(self, name: str) -> Backend:
        """Backend ``name``; :class:`BackendUnavailable` (saying why) if it cannot be used."""
        backend = self.loaded.get(name)
        if backend is None or name in self.unavailable:
            reason = self.unavailable.get(name, "it is not implemented on this node yet")
            raise BackendUnavailable(f"backend {name!r} is not available: {reason}", backend=name)
        return backend

    def usable(self, name: str) -> Backend | None:
        """Backend ``name`` if it can be used, else None (no error: for callers that fall back)."""
        backend = self.loaded.get(name)
        return None if backend is None or name in self.unavailable else backend

    def started(self) -> dict[str, Backend]:
        """The backends that started (or may be used)."""
        return {n: b for n, b in self.loaded.items() if n not in self.unavailable}

    def states(self) -> dict[str, str]:
        """Each backend name's state: ``ok``, ``pending: <what it waits for>``, or why it cannot be used."""
        states = {}
        for name in get_args(BackendName):
            if name in self.unavailable:
                states[name] = self.unavailable[name]
            elif name in self.loaded:
                pending = self.loaded[name].pending()
                states[name] = "ok" if pending is None else f"pending: {pending}"
            else:
                states[name] = "not implemented on this node yet"
        return states

    async def start(self, phase: Callable[[str], None]) -> None:
        """Start every backend that says it is available (telling ``phase`` which); one that fails is marked
        unavailable with why."""
        for name, backend in list(self.loaded.items()):
            reason = backend.available()
            if reason == "ok":
                phase(f"starting the {name} backend")
                try:
                    await backend.start()
                except Exception as exc:
                    log.exception("backend %s failed to start", name)
                    reason = f"failed to start: {type(exc).__name__}: {exc}"
            if reason != "ok":
                self.unavailable[name] = reason

    async def aclose(self) -> None:
        """Close every loaded backend (one that fails is logged; the others still close)."""
        for name, backend in self.loaded.items():
            try:
                await backend.aclose()
            except Exception:
                log.exception("backend %s failed to close", name)
