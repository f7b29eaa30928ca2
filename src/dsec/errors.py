"""The DSec error tree, shared by the SDK, the node daemon and the gateway.

Every error a caller can see is a :class:`DSecError`. Errors cross HTTP as
``{"error": {"type": <class name>, "message": ..., "detail": {...}}}`` with the
class's ``status_code``; the client re-raises the class of the same name (only
classes defined here, never an arbitrary import path).

    DSecError
    ├── InvalidRequest (ValueError)        400  malformed body, bad path, bad limit
    │   ├── BuildFailed                     400  a Dockerfile build failed at a step (``detail["step"]``)
    │   ├── IsADirectory (IsADirectoryError)     a file operation's errno in the sandbox (SandboxFileError)
    │   └── NotADirectory (NotADirectoryError)
    ├── Unauthorized (PermissionError)      401  missing or wrong token on TCP
    ├── Forbidden (PermissionError)         403  the token's scope does not cover the route
    ├── NotFound (LookupError)              404
    │   ├── SandboxNotFound
    │   ├── ImageNotFound
    │   ├── UserNotFound                         ``user=`` names no user (or group) of the sandbox
    │   ├── ProcessNotFound                      no such process handle, shell session or file watch
    │   └── FileNotFound (FileNotFoundError)     (SandboxFileError)
    ├── FileExists (FileExistsError)        409  (SandboxFileError)
    ├── DirectoryNotEmpty                   409  (SandboxFileError)
    ├── PermissionDenied (PermissionError)  403  the sandbox's permission bits refused a file operation
    ├── SandboxStateError                   409  e.g. exec on a paused sandbox
    │   └── Fenced                          409  cluster mode: a create under a cell lease a newer one replaced
    ├── SandboxTimeout (TimeoutError)       408  the sandbox outlived its ``timeout``
    ├── QuotaExceeded                       429
    │   └── RateLimited                     429  the token's rate limit (``retry_after`` seconds)
    ├── SandboxLost                         410  the sandbox died (init, VM, image mount) or its node did
    ├── ReplayDivergence                    409  trajectory replay saw a different call
    ├── BackendUnavailable                  503  backend not usable on this host
    ├── NotSupported (NotImplementedError)  501  operation not offered by this backend
    ├── SandboxError                        500  the sandbox failed (init died, mount failed...)
    ├── SandboxFileError (OSError)          400  base of the file errors: ``errno``, ``filename``, ``reason``
    ├── RemoteError                              ``sb.call``: the callable raised (or could not be loaded)
    ├── CallFailed                               ``sb.call``: no result (killed at a limit, result refused)
    ├── ImageCorrupt                        502  image bytes did not match their digest (twice)
    ├── StoreUnavailable (ConnectionError)  503  the image store cannot be reached
    ├── CacheFull                           507  the node image cache's disk is full of pinned chunks
    └── ConnectionFailed (ConnectionError)       client could not reach the daemon
        └── DaemonStopping                  503  the daemon is stopping: creates refused, long calls cut off
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any, ClassVar

__all__ = [
    "BackendUnavailable",
    "BuildFailed",
    "CacheFull",
    "CallFailed",
    "ConnectionFailed",
    "DSecError",
    "DaemonStopping",
    "DirectoryNotEmpty",
    "Fenced",
    "FileExists",
    "FileNotFound",
    "Forbidden",
    "ImageCorrupt",
    "ImageNotFound",
    "InvalidRequest",
    "IsADirectory",
    "NotADirectory",
    "NotFound",
    "NotSupported",
    "PermissionDenied",
    "ProcessNotFound",
    "QuotaExceeded",
    "RateLimited",
    "RemoteError",
    "ReplayDivergence",
    "SandboxError",
    "SandboxFileError",
    "SandboxNotFound",
    "SandboxStateError",
    "SandboxTimeout",
    "StoreUnavailable",
    "Unauthorized",
    "UserNotFound",
    "error_from_payload",
    "file_error",
]


class DSecError(Exception):
    """Root of every error DSec raises on purpose."""

    status_code: ClassVar[int] = 500

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = detail

    def to_payload(self) -> dict[str, Any]:
        """The JSON body that carries this error over HTTP."""
        return {"error": {"type": type(self).__name__, "message": self.message, "detail": self.detail}}


class InvalidRequest(DSecError, ValueError):
    """The request was malformed or named something impossible (a path escaping the root, a bad size)."""

    status_code = 400


class BuildFailed(InvalidRequest):
    """A Dockerfile build failed: ``detail`` names the ``step`` (``RUN make``), its ``line`` in the Dockerfile
    when known, and the builder's last ``output`` lines. Nothing was stored."""


