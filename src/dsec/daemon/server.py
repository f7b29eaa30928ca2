"""Running the node daemon: ``serve`` in the foreground, ``up``/``down`` in the background.

Owns the process side: directories and their modes, the unix socket (0600 in a 0700 directory), the
optional TCP listener (always behind a token), signals, the home's lock, the janitor that cleans up if the
daemon dies (:mod:`dsec.daemon.janitor`), the start-up phases (:mod:`dsec.daemon.startup`), the pid file and the
log file. It must never hold sandbox logic (the engine does) and never destroy sandboxes on a plain stop: a
restarted daemon re-adopts them.

    serve(settings, tcp=None, token=None, engine=None)   # blocks until SIGTERM/SIGINT
    up(settings, tcp=None, token=None, timeout=15) -> pid # background daemon, waits while its start progresses
    down(settings, destroy=False, timeout=30) -> bool     # stop the home's daemon, however it was started
    restart(settings, ...) -> pid                         # down (if one runs), then up
    destroy_every(base_url, uds=None, token=None) -> int  # every sandbox a daemon holds, in parallel
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn

from dsec.api.client import NodeClient
from dsec.config import Settings
from dsec.daemon import memory
from dsec.daemon.app import AnswerCutOffCalls, create_app
from dsec.daemon.auth import TokenFile
from dsec.daemon.engine import Engine
from dsec.daemon.janitor import Janitor
from dsec.daemon.startup import SERVING, Phases, find_daemon, is_dsec, lock_holder, read_status, write_lock_owner
from dsec.e2b.options import E2BOptions
from dsec.errors import DSecError, NotFound
from dsec.fusion.options import FusionOptions
from dsec.isolation import affinity
from dsec.isolation.procs import start_time

__all__ = ["Daemon", "ServeError", "daemon_answers", "destroy_every", "down", "loop_factory", "restart", "serve",
           "up"]

log = logging.getLogger(__name__)

# Popen objects of daemons this process started, kept so they are reaped (no zombie, no ResourceWarning).
_children: dict[int, subprocess.Popen[bytes]] = {}
_JANITOR_WAIT = 30.0
"""How long a new daemon, ``dsec up`` or ``dsec down`` wait for a dead daemon's janitor to finish its cleanup."""


def _reap_exited() -> None:
    """Forget (and reap) daemons this process started that have exited since, a killed one included."""
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            del _children[pid]


class ServeError(RuntimeError):
    """The daemon cannot start or stop (already running, bad address, died at startup)."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon stops both listeners on one signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _parse_tcp(tcp: str) -> tuple[str, int]:
    host, sep, port = tcp.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ServeError(f"--tcp must look like HOST:PORT (e.g. 127.0.0.1:8600), got {tcp!r}")
    return host.strip("[]"), int(port)


def daemon_answers(settings: Settings) -> bool:
    """True when a daemon answers ``GET /v1/health`` on the settings' unix socket."""
    if not settings.socket_path.exists():
        return False
    # One plain HTTP/1.1 request on a socket we own: httpx leaks its socket when the peer vanishes
    # between connect and response (a daemon dying while `dsec up` watches it).
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(settings.socket_path))
            probe.sendall(b"GET /v1/health HTTP/1.1\r\nHost: dsec\r\nConnection: close\r\n\r\n")
            head = probe.recv(32)
        except OSError:
            return False
    return head.startswith(b"HTTP/1.1 200")


