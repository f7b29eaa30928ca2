"""The loader of ``sb.call``: the program the image's Python runs inside a function sandbox.

Run as ``python3 -I /.dsec/loader.py MAX_RESULT_BYTES CLIENT_PYTHON`` with the cloudpickled
``(func, args, kwargs)`` on stdin. It imports the read-only copy of cloudpickle shipped in
``/.dsec``, calls the function and writes one reply to its original stdout:
``pickle.dumps(("ok", <cloudpickled value>))`` or ``pickle.dumps(("error", {type, message,
traceback, stage}))``. The callable's own prints go to stderr, so they can never corrupt the
reply. The reply comes from untrusted code: the client decodes it with a restricted unpickler.

This file is copied into every function sandbox and must import nothing but the standard
library and cloudpickle (it is never imported by the daemon for anything but its path).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any, BinaryIO

__all__ = ["main"]


def _error(stage: str, exc: BaseException) -> tuple[str, dict[str, str]]:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    text = "".join(traceback.format_exception(exc))
    return "error", {"type": name, "message": str(exc), "traceback": text, "stage": stage}


def _reply(out: BinaryIO, reply: tuple[str, Any]) -> None:
    out.write(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    out.flush()


def main() -> None:
    """Load the call from stdin, run it, write the reply."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the callable's prints land on stderr
    limit, client = int(sys.argv[1]), sys.argv[2]
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if client != here:
        _reply(out, _error("load", RuntimeError(
            f"the client runs Python {client} but the image's python3 is {here}: cloudpickle needs the same "
            f"minor version on both sides (use an image with Python {client})")))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cloudpickle

    try:
        func, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
    except BaseException as exc:  # whatever unpickling raises is the caller's to see
        _reply(out, _error("load", exc))
        return
    try:
        value = func(*args, **kwargs)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are results too
        _reply(out, _error("call", exc))
        return
    try:
        data = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:
        _reply(out, _error("result", exc))
        return
    if len(data) > limit:
        _reply(out, _error("result", OverflowError(
            f"the result pickles to {len(data)} bytes, over max_result_bytes={limit}: return less, or write it "
            f"to the workspace and read it with sb.files.read")))
        return
    _reply(out, ("ok", data))


if __name__ == "__main__":
    main()
