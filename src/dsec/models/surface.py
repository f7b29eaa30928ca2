"""Wire models of the sandbox surface agent harnesses drive: process handles, terminals, shell sessions,
file operations and exposed ports.

Owns the surface's requests and responses, shared by the SDK, the node daemon and the gateway (importable from
:mod:`dsec.models` too). Must never describe a sandbox's lifecycle or a node. Binary fields travel as base64 in
JSON; no I/O.
"""

from __future__ import annotations

import stat
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dsec.models.common import Cwd, Env, Model, User, check_command, check_user

__all__ = [
    "ExposeRequest",
    "FileEvent",
    "FileStat",
    "MkdirRequest",
    "OwnerRequest",
    "PortInfo",
    "ProcessEvent",
    "ProcessInfo",
    "ProcessRequest",
    "PtySize",
    "RenameRequest",
    "ShellInfo",
    "ShellRequest",
    "ShellResult",
    "ShellRunRequest",
    "SignalRequest",
    "WatchInfo",
    "WatchRequest",
    "XattrRequest",
    "check_user",
    "check_xattr_names",
]

FileKind = Literal["file", "dir", "symlink", "other"]


class PtySize(Model):
    """A terminal's size in character cells."""

    cols: int = Field(80, ge=1, le=4096)
    rows: int = Field(24, ge=1, le=4096)


class ProcessRequest(Model):
    """A process to start and keep: it outlives the request (and the client), and is found again by pid."""

    command: str | list[str] | None = None
    """A shell string (``/bin/sh -c``) or an argv list; with ``pty`` and no command, the user's login shell."""
    cwd: Cwd = None
    """Working directory, absolute or relative to the sandbox's (default: the sandbox's)."""
    env: Env = None
    """Extra environment, merged over the sandbox's."""
    user: User = None
    """Run as this user (``name``, ``uid``, ``name:group``, ``uid:gid``; default: the sandbox's user)."""
    stdin: bytes | None = None
    """Bytes written to its standard input first."""
    keep_stdin: bool = True
    """Leave standard input open for ``send_stdin`` (False: closed after ``stdin``)."""
    pty: PtySize | None = None
    """Run it in a new terminal of this size (stdin, stdout and stderr on the terminal; output is ``pty``)."""
    tag: str | None = Field(None, max_length=256)
    """A name of the caller's choosing, shown in listings."""
    timeout: float | None = Field(None, gt=0)
    """Seconds before it is killed (default: none; it lives until it exits or the sandbox goes)."""

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_command(v)

    @model_validator(mode="after")
    def _needs_command(self) -> ProcessRequest:
        if self.command is None and self.pty is None:
            raise ValueError("give a command (only a terminal, pty=..., starts the user's shell by default)")
        return self


class ProcessInfo(Model):
    """A process started through DSec, running or ended."""

    pid: int
    """Its pid inside the sandbox (what ``ps`` there shows)."""
    command: list[str]
    """The argv it runs."""
    tag: str | None = None
    """The caller's name for it."""
    user: str | None = None
    """The user it runs as (as asked; None: the sandbox's)."""
    cwd: str
    """Its working directory."""
    env: dict[str, str] = Field(default_factory=dict)
    """The environment it was given on top of the sandbox's."""
    pty: PtySize | None = None
    """Its terminal's size, if it runs in one."""
    started_at: float
    """Unix seconds."""
    running: bool
    """False once it exited (its output stays readable until the sandbox goes or it is removed)."""
    stdin_open: bool = False
    """Its standard input accepts ``send_stdin``."""
    exit_code: int | None = None
    """Exit status once it ended (``128 + N`` when killed by signal N)."""
    signal: int | None = None
    """The signal that ended it."""
    ended_at: float | None = None
    """Unix seconds."""
    output_bytes: dict[str, int] = Field(default_factory=dict)
    """Bytes written so far per stream (``stdout``, ``stderr``, or ``pty``)."""
    dropped_bytes: dict[str, int] = Field(default_factory=dict)
    """Bytes per stream no longer kept (the oldest, past the per-process buffer)."""


