"""``sb.call`` on the client: pickle the callable, and decode the sandbox's reply without trusting it.

The reply is produced inside the sandbox by code we are grading or otherwise do not trust, so it is
never handed to ``pickle.loads``: :class:`SafeUnpickler` rebuilds only plain data (numbers, strings,
bytes, lists, tuples, dicts, sets, ``None``...) plus a short allowlist of standard-library types, and
refuses everything else by name. ``trusted=True`` opts into full cloudpickle loading for callers who
trust the code that ran. This module does no I/O.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import sysconfig
import types
from typing import Any

from dsec.errors import CallFailed, InvalidRequest, RemoteError
from dsec.models import CallResult

__all__ = ["EXCERPT_BYTES", "SAFE_GLOBALS", "SafeUnpickler", "decode_reply", "encode_arguments", "encode_call",
           "encode_function", "excerpt"]

SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", name) for name in (
        "set", "frozenset", "complex", "slice", "range", "bytearray", "bool", "int", "float", "str", "bytes",
        "list", "tuple", "dict",
    )
} | {
    ("collections", "OrderedDict"), ("collections", "deque"), ("collections", "Counter"),
    ("datetime", "datetime"), ("datetime", "date"), ("datetime", "time"), ("datetime", "timedelta"),
    ("datetime", "timezone"), ("decimal", "Decimal"), ("fractions", "Fraction"), ("uuid", "UUID"),
    ("copyreg", "_reconstructor"), ("builtins", "object"),
})
"""``(module, name)`` pairs a reply may reference; anything else is refused."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that can only build :data:`SAFE_GLOBALS` (no functions, no arbitrary classes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _safe_loads(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def _installed_roots() -> tuple[str, ...]:
    """Where the standard library and installed packages live (their modules travel by reference)."""
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _user_module(func: Any) -> types.ModuleType | None:
    """The module ``func`` was defined in, if it is the caller's own code rather than an installed package.

    cloudpickle pickles functions of importable modules by reference, which the sandbox could not import:
    the caller's own module goes by value instead (as ``__main__`` always does)."""
    module = sys.modules.get(getattr(func, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if module is None or path is None or module.__name__ == "__main__":
        return None
    return None if os.path.realpath(path).startswith(_installed_roots()) else module


def encode_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``cloudpickle.dumps((func, args, kwargs))``; an unpicklable argument is the caller's InvalidRequest."""
    return _dumps(func, (func, args, kwargs))


def encode_function(func: Any) -> bytes:
    """The first half of a call's payload, pickled once for many calls (``sb.map``); the loader reads the function,
    then :func:`encode_arguments`."""
    return _dumps(func, func)


def encode_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The second half of a call's payload: ``cloudpickle.dumps((args, kwargs))``."""
    return _dumps(func, (args, kwargs))


def _dumps(func: Any, value: Any) -> bytes:
    import cloudpickle

    if not callable(func):
        raise InvalidRequest(f"call needs a callable, got {type(func).__name__}")
    module = _user_module(func)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        raise InvalidRequest(f"cannot pickle the call to {getattr(func, '__qualname__', func)!r}: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        if module is not None:
            cloudpickle.unregister_pickle_by_value(module)


def client_python() -> str:
    """This interpreter's ``major.minor``: the sandbox's must match it (cloudpickle ships bytecode)."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


_LIMITS = {
    "time": "was killed at its time limit",
    "memory": "was killed at its memory limit",
    "output": "was killed at its output limit (it printed more than max_output)",
    "pids": "failed at its process limit (a fork was refused: pids)",
    "disk": "failed at its disk limit (no room left in its /tmp or the workspace)",
}
EXCERPT_BYTES = 4096
"""At most this much of a call's stderr travels in an error (its head and tail)."""


def decode_reply(out: CallResult, trusted: bool = False) -> Any:
    """The callable's return value, or the matching error (RemoteError, CallFailed)."""
    result = out.result
    kind, body = None, None
    if out.reply:
        try:
            kind, body = _safe_loads(out.reply)
        except Exception as exc:
            if result.limit is None:
                raise CallFailed(f"the sandbox's reply is malformed ({type(exc).__name__}: {exc}); "
                                 f"stderr: {excerpt(result.stderr)}") from None
    if result.limit is not None:
        detail: dict[str, Any] = {"limit": result.limit, "exit_code": result.exit_code,
                                  "stderr": excerpt(result.stderr)}
        raised = ""
        if kind == "error" and isinstance(body, dict):
            detail.update(remote_type=str(body.get("type", "")), remote_message=str(body.get("message", ""))[:500])
            raised = f", raising {detail['remote_type']}: {detail['remote_message'][:200]}"
        raise CallFailed(f"the call {_LIMITS.get(result.limit, f'hit its {result.limit} limit')} "
                         f"(exit {result.exit_code}, {result.duration_s:.2f} s{raised})", **detail)
    if not out.reply:
        killed = f", signal {result.signal}" if result.signal else ""
        raise CallFailed(f"the call crashed without a result (exit {result.exit_code}{killed}): "
                         f"{excerpt(result.stderr)}", exit_code=result.exit_code, stderr=excerpt(result.stderr))
    if kind == "error" and isinstance(body, dict):
        raise RemoteError(f"{body.get('type')}: {body.get('message')}", type=str(body.get("type", "")),
                          traceback=str(body.get("traceback", "")), stage=str(body.get("stage", "")))
    if kind != "ok" or not isinstance(body, bytes):
        raise CallFailed(f"the sandbox's reply is malformed (kind {kind!r})")
    if trusted:
        import cloudpickle  # noqa: F401  (registers what cloudpickled values reference)

        return pickle.loads(body)
    try:
        return _safe_loads(body)
    except pickle.UnpicklingError as exc:
        raise CallFailed(f"the result references {exc}, which is not plain data: return built-in types "
                         f"(e.g. .tolist()), or pass trusted=True if you trust the code that ran") from None


def excerpt(data: bytes, limit: int = EXCERPT_BYTES) -> str:
    """``data`` as text, whole when short, else its head and tail with how much was left out between them."""
    if len(data) <= limit:
        return data.decode(errors="replace").strip()
    head, tail = data[: limit // 4], data[-(limit - limit // 4):]
    return (f"{head.decode(errors='replace')}\n... [{len(data) - limit} bytes left out] ...\n"
            f"{tail.decode(errors='replace')}").strip()
