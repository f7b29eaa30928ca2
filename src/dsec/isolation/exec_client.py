"""Daemon side of the exec helper: start it, hand it a command, stream what the command does.

:class:`ExecHelper` owns the helper process (``dsec-nsexec``, built from ``nsexec.c``) and the
socketpair to it. :func:`stream_exec` turns one spawned command into ``ExecEvent``s with
the limits every backend promises: wall-clock timeout, captured-output cap, kill on
close, and a verdict naming the limit that ended the command.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import BackendUnavailable, InvalidRequest, SandboxError
from dsec.isolation.affinity import hex_mask, sandbox_cpus
from dsec.isolation.pipewatch import pipe_watch
from dsec.isolation.procs import reap
from dsec.models import ExecEvent, ExecRequest, ExecResult, LimitHit

__all__ = ["ARG_MAX", "MAX_ARG_STRLEN", "MAX_MESSAGE", "ExecHelper", "Spawned", "check_exec_size", "encode_request",
           "send_with_pipes", "stream_exec"]

ARG_MAX = 2 << 20
"""What Linux's execve takes of arguments and environment together (a quarter of the usual 8 MiB stack),
counting each string with its NUL and a pointer for each."""
MAX_ARG_STRLEN = 32 * 4096
"""What execve takes per argument or environment string, its NUL included."""
MAX_MESSAGE = ARG_MAX + (64 << 10)
"""The largest request a peer (the exec helper, a zygote, a guest agent) reads per command (``MAX_MESSAGE`` in
``nsexec.c``): a command at the kernel's limit plus the request's own fields."""

_CHUNK = 64 * 1024
# After the command exits, output still in the pipes is read for this long; a background job that
# keeps the pipes open does not hold the call hostage (it gets EPIPE later: redirect its output).
_DRAIN_AFTER_EXIT_S = 0.2
# ...or longer, up to this, while the pipes are paused for a slow consumer.
_DRAIN_MAX_S = 2.0
# How long a command killed at its timeout has to show its exit before the call ends without it: a process
# of a paused (frozen) sandbox keeps a SIGKILL pending until the sandbox is resumed.
_KILLED_GRACE_S = 5.0
# A timeout given back for the time a command waited for a CPU (``stream_exec``'s ``starved``): at most this many
# times the timeout and this many seconds in all, and only in steps worth a timer.
_STARVED_FACTOR = 10.0
_STARVED_MAX_S = 300.0
_STARVED_MIN_S = 0.02
_PRESSING_STEP_S = 0.5
# Output waiting for a slow consumer; past it the pipes are paused (the command blocks on write).
_MAX_QUEUED = 4 * 1024 * 1024
# Messages to a helper or zygote up to this size fit any default socket send buffer.
_SMALL_MESSAGE = 128 * 1024
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
# How long a request may wait for room in the queue of a helper or zygote that does not read.
_SEND_WITHIN_S = 30.0


@dataclass
class Spawned:
    """Our ends of a command's pipes."""

    stdin: int
    stdout: int
    stderr: int
    status: int
    pid: int | None = None
    closed: bool = field(default=False)
    reports: dict[str, str] = field(default_factory=dict)
    """Status lines the stream does not act on itself, by kind (a function call's ``tmpfull``), for verdicts."""

    def kill(self) -> None:
        """SIGKILL the command's process group (it is a session leader)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.stdin, self.stdout, self.stderr, self.status):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)


def check_exec_size(argv: list[str], env: dict[str, str]) -> None:
    """Refuse, naming the limit, a command whose arguments and environment the kernel's execve would refuse
    (E2BIG): a string over :data:`MAX_ARG_STRLEN`, or all of them over :data:`ARG_MAX`."""
    strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
    sizes = [len(os.fsencode(text)) + 1 for text in strings]
    for index, size in enumerate(sizes):
        if size > MAX_ARG_STRLEN:
            name = strings[index].split("=")[0]
            what = f"argument {index}" if index < len(argv) else f"environment variable {name!r}"
            raise InvalidRequest(f"{what} of the command is {size - 1} bytes: Linux's exec takes at most "
                                 f"{MAX_ARG_STRLEN - 1} per string (MAX_ARG_STRLEN); pass larger data as stdin "
                                 "or in a file", size=size - 1, limit=MAX_ARG_STRLEN - 1)
    total = sum(sizes) + 8 * (len(strings) + 2)
    if total > ARG_MAX:
        raise InvalidRequest(f"the command's arguments and environment take {total} bytes: Linux's exec takes at "
                             f"most {ARG_MAX} (ARG_MAX); pass larger data as stdin or in a file", size=total,
                             limit=ARG_MAX)


def encode_request(request: dict[str, Any]) -> bytes:
    """The exec helper's request for one command: NUL-terminated fields (see ``nsexec.c``)::

        INIT_PID UID GID[,GROUP...] CAPMASK(hex) NOFILE FLAGS CWD NCGROUPS CGROUP_PROCS... ARGC ARGV... ENVC ENV...

    FLAGS: bit 0 Landlock, bit 1 pristine, bit 2 fd 0 is the controlling terminal, bit 3 setuid (no no_new_privs)
    (``nsenter.c``). A NUL inside a
    field would shift every field after it: such a request is refused here, naming the field (the API's
    models refuse them earlier)."""
    flags = (int(request.get("landlock", True)) | int(request.get("pristine", False)) << 1
             | int(request.get("tty", False)) << 2 | int(request.get("setuid", False)) << 3)
    cgroups, argv, env = list(request["cgroup_procs"]), list(request["argv"]), request["env"]
    groups = ",".join(str(int(g)) for g in [request["gid"], *request.get("groups", ())])
    fields = [str(int(request["init_pid"])), str(int(request["uid"])), groups,
              f"{int(request['capmask']):x}", str(int(request["nofile"])), str(flags), request["cwd"],
              str(len(cgroups)), *cgroups, str(len(argv)), *argv, str(len(env)),
              *(f"{key}={value}" for key, value in env.items())]
    encoded = [os.fsencode(field) for field in fields]
    message = b"\0".join(encoded) + b"\0"
    if message.count(b"\0") != len(encoded):
        bad = next(field for field in fields if "\0" in field)
        raise InvalidRequest(f"a NUL byte in {bad!r}: commands, environment and working directory cannot carry one")
    if any(not key or "=" in key for key in env):
        raise InvalidRequest(f"environment names must be non-empty without '=': {sorted(env)!r}")
    return message


class ExecHelper:
    """One helper process per daemon; :meth:`spawn` is cheap (one message + one vfork there)."""

    def __init__(self, seccomp_bpf: bytes, nsenter: Path, binary: Path) -> None:
        self._bpf = seccomp_bpf
        self._nsenter = nsenter
        self._binary = binary
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.healed: list[tuple[str, float, float]] = []
        """Deaths found and repaired by :meth:`spawn` itself, before the daemon's watchdog saw them: (what was
        wrong, when found, when repaired), for the health registry to count (:meth:`Backend.take_healed`)."""

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                # It runs where the daemon runs (housekeeping CPUs, if any); its commands get the node's CPUs back.
                [str(self._binary), str(theirs.fileno()), str(self._nsenter), hex_mask(sandbox_cpus())],
                stdin=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            raise BackendUnavailable(f"cannot start the exec helper: {e}") from e
        finally:
            theirs.close()
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._bpf)
        self._proc.stdin.close()
        self._sock = ours

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    @property
    def pid(self) -> int | None:
        """The helper's pid (None before it starts)."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the helper process runs (non-blocking)."""
        return self._proc is not None and self._proc.poll() is None

    def _death(self) -> str | None:
        """How the helper that ran ended (None: none ran)."""
        if self._proc is None:
            return None
        code = self._proc.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exited with status {code}")
        return f"the exec helper (dsec-nsexec, pid {self._proc.pid}) {how}"

    def restart(self) -> None:
        """Start a new helper after this one died (what :meth:`spawn` also does on its own at the next exec)."""
        self.close()
        self.start()

    async def spawn(self, request: dict[str, Any],
                    stdio: tuple[int | None, int | None, int | None] = (None, None, None)) -> Spawned:
        """Ask the helper to run ``request`` (fields: :func:`encode_request`); returns our pipe ends (``stdio``:
        see :func:`send_with_pipes`)."""
        message = encode_request(request)
        if self._proc is None or self._proc.poll() is not None:
            # The helper died (or was never started): one restart, then give up loudly.
            began, why = time.time(), self._death()
            self.close()
            self.start()
            if why is not None:
                self.healed = [*self.healed[-99:], (why, began, time.time())]
        assert self._sock is not None
        return await send_with_pipes(self._sock, message, "exec helper", stdio=stdio)


