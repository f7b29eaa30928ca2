"""``dsec doctor``: what works on this host, and what to install when something does not.

Owns the host probes (privileges, kernel features, external tools, the image store) and their
rendering. Every probe is read-only and bounded in time; a probe that fails or raises becomes a
failed check, never an exception. It never installs, mounts or changes anything.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec.config import Settings
from dsec.isolation.landlock import landlock_abi

__all__ = ["Check", "as_json", "daemon_checks", "healthy", "render", "run_checks", "table"]

_PROBE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None
    """What to run or install when ``ok`` is false."""
    required: bool = True
    """False for things only some backends or benchmarks need (a failure is then a warning)."""


@dataclass(frozen=True)
class _Tool:
    name: str
    binary: str
    package: str
    version_args: tuple[str, ...]
    required: bool
    why: str


_TOOLS = (
    _Tool("crun", "crun", "crun", ("--version",), True, "container backend (OCI runtime)"),
    _Tool("runc", "runc", "runc", ("--version",), False, "benchmark peer"),
    _Tool("gcc", "gcc", "gcc libc6-dev", ("--version",), True, "builds the container init and the function zygote"),
    _Tool("cp", "cp", "coreutils", ("--version",), True, "container snapshots (copies the writable layer)"),
    _Tool("mmdebstrap", "mmdebstrap", "mmdebstrap", ("--version",), True, "builds images"),
    _Tool("mkfs.erofs", "mkfs.erofs", "erofs-utils", ("-V",), True, "builds EROFS images and snapshot layers"),
    _Tool("fusermount3", "fusermount3", "fuse3 libfuse3-dev", ("-V",), True, "the lazy image filesystem"),
    _Tool("qemu", "qemu-system-x86_64", "qemu-system-x86", ("--version",), False, "microvm and vm backends"),
    _Tool("qemu-img", "qemu-img", "qemu-utils", ("--version",), False, "vm backend disk overlays"),
    _Tool("busybox", "busybox", "busybox-static", (), False, "microvm initramfs"),
    _Tool("bwrap", "bwrap", "bubblewrap", ("--version",), False, "benchmark peer"),
    _Tool("podman", "podman", "podman", ("--version",), False, "benchmark peer"),
    _Tool("buildah", "buildah", "buildah", ("--version",), False, "Dockerfile builds (dsec image build --file)"),
    _Tool("slirp4netns", "slirp4netns", "slirp4netns", ("--version",), False, "a Dockerfile RUN step's network"),
    _Tool("newuidmap", "newuidmap", "uidmap", (), False, "rootless user namespaces"),
)


def run_checks(settings: Settings | None = None) -> list[Check]:
    """Run every probe; never raises."""
    try:
        settings = settings or Settings()
    except Exception as exc:  # a bad DSEC_UID_SHIFT must not crash the doctor
        return [Check("settings", False, f"cannot read settings: {exc}", "fix the DSEC_* environment")]
    probes: list[tuple[str, Callable[[], Check]]] = [
        ("root", _root), ("kernel", _kernel), ("user namespaces", _userns), ("cgroups", _cgroups),
        ("overlayfs", _overlayfs), ("inotify limits", _inotify), ("pid limit", _pid_max),
        ("seccomp", _seccomp),
        ("landlock", _landlock), ("kvm", _kvm), ("cpu wakeups", lambda: _wakeups(settings)),
        *[(f"tool: {t.name}", lambda t=t: _tool(t)) for t in _TOOLS],
        ("libseccomp", _libseccomp),
        ("image store", lambda: _image_store(settings)),
        ("image debian-python", lambda: _base_image(settings)),
        ("vm images", _vm_images),
        ("build user", _build_user),
        ("python >= 3.12 (harbor)", _harbor_python),
    ]

    def run(name: str, probe: Callable[[], Check]) -> Check:
        try:
            return probe()
        except Exception as exc:
            return Check(name, False, f"probe failed: {type(exc).__name__}: {exc}")

    # Side by side: most probes wait on a subprocess (a tool's version, the wakeup and KVM probes), so the
    # report takes about as long as its slowest probe rather than their sum.
    with ThreadPoolExecutor(max_workers=len(probes), thread_name_prefix="dsec-doctor") as pool:
        checks = list(pool.map(lambda item: run(*item), probes))
    try:
        checks += daemon_checks(settings)
    except Exception as exc:
        checks.append(Check("daemon", False, f"probe failed: {type(exc).__name__}: {exc}"))
    return checks


_FIXES = {
    "lazy-server": "the daemon restarts it by itself; if it stays down, see {home}/log/lazyfs.log",
    "mount-holder": "the daemon starts a new one by itself; `dsec logs --daemon --component mount-holder`",
    "exec-helper": "the daemon restarts it by itself; `dsec logs --daemon --component exec-helper`",
    "image-store": "check DSEC_IMAGE_STORE and that its server answers (creates of uncached images fail meanwhile)",
    "trajectory-store": "make DSEC_TRAJECTORY_DB writable (trajectory-bound calls fail meanwhile)",
    "node-disk": "free space on the disk of {home} (creates are refused meanwhile)",
    "accelerator": "a KVM probe runs once per boot (microvm and vm creates wait for it); if /dev/kvm went away, "
                   "`dsec up --restart` decides again",
}


def daemon_checks(settings: Settings) -> list[Check]:
    """The running daemon of this home, if any: it answers, and each component it depends on is ok
    (``/v1/health``: the lazy image server, the mount holder, the exec helper, the stores, the disk, each image
    in use)."""
    import httpx

    socket = settings.socket_path
    if not socket.exists():
        return [Check("daemon", True, f"no daemon runs on {settings.home} (nothing to check)", required=False)]
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=10) as client:
            answer = client.get("http://dsec/v1/health").raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        return [Check("daemon", False, f"{socket} does not answer: {exc}", "stale socket of a killed daemon? "
                      "`dsec up` starts one (`dsec logs --daemon` shows why it stopped)")]
    stopping = f", stopping: {answer['stopping']}" if answer.get("stopping") else ""
    checks = [Check("daemon", answer.get("status", "ok") == "ok",
                    f"version {answer.get('version')}, {answer.get('sandboxes')} sandboxes, status "
                    f"{answer.get('status', 'ok')}{stopping}", "see the components below and `dsec logs --daemon`")]
    for part in answer.get("components", []):
        name, state = str(part.get("name")), str(part.get("state"))
        ok = state == "ok"
        detail = f"{state}: {part.get('error')}" if not ok else (part.get("detail") or "ok")
        if ok and part.get("faults"):
            detail += f" ({part['faults']} fault(s) since start, last: {part.get('last_error')})"
        fix = _FIXES.get(name.split(":")[0], "`dsec logs --daemon --component " + name + "`")
        checks.append(Check(f"daemon: {name}", ok, detail, None if ok else fix.format(home=settings.home)))
    return checks


def healthy(checks: list[Check]) -> bool:
    """True when every required check passed."""
    return all(c.ok for c in checks if c.required)


def as_json(checks: list[Check]) -> str:
    """The checks as a JSON array of objects (name, ok, detail, fix, required)."""
    return json.dumps([asdict(c) for c in checks], indent=2)


def table(checks: list[Check], width: int = 200) -> object:
    """A :class:`rich.table.Table` of the checks, fitted to ``width`` columns."""
    from rich.markup import escape

    from dsec._term import Column
    from dsec._term import table as fit

    rows = []
    for c in checks:
        status = "[green]ok[/]" if c.ok else ("[red]FAIL[/]" if c.required else "[yellow]warn[/]")
        rows.append([escape(c.name), status, escape(c.detail), escape(c.fix or "")])
    columns = (Column("check", rank=9), Column("status", rank=9), Column("detail", "text", rank=8),
               Column("fix", "text", rank=7))
    return fit(columns, rows, width, title="dsec doctor")


def render(checks: list[Check], console: object | None = None) -> None:
    """Print the checks as a table on ``console`` (default: stdout)."""
    from rich.console import Console

    from dsec._term import console as default_console

    out = console if isinstance(console, Console) else default_console()
    out.print(table(checks, out.width))
    bad = [c for c in checks if not c.ok and c.required]
    out.print("[green]all required checks passed[/]" if not bad
              else f"[red]{len(bad)} required check(s) failed[/]")


# --------------------------------------------------------------------- probes
def _run(argv: list[str], timeout: float = _PROBE_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


def _root() -> Check:
    uid = os.geteuid()
    return Check("root", uid == 0, "running as root" if uid == 0 else f"running as uid {uid}",
                 None if uid == 0 else "run the daemon as root (sudo dsec serve)")


def _kernel() -> Check:
    release = platform.release()
    m = re.match(r"(\d+)\.(\d+)", release)
    ok = bool(m) and (int(m.group(1)), int(m.group(2))) >= (5, 13) if m else False
    return Check("kernel", ok, f"Linux {release}",
                 None if ok else "Linux >= 5.13 is needed (Landlock, overlayfs in user namespaces)")


def _userns() -> Check:
    exe = shutil.which("unshare")
    if exe is None:
        return Check("user namespaces", False, "unshare not found", "apt-get install util-linux")
    proc = _run([exe, "-Ur", "true"])
    if proc.returncode == 0:
        return Check("user namespaces", True, "unshare -Ur works")
    return Check("user namespaces", False, f"unshare -Ur failed: {proc.stderr.strip()[:200]}",
                 "sysctl -w user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1")


def cgroup_mode(mountinfo: str) -> tuple[str, list[str]]:
    """(``"v2 unified"`` | ``"v1 (hybrid)"`` | ``"v1 (legacy)"`` | ``"none"``, controllers) from mountinfo."""
    v1: set[str] = set()
    v2_at: list[str] = []
    known = {"cpu", "cpuacct", "cpuset", "memory", "pids", "blkio", "freezer", "devices", "net_cls",
             "net_prio", "perf_event", "hugetlb", "rdma", "misc"}
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            v2_at.append(fields[4])
        elif tail[0] == "cgroup":
            v1.update(opt for opt in tail[2].split(",") if opt in known)
    if v1:
        return ("v1 (hybrid)" if v2_at else "v1 (legacy)"), sorted(v1)
    if v2_at:
        ctl = Path(v2_at[0]) / "cgroup.controllers"
        controllers = ctl.read_text().split() if ctl.is_file() else []
        return "v2 unified", sorted(controllers)
    return "none", []


def _cgroups() -> Check:
    mode, controllers = cgroup_mode(Path("/proc/self/mountinfo").read_text())
    needed = {"memory", "pids", "cpu"}
    missing = sorted(needed - set(controllers))
    ok = mode != "none" and not missing
    detail = f"{mode}; controllers: {', '.join(controllers) or 'none'}"
    if missing:
        detail += f"; missing {', '.join(missing)}"
    fix = None if ok else "mount cgroups with the memory, pids and cpu controllers"
    return Check("cgroups", ok, detail, fix)


def _overlayfs() -> Check:
    if "overlay" in Path("/proc/filesystems").read_text().split():
        return Check("overlayfs", True, "available")
    modules = Path("/lib/modules") / platform.release()
    if modules.is_dir() and any(modules.rglob("overlay.ko*")):
        return Check("overlayfs", True, "module present (loaded on first mount)")
    return Check("overlayfs", False, "not in /proc/filesystems",
                 "modprobe overlay (kernel CONFIG_OVERLAY_FS)")


INOTIFY_MIN = {"max_user_instances": 8192, "max_user_watches": 1048576}


def _inotify() -> Check:
    """Every sandbox's user namespace is created by host root, so all their inotify instances count
    against root's one budget: at the kernel default of 128, one sandbox's file watchers (an editor,
    a dev server) starve every other sandbox and the host's own services."""
    values = {k: int(Path(f"/proc/sys/fs/inotify/{k}").read_text()) for k in INOTIFY_MIN}
    low = [f"{k}={v} (< {INOTIFY_MIN[k]})" for k, v in values.items() if v < INOTIFY_MIN[k]]
    detail = ", ".join(f"{k}={v}" for k, v in values.items())
    if low:
        fix = " && ".join(f"sysctl -w fs.inotify.{k}={v}" for k, v in INOTIFY_MIN.items())
        return Check("inotify limits", False, "shared by all sandboxes and host root: " + ", ".join(low),
                     f"{fix} (scripts/setup does this)", required=False)
    return Check("inotify limits", True, detail)


