"""Helpers shared by the tests that run real ``container`` sandboxes (root, crun, cgroups).

Every such test uses its own ``DSEC_HOME``; the backend derives a tag from it and keeps every host
resource under that tag (``/run/dsec/<tag>``, ``/sys/fs/cgroup/*/dsec-<tag>``), so these helpers can
look for leftovers of *this* test's sandboxes without touching anyone else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.isolation.network import Network, dsec_tables
from dsec.models import ExecRequest, ExecResult, SandboxRecord

CGROUP_ROOT = Path("/sys/fs/cgroup")
VM_RUN_ROOT = Path("/run/dsec-vm")
"""Where the microvm and vm backends keep each home's run directory (``<tag>`` and ``<tag>.vm``)."""


def images_dir() -> Path:
    """The image store the tests use: ``DSEC_IMAGES``, else ``/var/lib/dsec/images``; never used as a home."""
    return Path(os.environ.get("DSEC_IMAGES") or "/var/lib/dsec/images")


def home_tag(home: Path) -> str:
    """The tag ContainerBackend derives from a DSEC_HOME (same formula as the backend)."""
    return hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]


def state_root(home: Path) -> Path:
    """The home's tmpfs directory of sandbox bundles and runtime state (ContainerBackend.state_root)."""
    return ContainerBackend.STATE_BASE / f"dsec-{home_tag(home)}"


def bundle_dir(home: Path, sandbox_id: str) -> Path:
    """A sandbox's bundle (config, init pid, runtime log, the mount point of its disk)."""
    return state_root(home) / "container" / sandbox_id


SESSION_TAGS: set[str] = set()
"""Tags of the homes this test session made outside pytest's temporary root (see ``short_home``)."""


def short_home(prefix: str) -> Path:
    """A new DSEC_HOME under /tmp (a unix socket path must fit in 108 bytes; pytest's tmp_path may not).

    Its tag is remembered so that the session-wide leak check covers it after it is deleted.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    SESSION_TAGS.add(home_tag(path))
    return path


def mounts_under(prefix: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points (from our mountinfo, or another namespace's) at or below ``prefix``."""
    found = []
    try:
        text = Path(mountinfo).read_text()
    except OSError:  # that namespace's process is gone: nothing is mounted there any more
        return []
    for line in text.splitlines():
        point = line.split()[4]
        if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
            found.append(point)
    return found


def cgroup_dirs(tag: str, sandbox_id: str | None = None) -> list[str]:
    """Existing cgroup directories of one sandbox of this home (default: of any), over every hierarchy."""
    rel = f"dsec-{tag}/{sandbox_id or 'sb-*'}"
    return sorted(str(p) for p in CGROUP_ROOT.glob(f"*/{rel}") if p.is_dir() and not p.parent.parent.is_symlink())


def cgroup_parents(tag: str) -> list[str]:
    """This home's parent cgroup directories (``dsec-<tag>``), which must go with its last sandbox."""
    return sorted(str(p) for p in CGROUP_ROOT.glob(f"*/dsec-{tag}") if p.is_dir() and not p.parent.is_symlink())


def proc_state(pid: int) -> str:
    """A process's state letter (``Z`` for a zombie), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    return proc_state(pid) not in ("gone", "Z")


def pids_in_sandbox(init_pid: int, comm: str) -> list[int]:
    """Host pids of the processes named ``comm`` in the pid namespace of the sandbox whose init is ``init_pid``
    (zombies included)."""
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm \
                    and os.readlink(entry / "ns/pid") == ns:
                found.append(int(entry.name))
    return found


def mount_holder(home: Path) -> int | None:
    """Pid of the home's live mount holder (``dsec-mntns``, see dsec.isolation.mounts), if any."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((home / "container" / "mntns.pid").read_text().split()[0])
        if Path(f"/proc/{pid}/comm").read_text().strip() == "dsec-mntns":
            return pid
    return None


def holder_mountinfo(home: Path) -> list[str]:
    """The lines of the home's mount holder's mountinfo (where its sandboxes' overlays and disks are)."""
    holder = mount_holder(home)
    assert holder is not None, f"no mount holder runs for {home}"
    return Path(f"/proc/{holder}/mountinfo").read_text().splitlines()


def sandbox_mounts(home: Path, prefix: str) -> list[str]:
    """Mount points at or below ``prefix``, on the host or in the home's mount holder."""
    holder = mount_holder(home)
    return mounts_under(prefix) + (mounts_under(prefix, f"/proc/{holder}/mountinfo") if holder else [])


