"""The OCI runtime config (crun's or runc's ``config.json``) of a container sandbox.

Everything a container is allowed to do is decided here, in one place: namespaces,
the user-namespace mapping, mounts, masked and read-only ``/proc``/``/sys`` paths,
capabilities, rlimits, cgroup limits (:func:`sandbox_limits`) and the seccomp profile.
The exec helper reads the same :func:`exec_rlimits`, capabilities and profile so that
commands joining the sandbox carry exactly the init's restrictions.
"""

from __future__ import annotations

import functools
import os
import resource
from pathlib import Path
from typing import Any

from dsec.isolation.capabilities import DEFAULT_CAPS
from dsec.isolation.cgroups import Limits, cgroup_mode
from dsec.isolation.seccomp import Profile
from dsec.models import SandboxSpec

__all__ = ["INIT_PATH", "MASKED_PATHS", "READONLY_PATHS", "exec_rlimits", "runtime_config", "sandbox_limits"]

INIT_PATH = "/dev/.dsec-init"
"""Where the host's static init is bind-mounted (``/dev`` is not the image's: a fresh tmpfs, or a directory of
the sandbox's disk with ``node_mounts``; nothing lands in the image)."""

# Paths that leak host state or reach host kernel interfaces. /proc/kpage* let a recursive
# grep of /proc take a host down; sysrq-trigger and kcore speak for themselves.
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/key-users", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup",
    "/proc/kpagecount", "/proc/kpageflags", "/proc/kmsg", "/proc/sysrq-trigger", "/proc/vmallocinfo",
    "/proc/pagetypeinfo", "/proc/slabinfo", "/proc/config.gz", "/sys/firmware", "/sys/kernel/debug",
    "/sys/kernel/tracing", "/sys/kernel/security", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys")


@functools.cache
def masked_dirs() -> tuple[str, ...]:
    """The :data:`MASKED_PATHS` that are directories on this kernel (a sandbox's /proc and /sys show the
    host kernel's tree)."""
    return tuple(p for p in MASKED_PATHS if os.path.isdir(p))

_NOFILE = 65536


def exec_rlimits() -> dict[str, tuple[int, int]]:
    """(soft, hard) per limit: enough open files for builds and test runners, bounded so one sandbox
    cannot exhaust host tables, and never above the daemon's own hard limit (a user namespace cannot
    raise it, and some hosts deny even root CAP_SYS_RESOURCE)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = _NOFILE if hard == resource.RLIM_INFINITY else min(_NOFILE, hard)
    return {"nofile": (nofile, nofile), "core": (0, 0)}

_OCI_RLIMIT_NAMES = {"nofile": "RLIMIT_NOFILE", "core": "RLIMIT_CORE"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sandbox_limits(spec: SandboxSpec) -> Limits:
    """The cgroup limits of a sandbox with ``spec``."""
    return Limits(memory=spec.memory, cpu=spec.cpu, pids=spec.pids)


def _oci_resources(limits: Limits) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "devices": [{"allow": False, "access": "rwm"}],
        "memory": {"limit": limits.memory},
        "cpu": {"quota": limits.cpu_quota_us, "period": limits.cpu_period_us},
        "pids": {"limit": limits.pids},
    }
    if cgroup_mode() == "v2" or Path("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists():
        resources["memory"]["swap"] = limits.memory  # memory+swap == memory: the sandbox never swaps
    return resources


def runtime_config(
    *,
    sandbox_id: str,
    spec: SandboxSpec,
    rootfs: Path,
    init_binary: Path,
    uid_shift: int,
    uid_count: int,
    cgroups_path: str | None,
    profile: Profile,
    mask_dir: Path | None = None,
    node_mounts: bool = False,
    node_sysfs: bool = False,
) -> dict[str, Any]:
    """The config.json for the OCI runtime.

    With ``cgroups_path`` the runtime creates and limits the cgroups (how the runc peers of the
    benchmark run); with None it leaves cgroups alone (DSec's own sandboxes: the backend creates
    them with :func:`sandbox_limits` and starts the runtime inside them).

    With ``mask_dir`` (an empty directory that no sandbox can write to: root's, mode 0555) the masked
    directories are read-only binds of it instead of the runtime's empty tmpfs each: a tmpfs is a
    superblock, and every superblock registers a shrinker in every memory cgroup of the node, a cost that
    grows with the number of live sandboxes (five of the thirteen superblocks a sandbox had were these masks).
    With ``node_mounts`` (DSec's own sandboxes) the root already carries /dev and /dev/shm (directories of
    the sandbox's disk): the runtime mounts neither, populates /dev and, with Landlock, makes it read-only as a
    read-only path. With ``node_sysfs`` the root also carries /sys (a read-only clone of the node's one sysfs,
    mounts.sysfs_mount) and the runtime mounts none.
    """
    caps = list(DEFAULT_CAPS)
    # With Landlock (the default), whose one rule lets a command write anywhere beneath the root (see
    # confine_writes in nsenter.c), /proc and /dev are mounted read-only as a whole: no /proc/PID knob and
    # no file in /dev is writable, while the device nodes (/dev/null, /dev/tty...) stay writable (a
    # device is no file of the mount) and /dev/shm, /dev/mqueue and /dev/pts are writable mounts of their
    # own. The runtime populates /dev before it turns it read-only.
    ro = ["ro"] if spec.landlock else []
    mapping = [{"containerID": 0, "hostID": uid_shift, "size": uid_count}]
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH],
            "env": [f"PATH={DEFAULT_PATH}"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps, "inheritable": [],
                             "ambient": []},
            "rlimits": [{"type": _OCI_RLIMIT_NAMES[k], "soft": s, "hard": h} for k, (s, h) in exec_rlimits().items()],
            "noNewPrivileges": True,
            # The host OOM killer should pick a sandbox before the daemon or anything else on the node.
            "oomScoreAdj": 500,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": sandbox_id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev", *ro]},
            *([] if node_mounts else [{"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                                       "options": ["nosuid", "strictatime", "mode=755", "size=65536k", *ro]}]),
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            *([] if node_mounts else [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                                       "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}]),
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            *([] if node_sysfs else [{"destination": "/sys", "type": "sysfs", "source": "sysfs",
                                      "options": ["nosuid", "noexec", "nodev", "ro"]}]),
            {"destination": INIT_PATH, "type": "bind", "source": str(init_binary),
             "options": ["bind", "ro", "nosuid", "nodev"]},
            *({"destination": d, "type": "bind", "source": str(mask_dir),
               "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for d in (masked_dirs() if mask_dir else ())),
        ],
        "linux": {
            "uidMappings": mapping,
            "gidMappings": mapping,
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
            "maskedPaths": [p for p in MASKED_PATHS if not (mask_dir and p in masked_dirs())],
            "readonlyPaths": [*READONLY_PATHS, *(["/dev"] if node_mounts and ro else [])],
            "seccomp": profile.to_oci(),
            "rootfsPropagation": "private",
        },
    }
    if cgroups_path is not None:
        config["linux"]["cgroupsPath"] = cgroups_path
        config["linux"]["resources"] = _oci_resources(sandbox_limits(spec))
    return config