PID_MAX_FOR_DENSITY = 262_144
"""kernel.pid_max below which ~10,000 idle sandboxes (plus the host) may run out of pids."""


WAKEUP_LATE_MS = 0.5
"""A busy CPU that takes longer than this (p50) to run a task woken for it is late enough to show in exec
latency next to CPU-bound sandboxes (each hop of an exec may wait this long)."""


def _wakeups(settings: Settings) -> Check:
    """How fast this host wakes a task on a CPU that runs a SCHED_IDLE hog (``dsec.bench.wakeup``, ~0.5 s, in a
    process of its own since it forks); late wakeups are what ``DSEC_CONTROL_CPUS`` is for."""
    import sys

    try:
        # 60 round trips a phase: its p50 reads the same as the pools bench's 200, in a third of the time
        proc = _run([sys.executable, "-m", "dsec.bench.wakeup", "--rounds", "60"], timeout=_PROBE_TIMEOUT * 3)
        result = json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr.strip()[-200:] or "no output"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        result = f"{type(exc).__name__}: {exc}"
    if not isinstance(result, dict):
        return Check("cpu wakeups", False, f"the probe failed: {result}", "python -m dsec.bench.wakeup shows why",
                     required=False)
    return wakeup_check(result, settings.control_cpus)


def wakeup_check(result: dict[str, object], control_cpus: str | None) -> Check:
    """The verdict on a ``dsec.bench.wakeup`` result for a daemon with ``control_cpus`` (``DSEC_CONTROL_CPUS``)."""
    busy, idle = result.get("busy_ms"), result.get("idle_ms")
    if not isinstance(busy, list) or not isinstance(idle, list):
        return Check("cpu wakeups", True, f"not measured: {result.get('skipped')}", required=False)
    detail = f"a task woken on a busy CPU runs after {busy[0]:g} ms p50 (on an idle CPU {idle[0]:g} ms)"
    if busy[0] <= WAKEUP_LATE_MS:
        return Check("cpu wakeups", True, detail, required=False)
    if control_cpus:
        return Check("cpu wakeups", True, f"{detail}; the control path is pinned (DSEC_CONTROL_CPUS={control_cpus})",
                     required=False)
    return Check("cpu wakeups", False, f"{detail}: execs next to CPU-bound sandboxes wait for it at every hop",
                 f"run the daemon with DSEC_CONTROL_CPUS={min(os.sched_getaffinity(0))} (its control path on that CPU; "
                 "sandboxes keep every CPU)",
                 required=False)