def leftovers(home: Path, sandbox_id: str | None = None) -> dict[str, list[str]]:
    """Host resources still held by this home's sandboxes (or one sandbox): empty lists when clean."""
    tag = home_tag(home)
    ids = (lambda p: p.name == sandbox_id) if sandbox_id else (lambda p: p.name.startswith("sb-"))
    mounts = (sandbox_mounts(home, f"/run/dsec/{tag}/{sandbox_id}" if sandbox_id else f"/run/dsec/{tag}")
              + sandbox_mounts(home, str(home / "container" / sandbox_id) if sandbox_id else str(home / "container"))
              + sandbox_mounts(home, str(bundle_dir(home, sandbox_id)) if sandbox_id else str(state_root(home))))
    out = {
        "mounts": mounts,
        "cgroups": cgroup_dirs(tag, sandbox_id),
        # what the home's sandboxes share while its backend runs: parent cgroups, the node's sysfs (mounted in
        # the holder)
        "shared": [] if sandbox_id else cgroup_parents(tag) + sandbox_mounts(home, f"/run/dsec/{tag}.sysfs"),
        "runtime_state": [],
        "network_chains": [] if sandbox_id else [f"n{i}" for i in Network(tag).indexes()],
        "bundles": [],
        "rootfs_dirs": [],
    }
    state = state_root(home)
    for key, parent in (("runtime_state", state / "runtime"), ("runtime_state", home / "runtime"),
                        ("bundles", state / "container"), ("bundles", home / "container"),
                        ("rootfs_dirs", Path("/run/dsec") / tag)):
        if parent.is_dir():
            out[key] += sorted(str(p) for p in parent.iterdir() if ids(p))
    return out


