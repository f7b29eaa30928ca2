"""The process and port parts of the backend interface: what a backend hands the daemon for a process it
started and keeps running, and for a connection it opened to a port inside a sandbox.

A :class:`ProcessIO` is driven by the backend's own machinery (the exec helper's pipes, a zygote's, a guest
agent's channel) and reports to a :class:`ProcessSink` as things happen: output chunks as they are read,
the exit once. It never buffers output itself and never decides how long a process is kept: the daemon's
process table does (``daemon/processes.py``). This module does no I/O.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = ["PortStream", "ProcessIO", "ProcessSink", "ProcessSpec", "Stream"]

Stream = Literal["stdout", "stderr", "pty"]


@dataclass(frozen=True)
class ProcessSpec:
    """A process to start (the backend adds the sandbox's environment, user and working directory)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment, merged over the sandbox's (and ``HOME`` of the user)."""
    cwd: str | None = None
    """Absolute working directory (None: the sandbox's)."""
    pty: tuple[int, int] | None = None
    """``(cols, rows)``: stdin, stdout and stderr on a new terminal, which is its controlling terminal."""
    pty_stdin: bool = False
    """With ``pty``: only stdin on the terminal (its controlling terminal, for job control and Ctrl-C);
    stdout and stderr stay pipes (a shell session)."""
    timeout: float | None = None
    """Seconds before the backend kills it (None: never)."""


class ProcessSink(Protocol):
    """Where a :class:`ProcessIO` reports; called on the event loop, never blocking."""

    def output(self, stream: Stream, data: bytes) -> None:
        """``data`` arrived on ``stream``."""

    def exited(self, exit_code: int, signal: int | None) -> None:
        """The process ended (called once, after the output it wrote before ending)."""


class ProcessIO(abc.ABC):
    """A running process as its backend holds it."""

    pid: int
    """Its pid inside the sandbox (unique among the sandbox's live processes)."""
    streams: tuple[Stream, ...]
    """The streams it reports: ``("stdout", "stderr")``, or ``("pty",)`` on a terminal."""

    @abc.abstractmethod
    async def write(self, data: bytes) -> None:
        """Write to its standard input (the terminal's input when it has one); OSError once it is closed."""

    @abc.abstractmethod
    async def close_stdin(self) -> None:
        """End its standard input (EOF); a terminal gets Ctrl-D instead."""

    @abc.abstractmethod
    def signal(self, signo: int, group: bool = True) -> None:
        """Send ``signo`` to it (``group``: to the process group it leads)."""

    @abc.abstractmethod
    async def signal_foreground(self, signo: int, include_self: bool = True) -> None:
        """Send ``signo`` to its terminal's foreground process group (a shell's running job); when that group
        is the process's own (a shell between jobs, or running a builtin), only if ``include_self``."""

    @abc.abstractmethod
    async def resize(self, cols: int, rows: int) -> None:
        """Set its terminal's size (SIGWINCH to the foreground job)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Kill it if it still runs and release what the backend holds for it (fds, channels)."""


class PortStream(Protocol):
    """A connection to a port inside a sandbox: bytes in both directions until either side ends."""

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; ``b""`` at the end."""

    async def write(self, data: bytes) -> None:
        """Send ``data`` (waits while the other side is slow)."""

    async def write_eof(self) -> None:
        """Half-close: the other side reads its end."""

    async def aclose(self) -> None:
        """Close both directions."""