class Unauthorized(DSecError, PermissionError):
    """The TCP API was called without the right token."""

    status_code = 401


class Forbidden(DSecError, PermissionError):
    """The token is valid but its scope does not allow this route (a job token on an admin route)."""

    status_code = 403


class NotFound(DSecError, LookupError):
    """Something named in the request does not exist."""

    status_code = 404


class SandboxNotFound(NotFound):
    """No sandbox with this id on this daemon."""


class ImageNotFound(NotFound):
    """No image with this name in the image store."""


class UserNotFound(NotFound):
    """``user=`` names a user or group that the sandbox's ``/etc/passwd`` or ``/etc/group`` does not have."""


class ProcessNotFound(NotFound):
    """No process handle with this pid (or shell session, or file watch with this id) in the sandbox: it was
    never started through DSec, or it ended and its record was dropped."""


class SandboxFileError(DSecError, OSError):
    """A file operation in the sandbox failed with ``errno`` (``detail["errno"]``, its name in
    ``detail["reason"]``, the path in ``detail["path"]``); the subclasses are the builtin ``OSError`` subclasses
    Python raises for the same errno, so ``except FileNotFoundError`` works on sandbox files as on local ones."""

    status_code = 400

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message, **detail)
        code = detail.get("errno")
        self.errno = code if isinstance(code, int) else None
        self.strerror = message
        self.filename = detail.get("path")

    def __str__(self) -> str:
        return self.message


class FileNotFound(SandboxFileError, NotFound, FileNotFoundError):
    """No such file or directory in the sandbox (ENOENT)."""

    status_code = 404


class IsADirectory(SandboxFileError, InvalidRequest, IsADirectoryError):
    """A file operation met a directory where it needs a file (EISDIR)."""

    status_code = 400


class NotADirectory(SandboxFileError, InvalidRequest, NotADirectoryError):
    """A path component, or the target of a directory operation, is not a directory (ENOTDIR)."""

    status_code = 400


class FileExists(SandboxFileError, FileExistsError):
    """The target already exists (EEXIST)."""

    status_code = 409


class DirectoryNotEmpty(SandboxFileError):
    """A directory removed without ``recursive=True`` (or renamed over) has entries (ENOTEMPTY)."""

    status_code = 409


class PermissionDenied(SandboxFileError, PermissionError):
    """The user the operation ran as may not do it (EACCES, EPERM), or the path is read-only (EROFS: a
    protected path, a function sandbox's image)."""

    status_code = 403


_FILE_ERRORS: dict[int, type[SandboxFileError]] = {
    _errno.ENOENT: FileNotFound, _errno.EISDIR: IsADirectory, _errno.ENOTDIR: NotADirectory,
    _errno.EEXIST: FileExists, _errno.ENOTEMPTY: DirectoryNotEmpty, _errno.EACCES: PermissionDenied,
    _errno.EPERM: PermissionDenied, _errno.EROFS: PermissionDenied,
}
_FILE_WORDS: dict[int, str] = {
    _errno.ENOENT: "no such file or directory", _errno.EISDIR: "is a directory", _errno.ENOTDIR: "not a directory",
    _errno.EEXIST: "already exists", _errno.ENOTEMPTY: "directory not empty", _errno.EACCES: "permission denied",
    _errno.EPERM: "operation not permitted", _errno.EROFS: "read-only path",
}


def file_error(code: int, path: str, what: str = "", **detail: Any) -> SandboxFileError:
    """The error for errno ``code`` from a file operation on ``path`` in the sandbox (``what``: the operation,
    for the message): one class per errno Python maps, :class:`SandboxFileError` for any other."""
    reason = _errno.errorcode.get(code, str(code))
    words = _FILE_WORDS.get(code) or _strerror(code)
    message = f"{what + ' ' if what else ''}{path}: {words}"
    return _FILE_ERRORS.get(code, SandboxFileError)(message, errno=code, reason=reason, path=path, **detail)


def _strerror(code: int) -> str:
    """``strerror(code)`` in lower case, as file messages word it."""
    text = os.strerror(code)
    return text[:1].lower() + text[1:]


class SandboxStateError(DSecError):
    """The sandbox is not in a state that allows the operation (paused, stopped...)."""

    status_code = 409


class Fenced(SandboxStateError):
    """Cluster mode: a node refused a create sent under a cell lease (``X-DSec-Fence: cell:epoch``) older than
    one it has already seen for that cell: another gateway replica took the cell over, and the sender must
    not place there any more. Nothing was created."""


