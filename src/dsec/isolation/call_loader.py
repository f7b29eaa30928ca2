"""The loader of ``sb.call``: what runs one call in the process the Python zygote forked for it.

:func:`serve` reads the cloudpickled ``(func, args, kwargs)`` (or the function, then ``(args, kwargs)``) on
stdin (cloudpickle is the read-only copy shipped in ``/.dsec``, imported once by the zygote), calls the
function and writes one reply to its original stdout: ``pickle.dumps(("ok", <cloudpickled value>))`` or
``pickle.dumps(("error", {type, message, traceback, stage}))``, the message and traceback cut to a bounded
excerpt. The callable's own prints go to stderr, so they can never corrupt the reply. The reply comes from
untrusted code: the client decodes it with a restricted unpickler. The exit code says which it was (0 a value,
1 an error), so the daemon can tell a call that failed at a limit from one that succeeded.

:func:`run_program` runs a Python program instead (``exec(..., warm_python=True)``): the script as
``python3 script.py`` would, its stdin, stdout and stderr the call's own.

This file is copied into every function sandbox as ``/.dsec/loader.py`` and must import nothing but the
standard library and cloudpickle (the daemon never imports it but for its path).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import pickle
import signal
import sys
import traceback
from typing import Any, BinaryIO

__all__ = ["excerpt", "run_program", "serve"]

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


def _exit_status(exc: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught SystemExit (``_Py_HandleSystemExit``)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{code}\n")
    return 1


def _uncaught(exc: BaseException) -> int:
    """Print an uncaught exception as the interpreter does (``sys.excepthook``, without this module's frame)."""
    if isinstance(exc, SystemExit):
        return _exit_status(exc)
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    with contextlib.suppress(BaseException):
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    if isinstance(exc, KeyboardInterrupt):  # as CPython: die of SIGINT, so the parent sees the signal
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return 1


def _stdio(errors: str) -> None:
    """Standard streams made as ``create_stdio`` makes them for a process whose stdio are pipes."""
    def stream(fd: int, name: str, mode: str, errs: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = name
        buffered: io.BufferedReader | io.BufferedWriter = (
            io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
        return io.TextIOWrapper(buffered, encoding="utf-8", errors=errs, newline="\n", line_buffering=line)

    sys.stdin = stream(0, "<stdin>", "r", errors, False)
    sys.stdout = stream(1, "<stdout>", "w", errors, False)
    sys.stderr = stream(2, "<stderr>", "w", "backslashreplace", True)
    for name in ("stdin", "stdout", "stderr"):  # what the program may restore them to
        setattr(sys, f"__{name}__", getattr(sys, name))


def _locale() -> str:
    """The stdio error handler a fresh interpreter would pick for this environment (PEP 538 and 540: in the C
    locale it coerces ``LC_CTYPE`` to C.UTF-8 and runs in UTF-8 mode); the daemon sends only environments whose
    locale is C, POSIX, unset or UTF-8."""
    effective = os.environ.get("LC_ALL") or os.environ.get("LC_CTYPE") or os.environ.get("LANG") or "C"
    if effective in ("C", "POSIX"):
        if not os.environ.get("LC_ALL"):
            os.environ["LC_CTYPE"] = "C.UTF-8"
        return "surrogateescape"
    return "strict"


def run_program(argv: list[str]) -> int:
    """Run ``argv`` (``[python, script, arg...]``) as ``python script arg...`` would run in a fresh process:
    ``sys.argv``, ``sys.path[0]`` the script's directory, a fresh ``__main__`` module, the standard streams,
    uncaught exceptions, ``SystemExit``, non-daemon threads and ``atexit`` handlers; returns the exit status.
    What remains of the zygote (its imported standard library modules, its hash seed, ``sys.flags`` of ``-I``)
    is documented in ``docs/design/function.md``."""
    import atexit
    import types

    program, script = argv[0], argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    for name in [n for n in sys.modules if n in ("cloudpickle", "loader") or n.startswith("cloudpickle.")]:
        del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *(p for p in sys.path if p != here)]
    sys.argv = argv[1:]
    _stdio(_locale())
    atexit._clear()
    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as e:
        sys.stderr.write(f"{program}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}\n")
        return 2
    import importlib.machinery

    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    try:
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
        status = 0
    except BaseException as exc:
        status = _uncaught(exc)
    return _finish(status)


def _finish(status: int) -> int:
    """``Py_FinalizeEx``'s part a program can observe: wait for its non-daemon threads, run its ``atexit``
    handlers, flush the standard streams (a flush that fails exits 120)."""
    import atexit

    threading = sys.modules.get("threading")
    if threading is not None:
        with contextlib.suppress(BaseException):
            threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = 120
    return status
