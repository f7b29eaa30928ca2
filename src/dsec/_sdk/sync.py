"""``dsec.Sandbox``: the blocking SDK, generated from ``AsyncSandbox`` rather than written twice.

:func:`derive` walks an async class's public coroutine functions, async generator functions, classmethods
and properties, and adds a blocking twin of each to the decorated class: coroutines run on the portal's
event-loop thread, async iterators become sync iterators (closing one closes the other), and results that
are async SDK objects come back as their sync twins. Names, docstrings and signatures are kept (return
annotations are renamed ``AsyncSandbox`` -> ``Sandbox``, ``AsyncGenerator`` -> ``Generator``...). Type
checkers cannot see runtime-made methods, so ``sync.pyi`` (rendered by ``stubgen.py`` from the same
signatures, and checked by a test) gives them static types.

This module must never contain sandbox logic: a behaviour change belongs in ``sandbox.py`` and reaches
the blocking API by itself. The only hand-written members here are the context-manager and iteration
dunders.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from dsec.models.surface import FileEvent

from .client import Client
from .files import AsyncFiles, AsyncWatch
from .portal import portal
from .processes import AsyncProcess, AsyncProcesses, AsyncShell
from .sandbox import AsyncSandbox
from .trajectory import AsyncTrajectory

__all__ = ["Files", "Process", "Processes", "Sandbox", "Shell", "Trajectory", "Watch", "derive", "rename_annotation"]

C = TypeVar("C", bound=type)

# Async-only spellings with no place in a blocking API: ``close`` already is the blocking close.
_SKIP = frozenset({"aclose"})
# Async class -> its sync twin, filled by ``derive``; used to convert results and rename annotations.
_TWINS: dict[type, Callable[[Any], Any]] = {}
_RENAMES = {"AsyncIterator": "Iterator", "AsyncGenerator": "Generator", "AsyncIterable": "Iterable"}


def _sync_result(value: Any) -> Any:
    twin = _TWINS.get(type(value))
    if twin is not None:
        return twin(value)
    if isinstance(value, list):
        return [_sync_result(v) for v in value]
    return value


def _unwrap_arg(value: Any) -> Any:
    # A sync twin passed back in (``Sandbox.close_many([sb, ...])``) must reach the async code as async.
    if isinstance(value, list | tuple):
        return type(value)(_unwrap_arg(v) for v in value)
    inner = getattr(value, "_async", None)
    return inner if isinstance(value, _SyncBase) and inner is not None else value


def rename_annotation(annotation: Any) -> Any:
    """An async annotation (text) as its blocking twin reads it (``AsyncSandbox`` -> ``Sandbox``...)."""
    if not isinstance(annotation, str):
        return annotation
    twins = {a.__name__: getattr(s, "__name__", "") for a, s in _TWINS.items()}
    for async_name, sync_name in {**_RENAMES, **twins}.items():
        annotation = re.sub(rf"\b{async_name}\b", sync_name, annotation)
    return annotation


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    sig = inspect.signature(func)
    params = [p.replace(annotation=rename_annotation(p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=rename_annotation(sig.return_annotation))


def _unwrap_all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Sync objects passed positionally or by keyword become their async originals."""
    return tuple(_unwrap_arg(a) for a in args), {k: _unwrap_arg(v) for k, v in kwargs.items()}


