"""Persistent shell sessions: one ``bash`` per session whose state (cwd, variables, functions) outlives each
command, driven over a backend's process machinery.

Owns the session protocol. ``bash -i`` runs with its standard input on a terminal in raw mode (its
controlling terminal: job control, each command a foreground job of its own) and its output on two pipes,
so stdout and stderr stay apart. A command is sent as a here-document that bash reads into a variable and
``eval``s in the shell itself, followed on the same line by two markers carrying a random token: the exit
status on stdout, an end mark on stderr; what a stream carries before its marker is the command's output.
A command past its timeout gets SIGINT in its foreground job (an interactive bash then abandons the rest of
that line, markers included), so the session sends a fresh pair of markers and waits for them; a job that
ignores SIGINT gets SIGKILL. The shell itself is never killed by an interrupt: the session stays usable.
It never touches a backend's internals: only :meth:`Backend.start_process` and the :class:`ProcessIO`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time

from dsec.accounts import Identity
from dsec.backends.base import Backend
from dsec.backends.surface import ProcessIO, ProcessSpec, Stream
from dsec.errors import InvalidRequest, SandboxError
from dsec.models import SandboxRecord
from dsec.models.surface import ShellResult

__all__ = ["ShellSession"]

SHELL = ["/bin/bash", "--noprofile", "--norc", "--noediting", "-i"]
_QUIET = {"PS1": "", "PS2": "", "PS0": "", "PS4": "", "HISTFILE": "/dev/null", "TERM": "dumb"}
_SETUP = "PROMPT_COMMAND=; set +o history; set +b"
_GRACE_S = 2.0
"""How long an interrupted command has to end before its job gets SIGKILL (and again before the session
is declared stuck)."""
_START_S = 30.0


def _wrap(command: str, token: str) -> bytes:
    """The text bash reads for one command: the command itself is a quoted here-document (never parsed with
    the markers, so an unbalanced quote in it cannot swallow them), evaluated by the shell itself."""
    eof = f"DSEC_EOF_{token}"
    return (f"builtin read -r -d '' __dsec_c <<'{eof}'; builtin eval \"$__dsec_c\"; {_markers(token, '$?')}\n"
            f"{command}\n{eof}\n").encode()


def _markers(token: str, status: str) -> str:
    return (f"builtin printf '\\036%s %d\\036' {token} \"{status}\"; "
            f"builtin printf '\\036%s\\036' {token} >&2")


class _Stream:
    """One stream of a command: its output up to the first marker, then only markers."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.rest = bytearray()
        self.closed = False
        self.seen: dict[str, int | None] = {}


class _Run:
    """What one command printed so far, and the markers each stream has shown. ``tokens[-1]`` is the marker
    pair sent last: the run is over when both streams have shown it (nothing the session sent comes after)."""

    def __init__(self, token: str, cap: int) -> None:
        self.tokens = [token]
        self.cap = cap
        self.streams: dict[str, _Stream] = {"stdout": _Stream(), "stderr": _Stream()}
        self.truncated = False
        self.done = asyncio.Event()

    def feed(self, stream: str, chunk: bytes) -> None:
        state = self.streams.get(stream)
        if state is None:
            return
        buf = state.rest + chunk
        state.rest = bytearray()
        while buf:
            start = buf.find(b"\x1e")
            if start < 0:
                self._keep(state, buf)
                break
            self._keep(state, buf[:start])
            end = buf.find(b"\x1e", start + 1)
            if end < 0:
                if len(buf) - start <= 40:  # perhaps a marker cut by the chunk boundary: wait for the rest
                    state.rest = buf[start:]
                    break
                self._keep(state, buf[start:start + 1])
                buf = buf[start + 1:]
                continue
            words = buf[start + 1:end].decode(errors="replace").split()
            if words and words[0] in self.tokens:
                state.closed = True
                state.seen[words[0]] = int(words[1]) if len(words) > 1 and words[1].lstrip("-").isdigit() else None
                buf = buf[end + 1:]
            else:  # a record separator of the command's own output
                self._keep(state, buf[start:start + 1])
                buf = buf[start + 1:]
        if all(self.tokens[-1] in s.seen for s in self.streams.values()):
            self.done.set()

    def _keep(self, state: _Stream, data: bytes | bytearray) -> None:
        if state.closed or not data:
            return
        room = self.cap - len(state.out)
        if len(data) > room:
            self.truncated = True
            data = data[:max(room, 0)]
        state.out += data

    def output(self, stream: str) -> bytes:
        return bytes(self.streams[stream].out)

    def status(self) -> int | None:
        """The command's own exit status (None: its markers never ran: it was interrupted)."""
        return self.streams["stdout"].seen.get(self.tokens[0])