def _pid_max() -> Check:
    """Every sandbox holds at least its init's pid; 10,000 sandboxes with a few processes each need more
    than the common default of 32,768."""
    value = int(Path("/proc/sys/kernel/pid_max").read_text())
    if value < PID_MAX_FOR_DENSITY:
        return Check("pid limit", False, f"kernel.pid_max={value}: enough for a few thousand sandboxes, not 10,000",
                     "sysctl -w kernel.pid_max=4194304, or run the daemon with DSEC_HOST_LIMITS=1 (raised at start, "
                     "restored at stop)", required=False)
    return Check("pid limit", True, f"kernel.pid_max={value}")


def _seccomp() -> Check:
    actions = Path("/proc/sys/kernel/seccomp/actions_avail")
    if not actions.is_file():
        return Check("seccomp", False, "no seccomp filter support", "kernel with CONFIG_SECCOMP_FILTER")
    avail = actions.read_text().split()
    ok = "errno" in avail and "kill_process" in avail
    return Check("seccomp", ok, f"filter mode; actions: {' '.join(avail)}",
                 None if ok else "kernel with CONFIG_SECCOMP_FILTER")


def _landlock() -> Check:
    abi = landlock_abi()
    if abi > 0:
        return Check("landlock", True, f"ABI {abi}", required=False)
    return Check("landlock", False, "not available (the function backend needs it and is unavailable)",
                 "kernel >= 5.13 with CONFIG_SECURITY_LANDLOCK and lsm=landlock", required=False)


