"""The loader of ``sb.call``: what runs one call in the process the Python zygote forked for it.

:func:`serve` reads the cloudpickled ``(func, args, kwargs)`` (or the function, then ``(args, kwargs)``) on
stdin (cloudpickle is the read-only copy shipped in ``/.dsec``, imported once by the zygote), calls the
function and writes one reply to its original stdout: ``pickle.dumps(("ok", <cloudpickled value>))`` or
``pickle.dumps(("error", {type, message, traceback, stage}))``, the message and traceback cut to a bounded
excerpt. The callable's own prints go to stderr, so they can never corrupt the reply. The reply comes from
untrusted code: the client decodes it with a restricted unpickler. The exit code says which it was (0 a value,
1 an error), so the daemon can tell a call that failed at a limit from one that succeeded.

This file is copied into every function sandbox as ``/.dsec/loader.py`` and must import nothing but the
standard library and cloudpickle (the daemon never imports it but for its path).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import traceback
from typing import Any, BinaryIO

__all__ = ["excerpt", "serve"]

_MESSAGE_CHARS = 2000
_TRACEBACK_CHARS = 8000


def excerpt(text: str, limit: int) -> str:
    """``text`` whole, or its head and tail with how much was left out between them."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters left out] ...\n{text[-tail:]}"


def _error(stage: str, exc: BaseException) -> tuple[str, dict[str, str]]:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(exc)
    except Exception as e:  # a __str__ that raises is the callable's problem, not the reply's
        message = f"<str() of the exception raised {type(e).__name__}>"
    text = "".join(traceback.format_exception(exc))
    return "error", {"type": name, "message": excerpt(message, _MESSAGE_CHARS),
                     "traceback": excerpt(text, _TRACEBACK_CHARS), "stage": stage}


def _reply(out: BinaryIO, reply: tuple[str, Any]) -> int:
    out.write(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    out.flush()
    return 0 if reply[0] == "ok" else 1


def serve(limit: int, client: str) -> int:
    """Load the call from stdin, run it, write the reply; returns the exit code (0 ok, 1 an error reply)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the callable's prints land on stderr
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if client != here:
        return _reply(out, _error("load", RuntimeError(
            f"the client runs Python {client} but the image's python3 is {here}: cloudpickle needs the same "
            f"minor version on both sides (use an image with Python {client})")))
    import cloudpickle

    try:
        stream = io.BytesIO(sys.stdin.buffer.read())
        first = cloudpickle.load(stream)
        # (func, args, kwargs) in one pickle, or the function (pickled once for a whole sb.map), then (args, kwargs)
        if isinstance(first, tuple) and len(first) == 3:
            func, args, kwargs = first
        else:
            func, (args, kwargs) = first, cloudpickle.load(stream)
    except BaseException as exc:  # whatever unpickling raises is the caller's to see
        return _reply(out, _error("load", exc))
    try:
        value = func(*args, **kwargs)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are results too
        return _reply(out, _error("call", exc))
    try:
        data = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:
        return _reply(out, _error("result", exc))
    if len(data) > limit:
        return _reply(out, _error("result", OverflowError(
            f"the result pickles to {len(data)} bytes, over max_result_bytes={limit}: return less, or write it "
            f"to the workspace and read it with sb.files.read")))
    return _reply(out, ("ok", data))