def _bind_unix(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        # Only the daemon's user may talk to it: the socket carries no token.
        os.chmod(path, 0o600)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on TCP {host}:{port}: {exc}") from exc
    return sock


class Daemon:
    """One daemon run: ``await run()`` serves until :meth:`stop` (thread-safe) or a signal."""

    def __init__(
        self,
        settings: Settings,
        *,
        tcp: str | None = None,
        token: str | None = None,
        engine: Engine | None = None,
        e2b: E2BOptions | None = None,
        fusion: FusionOptions | None = None,
    ) -> None:
        _check_tcp_auth(settings, tcp, token)
        if e2b is not None:
            _check_tcp_auth(settings, e2b.listen, token, "--e2b")
        if fusion is not None:
            _check_tcp_auth(settings, fusion.listen, token, "--sandbox-fusion")
        self.settings = settings
        self.e2b = e2b
        self.fusion = fusion
        self.tcp = _parse_tcp(tcp) if tcp is not None else None
        self.token = token
        self.engine = engine
        self.started = threading.Event()
        self.tcp_address: tuple[str, int] | None = None
        """The bound TCP address once serving (useful with port 0)."""
        self.e2b_address: tuple[str, int] | None = None
        """The bound address of the E2B listener once serving."""
        self.fusion_address: tuple[str, int] | None = None
        """The bound address of the SandboxFusion listener once serving."""
        self._servers: list[_Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._serving: Engine | None = None
        self.phases: Phases | None = None

    def stop(self) -> None:
        """Ask every listener to finish (callable from any thread or a signal handler); the engine refuses
        new and queued creates from now on, so a batch still queued does not hold the shutdown."""
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stop_servers)

    def _stop_servers(self) -> None:
        try:
            if self._serving is not None:
                self._serving.drain(f"the DSec daemon on node {self.settings.node} is stopping; retry once it is "
                                    "back")
        finally:
            for server in self._servers:
                server.should_exit = True

    def _prepare_dirs(self) -> None:
        s = self.settings
        for path in (s.home, s.log_file.parent):
            path.mkdir(parents=True, exist_ok=True)
        s.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(s.run_dir, 0o700)

    def _lock_home(self) -> int:
        """An exclusive lock on DSEC_HOME for the daemon's lifetime: two daemons on one home would both
        adopt, reap and clean up the same sandboxes. Released by the kernel when the process dies. The janitor
        of a daemon that just died holds it while it cleans up (seconds): that is waited for."""
        fd = os.open(self.settings.run_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + _JANITOR_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = lock_holder(self.settings)
                if holder is None or holder[0] != "janitor" or time.monotonic() > deadline:
                    os.close(fd)
                    pid = f" (pid {holder[1]})" if holder is not None else ""
                    raise ServeError(f"another DSec daemon{pid} is running on {self.settings.home}; stop it first "
                                     "(dsec down)") from None
                time.sleep(0.05)
        write_lock_owner(fd, "daemon")  # what `dsec down` finds a daemon by, whoever started it
        return fd

    async def run(self) -> None:
        """Serve until stopped; the engine is closed (sandboxes left alive) and the socket removed."""
        self._loop = asyncio.get_running_loop()
        handled = self._handle_signals()
        try:
            self._prepare_dirs()
            lock = await asyncio.to_thread(self._lock_home)
            try:
                janitor = await asyncio.to_thread(Janitor.spawn, self.settings)
                self.phases = Phases(self.settings, (janitor.pid, janitor.start_time))
                try:
                    await self._run_locked()
                finally:
                    self.phases.remove()
                    await asyncio.to_thread(janitor.release)  # closed down by itself: nothing left to clean
            finally:
                os.close(lock)
        finally:
            for sig in handled:
                self._loop.remove_signal_handler(sig)

    def _handle_signals(self) -> list[signal.Signals]:
        """SIGTERM and SIGINT stop the daemon, from the start: one that arrives while the engine starts stops it
        as soon as it has started (leaving nothing half-started behind)."""
        handled = []
        if threading.current_thread() is threading.main_thread():
            assert self._loop is not None
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self.stop)
                handled.append(sig)
        return handled

    def _phase(self, what: str) -> None:
        if self.phases is not None:
            self.phases(what)

    async def _run_locked(self) -> None:
        s = self.settings
        if s.socket_path.exists() or s.socket_path.is_symlink():
            if await asyncio.to_thread(daemon_answers, s):
                raise ServeError(f"another DSec daemon already answers on {s.socket_path}; stop it first")
            s.socket_path.unlink()  # stale: left by a daemon that was killed
        self._phase("binding the sockets")
        sockets = [_bind_unix(s.socket_path)]
        try:
            if self.tcp is not None:
                sockets.append(_bind_tcp(*self.tcp))
                self.tcp_address = sockets[-1].getsockname()[:2]
            if self.e2b is not None:
                sockets.append(_bind_tcp(*self.e2b.address))
                self.e2b_address = sockets[-1].getsockname()[:2]
            if self.fusion is not None:
                sockets.append(_bind_tcp(*self.fusion.address))
                self.fusion_address = sockets[-1].getsockname()[:2]
            self._phase("loading the backends")
            engine = self._serving = self.engine or Engine.from_settings(s)
            engine.on_phase = self._phase
            try:  # closed however far its start got: a failed start leaves nothing running
                await engine.start()
                self._phase(SERVING)
                await self._serve(engine, sockets)
                await self._wait_cut_off_calls()
            finally:
                await engine.aclose()
        finally:
            for sock in sockets:
                sock.close()
            with contextlib.suppress(FileNotFoundError):
                s.socket_path.unlink()

    async def _wait_cut_off_calls(self, timeout: float = 10.0) -> None:
        """Let the calls uvicorn cancelled at its graceful timeout finish their way out (a batch retiring what
        it made, an exec killing its command, the DaemonStopping answer) before the engine closes under them:
        uvicorn cancels them and returns without waiting."""
        pending = [t for server in self._servers for t in server.server_state.tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def _serve(self, engine: Engine, sockets: list[socket.socket]) -> None:
        apps = [create_app(engine, None)]
        if self.tcp is not None:
            apps.append(create_app(engine, self.token, tokens=TokenFile(self.settings.tokens_file)))
        for app in apps:
            # X-Forwarded-For means nothing on the unix socket (apps[0]); uvicorn's layer for it costs a frame
            # per request.
            config = uvicorn.Config(
                AnswerCutOffCalls(app, engine), loop="none", http=_HTTP_IMPL, log_level="warning", lifespan="off",
                timeout_graceful_shutdown=5, proxy_headers=app is not apps[0],
            )
            self._servers.append(_Server(config))
        if self.e2b is not None:
            from dsec.e2b.serve import node_app, uvicorn_settings

            e2b = node_app(engine, self.e2b, self.token, TokenFile(self.settings.tokens_file), self.settings.home)
            self._servers.append(_Server(uvicorn.Config(
                AnswerCutOffCalls(e2b, engine), loop="none", log_level="warning", lifespan="off",
                timeout_graceful_shutdown=5, **uvicorn_settings(self.e2b))))
        if self.fusion is not None:
            from dsec.fusion.serve import node_app as fusion_app

            fusion = fusion_app(engine, self.fusion, self.token, TokenFile(self.settings.tokens_file),
                                self.settings.node)
            # lifespan: the app declares its warm pool at start and waits for its sandboxes' destruction at stop
            self._servers.append(_Server(uvicorn.Config(
                AnswerCutOffCalls(fusion, engine), loop="none", http=_HTTP_IMPL, log_level="warning", lifespan="on",
                timeout_graceful_shutdown=5)))
        if self._stopping:
            self._stop_servers()
        self.started.set()
        log.info("dsec daemon serving on %s%s%s%s", self.settings.socket_path,
                 f" and tcp {self.tcp[0]}:{self.tcp[1]}" if self.tcp else "",
                 f" and E2B on {self.e2b.scheme}://{self.e2b.listen}" if self.e2b else "",
                 f" and SandboxFusion on http://{self.fusion.listen}" if self.fusion else "")
        pairs = zip(self._servers, sockets, strict=True)
        await asyncio.gather(*(server.serve([sock]) for server, sock in pairs))


try:  # httptools parses HTTP in C; h11 (pure Python) is the fallback
    import httptools  # noqa: F401

    _HTTP_IMPL = "httptools"
except ImportError:
    _HTTP_IMPL = "h11"


def serve(
    settings: Settings,
    tcp: str | None = None,
    token: str | None = None,
    engine: Engine | None = None,
    e2b: E2BOptions | None = None,
    fusion: FusionOptions | None = None,
) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT; raises :class:`ServeError` if it cannot start.

    ``tcp`` is ``"HOST:PORT"`` for a second listener that requires ``token`` (refused without one).
    ``engine`` defaults to :meth:`Engine.from_settings`. ``e2b``: also serve E2B's API (:mod:`dsec.e2b`);
    ``fusion``: SandboxFusion's ``/run_code`` (:mod:`dsec.fusion`).
    """
    try:
        affinity.control_cpus(settings.control_cpus)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    memory.cap_malloc_arenas()  # before the loop's and the executors' threads exist
    raise_nofile()
    try:
        trim = memory.trim_from_env()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(Daemon(settings, tcp=tcp, token=token, engine=engine, e2b=e2b, fusion=fusion).run())
    finally:
        if trim is not None:
            trim.stop()


def raise_nofile() -> int:
    """Raise the daemon's soft limit of open files to its hard limit, and return it: each live sandbox holds
    a few descriptors here (sockets, pidfds, a function call slot's cgroup files), so a dense node needs more
    than the usual soft 1,024. Its commands are unaffected: every backend sets their own ``RLIMIT_NOFILE``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: it roughly halves the daemon's per-request overhead on exec round trips."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _alive(pid: int) -> bool:
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        # A zombie has exited; it only waits for its parent to reap it.
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _log_tail(settings: Settings, lines: int = 20) -> str:
    try:
        tail = "\n".join(settings.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {settings.log_file}: {exc.strerror})"
    return tail or f"(the daemon wrote nothing to its log {settings.log_file})"


def _check_tcp_auth(settings: Settings, tcp: str | None, token: str | None, what: str = "TCP") -> None:
    if tcp is not None and not token and not TokenFile(settings.tokens_file).entries():
        raise ServeError(f"refusing to serve {what} without a token: pass --token, set DSEC_TOKEN or create "
                         f"tokens with `dsec token create` (token file {settings.tokens_file})")


def _daemon_env(settings: Settings, token: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["DSEC_HOME"] = str(settings.home)
    env["DSEC_IMAGES"] = str(settings.images)
    env["DSEC_NODE"] = settings.node
    env["DSEC_SNAPSHOT_STORE"] = settings.snapshot_store
    env["DSEC_TRAJECTORY_SYNC"] = settings.trajectory_sync
    if settings.trajectory_db:
        env["DSEC_TRAJECTORY_DB"] = settings.trajectory_db
    env["DSEC_SANDBOX_CPU_IDLE"] = "1" if settings.sandbox_cpu_idle else "0"
    if token:
        env["DSEC_TOKEN"] = token
    # Work from a source tree too: the child must import the same dsec as this process.
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def up(settings: Settings, tcp: str | None = None, token: str | None = None, timeout: float = 15.0,
       args: Sequence[str] = (), module: str = "dsec.daemon") -> int:
    """Start a background daemon (``python -m dsec.daemon serve``) and wait until it answers; returns its pid.

    It waits as long as the daemon's start makes progress: ``timeout`` is how long one start-up phase may last
    (:mod:`dsec.daemon.startup`). A daemon that stalls in a phase, or dies, is stopped, its janitor's cleanup
    waited for (nothing is left behind), and the ServeError names the phase and ends with the log's tail.
    The daemon logs to ``settings.log_file`` and its pid goes to ``settings.pid_file``. The token travels in the
    environment, never on the command line (where ``ps`` would show it). ``args`` are more options of
    ``python -m dsec.daemon serve`` (``--e2b HOST:PORT`` ...). ``module``: the entry point run instead of
    ``dsec.daemon`` (the tests' :mod:`dsec.testing.fake_daemon`).
    """
    _check_tcp_auth(settings, tcp, token)
    _reap_exited()
    if daemon_answers(settings):
        raise ServeError(f"a DSec daemon already answers on {settings.socket_path} (pid {find_daemon(settings)}): "
                         "`dsec up --restart` replaces it, `dsec down` stops it")
    settings.log_file.parent.mkdir(parents=True, exist_ok=True)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.run_dir, 0o700)
    argv = [sys.executable, "-m", module, "serve"] + (["--tcp", tcp] if tcp else []) + list(args)
    with settings.log_file.open("ab") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                env=_daemon_env(settings, token), start_new_session=True, cwd="/")
    _children[proc.pid] = proc
    settings.pid_file.write_text(f"{proc.pid}\n")
    seen: tuple[str, float] | None = None
    janitor: tuple[int, str] | None = None
    stall = time.monotonic() + timeout
    while True:
        exited = proc.poll() is not None  # before the phase is read: a daemon that died has written its last
        status = read_status(settings)
        if status is not None and status.pid == proc.pid:
            janitor = status.janitor
            if (status.phase, status.since) != seen:  # progress: the phase's own time starts again
                seen, stall = (status.phase, status.since), time.monotonic() + timeout
        phase = f" in its start-up phase {seen[0]!r}" if seen else " before its first start-up phase"
        if exited:
            _children.pop(proc.pid, None)
            settings.pid_file.unlink(missing_ok=True)
            _wait_janitor(janitor)
            raise ServeError(f"the daemon exited with status {proc.returncode}{phase}; log tail:\n"
                             + _log_tail(settings))
        if daemon_answers(settings):
            return proc.pid
        if time.monotonic() > stall:
            break
        time.sleep(0.05)
    _signal_and_wait(proc.pid, 5.0)
    settings.pid_file.unlink(missing_ok=True)
    _wait_janitor(janitor)
    raise ServeError(f"the daemon made no progress for {timeout:g} s{phase} and was stopped; log tail:\n"
                     + _log_tail(settings))


def _wait_janitor(janitor: tuple[int, str] | None, timeout: float = _JANITOR_WAIT) -> None:
    """Wait for a dead daemon's janitor to finish its cleanup (it exits when done)."""
    deadline = time.monotonic() + timeout
    while janitor is not None and start_time(janitor[0]) == janitor[1] and _alive(janitor[0]):
        if time.monotonic() > deadline:
            log.warning("the daemon's janitor (pid %d) is still cleaning up after %g s", janitor[0], timeout)
            return
        time.sleep(0.05)


def _signal_and_wait(pid: int, timeout: float) -> bool:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; True if it stopped gracefully."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    graceful = _wait_gone(pid, timeout)
    if not graceful:
        log.warning("daemon %d ignored SIGTERM for %g s; killing it", pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10.0)
    child = _children.pop(pid, None)
    if child is not None:
        child.wait()
    return graceful


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def down(settings: Settings, destroy: bool = False, timeout: float = 30.0) -> bool:
    """Stop the home's daemon, whoever started it (``dsec serve``, a unit file, :func:`up`: it is found through
    its socket or its lock, :func:`dsec.daemon.startup.find_daemon`); False if none was running.

    With ``destroy=True`` every sandbox is destroyed through the API first (:func:`destroy_every`), and
    once the daemon is gone its image mounts and lazy image server are removed too; otherwise sandboxes
    (and the image mounts under them) stay alive and the next daemon re-adopts them. A sandbox that could
    not be destroyed is named in a ServeError raised after the daemon stopped (its image mounts are left
    for it). A daemon that ignores SIGTERM for ``timeout`` seconds is killed, and its janitor's cleanup waited for.
    """
    _reap_exited()
    pid = find_daemon(settings)
    failed: ServeError | None = None
    if destroy and daemon_answers(settings):
        try:
            destroy_every("http://dsec", uds=str(settings.socket_path), timeout=max(timeout, 60.0))
        except ServeError as exc:  # still stopped: the next daemon re-adopts what is left
            failed = exc
    status = read_status(settings)
    stopped = pid is not None and _alive(pid) and is_dsec(pid)
    if stopped:
        assert pid is not None
        if not _signal_and_wait(pid, timeout):
            _wait_janitor(status.janitor if status is not None and status.pid == pid else None)
    settings.pid_file.unlink(missing_ok=True)
    if failed is not None:
        raise ServeError(f"the daemon {'stopped' if stopped else 'was not running'}, but {failed}; the next "
                         "daemon re-adopts them") from failed
    if destroy:
        _unmount_images(settings)
    return stopped


def restart(settings: Settings, tcp: str | None = None, token: str | None = None, timeout: float = 15.0) -> int:
    """Stop the home's daemon if one runs (whoever started it), then start one with :func:`up`; returns its pid."""
    _check_tcp_auth(settings, tcp, token)
    down(settings)
    return up(settings, tcp=tcp, token=token, timeout=timeout)


def destroy_every(base_url: str, *, uds: str | None = None, token: str | None = None, timeout: float = 60.0,
                  parallel: int = 16) -> int:
    """Destroy every sandbox the daemon at ``base_url`` (or on the unix socket ``uds``) holds, ``parallel``
    at a time, through the node API's client; how many. It runs on an event loop of its own in a helper
    thread: the benchmarks call this from inside their event loop. Raises ServeError naming those that could
    not be destroyed (one already gone counts as destroyed)."""
    if uds is not None and not os.path.exists(uds):  # a clear error rather than a failed connect
        raise ServeError(f"cannot list the sandboxes to destroy: no daemon socket at {uds}")
    url = f"unix://{uds}" if uds is not None else base_url
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-destroy") as pool:
        ids, failures = pool.submit(asyncio.run, _destroy_all(url, token, timeout, parallel)).result()
    if failures:
        raise ServeError(f"{len(failures)} of {len(ids)} sandbox(es) could not be destroyed: "
                         + "; ".join(failures[:5]) + (" ..." if len(failures) > 5 else ""))
    return len(ids)


async def _destroy_all(url: str, token: str | None, timeout: float, parallel: int) -> tuple[list[str], list[str]]:
    """The ids of the daemon's sandboxes, and a line for each whose destroy failed."""
    async with NodeClient(url, token, timeout=httpx.Timeout(timeout)) as node:
        try:
            ids = [info.id for info in await node.list()]
        except (DSecError, ValueError) as exc:  # not a DSec daemon's answer
            raise ServeError(f"cannot list the sandboxes to destroy at {url}: {exc!r}") from exc
        gate = asyncio.Semaphore(parallel)

        async def one(sandbox_id: str) -> str | None:
            async with gate:
                try:
                    await node.destroy(sandbox_id)
                except NotFound:
                    return None
                except DSecError as exc:
                    return f"{sandbox_id} (HTTP {exc.status_code}: {str(exc)[:300]})"
            return None

        failures = [f for f in await asyncio.gather(*(one(i) for i in ids)) if f is not None]
    return ids, failures


def _unmount_images(settings: Settings) -> None:
    if (settings.home / "lazy").exists():
        from dsec.images.node import NodeImages

        NodeImages(settings).aclose_sync(unmount=True)