def assert_clean(home: Path, sandbox_id: str | None = None) -> None:
    left = leftovers(home, sandbox_id)
    assert not any(left.values()), f"host resources left behind: { {k: v for k, v in left.items() if v} }"


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` (a bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


async def await_until(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return bool(predicate())


async def sweep(home: Path, images: Path) -> list[str]:
    """Last-resort cleanup of a home: destroy every sandbox the container and function backends can find under it.

    Returns the ids it had to remove (a test that cleaned up after itself gets ``[]``). Leaves the
    home's ``/run/dsec/<tag>`` directory gone as well (it only holds a copy of the static init).
    """
    backend = ContainerBackend(Settings(home=home, images_dir=images))
    if (home / "container").is_dir():  # started, it adopts the home's mount holder, and ends it when done
        await backend.start()
    try:
        removed = await backend.cleanup_orphans(set())
    finally:
        await backend.aclose()
    if (home / "function").is_dir():  # a function sandbox's zygote, cgroups and workspace (a killed daemon's)
        from dsec.backends.function import FunctionBackend

        removed += await FunctionBackend(Settings(home=home, images_dir=images)).cleanup_orphans(set())
    if (home / "lazy").exists():  # image mounts a daemon of this home kept warm, then its FUSE server
        from dsec.images.node import NodeImages

        await NodeImages(Settings(home=home, images_dir=images)).aclose(unmount=True)
    tag_dir = Path("/run/dsec") / home_tag(home)
    if tag_dir.is_dir() and not sandbox_mounts(home, str(tag_dir)):
        shutil.rmtree(tag_dir, ignore_errors=True)
    if state_root(home).is_dir() and not sandbox_mounts(home, str(state_root(home))):
        shutil.rmtree(state_root(home), ignore_errors=True)
    for parent in (*CGROUP_ROOT.glob(f"*/dsec-{home_tag(home)}"), *CGROUP_ROOT.glob(f"*/dsec-{home_tag(home)}-fn")):
        with contextlib.suppress(OSError):
            parent.rmdir()
    # The microvm and vm backends' run directories, which a daemon of this home killed before its close (a
    # cluster node killed on purpose) leaves; only empty ones: a VM still running keeps its own in them.
    for run_dir in (VM_RUN_ROOT / home_tag(home), VM_RUN_ROOT / f"{home_tag(home)}.vm", VM_RUN_ROOT):
        with contextlib.suppress(OSError):
            run_dir.rmdir()
    return removed


@contextlib.asynccontextmanager
async def started_backend(home: Path, images: Path) -> AsyncIterator[ContainerBackend]:
    """A started ContainerBackend on ``home``; on exit it is closed and anything it left is destroyed."""
    backend = ContainerBackend(Settings(home=home, images_dir=images))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.aclose()


@contextlib.contextmanager
def swept_home(path: Path) -> Iterator[Path]:
    """A module's DSEC_HOME; at the end anything still there is swept, and finding something fails."""
    try:
        yield path
    finally:
        removed = asyncio.run(sweep(path, images_dir()))
        assert removed == [], f"sandboxes were left behind and had to be swept: {removed}"


@contextlib.asynccontextmanager
async def checked_backend(home: Path) -> AsyncIterator[ContainerBackend]:
    """A started backend for one test; afterwards nothing of its sandboxes may remain on the host."""
    async with started_backend(home, images_dir()) as b:
        try:
            yield b
        finally:
            left = leftovers(home)
            left.pop("shared")  # shared by all sandboxes of the home while the backend runs
            # Destroy whatever the test leaked before failing, so one failure does not cascade.
            removed = await b.cleanup_orphans(set())
    assert removed == [] and not any(left.values()), f"test leaked: {removed} {left}"
    # closing the backend drops the home's (now empty) parent cgroups, nft table, mask directory and sysfs
    # mount point (shared while it runs)
    assert cgroup_parents(home_tag(home)) == []
    tag = home_tag(home)
    node_dirs = [p for p in (f"/run/dsec/{tag}.masked", f"/run/dsec/{tag}.sysfs") if os.path.lexists(p)]
    assert node_dirs == [], f"left after the backend closed: {node_dirs}"
    assert f"dsec_{home_tag(home)}" not in dsec_tables(), "the home's nft table outlived its last sandbox"
    assert mount_holder(home) is None, "the home's mount holder outlived its last sandbox"


async def run(backend: Backend, record: SandboxRecord, command: str | list[str], **kw: Any) -> ExecResult:
    """Run a command in a sandbox of any backend (30 s timeout unless given)."""
    kw.setdefault("timeout", 30.0)
    return await backend.exec(record, ExecRequest(command=command, **kw))


async def py(backend: Backend, record: SandboxRecord, code: str, timeout: float = 30.0) -> Any:
    """Run a python3 snippet in the sandbox; it must print one JSON document, returned decoded."""
    r = await run(backend, record, ["python3", "-c", code], timeout=timeout)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


# creates empty files in /workspace until the disk quota's inode count says no; prints {"n": .., "err": errno}
INODE_BOMB = r"""
import json, os
n, err = 0, None
try:
    while n < 200000:
        os.close(os.open(f"/workspace/f{n}", os.O_CREAT | os.O_WRONLY, 0o644)); n += 1
except OSError as e:
    err = e.errno
print(json.dumps({"n": n, "err": err}))
"""


@contextlib.contextmanager
def daemon_process(prefix: str, *, tcp_token: str | None = None, args: Sequence[str] = (), home: Path | None = None,
                   **env: str) -> Iterator[tuple[str, str | None]]:
    """``python -m dsec.daemon serve`` on a fresh home, or on ``home`` (kept afterwards: a session's home whose
    VM templates the daemon reuses), and on TCP loopback with ``tcp_token`` (``args`` are more options); yields
    its unix URL and TCP URL. Afterwards every sandbox is destroyed, the daemon stopped, and finding anything of
    its home left on the host fails the test."""
    import signal
    import socket
    import subprocess
    import sys

    import dsec
    from dsec.daemon.server import daemon_answers

    keep = home is not None
    home = home or short_home(prefix)
    settings = Settings(home=home, images_dir=images_dir())
    argv = [sys.executable, "-m", "dsec.daemon", "serve", "--home", str(home), *args]
    tcp_url = None
    if tcp_token is not None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        argv += ["--tcp", f"127.0.0.1:{port}"]
        tcp_url = f"http://127.0.0.1:{port}"
        env = {**env, "DSEC_TOKEN": tcp_token}
    full_env = dict(os.environ, DSEC_HOME=str(home), DSEC_IMAGES=str(images_dir()), **env)
    log = home / "daemon.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=full_env,
                                start_new_session=True, cwd="/")
    unix_url = f"unix://{settings.socket_path}"
    removed: list[str] = []
    try:
        ok = wait_until(lambda: proc.poll() is not None or daemon_answers(settings), timeout=60)
        assert ok and proc.poll() is None, f"daemon did not start:\n{log.read_text()[-3000:]}"
        yield unix_url, tcp_url
    finally:
        try:
            with dsec.Client(unix_url) as client:
                for sb in dsec.Sandbox.list(client=client):
                    sb.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            removed = asyncio.run(sweep(home, images_dir()))
            if not keep:
                shutil.rmtree(home, ignore_errors=True)
    assert removed == [], f"sandboxes were left behind and had to be swept: {removed}"
