"""FakeBackend: a backend with no isolation at all, for testing everything above the backends.

Each sandbox is a host temporary directory standing in for its root; commands are real host
subprocesses (one process group each) so timeouts, output caps, kills and disconnects behave like the
real thing. It must never be used to run untrusted code: nothing here isolates anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import shutil
import signal
import socket
import stat
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from dsec.accounts import Identity
from dsec.backends.base import Backend, ImageRef, apply_image_defaults, workdir_of
from dsec.backends.hostside import HostFileOps, HostFiles
from dsec.backends.surface import PortStream, ProcessIO, ProcessSink, ProcessSpec
from dsec.errors import ImageNotFound, InvalidRequest, NotSupported, SandboxError, file_error
from dsec.isolation.exec_client import check_exec_size
from dsec.isolation.files import SandboxFS
from dsec.isolation.ports import SocketStream
from dsec.models import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageInfo,
    LimitHit,
    SandboxRecord,
    SandboxStats,
)
from dsec.models.surface import FileStat
from dsec.testing.fake_surface import FakeProcess

__all__ = ["FakeBackend", "FakeImages"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CHUNK = 64 * 1024
_Stream = Literal["stdout", "stderr"]


class FakeBackend(HostFileOps):
    """Sandboxes as plain directories and host processes. ``create_error`` makes the next create fail."""

    name = "container"
    users = False

    def __init__(self, name: str = "container", root: Path | None = None) -> None:
        self.name = name  # type: ignore[misc]  # one fake class stands in for every backend name
        self.root = root or Path(tempfile.mkdtemp(prefix="dsec-fake-"))
        self.root.mkdir(parents=True, exist_ok=True)
        if root is None:  # a root of its own goes with the fake (collected, or at exit), not with an engine's close:
            weakref.finalize(self, shutil.rmtree, self.root, True)  # one fake may outlive an engine restart
        self.create_error: BaseException | None = None
        self._groups: dict[str, set[int]] = {}
        self.files = HostFiles(self._view)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def create(self, record: SandboxRecord, image: ImageRef) -> None:
        root = self.root / record.id
        record.backend_state = {"root": str(root)}
        root.mkdir(parents=True, exist_ok=True)
        if self.create_error is not None:
            err, self.create_error = self.create_error, None
            raise err
        apply_image_defaults(record, image)
        self._host(record, workdir_of(record)).mkdir(parents=True, exist_ok=True)

    async def snapshot(self, record: SandboxRecord, target: Path) -> None:
        await asyncio.to_thread(shutil.copytree, self._root(record), target / "root", symlinks=True)

    async def restore(self, record: SandboxRecord, image: ImageRef, layers: list[Path]) -> None:
        root = self.root / record.id
        record.backend_state = {"root": str(root)}
        await asyncio.to_thread(shutil.copytree, layers[0] / "root", root, symlinks=True)

    async def destroy(self, record: SandboxRecord) -> None:
        for pgid in self._groups.pop(record.id, set()):
            _killpg(pgid, signal.SIGKILL)
        root = record.backend_state.get("root")
        if root:
            await asyncio.to_thread(shutil.rmtree, root, True)

    async def recover(self, record: SandboxRecord) -> bool:
        root = record.backend_state.get("root")
        return bool(root) and Path(str(root)).is_dir()

    async def cleanup_orphans(self, known: set[str]) -> list[str]:
        orphans = [p.name for p in self.root.iterdir() if p.is_dir() and p.name not in known]
        for name in orphans:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return orphans

    async def pause(self, record: SandboxRecord) -> None:
        for pgid in self._groups.get(record.id, set()):
            _killpg(pgid, signal.SIGSTOP)

    async def resume(self, record: SandboxRecord) -> None:
        for pgid in self._groups.get(record.id, set()):
            _killpg(pgid, signal.SIGCONT)

    async def stats(self, record: SandboxRecord) -> SandboxStats:
        disk = sum(p.lstat().st_size for p in self._root(record).rglob("*"))
        return SandboxStats(disk_bytes=disk, pids=len(self._groups.get(record.id, ())))

    # -- paths and files -----------------------------------------------------------------------------

    def _root(self, record: SandboxRecord) -> Path:
        root = record.backend_state.get("root")
        if not root or not Path(str(root)).is_dir():
            raise SandboxError(f"sandbox {record.id} has no root directory")
        return Path(os.path.realpath(str(root)))

    def _host(self, record: SandboxRecord, path: str) -> Path:
        """Map a sandbox path to the host, resolving symlinks; refuse anything that leaves the root."""
        root = self._root(record)
        # ".." stops at the sandbox root, as it does at "/" (symlinks leaving the root are refused below)
        host = Path(os.path.realpath(root / posixpath.normpath("/" + path).lstrip("/")))
        if host != root and root not in host.parents:
            raise InvalidRequest(f"path {path!r} resolves outside the sandbox", path=path)
        return host

    async def read_file(self, record: SandboxRecord, path: str, max_bytes: int, user: Identity | None = None
                        ) -> bytes:
        _only_root(user)
        host = self._host(record, path)
        if not host.exists():
            raise file_error(errno.ENOENT, path, "read")
        if host.is_dir():
            raise file_error(errno.EISDIR, path, "read")
        if not host.is_file():
            raise InvalidRequest(f"not a regular file: {path}", path=path)
        with host.open("rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise InvalidRequest(f"file {path} is larger than {max_bytes} bytes", path=path)
        return data

    async def write_file(self, record: SandboxRecord, path: str, data: bytes, mode: int | None,
                         user: Identity | None = None) -> None:
        _only_root(user)
        host = self._host(record, path)
        if host.is_dir():
            raise file_error(errno.EISDIR, path, "write")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
        host.chmod(0o644 if mode is None else mode)

    async def list_files(self, record: SandboxRecord, path: str, user: Identity | None = None) -> list[FileEntry]:
        _only_root(user)
        host = self._host(record, path)
        if not host.is_dir():
            raise file_error(errno.ENOTDIR if host.exists() else errno.ENOENT, path, "list")
        entries = []
        for entry in sorted(os.scandir(host), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            kind: Literal["file", "dir", "symlink", "other"] = (
                "symlink" if stat.S_ISLNK(st.st_mode)
                else "dir" if stat.S_ISDIR(st.st_mode)
                else "file" if stat.S_ISREG(st.st_mode)
                else "other"
            )
            entries.append(FileEntry(
                name=entry.name, path=path.rstrip("/") + "/" + entry.name, type=kind,
                size=st.st_size, mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime,
            ))
        return entries

    # -- the surface: files through SandboxFS on the root directory, host processes, host loopback ports -------

    def _view(self, record: SandboxRecord, path: str, user: Identity | None) -> tuple[SandboxFS, str]:
        _only_root(user)
        return SandboxFS(str(self._root(record)), os.getuid(), os.getgid()), path

    set_xattrs = Backend.set_xattrs  # (NotSupported: the fake keeps no extended attributes)

    async def chown_file(self, record: SandboxRecord, path: str, owner: Identity, user: Identity | None = None
                         ) -> FileStat:
        _only_root(owner)
        return await super().chown_file(record, path, owner, user)

    async def start_process(self, record: SandboxRecord, spec: ProcessSpec, sink: ProcessSink,
                            user: Identity | None = None) -> ProcessIO:
        _only_root(user)
        cwd = self._host(record, spec.cwd or workdir_of(record))
        env = {"PATH": DEFAULT_PATH, "HOME": str(self._root(record)), **record.spec.env, **spec.env}
        process = FakeProcess(spec, str(cwd), env, sink)
        self._groups.setdefault(record.id, set()).add(process.pid)
        return process

    async def open_port(self, record: SandboxRecord, port: int) -> PortStream:
        self._root(record)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
        except BaseException:
            sock.close()
            raise
        return SocketStream(sock)

    # -- exec ----------------------------------------------------------------------------------------

    async def exec_stream(self, record: SandboxRecord, request: ExecRequest, user: Identity | None = None
                          ) -> AsyncIterator[ExecEvent]:
        _only_root(user)
        cwd = self._host(record, request.cwd or workdir_of(record))
        cwd.mkdir(parents=True, exist_ok=True)
        env = {"PATH": DEFAULT_PATH, **record.spec.env, **(request.env or {})}
        check_exec_size(request.argv(), env)
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *request.argv(), cwd=cwd, env=env, start_new_session=True,
                stdin=asyncio.subprocess.PIPE if request.stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            yield ExecEvent(type="exit", result=ExecResult(exit_code=127, stderr=str(exc).encode()))
            return
        groups = self._groups.setdefault(record.id, set())
        groups.add(proc.pid)
        queue: asyncio.Queue[tuple[_Stream, bytes]] = asyncio.Queue()

        async def pump(kind: _Stream, stream: asyncio.StreamReader | None) -> None:
            while stream is not None and (chunk := await stream.read(_CHUNK)):
                await queue.put((kind, chunk))
            await queue.put((kind, b""))

        async def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(request.stdin or b"")
                await proc.stdin.drain()
                proc.stdin.close()

        tasks = [
            asyncio.create_task(pump("stdout", proc.stdout)),
            asyncio.create_task(pump("stderr", proc.stderr)),
        ]
        if request.stdin is not None:
            tasks.append(asyncio.create_task(feed()))
        captured = {"stdout": bytearray(), "stderr": bytearray()}
        open_streams, truncated = 2, False
        limit: LimitHit | None = None
        try:
            while open_streams:
                left = None if request.timeout is None else request.timeout - (time.monotonic() - started)
                try:
                    kind, chunk = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    limit = "time"
                    break
                if not chunk:
                    open_streams -= 1
                    continue
                room = request.max_output - len(captured[kind])
                if len(chunk) > room:
                    chunk, truncated, limit = chunk[:room], True, "output"
                captured[kind] += chunk
                if chunk:
                    yield ExecEvent(type=kind, data=chunk)
                if limit:
                    break
            if limit:
                _killpg(proc.pid, signal.SIGKILL)
            code = await proc.wait()
            sig = -code if code < 0 else None
            yield ExecEvent(type="exit", result=ExecResult(
                exit_code=128 + sig if sig else code, stdout=bytes(captured["stdout"]),
                stderr=bytes(captured["stderr"]), duration_s=time.monotonic() - started,
                truncated=truncated, signal=sig, limit=limit,
            ))
        finally:
            # Kill before any await: when a client hangs up, the awaits below may be cancelled.
            if proc.returncode is None:
                _killpg(proc.pid, signal.SIGKILL)
            groups.discard(proc.pid)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ProcessLookupError):
                await proc.wait()


class FakeImages:
    """An image resolver knowing a fixed set of names, all pointing at one (unused) root directory."""

    def __init__(self, names: tuple[str, ...] = ("base",), rootfs: Path = Path("/nonexistent")) -> None:
        self.names = names
        self.rootfs = rootfs

    def get(self, name: str) -> ImageInfo:
        if name not in self.names:
            raise ImageNotFound(f"image {name!r} not found (fake store has {', '.join(self.names)})")
        return ImageInfo(name=name, created_at=0.0, size_bytes=0, files=0, source="fake", uid_shift=0)

    def resolve(self, name: str) -> ImageRef:
        self.get(name)
        return ImageRef(name=name, rootfs=self.rootfs)

    def list(self) -> list[ImageInfo]:
        return [self.get(n) for n in self.names]


def _only_root(user: Identity | None) -> None:
    """The fake runs everything as the test's own user: it can stand for root, not for anyone else."""
    if user is not None and not user.is_root:
        raise NotSupported(f"the fake backend runs everything as one host user; it cannot act as uid {user.uid}")


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