def _kvm() -> Check:
    """KVM or TCG, as the daemon decides it (:mod:`dsec.guest.accel`): a /dev/kvm that exists may still be unable
    to run a stock kernel (a paravirtual KVM), so only a probe boot tells. The verdict kept for this boot is read
    as it is; without one, the probe runs now (bounded) and keeps its verdict for the daemon."""
    from dsec.guest.accel import decide
    from dsec.guest.kernel import default_guest_dir, find_kernel

    if not Path("/dev/kvm").exists():
        return Check("kvm", False, "absent → microvm runs under TCG (emulated, slower)",
                     "enable (nested) hardware virtualisation to use KVM", required=False)
    try:
        kernel = find_kernel(default_guest_dir())
    except Exception as exc:
        return Check("kvm", False, f"present, not probed: {exc}", "python -m dsec.guest.kernel", required=False)
    verdict = decide(kernel.vmlinuz)
    return Check("kvm", verdict.accel == "kvm", f"microvm and vm accelerator: {verdict.describe()}",
                 None if verdict.accel == "kvm" else "none needed: TCG works, only slower", required=False)


def _vm_images() -> Check:
    from dsec.guest.vmimage import default_vm_dir, list_vm_images

    images = list_vm_images()
    if not images:
        return Check("vm images", False, f"none in {default_vm_dir() / 'images'} (the vm backend has nothing to boot)",
                     "dsec image build-vm debian-desktop --desktop", required=False)
    names = ", ".join(f"{i.name} ({i.meta.get('kernel')}{', desktop' if i.desktop else ''})" for i in images)
    return Check("vm images", True, names, required=False)


