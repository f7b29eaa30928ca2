"""The one small async interface every isolation backend implements.

A backend owns the mechanics of one substrate (processes, mounts, cgroups, QEMU).
It never owns records, timeouts, metrics or HTTP: the engine does. It keeps what it
needs to find a sandbox again in ``SandboxRecord.backend_state`` (plain JSON), so a
restarted daemon can call :meth:`Backend.recover` and either re-adopt or destroy.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar, Literal, NamedTuple

from dsec.accounts import ROOT, Identity, resolve_identity
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.errors import NotSupported, SandboxError, error_from_payload
from dsec.images.ref import ImageRef
from dsec.models import (
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    SandboxRecord,
    SandboxStats,
)
from dsec.models.surface import FileEvent, FileStat

__all__ = ["DEFAULT_WORKDIR", "Backend", "Check", "ImageRef", "apply_image_defaults", "collect_exec",
           "default_identity", "resolve_user_in", "signal_of", "store_identity", "workdir_of"]

_ACCOUNT_FILE_MAX = 4 << 20
DEFAULT_WORKDIR = "/workspace"
"""Working directory of sandboxes whose spec and image name none."""


class Check(NamedTuple):
    """A node-level helper's state (:meth:`Backend.components`)."""

    error: str | None
    """What is wrong; None while it works."""
    detail: str | None = None
    """What it is or runs as (a pid, ``kvm``/``tcg``), whatever its state."""
    state: Literal["degraded", "down"] = "down"
    """How bad ``error`` is: ``down`` (it does not work: the watchdog restarts it) or ``degraded`` (it works in
    part, or will by itself: reported, not restarted)."""


def apply_image_defaults(record: SandboxRecord, image: ImageRef) -> None:
    """Fill what the spec left to the image (the working directory). Idempotent; backends call it in create."""
    if record.spec.workdir is None:
        record.spec.workdir = image.config.workdir or DEFAULT_WORKDIR


def signal_of(exit_code: int, sig: int | None) -> int | None:
    """The signal that ended a command: its own, or the one a shell reports as exit code 128+N (``sh -c``, what
    a string command runs, forks its last command rather than exec it, so a memory bomb it ran exits 137 with
    no signal). Only for a verdict that a kernel counter confirms: a command may ``exit 137`` by itself."""
    if sig is not None:
        return sig
    return exit_code - 128 if 128 < exit_code < 128 + 65 else None


def workdir_of(record: SandboxRecord) -> str:
    """The sandbox's default working directory."""
    return record.spec.workdir or DEFAULT_WORKDIR


def store_identity(record: SandboxRecord, user: Identity) -> None:
    """Keep the sandbox's default user (resolved at create from ``spec.user`` or the image's) in its record;
    ``user_spec`` says ``spec.user`` is in it (the engine resolves it per call where a backend could not)."""
    record.backend_state.update(user=[user.uid, user.gid], home=user.home, user_groups=list(user.groups),
                                user_name=user.name, user_spec=record.spec.user)


async def resolve_user_in(backend: Backend, record: SandboxRecord, user: str) -> Identity:
    """The identity ``user`` names in the sandbox's own ``/etc/passwd`` and ``/etc/group`` (read as root;
    either may be missing). :class:`~dsec.errors.UserNotFound` when it names nobody there."""
    texts = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            texts.append((await backend.read_file(record, path, _ACCOUNT_FILE_MAX, ROOT)).decode(errors="replace"))
        except (FileNotFoundError, NotADirectoryError):
            texts.append("")
    return resolve_identity(texts[0], texts[1], user)


def default_identity(record: SandboxRecord) -> Identity:
    """The sandbox's default user, as :func:`store_identity` kept it (root for a record from before users)."""
    state = record.backend_state
    uid, gid = state.get("user", [0, 0])
    name = state.get("user_name", "root" if uid == 0 else None)
    return Identity(uid=int(uid), gid=int(gid), groups=tuple(int(g) for g in state.get("user_groups", [])),
                    home=str(state.get("home", "/root")), name=name)