class ProcessEvent(Model):
    """One item of a process's output stream."""

    type: Literal["stdout", "stderr", "pty", "dropped", "exit"]
    """Output of a stream; ``dropped``: output older than the buffer that a late reader missed; ``exit``."""
    data: bytes | None = None
    """The output chunk."""
    offset: int = 0
    """Position of ``data`` in its stream (bytes since the process started); for ``dropped``, where the kept
    output resumes. Pass it back (plus ``len(data)``) to continue reading after a reconnect."""
    dropped: int = 0
    """For ``dropped``: bytes of the stream lost before ``offset``."""
    stream: Literal["stdout", "stderr", "pty"] | None = None
    """For ``dropped``: which stream."""
    exit_code: int | None = None
    """For ``exit``."""
    signal: int | None = None
    """For ``exit``: the signal that ended it."""


class SignalRequest(Model):
    """A signal for a process (its whole process group unless ``group`` is false)."""

    signal: int = Field(15, ge=1, le=64)
    group: bool = True
    """Send it to the process group the process leads (its children too); False: the process only."""


class ShellRequest(Model):
    """A persistent shell session: one ``bash`` whose state (cwd, variables, functions) outlives each command."""

    user: User = None
    cwd: Cwd = None
    env: Env = None


class ShellInfo(Model):
    """A shell session of a sandbox."""

    id: str
    pid: int
    """The shell's pid inside the sandbox."""
    user: str | None = None
    alive: bool = True
    busy: bool = False
    """A command is running in it now."""


class ShellRunRequest(Model):
    """One command for a shell session, parsed by its ``bash`` as typed at its prompt."""

    command: str = Field(min_length=1)
    timeout: float | None = Field(60.0, gt=0)
    """Seconds before the command is interrupted (Ctrl-C, then SIGKILL of its job); the session stays usable."""
    max_output: int = Field(16 * 1024 * 1024, ge=0)
    """Captured bytes per stream; past it the rest is dropped (``truncated``)."""

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("command must not contain NUL bytes")
        return v


