"""The identity of a call: what replay compares, computed the same way by the SDK and the daemon.

A call is its operation and its arguments as the wire models carry them. Bodies (``stdin``, file data)
enter the digest by their sha256 and appear in the readable form only as size and digest, so a log row
stays small and a divergence message stays printable. This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsec.models import ExecRequest

__all__ = ["call_identity", "exec_args"]


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def call_identity(op: str, args: dict[str, Any]) -> tuple[str, str]:
    """``(digest, readable)`` of one call: the sha256 replay matches on and the JSON shown to humans."""
    readable = json.dumps({"op": op, "args": _plain(args)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(readable.encode()).hexdigest(), readable


def exec_args(request: ExecRequest) -> dict[str, Any]:
    """The arguments of an exec as they enter its identity (every field of the request; ``pristine``,
    ``warm_python`` and ``user`` only when set, so the calls of logs written before they existed keep their
    identity)."""
    args = request.model_dump(mode="python")
    for flag in ("pristine", "warm_python"):
        if not args[flag]:
            del args[flag]
    if args["user"] is None:
        del args["user"]
    return args