class Backend(abc.ABC):
    """One isolation substrate. All methods are safe to call concurrently for different sandboxes."""

    name: ClassVar[str]
    root_writable: ClassVar[bool] = True
    """Commands and the file API may write anywhere in the sandbox's root (False: only below the workdir,
    plus a ``/tmp`` that lasts one exec)."""
    processes_persist: ClassVar[bool] = True
    """Processes an exec starts in the background outlive it (False: each exec is a fresh process tree that
    is gone when the exec returns)."""
    reads_image: ClassVar[bool] = True
    """A running sandbox reads its image mount (False: the image was copied at create, as a VM's disk, and
    the death of the node's lazy image server does not touch it)."""
    users: ClassVar[bool] = True
    """Commands and file operations can run as any user of the sandbox (False: only as root)."""
    ports: ClassVar[bool] = True
    """A server listening in the sandbox can be reached through :meth:`open_port`."""

    async def start(self) -> None:
        """Prepare host-side machinery (helpers, pools). Called once by the engine."""

    async def aclose(self) -> None:
        """Stop host-side machinery. Live sandboxes are left running for a later ``recover``."""

    def release_host(self, live: set[str]) -> list[str]:
        """For a daemon of this home that died (its janitor calls this on an unstarted backend, blocking): end
        what it started that nobody will re-adopt (anything of a sandbox not in ``live``, the ids of the running and
        paused records it left; with none, what :meth:`aclose` ends when no sandbox is left, and its directories
        and cgroups). Never touches a sandbox in ``live``. Returns what it did."""
        return []

    def available(self) -> str:
        """``"ok"`` or a sentence saying why this backend cannot run here and what to install."""
        return "ok"

    def pending(self) -> str | None:
        """What a started backend still decides in the background before it can create (its creates wait for it,
        with a bound), or None when it is ready. Health reports the backend as ``pending: <this>``."""
        return None

    @abc.abstractmethod
    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        """Create and start the sandbox; fill ``record.backend_state``. Clean up fully on failure."""

    @abc.abstractmethod
    def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                    ) -> AsyncIterator[ExecEvent]:
        """Run a command (as ``user``; None: the sandbox's default user); yield output chunks and finally one
        ``exit`` event. Closing the iterator kills it."""

    async def exec(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None) -> ExecResult:
        """Run a command to completion."""
        return await collect_exec(self.exec_stream(record, request, user))

    # Files. Paths are absolute (the engine resolves relative ones); ``user`` is whose permissions are checked
    # (None: the sandbox's default user; :data:`dsec.accounts.ROOT`: none). Errors are dsec.errors.file_error's.

    @abc.abstractmethod
    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        """Read a regular file, resolved inside the sandbox root."""

    @abc.abstractmethod
    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        """Create or replace a file (parents created), owned by ``user`` (root: the sandbox's root user)."""

    @abc.abstractmethod
    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        """List a directory, resolved inside the sandbox root."""

    async def stat_file(self, record: SandboxRecord, path: str, user: Identity | None = None) -> FileStat:
        """What ``lstat`` says of ``path`` (owner and group as ids; the engine adds their names)."""
        raise NotSupported(f"backend {self.name!r} cannot stat files")

    async def make_dir(self, record: SandboxRecord, path: str, parents: bool, mode: int,
                       user: Identity | None = None) -> FileStat:
        """Create a directory (``parents``: ``mkdir -p``)."""
        raise NotSupported(f"backend {self.name!r} cannot create directories")

    async def remove_file(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> None:
        """Remove a file, symlink or empty directory (``recursive``: a whole tree)."""
        raise NotSupported(f"backend {self.name!r} cannot remove files")

    async def rename_file(self, record: SandboxRecord, source: str, destination: str, overwrite: bool,
                          user: Identity | None = None) -> FileStat:
        """Move ``source`` to ``destination``."""
        raise NotSupported(f"backend {self.name!r} cannot rename files")

    async def chmod_file(self, record: SandboxRecord, path: str, mode: int, user: Identity | None = None
                         ) -> FileStat:
        """Set ``path``'s permission bits."""
        raise NotSupported(f"backend {self.name!r} cannot change permissions")

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        """Give ``path`` to ``owner``'s uid and gid."""
        raise NotSupported(f"backend {self.name!r} cannot change owners")

    async def set_xattrs(self, record: SandboxRecord, path: str, values: dict[str, str], remove: list[str],
                         user: Identity | None = None) -> FileStat:
        """Set and remove ``user.`` extended attributes of ``path`` (a symlink's target)."""
        raise NotSupported(f"backend {self.name!r} cannot set extended attributes (its files API does not carry "
                           "them): set them with a command in the sandbox (setfattr)")

    async def watch_files(self, record: SandboxRecord, path: str, recursive: bool, user: Identity | None = None
                          ) -> AsyncIterator[FileEvent]:
        """Start watching directory ``path``; returns (once the watch is in place) its changes as they happen,
        until the iterator is closed (``aclose``)."""
        raise NotSupported(f"backend {self.name!r} cannot watch files")

    # Processes and ports.

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        """Start a process that outlives this call (and the client), reporting to ``sink``; it dies with the
        sandbox."""
        raise NotSupported(f"backend {self.name!r} cannot keep processes running")

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        """A TCP connection to ``port`` on the sandbox's loopback (whatever its network policy: this is the
        node's own way in, never the sandbox's way out). ConnectionRefusedError when nothing listens."""
        raise NotSupported(f"backend {self.name!r} cannot reach ports inside its sandboxes")

    @abc.abstractmethod
    async def destroy(self, record: SandboxRecord) -> None:
        """Kill everything and release every host resource. Idempotent; works on half-created sandboxes."""

    @abc.abstractmethod
    async def recover(self, record: SandboxRecord) -> bool:
        """After a daemon restart: True if the sandbox is alive and re-adopted, False if it is gone."""

    def alive(self, record: SandboxRecord) -> bool:
        """Whether the sandbox still runs, judged without blocking (a few reads of /proc at most): a warm-pool
        member that died while it waited (the OOM killer picks idle ones first) is not handed out."""
        return True

    def lost(self, record: SandboxRecord) -> str | None:
        """Why a running sandbox stopped running on its own (its init killed, its VM gone), judged without
        blocking like :meth:`alive`; None while it runs."""
        return None if self.alive(record) else "its processes are gone"

    def image_mounts(self, record: SandboxRecord) -> list[Path]:
        """The image mounts the sandbox's root sits on, as the backend recorded them (its snapshot layers, top
        first, then its image); [] if it records none. A restarted daemon mounts afresh, at new paths, the images
        whose lazy server died while no daemon ran: these paths tell it which sandboxes sit on the dead ones."""
        return []

    async def revive(self, record: SandboxRecord, image: ImageRef) -> bool:
        """Bring back a sandbox that :meth:`lost` reports, or whose image mount died under it (``image`` is
        the image mounted afresh), if the backend can without losing its state; False: it is lost."""
        return False

    def components(self) -> dict[str, Check]:
        """The node-level helpers this backend runs (an exec helper, a mount holder, an accelerator), by name.
        Non-blocking."""
        return {}

    async def repair(self, component: str) -> None:
        """Start helper ``component`` again after :meth:`components` reported it broken."""

    def take_healed(self) -> list[tuple[str, str, float, float]]:
        """Helper faults this backend met and repaired on its own since the last call, before the watchdog saw
        them (an exec restarting a dead exec helper): (component, what was wrong, when found, when repaired)."""
        return []

    async def call(self, record: SandboxRecord, request: CallRequest) -> CallResult:
        """Run a pickled Python callable (``sb.call``); the reply is decoded by the SDK, never here."""
        raise NotSupported(f"backend {self.name!r} cannot run Python callables: use backend='function'")

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        """Resource usage now."""
        return SandboxStats()

    async def pause(self, record: SandboxRecord) -> None:
        """Freeze every process of the sandbox."""
        raise NotSupported(f"backend {self.name!r} cannot pause sandboxes")

    async def resume(self, record: SandboxRecord) -> None:
        """Thaw a paused sandbox."""
        raise NotSupported(f"backend {self.name!r} cannot resume sandboxes")

    async def hibernate(self, record: SandboxRecord) -> None:
        """Pause the sandbox with its memory released to disk (``pause(release_memory=True)``); a no-op on
        one already hibernated. :meth:`resume` brings it back."""
        raise NotSupported(f"backend {self.name!r} cannot release a paused sandbox's memory; pause() without "
                           "release_memory freezes it in place")

    async def set_network(self, record: SandboxRecord, network: str | list[str]) -> None:
        """Replace a live sandbox's network policy (``"none"``, ``"allow"`` or an allowlist)."""
        raise NotSupported(f"backend {self.name!r} cannot change network policies")

    layered: bool = False
    """True when :meth:`snapshot` writes only what changed over the layers the sandbox was restored from
    (the engine stacks the new layer over them); False when a snapshot is whole (a VM's state)."""

    async def reveal(self, record: SandboxRecord) -> None:
        """Make the sandbox's hidden paths (``spec.hidden``) visible, read-only."""
        raise NotSupported(f"backend {self.name!r} has no hidden paths")

    async def snapshot(self, record: SandboxRecord, target: Path) -> None:
        """Write the sandbox's writable state into the empty directory ``target``, consistently (the
        sandbox is frozen while it is read) and leave the sandbox as it was (running or paused)."""
        raise NotSupported(f"backend {self.name!r} cannot snapshot sandboxes yet")

    async def restore(self, record: SandboxRecord, image: ImageRef, layers: list[Path]) -> None:
        """Like :meth:`create`, with the state of a snapshot: ``layers`` are the read-only roots of the
        trees :meth:`snapshot` wrote (top first; one for a backend that is not :attr:`layered`)."""
        raise NotSupported(f"backend {self.name!r} cannot restore snapshots yet")

    def resolve_image(self, name: str) -> ImageRef | None:
        """The backend's own image ``name`` (the ``vm`` backend's disk images), or None: the engine then
        resolves it in the node's image store."""
        return None

    async def screenshot(self, record: SandboxRecord) -> bytes:
        """The sandbox's display as PNG bytes."""
        raise NotSupported(f"backend {self.name!r} has no display: use backend='vm' with a desktop image")

    async def mouse(self, record: SandboxRecord, x: int, y: int, button: str = "left", action: str = "click"
                    ) -> None:
        """Move the pointer to pixel (``x``, ``y``) of the display and act there (see ``dsec.MouseRequest``)."""
        raise NotSupported(f"backend {self.name!r} has no display: use backend='vm' with a desktop image")

    async def keyboard(self, record: SandboxRecord, text: str | None = None, keys: list[str] | None = None
                       ) -> None:
        """Type ``text`` or press the key combos ``keys`` on the sandbox's display."""
        raise NotSupported(f"backend {self.name!r} has no display: use backend='vm' with a desktop image")

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        """Remove host resources of sandboxes not in ``known`` (crash leftovers); returns their ids."""
        return []


async def collect_exec(events: AsyncIterator[ExecEvent]) -> ExecResult:
    """Drain an exec stream into one result."""
    start = time.monotonic()
    result: ExecResult | None = None
    try:
        async for event in events:
            if event.type == "exit":
                result = event.result
            elif event.type == "error" and event.error is not None:
                raise error_from_payload({"error": event.error})
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    if result is None:
        raise SandboxError(f"exec stream ended without an exit event after {time.monotonic() - start:.1f}s")
    return result