class ShellResult(Model):
    """What one shell-session command printed and how it ended."""

    exit_code: int
    """``$?`` after the command (130 when interrupted at its timeout)."""
    stdout: bytes = b""
    stderr: bytes = b""
    duration_s: float = 0.0
    timed_out: bool = False
    """The command was interrupted at its timeout."""
    truncated: bool = False
    """Output was cut at ``max_output``."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0


class FileStat(Model):
    """What ``stat`` says of a path (symlinks not followed)."""

    name: str
    path: str
    """Absolute path inside the sandbox."""
    type: FileKind
    size: int
    mode: int
    """Permission bits (with set-id and sticky bits)."""
    uid: int
    gid: int
    owner: str | None = None
    """The owner's name in the sandbox's ``/etc/passwd``, if it has one."""
    group: str | None = None
    """The group's name in the sandbox's ``/etc/group``, if it has one."""
    mtime: float
    """Modification time (Unix seconds)."""
    symlink_target: str | None = None
    """Where a symlink points (as written in it)."""
    xattrs: dict[str, str] | None = None
    """The path's extended attributes of the ``user.`` namespace, by full name (``user.e2b.author``), as text
    (bytes that are not UTF-8 read as U+FFFD); None where the backend does not read them, or where the user
    may not read the file."""

    @property
    def permissions(self) -> str:
        """``ls -l`` style: ``drwxr-xr-x``."""
        kind = {"file": "-", "dir": "d", "symlink": "l", "other": "?"}[self.type]
        return kind + stat.filemode(self.mode)[1:]


class MkdirRequest(Model):
    """A directory to create."""

    path: str
    parents: bool = False
    """Create missing parents, and accept an existing directory (``mkdir -p``)."""
    mode: int = Field(0o755, ge=0, le=0o7777)


class RenameRequest(Model):
    """Move ``source`` to ``destination`` (within the sandbox's filesystem)."""

    source: str
    destination: str
    overwrite: bool = True
    """Replace an existing ``destination`` (as ``mv`` does); False: :class:`~dsec.FileExists` instead."""


class OwnerRequest(Model):
    """New permission bits or owner for a path (symlinks followed)."""

    path: str
    mode: int | None = Field(None, ge=0, le=0o7777)
    owner: User = None
    """``user``, ``uid``, ``user:group`` or ``uid:gid`` (resolved in the sandbox)."""

    @model_validator(mode="after")
    def _one(self) -> OwnerRequest:
        if (self.mode is None) == (self.owner is None):
            raise ValueError("give exactly one of mode or owner")
        return self


XATTR_PREFIX = "user."
MAX_XATTR_NAME = 255
"""Linux's limit on an attribute's full name."""
MAX_XATTR_VALUE = 64 * 1024
"""Linux's limit on one attribute's value."""


def check_xattr_names(names: list[str]) -> None:
    """ValueError unless every name is ``user.NAME`` (the namespace a sandbox's own users may set)."""
    for name in names:
        if (not name.startswith(XATTR_PREFIX) or len(name) == len(XATTR_PREFIX) or "\0" in name
                or len(name.encode()) > MAX_XATTR_NAME):
            raise ValueError(f"invalid extended attribute name {name!r}: only the user namespace is served, "
                             f"as 'user.NAME' of at most {MAX_XATTR_NAME} bytes without NUL")


class XattrRequest(Model):
    """Extended attributes of the ``user.`` namespace to set on a file (and ones to remove), in one call."""

    path: str
    set: dict[str, str] = Field(default_factory=dict)
    """Full names (``user.NAME``) and their text values."""
    remove: list[str] = Field(default_factory=list)
    """Full names to remove (one that is not there is fine)."""

    @model_validator(mode="after")
    def _names(self) -> XattrRequest:
        check_xattr_names([*self.set, *self.remove])
        for name, value in self.set.items():
            if len(value.encode()) > MAX_XATTR_VALUE:
                raise ValueError(f"the value of {name!r} is {len(value.encode())} bytes; at most {MAX_XATTR_VALUE}")
        if set(self.set) & set(self.remove):
            raise ValueError(f"{sorted(set(self.set) & set(self.remove))} are both set and removed: give each once")
        return self


class WatchRequest(Model):
    """A directory to watch for changes."""

    path: str
    recursive: bool = False
    """Also watch every directory below it (including ones created later)."""


class WatchInfo(Model):
    """A file watch of a sandbox."""

    id: str
    path: str
    recursive: bool


class FileEvent(Model):
    """One change below a watched directory."""

    type: Literal["create", "modify", "delete", "move", "chmod"]
    path: str
    """The entry changed (for ``move``: where it was)."""
    dest: str | None = None
    """For ``move``: where it went (None: out of the watched tree). A move into the tree is a ``create``."""
    is_dir: bool = False
    dropped: int = 0
    """Events lost just before this one (the watch's buffer overflowed, or the kernel's queue did)."""
    number: int = 0
    """Its number in the watch (read on from ``number + 1``)."""


class ExposeRequest(Model):
    """A port inside the sandbox to make reachable from the client's side."""

    port: int = Field(ge=1, le=65535)
    protocol: Literal["http", "tcp"] = "http"
    """``http``: a URL (plain HTTP and WebSocket upgrades); ``tcp``: a ``host:port`` for any TCP stream."""


class PortInfo(Model):
    """An exposed port and how to reach it."""

    port: int
    """The port inside the sandbox."""
    protocol: Literal["http", "tcp"]
    url: str | None = None
    """For ``http``: the base URL (send ``headers`` with each request, or use ``authenticated_url`` once)."""
    host: str
    """Where the node listens for it."""
    host_port: int
    token: str
    """The sandbox's port token: ``X-DSec-Token`` header (http), basic auth's password (http), ``?dsec_token=``
    (http, once: it sets a cookie), or the first line ``DSEC <token>`` of a tcp stream."""

    @property
    def headers(self) -> dict[str, str]:
        """The header that authenticates HTTP requests to this port."""
        return {"X-DSec-Token": self.token}

    @property
    def address(self) -> str:
        """``host:port`` of the node's listener."""
        return f"{self.host}:{self.host_port}"

    @property
    def credentials_url(self) -> str | None:
        """``url`` with the token as basic-auth credentials (``http://dsec:<token>@host:port``): for clients that
        take a URL but no headers (SWE-ReX's ``RemoteRuntime(host=...)``, ``curl``)."""
        return None if self.url is None else self.url.replace("://", f"://dsec:{self.token}@", 1)

    @property
    def authenticated_url(self) -> str | None:
        """``url`` with the token as a query parameter (a browser then keeps it as a cookie)."""
        return None if self.url is None else f"{self.url}/?dsec_token={self.token}"