class ShellSession:
    """One persistent ``bash`` of a sandbox; :meth:`run` one command at a time (later ones wait)."""

    def __init__(self, session_id: str, user: str | None = None) -> None:
        self.id = session_id
        self.user = user
        self.process: ProcessIO | None = None
        self._run: _Run | None = None
        self._lock = asyncio.Lock()
        self.exit: tuple[int, int | None] | None = None
        self._exited = asyncio.Event()

    @classmethod
    async def start(cls, session_id: str, backend: Backend, record: SandboxRecord, identity: Identity | None,
                    cwd: str | None, env: dict[str, str] | None, user: str | None = None) -> ShellSession:
        """A new session's bash, ready for its first command."""
        session = cls(session_id, user)
        spec = ProcessSpec(argv=SHELL, env={**_QUIET, **(env or {})}, cwd=cwd, pty=(200, 50), pty_stdin=True)
        session.process = await backend.start_process(record, spec, session, identity)
        try:
            setup = await session.run(_SETUP, timeout=_START_S)
        except BaseException:
            await session.aclose()
            raise
        if setup.exit_code != 0:
            await session.aclose()
            raise SandboxError(f"the shell session did not start: {setup.stderr.decode(errors='replace')[:500]}")
        return session

    # -- the process's sink ---------------------------------------------------------------------------

    def output(self, stream: Stream, data: bytes) -> None:
        if self._run is not None:
            self._run.feed(stream, data)

    def exited(self, exit_code: int, signal: int | None) -> None:
        self.exit = (exit_code, signal)
        self._exited.set()

    @property
    def alive(self) -> bool:
        return self.exit is None and self.process is not None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    # -- commands -------------------------------------------------------------------------------------

    async def run(self, command: str, timeout: float | None = 60.0, max_output: int = 16 * 1024 * 1024
                  ) -> ShellResult:
        """Run ``command`` as typed at the session's prompt; its exit status and output."""
        if "\0" in command:
            raise InvalidRequest("a shell command cannot carry a NUL byte")
        async with self._lock:
            if not self.alive:
                code = self.exit[0] if self.exit else "?"
                raise SandboxError(f"shell session {self.id} has ended (exit status {code})", session=self.id)
            assert self.process is not None
            token = secrets.token_hex(8)
            run = self._run = _Run(token, max_output)
            started = time.monotonic()
            try:
                await self.process.write(_wrap(command, token))
                timed_out = not await self._wait(run, timeout)
                if timed_out:
                    await self._interrupt(run)
            finally:
                self._run = None
            status = run.status()
            if self.exit is not None and status is None:
                status = self.exit[0]  # the command ended the shell (exit, exec, a fatal signal)
            return ShellResult(exit_code=status if status is not None else 130, stdout=run.output("stdout"),
                               stderr=run.output("stderr"), duration_s=round(time.monotonic() - started, 6),
                               timed_out=timed_out, truncated=run.truncated)

    async def _wait(self, run: _Run, timeout: float | None) -> bool:
        """True when both markers came (or the shell ended) within ``timeout``."""
        done = asyncio.ensure_future(run.done.wait())
        ended = asyncio.ensure_future(self._exited.wait())
        try:
            finished, _ = await asyncio.wait({done, ended}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            ended.cancel()
        return bool(finished)

    async def _interrupt(self, run: _Run) -> None:
        """SIGINT to the running job, fresh markers to find the prompt again; SIGKILL to a job that ignores it."""
        assert self.process is not None
        for signo in (signal.SIGINT, signal.SIGKILL):
            await self.process.signal_foreground(signo, include_self=signo == signal.SIGINT)
            resync = secrets.token_hex(8)
            run.tokens.append(resync)
            with contextlib.suppress(OSError):
                await self.process.write(f"\n{_markers(resync, '130')}\n".encode())
            if await self._wait(run, _GRACE_S) or not self.alive:
                return
        await self.aclose()
        raise SandboxError(f"shell session {self.id} did not come back after its command was interrupted and "
                           "killed; the session is closed", session=self.id)

    async def aclose(self) -> None:
        """End the session (its bash and every job of it)."""
        if self.process is not None:
            await self.process.aclose()
        if self.exit is None:
            self.exit = (137, signal.SIGKILL)
            self._exited.set()