class SandboxTimeout(DSecError, TimeoutError):
    """The sandbox passed its wall-clock ``timeout`` and was destroyed."""

    status_code = 408


class QuotaExceeded(DSecError):
    """A per-job or per-node limit refused the request."""

    status_code = 429


class RateLimited(QuotaExceeded):
    """The token sent requests (or creates) faster than its limit; retry after ``retry_after`` seconds
    (also sent as the HTTP ``Retry-After`` header)."""

    @property
    def retry_after(self) -> float:
        """Seconds to wait before the request can succeed."""
        return float(self.detail.get("retry_after", 1.0))


class SandboxLost(DSecError):
    """The sandbox died on its own and could not be revived (its init or VM killed, its image mount's server
    dead: the message says which), or the node that owned it died (cluster mode); ``detail["node"]`` names the
    node. A trajectory-bound sandbox is rebuilt from its latest checkpoint when its trajectory is re-opened."""

    status_code = 410


class ReplayDivergence(DSecError):
    """A call replayed against a trajectory log differs from the logged one."""

    status_code = 409


class BackendUnavailable(DSecError):
    """The backend cannot run on this host (missing tool, no KVM...)."""

    status_code = 503


class NotSupported(DSecError, NotImplementedError):
    """This backend does not offer the operation."""

    status_code = 501


class SandboxError(DSecError):
    """The sandbox itself failed: its init died, a mount or cgroup operation failed."""

    status_code = 500


class RemoteError(DSecError):
    """The callable of ``sb.call`` raised inside the sandbox (or its pickle could not be loaded there).

    ``type_name`` is the remote exception's class (``"ValueError"``, ``"mymod.MyError"``), ``remote_traceback``
    its formatted traceback as printed inside the sandbox, ``stage`` one of ``load``, ``call``, ``result``."""

    status_code = 500

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message, **detail)
        self.type_name: str = str(detail.get("type", ""))
        self.remote_traceback: str = str(detail.get("traceback", ""))
        self.stage: str = str(detail.get("stage", ""))

    def __str__(self) -> str:
        if not self.remote_traceback:
            return self.message
        return f"{self.message}\n\nRemote traceback:\n{self.remote_traceback}"


class CallFailed(DSecError):
    """``sb.call`` produced no value: the call ended at one of its own limits (``detail["limit"]``: time,
    memory, output, pids, disk), crashed (no ``limit``), or returned something the client refuses to unpickle.
    ``detail["stderr"]`` is a bounded excerpt of what it printed. A failure of the sandbox itself is never
    this error."""

    status_code = 500


class ImageCorrupt(DSecError):
    """Bytes of an image (chunk, metadata, manifest) did not match their digest, even after a re-fetch."""

    status_code = 502


class StoreUnavailable(DSecError, ConnectionError):
    """The image store (directory, shared mount or S3 endpoint) cannot be reached or answered an error."""

    status_code = 503


class CacheFull(DSecError):
    """The node's image cache disk is full even after evicting every chunk no mounted image uses."""

    status_code = 507


class ConnectionFailed(DSecError, ConnectionError):
    """The client could not reach the daemon (not running, wrong URL, died mid-call)."""

    status_code = 502


class DaemonStopping(ConnectionFailed):
    """The node daemon is stopping (SIGTERM, ``dsec down``). Either it refused a create (new, or still queued
    for admission; a batch's or fork's sandboxes already made are destroyed again, nothing of it is kept), or
    a call still running at the end of the shutdown's grace period was cut off (an exec's command is killed).
    Retry once the daemon is back; its running sandboxes stay. A :class:`ConnectionFailed`, so code that
    retries a daemon going away retries this too. ``detail["kept"] == 0`` on a refused create: the daemon
    kept nothing of it (a call cut off at the grace period's end makes no such promise)."""

    status_code = 503


def _registry() -> dict[str, type[DSecError]]:
    found: dict[str, type[DSecError]] = {}
    stack: list[type[DSecError]] = [DSecError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def error_from_payload(payload: Any, status_code: int = 500) -> DSecError:
    """Rebuild the error a server sent; unknown or malformed payloads become a plain DSecError."""
    body = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(body, dict):
        return DSecError(f"HTTP {status_code}: {str(payload)[:500]}")
    cls = _registry().get(str(body.get("type")), DSecError)
    raw_detail = body.get("detail")
    detail: dict[str, Any] = raw_detail if isinstance(raw_detail, dict) else {}
    try:
        err = cls(str(body.get("message", "")), **detail)
    except TypeError:  # a class whose own arguments the detail does not fit
        err = cls(str(body.get("message", "")))
    err.detail = detail
    return err
