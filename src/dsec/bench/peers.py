"""The peers DSec is measured against: plain runc, bwrap, podman and a bare process.

The runc peer is made fair on purpose: its containers get the *same* runtime config as a DSec
sandbox (:func:`dsec.isolation.oci_runtime.runtime_config`: user namespace, seccomp, cgroup limits, masked
paths) on an overlay over the same image root, so the only difference measured is how DSec starts
sandboxes and runs commands in them. Everything a peer creates (overlay mounts, runc state, cgroups)
is owned by :class:`RuncPeer` and removed by :meth:`RuncPeer.close`, even after a failure.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dsec.isolation.cgroups import CgroupSet
from dsec.isolation.oci_runtime import runtime_config
from dsec.isolation.seccomp import DEFAULT_PROFILE
from dsec.models import SandboxSpec

__all__ = ["PODMAN_LIMITS", "RuncPeer", "podman_argv", "time_command"]

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2

# Podman's defaults ask for more open files and processes than the hard limits here allow
# (runc then fails with "error setting rlimit ... operation not permitted").
PODMAN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def time_command(argv: Sequence[str], n: int, warmup: int = 1, check: bool = True) -> list[float]:
    """Wall time of ``n`` sequential runs of ``argv`` (after ``warmup`` untimed runs), in seconds."""
    samples: list[float] = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, check=False, timeout=120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(argv)} did not finish within 120 s") from None
        elapsed = time.perf_counter() - t0
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}: "
                               f"{proc.stderr.decode(errors='replace').strip()[-300:]}")
        if i >= warmup:
            samples.append(elapsed)
    return samples


def podman_argv(podman: str, rootfs: Path) -> list[str]:
    """``podman run`` of ``/bin/true`` in the image root, as a user would run it here.

    ``--runtime runc``: podman prefers crun when both are installed, and crun refuses to manage
    cgroups on a hybrid host like this one (DSec runs crun with cgroup management disabled).
    ``:O`` mounts the root with an overlay, as DSec does: a bare ``--rootfs`` is used read-write and
    podman writes its ``/etc/hosts``, ``/etc/mtab`` and ``/run/.containerenv`` into the image.
    """
    return [podman, "run", "--runtime", "runc", "--rm", *PODMAN_LIMITS, "--network", "none", "--rootfs",
            f"{rootfs}:O", "/bin/true"]


def mount_overlay(lower: Path, base: Path) -> Path:
    """An overlay over ``lower`` with its layers under ``base``; returns the merged directory."""
    upper, work, merged = base / "upper", base / "work", base / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    st = lower.stat()
    os.chown(upper, st.st_uid, st.st_gid)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if _libc.mount(b"overlay", str(merged).encode(), b"overlay", 0, opts.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"overlay mount on {merged} failed")
    return merged


def umount(target: Path) -> None:
    _libc.umount2(str(target).encode(), _MNT_DETACH)


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    """Wait until killed processes are reaped (runc delete returns before their parent reaps them)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.005)


class RuncPeer:
    """Plain runc containers with DSec's own runtime config, on overlays under ``workdir``."""

    def __init__(self, runc: str, image_root: Path, uid_shift: int, uid_count: int, init_binary: Path,
                 workdir: Path, tag: str) -> None:
        self.runc = runc
        self.image_root = image_root
        self.uid_shift = uid_shift
        self.uid_count = uid_count
        self.init_binary = init_binary
        self.workdir = workdir
        self.state_root = workdir / "runc"
        self.cgroup_parent = f"dsec-bench-{tag}"
        self._mounts: list[Path] = []
        self._containers: list[str] = []
        self._count = 0
        self.leaked: list[str] = []
        """Containers runc still listed after :meth:`close` deleted them (should stay empty)."""

    def _cmd(self, *args: str) -> list[str]:
        return [self.runc, "--root", str(self.state_root), *args]

    def bundle(self, name: str, args: Sequence[str] | None = None) -> Path:
        """A bundle (own overlay + config.json) whose init is DSec's init, or ``args`` when given."""
        bundle = self.workdir / name
        rootfs = mount_overlay(self.image_root, bundle / "layers")
        self._mounts.append(rootfs)
        config = runtime_config(
            sandbox_id=name, spec=SandboxSpec(image="bench"), rootfs=rootfs, init_binary=self.init_binary,
            uid_shift=self.uid_shift, uid_count=self.uid_count, cgroups_path=f"/{self.cgroup_parent}/{name}",
            profile=DEFAULT_PROFILE,
        )
        if args is not None:
            config["process"]["args"] = list(args)
        (bundle / "config.json").write_text(json.dumps(config))
        return bundle

    def start_detached(self, bundle: Path) -> str:
        """``runc run --detach`` the bundle's init; returns the container id."""
        cid = bundle.name
        self._containers.append(cid)
        log = bundle / "runc.log"
        # A detached init inherits runc's stdio and never closes it: a pipe here would never see EOF.
        proc = subprocess.run([self.runc, "--root", str(self.state_root), "--log", str(log), "run", "--detach",
                               "--bundle", str(bundle), cid],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").strip()[-300:] if log.exists() else ""
            raise RuntimeError(f"runc run --detach exited {proc.returncode}: {tail}")
        return cid

    def exec_argv(self, cid: str) -> list[str]:
        """``runc exec`` of ``/bin/true`` into a running container (inherits its caps and seccomp)."""
        return self._cmd("exec", cid, "/bin/true")

    def time_runs(self, bundle: Path, n: int, warmup: int = 1) -> list[float]:
        """``runc run`` (create + start + wait + delete) of the bundle ``n`` times, fresh ids."""
        samples: list[float] = []
        for i in range(warmup + n):
            self._count += 1
            cid = f"{bundle.name}-{self._count}"
            self._containers.append(cid)
            config = json.loads((bundle / "config.json").read_text())
            config["linux"]["cgroupsPath"] = f"/{self.cgroup_parent}/{cid}"
            (bundle / "config.json").write_text(json.dumps(config))  # untimed: a new cgroup per run
            t0 = time.perf_counter()
            proc = subprocess.run(self._cmd("run", "--bundle", str(bundle), cid), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
            elapsed = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"runc run failed: {proc.stderr.decode(errors='replace').strip()}")
            if i >= warmup:
                samples.append(elapsed)
        return samples

    def close(self) -> None:
        """Delete every container, unmount every overlay, remove cgroups and the work directory."""
        for cid in self._containers:
            pids = CgroupSet.at(f"/{self.cgroup_parent}/{cid}").pids()
            subprocess.run(self._cmd("delete", "--force", cid), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            _wait_gone(pids)
            CgroupSet.at(f"/{self.cgroup_parent}/{cid}").remove()
        CgroupSet.at(f"/{self.cgroup_parent}").remove()
        self.leaked = self._listed()
        for rootfs in reversed(self._mounts):
            umount(rootfs)
        self._mounts.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _listed(self) -> list[str]:
        if not self.state_root.is_dir():
            return []
        proc = subprocess.run(self._cmd("list", "-q"), capture_output=True, text=True, check=False)
        return proc.stdout.split()