def _tool(tool: _Tool) -> Check:
    path = shutil.which(tool.binary)
    name = f"tool: {tool.name}"
    fix = f"apt-get install {tool.package}"
    if path is None:
        return Check(name, False, f"not found ({tool.why})", fix, tool.required)
    version = ""
    if tool.version_args:
        proc = _run([path, *tool.version_args])
        lines = (proc.stdout or proc.stderr).strip().splitlines()
        version = lines[0].strip() if lines else f"exit {proc.returncode}"
    return Check(name, True, f"{version or 'present'} ({path})", None, tool.required)


def _libseccomp() -> Check:
    fix = "apt-get install libseccomp2 && pip install pyseccomp"
    try:
        import pyseccomp  # noqa: F401
    except Exception as exc:
        return Check("libseccomp", False, f"pyseccomp does not import: {exc}", fix)
    import ctypes.util

    lib = ctypes.util.find_library("seccomp")
    return Check("libseccomp", True, f"pyseccomp over {lib or 'libseccomp'}")


def _image_store(settings: Settings) -> Check:
    from dsec.errors import DSecError
    from dsec.images.image_store import ImageStore

    root = settings.images
    if not root.is_dir():
        return Check("image store", False, f"{root} does not exist",
                     f"mkdir -p {root} (or set DSEC_IMAGES), then `dsec image build debian-python`")
    store = ImageStore(root, settings.image_store)
    try:
        names = store.names()
    except DSecError as exc:
        return Check("image store", False, f"{store.blobs.url}: {exc}", "check DSEC_IMAGE_STORE and the store")
    writable = os.access(root, os.W_OK)
    detail = f"{store.blobs.url}: {len(names)} image(s): {', '.join(names) or 'none'}"
    if not writable:
        return Check("image store", False, detail + " (not writable)", f"run as root or chown {root}")
    return Check("image store", True, detail)


def _base_image(settings: Settings) -> Check:
    from dsec.images.image_store import ImageStore

    store = ImageStore(settings.images, settings.image_store)
    if store.exists("debian-python"):
        info = store.get("debian-python")
        return Check("image debian-python", True,
                     f"{info.size_bytes / 1e6:.0f} MB, {info.files} files, uid shift {info.uid_shift}")
    return Check("image debian-python", False, "not built", "dsec image build debian-python")


def _build_user() -> Check:
    from dsec.images.builder import BUILD_USER, build_user

    user = build_user()
    if user is None:
        return Check("build user", False, f"no {BUILD_USER} user with subordinate ids: Dockerfile builds run buildah "
                     "as root", "run ./scripts/setup (useradd --system dsec-build; usermod --add-subuids)", False)
    return Check("build user", True, f"{user.pw_name} (uid {user.pw_uid}): Dockerfile builds are rootless", None, False)


def _harbor_python() -> Check:
    from dsec.integrations.interpreters import find_python

    found = find_python((3, 12))
    name = "python >= 3.12 (harbor)"
    if found is None:
        return Check(name, False, "no Python 3.12+ interpreter on this host: harbor (dsec.integrations.harbor) cannot "
                     "run here", "install python3.12 or newer, or point DSEC_HARBOR_PYTHON at one", False)
    exe, (major, minor) = found
    return Check(name, True, f"{exe} ({major}.{minor}): harbor runs from its own venv made with it", None, False)