async def send_with_pipes(sock: socket.socket, message: bytes, peer: str,
                          within: float = _SEND_WITHIN_S, stdio: tuple[int | None, int | None, int | None] = (
                              None, None, None), extra_fds: Sequence[int] = ()) -> Spawned:
    """Send ``message`` to ``peer`` (the exec helper, a zygote) with the far ends of four new pipes
    (stdin, stdout, stderr, status) attached, then ``extra_fds`` (a function call's cgroup files, which stay
    ours); returns our ends, non-blocking. ``stdio`` replaces the far ends of stdin, stdout and stderr (a
    terminal's side); the caller keeps its own copies of those."""
    if len(message) > MAX_MESSAGE:
        # A peer reads at most this much per command (callers check the kernel's exec limit first).
        raise InvalidRequest(f"the command's arguments, environment and working directory take {len(message)} "
                             f"bytes; at most {MAX_MESSAGE} are accepted", size=len(message))
    if len(message) > _SMALL_MESSAGE and len(message) > _widen_send_buffer(sock):
        raise InvalidRequest(f"the command's arguments, environment and working directory take {len(message)} "
                             f"bytes; this host's socket buffers carry at most {_widen_send_buffer(sock)} "
                             f"(net.core.wmem_max)", size=len(message))
    pipes = [os.pipe2(os.O_CLOEXEC) if i == 3 or stdio[i] is None else (-1, -1) for i in range(4)]
    theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
    ours = Spawned(stdin=pipes[0][1], stdout=pipes[1][0], stderr=pipes[2][0], status=pipes[3][0])
    sent = [fd if given is None else given for fd, given in zip(theirs, (*stdio, None), strict=True)]
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [*sent, *extra_fds]).tobytes())]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pause = 0.001
    try:
        # Never blocking the event loop: a peer that does not read (a zygote in a sandbox starved of CPU, its
        # queue full of requests) holds this call only, for ``within`` seconds. Polled, not a writer callback:
        # the socket is shared by concurrent calls (one writer per fd: a second replaced the first), and may be
        # closed by a destroy in a worker thread meanwhile (a closed socket fails the next try at once).
        while True:
            try:
                sock.sendmsg([message], rights, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                if loop.time() >= deadline:
                    raise SandboxError(f"{peer} took no request for {within:g} s (its queue is full: is its "
                                       "sandbox starved of CPU?)") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
    except OSError as e:
        ours.close()
        raise SandboxError(f"{peer} is unreachable: {e}") from e
    except BaseException:
        ours.close()
        raise
    finally:
        for fd in theirs:
            if fd >= 0:
                os.close(fd)
    for fd in (ours.stdin, ours.stdout, ours.stderr, ours.status):
        if fd >= 0:
            os.set_blocking(fd, False)
    return ours


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _writable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_writer(fd, _resolve, ready)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


def _widen_send_buffer(sock: socket.socket) -> int:
    """Make ``sock`` carry a request of up to ``MAX_MESSAGE`` bytes; returns the largest it now carries.

    Past the send buffer (``net.core.wmem_default``, ~208 KiB) a datagram is refused with EMSGSIZE. The daemon
    runs as root, so SO_SNDBUFFORCE goes past ``net.core.wmem_max`` (also ~208 KiB on a stock host), where
    SO_SNDBUF would be capped silently; the kernel keeps 32 bytes of the buffer for itself.
    """
    want = MAX_MESSAGE + 64 * 1024
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, want)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, want)
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)) - 32