def _twin_of(name: str, attr: Any, async_cls: type) -> Any:
    """The blocking twin of one attribute of ``async_cls``, or None when it has none."""
    if isinstance(attr, classmethod):
        func = attr.__func__
        if not inspect.iscoroutinefunction(func):
            return None

        def class_call(cls: type, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = _unwrap_all(args, kwargs)
            return _sync_result(portal.run(getattr(async_cls, name)(*args, **kwargs)))

        return classmethod(_keep_meta(class_call, func, async_cls))
    if isinstance(attr, property):
        return property(
            _keep_meta(lambda self: _sync_result(getattr(self._async, name)), attr.fget, async_cls),
            doc=attr.__doc__,
        )
    if inspect.isasyncgenfunction(attr):

        def stream(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            args, kwargs = _unwrap_all(args, kwargs)
            for item in portal.iterate(getattr(self._async, name)(*args, **kwargs)):
                yield _sync_result(item)

        return _keep_meta(stream, attr, async_cls)
    if inspect.iscoroutinefunction(attr):

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = _unwrap_all(args, kwargs)
            return _sync_result(portal.run(getattr(self._async, name)(*args, **kwargs)))

        return _keep_meta(call, attr, async_cls)
    return None


def _keep_meta(wrapper: Callable[..., Any], original: Any, async_cls: type) -> Callable[..., Any]:
    functools.update_wrapper(wrapper, original)
    wrapper.__signature__ = _signature(original)  # type: ignore[attr-defined]
    # update_wrapper points __wrapped__ at the async function; tools that follow it would show
    # the async signature, so the twin stands on its own.
    del wrapper.__wrapped__  # type: ignore[attr-defined]
    return wrapper


def public_members(async_cls: type) -> dict[str, Any]:
    """The members of ``async_cls`` that get a blocking twin (public, defined on the class)."""
    members: dict[str, Any] = {}
    for name, attr in vars(async_cls).items():
        if name.startswith("_") or name in _SKIP:
            continue
        if isinstance(attr, (classmethod, property)) or inspect.iscoroutinefunction(attr) or (
            inspect.isasyncgenfunction(attr)
        ):
            members[name] = attr
    return members


def derive(async_cls: type) -> Callable[[C], C]:
    """Class decorator: add to the decorated class a blocking twin of each public member of ``async_cls``.

    The decorated class wraps one ``async_cls`` instance in ``self._async`` (its constructor takes that
    instance and may wrap sub-objects) but never defines a sandbox operation of its own.
    """

    def decorate(sync_cls: C) -> C:
        _TWINS[async_cls] = sync_cls
        for name, attr in public_members(async_cls).items():
            if name in vars(sync_cls):
                raise TypeError(
                    f"{sync_cls.__name__}.{name} is hand-written; derive it from {async_cls.__name__}"
                )
            twin = _twin_of(name, attr, async_cls)
            target = twin.__func__ if isinstance(twin, classmethod) else twin
            target = target.fget if isinstance(target, property) else target
            if target is not None:
                target.__qualname__ = f"{sync_cls.__qualname__}.{name}"
            setattr(sync_cls, name, twin)
        if async_cls.__doc__ and not sync_cls.__doc__:
            sync_cls.__doc__ = async_cls.__doc__
        return sync_cls

    return decorate


class _TwinMeta(type):
    if TYPE_CHECKING:
        # Class-level twins (``Sandbox.create``) are generated too; see ``_SyncBase.__getattr__``.
        def __getattr__(cls, name: str) -> Any: ...


class _SyncBase(metaclass=_TwinMeta):
    """Holds the async object a sync twin drives."""

    _async: Any

    def __init__(self, inner: Any) -> None:
        self._async = inner

    def __repr__(self) -> str:
        return repr(self._async).replace(type(self._async).__name__, type(self).__name__, 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SyncBase) and other._async is self._async

    def __hash__(self) -> int:
        return hash(id(self._async))

    if TYPE_CHECKING:
        # The twins are generated at import time, invisible to a type checker; say so instead of
        # letting it report every call as an error.
        def __getattr__(self, name: str) -> Any: ...


@derive(AsyncWatch)
class Watch(_SyncBase):
    """A started watch of a sandbox directory (blocking API of :class:`dsec.AsyncWatch`): iterate it for its
    events as they happen; ``with`` closes it."""

    def __iter__(self) -> Iterator[FileEvent]:
        events: Iterator[FileEvent] = self.events()
        return events

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@derive(AsyncFiles)
class Files(_SyncBase):
    """Files of one sandbox (blocking): raw bytes in and out, paths resolved inside the sandbox."""


@derive(AsyncProcess)
class Process(_SyncBase):
    """A process the node keeps for a sandbox (blocking API of :class:`dsec.AsyncProcess`)."""


@derive(AsyncProcesses)
class Processes(_SyncBase):
    """A sandbox's processes (blocking API of ``AsyncSandbox.processes``)."""


@derive(AsyncShell)
class Shell(_SyncBase):
    """A persistent shell session (blocking API of :class:`dsec.AsyncShell`); ``with`` closes it."""

    def __enter__(self) -> Shell:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@derive(AsyncSandbox)
class Sandbox(_SyncBase):
    """One isolated sandbox on a DSec node (blocking API).

    Make one with :meth:`create`, :meth:`create_many` or :meth:`connect`; ``with`` closes (destroys) it on
    exit. ``files`` reads and writes its files. Every method is the blocking twin of the
    :class:`dsec.AsyncSandbox` method of the same name.
    """

    _async: AsyncSandbox

    def __init__(self, inner: AsyncSandbox) -> None:
        super().__init__(inner)
        self.files = Files(inner.files)
        """The sandbox's files."""
        self.processes = Processes(inner.processes)
        """The processes the node keeps for the sandbox."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@derive(AsyncTrajectory)
class Trajectory(_SyncBase):
    """A trajectory in the node's log, by name (blocking API of :class:`dsec.AsyncTrajectory`):
    ``dsec.Trajectory("job-17/rollout-3").delete()``."""

    _async: AsyncTrajectory

    def __init__(self, name: str | AsyncTrajectory, client: Client | None = None) -> None:
        super().__init__(name if isinstance(name, AsyncTrajectory) else AsyncTrajectory(name, client))