async def _feed_stdin(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                await _writable(fd)
    except (BrokenPipeError, OSError):
        pass  # the command closed its stdin early; that is its business
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_ready(fd: int) -> bytes | None:
    """What a readable pipe holds: ``b""`` at EOF (or a read error), None when there was nothing after all."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _kill_once_started(loop: asyncio.AbstractEventLoop, fd: int, buffered: bytes, within: float = 10.0,
                       then: Callable[[int, bool], None] | None = None) -> None:
    """Own status pipe ``fd`` of a call closed before its command's pid was known: read on until the helper
    reports the pid, kill the command's process group then, and close the pipe (also at EOF: nothing was
    started, and after ``within`` seconds), or hand it to ``then(fd, at_eof)`` instead, its only reader from
    then on (a reader beside this one could take the pid line from it)."""
    pending = bytearray(buffered)
    timer: asyncio.TimerHandle | None = None

    def done(at_eof: bool = False) -> None:
        nonlocal fd
        if fd >= 0:
            loop.remove_reader(fd)
            if then is None:
                os.close(fd)
            else:
                then(fd, at_eof)
            fd = -1
        if timer is not None:
            timer.cancel()

    def ready() -> None:
        data = _read_ready(fd)
        if data is None:
            return
        pending.extend(data)
        lines = dict(line.partition(b" ")[::2] for line in bytes(pending).split(b"\n")[:-1])
        if b"pid" in lines:
            if b"exit" not in lines:  # (exited and reaped already: its number may be another's now)
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.killpg(int(lines[b"pid"]), signal.SIGKILL)
            done()
            return
        if not data:
            done(at_eof=True)

    loop.add_reader(fd, ready)
    timer = loop.call_later(within, done)


def _decode_status(wstatus: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        return 128 + sig, sig
    return os.waitstatus_to_exitcode(wstatus), None


def _raise_or_shell_status(error: str, request: ExecRequest, captured: dict[str, bytearray]) -> None:
    """A command that cannot be found or executed ends as it would in a shell (127/126, the reason on
    stderr); a bad working directory is the caller's mistake; anything else is the sandbox's failure."""
    if error.startswith("working directory"):
        raise InvalidRequest(error, cwd=request.cwd)
    if error.startswith("cannot execute"):
        captured["stderr"] += f"dsec: {error}\n".encode()
        return
    raise SandboxError(f"could not start {request.argv()[0]!r} in the sandbox: {error}", argv=request.argv())


class _Watch:
    """Everything the limits need, driven by loop callbacks, never by the consumer.

    Output is read as it comes, capped per stream at read time (past the cap the command is killed and
    the rest discarded), and queued for the consumer with backpressure (a consumer that stops reading
    pauses the pipes, never grows the daemon's memory); the timeout is a loop timer. A stalled HTTP
    client therefore cannot keep a command alive past its timeout or make the daemon buffer ``yes``."""

    def __init__(self, spawned: Spawned, request: ExecRequest, caps: Mapping[str, int] | None = None,
                 starved: Callable[[], float] | None = None, pressing: Callable[[], bool] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.pipes = pipe_watch(self.loop)
        self.spawned = spawned
        self.request = request
        self.caps = {"stdout": request.max_output, "stderr": request.max_output, **(caps or {})}
        # What the consumer has not taken yet, and the future it waits on while there is nothing (a deque and a
        # bare future: an asyncio.Queue costs a few objects and a lock-step of its own per exec).
        self.items: deque[tuple[str, bytes]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.queued = 0
        self.paused = False
        self.open: dict[int, str] = {}
        self.counts = {"stdout": 0, "stderr": 0}
        self.status_buf = b""
        self.wstatus: int | None = None
        self.status_closed = False
        self.setup_error: str | None = None
        self.usage: tuple[float, int] | None = None
        self.limit: LimitHit | None = None
        self.truncated = False
        self.timer: asyncio.TimerHandle | None = None
        self.unseen_exit = False
        """Killed at the timeout, and its exit not seen within ``_KILLED_GRACE_S``: the call ends without it."""
        self.starved = starved
        self.pressing = pressing
        self.credited = 0.0
        self.sent_at = self.loop.time()
        self.started_at: float | None = None
        self.delay_at_start = 0.0
        """A function call's ``start DELAY_NS`` line: when its setup ended, and what it had waited for a CPU then."""
        if request.timeout:
            self.timer = self.loop.call_later(request.timeout, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.wstatus is None and self.starved is not None and self.request.timeout:
            # The time the command waited for a CPU (the node overloaded) is given back, within a bound: the
            # timeout measures the command, not the node.
            # ...and so is the time before it started at all (its zygote waiting for a CPU, its cgroup move)
            waited = (self.started_at or self.loop.time()) - self.sent_at
            since = max(self.starved() - self.delay_at_start, 0.0) if self.started_at is not None else 0.0
            room = min(_STARVED_FACTOR * self.request.timeout, _STARVED_MAX_S) - self.credited
            extra = min(max(waited + since - self.credited, 0.0), room)
            if extra < _STARVED_MIN_S and self.pressing is not None and self.pressing():
                # At its memory limit when its time ran out: the kernel is reclaiming, or waiting to OOM-kill it
                # (the node's OOM killer takes one cgroup at a time). The memory verdict is the one it earned.
                extra = min(_PRESSING_STEP_S, room)
            if extra >= _STARVED_MIN_S:
                self.credited += extra
                self.timer = self.loop.call_later(extra, self._timed_out)
                return
        if self.wstatus is None:
            self.limit = self.limit or "time"
            self.spawned.kill()  # no-op until the pid is known; the "pid" line kills then
            self.timer = self.loop.call_later(_KILLED_GRACE_S, self._exit_unseen)

    def _exit_unseen(self) -> None:
        self.timer = None
        if self.wstatus is None and not self.status_closed and self.spawned.pid is not None:
            self.unseen_exit = True
            self._push("status", b"")

    def add(self, fd: int, name: str) -> None:
        self.open[fd] = name
        self._watch(fd)

    def _watch(self, fd: int) -> None:
        self.pipes.add(fd, lambda: self._ready(fd))

    def remove(self, fd: int) -> None:
        if self.open.pop(fd, None) is not None:
            self.pipes.remove(fd)

    def _ready(self, fd: int) -> None:
        name = self.open.get(fd)
        if name is None:
            return
        data = _read_ready(fd)
        if data is None:
            return
        if not data:
            self.remove(fd)
        if name == "status":
            self._status(data)
        elif data:
            self._output(name, data)
        else:
            self._push(name, b"")  # EOF marker

    def _status(self, data: bytes) -> None:
        self.status_buf += data
        while b"\n" in self.status_buf:
            line, self.status_buf = self.status_buf.split(b"\n", 1)
            kind, _, value = line.decode(errors="replace").partition(" ")
            if kind == "pid":
                self.spawned.pid = int(value)
                if self.started_at is None:
                    self.started_at = self.loop.time()
            elif kind == "start":  # a function call's own: its setup is over (it comes after "pid")
                self.started_at = self.loop.time()
                self.delay_at_start = int(value or 0) / 1e9
                if self.limit is not None:
                    self.spawned.kill()
            elif kind == "exit":
                if self.wstatus is None:  # the first report wins (a function call's own comes first)
                    self.wstatus = int(value)
            elif kind == "usage":
                cpu_us, _, rss_kb = value.partition(" ")
                self.usage = (int(cpu_us) / 1e6, int(rss_kb) * 1024)
            elif kind == "error":
                self.setup_error = value
            elif kind:
                self.spawned.reports[kind] = value
        if not data:
            self.status_closed = True
        if self.wstatus is not None or self.status_closed:
            self._push("status", b"")

    def _output(self, name: str, data: bytes) -> None:
        room = self.caps[name] - self.counts[name]
        if len(data) > room:
            data = data[: max(room, 0)]
            if not self.truncated:
                self.truncated = True
                self.limit = self.limit or "output"
                self.spawned.kill()
        if data:
            self.counts[name] += len(data)
            self._push(name, data)

    def _push(self, name: str, data: bytes) -> None:
        self.items.append((name, data))
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        self.queued += len(data)
        if self.queued > _MAX_QUEUED and not self.paused:
            self.paused = True
            for fd, stream in self.open.items():
                if stream != "status":
                    self.pipes.remove(fd)

    def drained(self) -> None:
        """The drain timer's marker: stop waiting for output of a command that has exited."""
        self._push("drained", b"")

    async def get(self) -> tuple[str, bytes]:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        name, data = self.items.popleft()
        self.queued -= len(data)
        if self.paused and self.queued <= _MAX_QUEUED // 2:
            self.paused = False
            for fd, stream in self.open.items():
                if stream != "status":
                    self._watch(fd)
        return name, data

    def outputs_open(self) -> bool:
        return any(stream != "status" for stream in self.open.values())

    def close(self) -> None:
        for fd in list(self.open):
            self.remove(fd)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


async def stream_exec(
    spawned: Spawned,
    request: ExecRequest,
    verdict: Callable[[int, int | None], LimitHit | None] | None = None,
    peer: str = "the exec helper",
    caps: Mapping[str, int] | None = None,
    starved: Callable[[], float] | None = None,
    pressing: Callable[[], bool] | None = None,
    status_to: Callable[[int, bool], None] | None = None,
) -> AsyncGenerator[ExecEvent, None]:
    """Stream a spawned command to its end. ``verdict(exit_code, signal)`` names a cgroup limit hit; ``peer``
    is what started it (named when it goes away mid-command); ``caps`` overrides ``request.max_output`` per
    stream (a function call's reply on stdout and its prints on stderr have caps of their own); ``starved()``
    says how many seconds the command has waited for a CPU so far, which its timeout then does not count
    (up to ``_STARVED_FACTOR`` times the timeout), nor, within that bound, the time while ``pressing()`` says
    it is at its memory limit (the OOM killer on its way). ``status_to(fd, at_eof)``, when given, takes the
    status pipe when the stream ends instead of it being closed (whether it reached end of file yet): the
    pipe stays registered with the loop's :func:`~dsec.isolation.pipewatch.pipe_watch`, so taking it over is
    a :meth:`~dsec.isolation.pipewatch.PipeWatch.replace` of its callback, not a second registration."""
    watch = _Watch(spawned, request, caps, starved, pressing)
    captured = {"stdout": bytearray(), "stderr": bytearray()}
    start = time.monotonic()
    exited_at: float | None = None
    drain_timer: asyncio.TimerHandle | None = None
    stdin_task: asyncio.Task[None] | None = None
    try:
        # The status pipe first: the helper reports the command's pid before it can print anything.
        watch.add(spawned.status, "status")
        watch.add(spawned.stdout, "stdout")
        watch.add(spawned.stderr, "stderr")
        if request.stdin:
            stdin_task = asyncio.create_task(_feed_stdin(spawned.stdin, request.stdin))
        else:
            os.close(spawned.stdin)
        spawned.stdin = -1
        while True:
            if exited_at is None and (watch.wstatus is not None or watch.status_closed or watch.unseen_exit):
                exited_at = time.monotonic()
                # After the exit, output still in the pipes is read for a short while; a background job
                # that keeps the pipes open does not hold the call.
                drain_timer = watch.loop.call_later(_DRAIN_AFTER_EXIT_S, watch.drained)
            if exited_at is not None and not watch.outputs_open() and not watch.items:
                break
            name, data = await watch.get()
            if name == "drained":
                # Pipes paused for a slow consumer still hold the command's own last output (at most a
                # pipe buffer each): keep going while the consumer catches up, within a bound.
                if watch.paused and time.monotonic() - (exited_at or 0.0) < _DRAIN_MAX_S:
                    drain_timer = watch.loop.call_later(_DRAIN_AFTER_EXIT_S, watch.drained)
                    continue
                if watch.paused:
                    watch.truncated = True  # output was left in the pipes: say so rather than drop it silently
                break
            if name in captured and data:
                captured[name] += data
                yield ExecEvent(type=name, data=data)
        if watch.setup_error is not None:
            _raise_or_shell_status(watch.setup_error, request, captured)
        if watch.wstatus is None and watch.unseen_exit:
            # SIGKILLed at the timeout; a frozen (paused) sandbox holds the signal until it is resumed. The call
            # keeps its timeout: it ends now, as killed at its limit, which the command will be.
            captured["stderr"] += (f"dsec: killed at its {request.timeout:g} s timeout; its exit was not seen "
                                   f"{_KILLED_GRACE_S:g} s later (a paused sandbox's processes die when it is "
                                   "resumed)\n").encode()
            watch.wstatus = signal.SIGKILL  # a wait status: killed by SIGKILL
        if watch.wstatus is None:
            # The helper went away without a verdict: any exit code we made up would be a lie.
            if spawned.pid is None:
                raise SandboxError(f"{peer} went away before starting {request.argv()[0]!r}")
            spawned.kill()
            # The helper's children are the daemon's now (its subreaper): collect this one, not a zombie for good.
            threading.Thread(target=reap, args=(spawned.pid, 2.0, True), name="dsec-reap", daemon=True).start()
            spawned.pid = None  # the reaper's now: no later kill may reach whatever reuses the number
            raise SandboxError(f"{peer} went away while running {request.argv()[0]!r}: the command is killed "
                               "(nothing could watch it any more) and its exit status is lost")
        exit_code, sig = _decode_status(watch.wstatus)
        limit = watch.limit
        if limit == "time" and sig != signal.SIGKILL:
            limit = None  # it exited on its own just as the timeout fired (its status not read yet): not killed
        if limit is None and verdict is not None:
            limit = verdict(exit_code, sig)
        result = ExecResult(
            exit_code=exit_code,
            stdout=bytes(captured["stdout"]),
            stderr=bytes(captured["stderr"]),
            duration_s=round(time.monotonic() - start, 6),
            truncated=watch.truncated,
            signal=sig,
            limit=limit,
            cpu_s=watch.usage[0] if watch.usage else None,
            memory_peak_bytes=watch.usage[1] if watch.usage else None,
        )
        yield ExecEvent(type="exit", result=result)
    finally:
        handover = (watch.wstatus is None and spawned.pid is None and not watch.status_closed
                    and not watch.loop.is_closed())
        if watch.wstatus is None:
            spawned.kill()  # closed early (client gone, caller cancelled): the command must not run on
        if status_to is not None and not handover:
            watch.open.pop(spawned.status, None)  # its watch stays registered for status_to
        watch.close()
        if handover:
            # Closed before the helper's "pid" line was read (it may sit in the pipe, or come a moment later):
            # closing the pipe now would leave that command running with no one to kill it.
            _kill_once_started(watch.loop, spawned.status, watch.status_buf, then=status_to)
            spawned.status = -1
        elif status_to is not None:
            status, spawned.status = spawned.status, -1
            status_to(status, watch.status_closed)
        if drain_timer is not None:
            drain_timer.cancel()
        if stdin_task is not None and not stdin_task.done():
            stdin_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stdin_task
        spawned.close()
