"""Disk images of the ``vm`` backend: a whole Debian system (its own kernel, systemd, the guest agent as a
service, optionally an X desktop), built with mmdebstrap into an ext4 filesystem in a qcow2 file.

Layout under the VM directory (``DSEC_VM_DIR``, default ``/var/lib/dsec/vm``)::

    images/<name>/disk.qcow2    the root filesystem (ext4 on the whole disk, no partition table); read-only
                                base of every sandbox's qcow2 overlay
    images/<name>/vmlinuz       the image's own kernel and initramfs, copied out of its /boot: QEMU boots them
    images/<name>/initrd.img    directly (no bootloader in the disk)
    images/<name>/image.json    what was built: suite, packages, desktop, kernel version, disk size

This module owns the recipe (packages, systemd units, the X session) and the image directory; the mmdebstrap
command line is :func:`dsec.images.build.mmdebstrap_command`'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.errors import BackendUnavailable, DSecError, ImageNotFound, InvalidRequest, NotSupported
from dsec.guest.initramfs import ensure_agent
from dsec.guest.kernel import default_guest_dir
from dsec.images.build import apt_options, apt_sources, check_packages, mmdebstrap_command, run_mmdebstrap
from dsec.images.image_store import validate_name
from dsec.images.ref import ImageRef
from dsec.isolation.idmap import unshifted_view

__all__ = ["AGENT_PORT", "BASE_PACKAGES", "DESKTOP_PACKAGES", "DISK_SIZE", "VMImage", "build_into", "build_vm_image",
           "check_bootable", "default_vm_dir", "find_vm_image", "image_machine", "list_vm_images", "load_vm_image",
           "recipe_digest"]

BASE_PACKAGES = ("systemd", "systemd-sysv", "udev", "linux-image-amd64", "initramfs-tools", "kmod", "procps",
                 "e2fsprogs", "iproute2", "python3", "ca-certificates")
"""A bootable system: the distribution kernel (it has the bochs/virtio-gpu display drivers the cloud kernel
lacks), systemd as init, and python3 for agents' scripts."""

DESKTOP_PACKAGES = ("xserver-xorg-core", "xserver-xorg-input-libinput", "xinit", "xterm", "twm",
                    "x11-xserver-utils", "xfonts-base", "fonts-dejavu-core")
"""``--desktop``: Xorg (modesetting driver on the VM's VGA, no GL acceleration: there is no GPU), the twm
window manager and xterm."""

AGENT_PORT = "dsec.agent"
"""Name of the virtio-serial port the agent serves (udev links it as /dev/virtio-ports/dsec.agent)."""

DISK_SIZE = 4 * 1024**3
"""Size of a VM image's root filesystem unless asked otherwise."""
_INITRAMFS_SETUP = ('mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/usr/share/initramfs-tools/modules.d" && '
                    'echo MODULES=list > "$1/etc/initramfs-tools/conf.d/dsec.conf" && '
                    'printf "virtio_pci\\nvirtio_blk\\next4\\n" > "$1/usr/share/initramfs-tools/modules.d/dsec"')
"""Run on the root tree (``$1``) before the kernel is installed: its initramfs holds only what mounts the root
disk (a smaller initramfs unpacks faster, which counts under TCG)."""
_INITRAMFS_HOOK = "--essential-hook=" + _INITRAMFS_SETUP
_APT_DIR = "run/dsec-apt"
"""Inside a ``--from`` tree while packages are installed: the host's apt sources and options (the image's own
sources may point where this host cannot reach)."""
_CHROOT_APT = f"""set -e
T=$1; shift
mount -t proc proc "$T/proc"
mount --rbind /dev "$T/dev"
mount -t sysfs sysfs "$T/sys"
export APT_CONFIG=/{_APT_DIR}/apt.conf DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
chroot "$T" apt-get update -q
chroot "$T" apt-get install -q -y --no-install-recommends -o Dpkg::Options::=--force-confold "$@"
chroot "$T" apt-get clean
rm -rf "$T"/var/lib/apt/lists/*
"""
"""Run in a private mount namespace (``unshare -m``): the chroot's /proc, /dev and /sys vanish with it."""
_UNITS_OFF = ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer",
              "serial-getty@ttyS0.service", "systemd-timesyncd.service", "e2scrub_reap.service")
"""Units masked in the image: periodic jobs that would wake an idle VM (and its template) for nothing."""

_AGENT_UNIT = f"""[Unit]
Description=DSec guest agent (exec and files for the host over virtio-serial)
DefaultDependencies=no
After=systemd-udevd.service local-fs.target
Wants=systemd-udevd.service
StartLimitIntervalSec=0

[Service]
ExecStart=/usr/local/sbin/dsec-agent /dev/virtio-ports/{AGENT_PORT} /dev/vdb
Restart=always
RestartSec=0.2
OOMScoreAdjust=-1000
Delegate=yes

[Install]
WantedBy=sysinit.target
"""
"""The agent as a service: never the OOM killer's victim (-1000, which its commands do not inherit: each puts its
score back to 0), with its cgroup delegated so it can put its commands in a memory cgroup of their own below the
guest's RAM (``commands``, beside its own leaf ``agent``; see ``setup_command_cgroup`` in ``agent_exec.c``). Its second
argument is the image's untouched base disk (``/dev/vdb``, attached read-only by the vm backend) for pristine
execs: its device number is taken when the agent starts, before any command ran."""

_DESKTOP_UNIT = """[Unit]
Description=DSec desktop (Xorg on the VM's display, twm, xterm)
After=systemd-user-sessions.service systemd-udev-settle.service dsec-agent.service

[Service]
Environment=HOME=/root
ExecStart=/usr/bin/xinit /etc/dsec/xsession -- /usr/bin/Xorg :0 vt7 -nolisten tcp -noreset -s 0 -dpms -extension XTEST
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""

_XSESSION = """#!/bin/sh
# The desktop's session: a plain background, twm (restarted if it exits), and one terminal at a fixed place
# (twm does not ask where to put a window that gives its own position). Agents open more with
# `DISPLAY=:0 xterm &`. The session lasts until X stops.
exec >/var/log/dsec-xsession.log 2>&1
xsetroot -solid '#2e3440'
(while :; do twm; sleep 1; done) &
xterm -geometry 80x24+40+40 -fa Monospace -fs 12 -bg black -fg white &
exec sleep infinity
"""

_TWMRC = """TitleFont "fixed"
ResizeFont "fixed"
MenuFont "fixed"
IconFont "fixed"
IconManagerFont "fixed"
RandomPlacement
"""
"""twm's default fonts (adobe-helvetica) are not in xfonts-base: without this it cannot open its fontset and
exits (the session restarts it)."""

_XORG_CONF = """Section "Device"
    Identifier "dsec-display"
    Driver "modesetting"
    Option "AccelMethod" "none"
EndSection

Section "ServerFlags"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection
"""


def _agent_build_dir() -> Path:
    """Where the agent for VM images is built: the node's guest directory (root's), never a world-writable
    /tmp, where another user could plant a binary under the name the build would then copy into an image."""
    return default_guest_dir() / "build"


@functools.cache
def recipe_digest(desktop: bool) -> str:
    """Digest of what :func:`build_vm_image` puts into an image besides the packages: the agent (its source, by
    the name :func:`~dsec.guest.initramfs.ensure_agent` gives the binary) and the units and files written into
    the tree. ``image.json`` records it (``recipe``); an image whose recipe differs is stale (``scripts/setup``
    rebuilds it). Builds the agent if needed; computed once per process (every vm create asks)."""
    agent = ensure_agent(_agent_build_dir())
    parts = [agent.name, _AGENT_UNIT, *_UNITS_OFF, *BASE_PACKAGES]
    if desktop:
        parts += [_DESKTOP_UNIT, _XSESSION, _TWMRC, _XORG_CONF, *DESKTOP_PACKAGES]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def default_vm_dir() -> Path:
    """``DSEC_VM_DIR`` or ``/var/lib/dsec/vm``: shared by every DSEC_HOME on the node, like images."""
    return Path(os.environ.get("DSEC_VM_DIR") or "/var/lib/dsec/vm")


@dataclass(frozen=True)
class VMImage:
    """A built VM disk image."""

    name: str
    dir: Path
    disk: Path
    kernel: Path
    initrd: Path
    desktop: bool
    disk_bytes: int
    meta: dict[str, Any]

    @property
    def current(self) -> bool:
        """Whether the image was built with this code's agent and recipe (:func:`recipe_digest`)."""
        return bool(self.meta.get("recipe") == recipe_digest(self.desktop))


def find_vm_image(name: str, vm_dir: Path | None = None) -> VMImage:
    """The VM image ``name``; raises :class:`ImageNotFound` naming how to build it."""
    validate_name(name)
    d = (vm_dir or default_vm_dir()) / "images" / name
    image = load_vm_image(d, name)
    if image is None:
        raise ImageNotFound(f"no VM image {name!r} in {d.parent}: build it with `dsec image build-vm {name}`",
                            image=name)
    return image


def load_vm_image(d: Path, name: str) -> VMImage | None:
    """The complete VM image in directory ``d``, or None."""
    try:
        meta = json.loads((d / "image.json").read_text())
    except (OSError, ValueError):
        return None
    for f in ("disk.qcow2", "vmlinuz", "initrd.img"):
        if not (d / f).is_file():
            return None
    return VMImage(name, d, d / "disk.qcow2", d / "vmlinuz", d / "initrd.img", bool(meta.get("desktop")),
                   int(meta.get("disk_bytes", DISK_SIZE)), meta)


def list_vm_images(vm_dir: Path | None = None) -> list[VMImage]:
    """Every complete VM image, by name."""
    root = (vm_dir or default_vm_dir()) / "images"
    found = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            found.append(find_vm_image(d.name, vm_dir))
        except (ImageNotFound, InvalidRequest):
            continue
    return found


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DSecError(f"{' '.join(argv[:3])} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")


def _configure(root: Path, desktop: bool) -> str:
    """Install the agent and units into the bootstrapped ``root``; return the kernel version."""
    agent = ensure_agent(_agent_build_dir())
    shutil.copy2(agent, root / "usr/local/sbin/dsec-agent")
    os.chmod(root / "usr/local/sbin/dsec-agent", 0o755)
    units = root / "etc/systemd/system"
    (units / "dsec-agent.service").write_text(_AGENT_UNIT)
    wants = units / "sysinit.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "dsec-agent.service").symlink_to("/etc/systemd/system/dsec-agent.service")
    for unit in _UNITS_OFF:
        link = units / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    if desktop:
        (units / "dsec-desktop.service").write_text(_DESKTOP_UNIT)
        mu = units / "multi-user.target.wants"
        mu.mkdir(exist_ok=True)
        (mu / "dsec-desktop.service").symlink_to("/etc/systemd/system/dsec-desktop.service")
        (root / "etc/dsec").mkdir(exist_ok=True)
        (root / "etc/dsec/xsession").write_text(_XSESSION)
        os.chmod(root / "etc/dsec/xsession", 0o755)
        (root / "root/.twmrc").write_text(_TWMRC)
        (root / "etc/X11/xorg.conf.d").mkdir(parents=True, exist_ok=True)
        (root / "etc/X11/xorg.conf.d/10-dsec.conf").write_text(_XORG_CONF)
    (root / "etc/fstab").write_text("/dev/vda / ext4 rw,errors=remount-ro 0 0\n")
    (root / "etc/hostname").write_text("dsec-vm\n")
    (root / "workspace").mkdir(exist_ok=True)
    # the clone's identity is set by the agent at create; an empty machine-id makes systemd make one at boot
    (root / "etc/machine-id").write_text("")
    if not os.path.lexists(root / "sbin/init"):
        raise DSecError("the system has no /sbin/init (systemd-sysv was not installed?): it cannot boot")
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise DSecError("the bootstrapped system has no kernel in /boot (linux-image-amd64 not installed?)")
    version = kernels[-1].name.removeprefix("vmlinuz-")
    if not (root / "boot" / f"initrd.img-{version}").is_file():
        raise DSecError(f"the bootstrapped system has no initramfs for kernel {version}")
    return version


def _tree_from(source: ImageRef, tree: Path, packages: list[str], log: Path | None) -> None:
    """``source``'s root with its real owners in ``tree``, plus ``packages`` installed by the tree's own apt
    (in a chroot, with the host's apt sources and options)."""
    check_bootable(source)
    check_packages(packages)
    tree.mkdir()
    if source.uid_shift:
        try:
            with unshifted_view(source.rootfs, source.uid_shift, tree.parent) as view:
                _run(["cp", "-a", "--reflink=auto", "-T", str(view), str(tree)])
        except NotSupported as e:
            raise DSecError(f"image {source.name!r} is stored with its owners shifted by {source.uid_shift}, and "
                            f"they cannot be read back here: {e}", image=source.name) from None
    else:
        _run(["cp", "-a", "--reflink=auto", "-T", str(source.rootfs), str(tree)])
    _run(["sh", "-c", _INITRAMFS_SETUP, "sh", str(tree)])
    apt = tree / _APT_DIR
    (apt / "sources.list.d").mkdir(parents=True)
    for src in apt_sources():
        shutil.copy(src, apt / "sources.list.d" / (src.name if src.name != "sources.list" else "host.list"))
    conf = [f'Dir::Etc::SourceList "/{_APT_DIR}/none.list";', f'Dir::Etc::SourceParts "/{_APT_DIR}/sources.list.d";']
    conf += [f.read_text() for f in apt_options()]
    (apt / "apt.conf").write_text("\n".join(conf) + "\n")
    # services are not started in a chroot; the host's resolver for apt's downloads (restored after)
    saved = {f: f.read_bytes() if f.is_file() and not f.is_symlink() else os.readlink(f) if f.is_symlink() else None
             for f in (tree / "etc/resolv.conf", tree / "usr/sbin/policy-rc.d")}
    for f in saved:
        f.unlink(missing_ok=True)
    shutil.copy("/etc/resolv.conf", tree / "etc/resolv.conf")
    (tree / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    os.chmod(tree / "usr/sbin/policy-rc.d", 0o755)
    try:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", _CHROOT_APT, "sh",
                               str(tree), *packages], capture_output=True, text=True, check=False)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise DSecError(f"installing the VM's packages into image {source.name!r} failed (exit "
                            f"{proc.returncode}):\n{tail}", image=source.name)
    finally:
        shutil.rmtree(apt, ignore_errors=True)
        for f, old in saved.items():
            f.unlink(missing_ok=True)
            if isinstance(old, bytes):
                f.write_bytes(old)
            elif isinstance(old, str):
                f.symlink_to(old)


def build_vm_image(name: str, desktop: bool = False, packages: list[str] | None = None, suite: str = "bookworm",
                   disk_bytes: int = DISK_SIZE, replace: bool = False, vm_dir: Path | None = None,
                   log: Path | None = None, source: ImageRef | None = None) -> VMImage:
    """Bootstrap a bootable Debian (plus ``packages``, plus the desktop) and store it as VM image ``name``;
    with ``source`` (a DSec image), start from that image's root instead and add the same packages with its
    own apt (``suite`` is then the image's).

    Needs root (mmdebstrap's root mode, or chroot), ``mkfs.ext4`` (populates the filesystem from the tree
    without a loop mount) and ``qemu-img``. Built in a temporary directory beside the images, which is always
    removed.
    """
    validate_name(name)
    if disk_bytes < 1024**3:
        raise InvalidRequest(f"disk_bytes={disk_bytes} is too small for a VM image (at least 1 GiB)")
    target = (vm_dir or default_vm_dir()) / "images" / name
    if target.exists() and not replace:
        raise InvalidRequest(f"VM image {name!r} exists: pass --replace to rebuild it", image=name)
    wanted = [*BASE_PACKAGES, *(DESKTOP_PACKAGES if desktop else ()), *(packages or [])]
    build_into(target, wanted, desktop, suite, disk_bytes, log, source)
    return find_vm_image(name, vm_dir)


def build_into(target: Path, wanted: list[str], desktop: bool, suite: str, disk_bytes: int, log: Path | None,
           source: ImageRef | None) -> None:
    """Build a VM image of ``wanted`` packages into directory ``target`` (replaced whole once complete), in a
    temporary ``.build-<target name>-*`` directory beside it, removed at the end."""
    for tool, pkg in (("mkfs.ext4", "e2fsprogs"), ("qemu-img", "qemu-utils")):
        if shutil.which(tool) is None:
            raise BackendUnavailable(f"{tool} not found: apt-get install {pkg}", package=pkg)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-", dir=target.parent))
    try:
        tree = work / "rootfs"
        if source is None:
            run_mmdebstrap(mmdebstrap_command(wanted, suite, tree, hooks=[_INITRAMFS_HOOK]), target.name, log)
        else:
            _tree_from(source, tree, wanted, log)
        version = _configure(tree, desktop)
        out = work / "out"
        out.mkdir()
        shutil.copy2(tree / "boot" / f"vmlinuz-{version}", out / "vmlinuz")
        shutil.copy2(tree / "boot" / f"initrd.img-{version}", out / "initrd.img")
        raw = work / "disk.raw"
        _run(["mkfs.ext4", "-q", "-F", "-L", "dsec-root", "-E", "root_owner=0:0", "-d", str(tree), str(raw),
              str(disk_bytes // 1024) + "k"])
        _run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out / "disk.qcow2")])
        os.chmod(out / "disk.qcow2", 0o444)
        meta = {"name": target.name, "suite": suite if source is None else None, "packages": wanted,
                "desktop": desktop, "kernel": version, "disk_bytes": disk_bytes, "built_at": time.time(),
                "from": source.name if source is not None else None,
                "digest": source.digest if source is not None else None, "recipe": recipe_digest(desktop)}
        (out / "image.json").write_text(json.dumps(meta, indent=2))
        os.chmod(out, 0o755)
        if target.exists():
            target.rename(work / "old")
        out.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_ELF_MACHINES = {3: "i386", 8: "mips", 20: "ppc", 21: "ppc64", 22: "s390x", 40: "arm", 62: "x86_64",
                 183: "aarch64", 243: "riscv64"}
_HOST_MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}


def image_machine(root: Path) -> str | None:
    """The machine an image's binaries are built for (from the ELF header of its dpkg or apt-get), or None when
    it has neither as a regular ELF file. Symlinks in the image are never followed (they may point out of it)."""
    for rel in ("usr/bin/dpkg", "usr/bin/apt-get"):
        try:
            fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            head = os.pread(fd, 20, 0)
        finally:
            os.close(fd)
        if head[:4] != b"\x7fELF" or len(head) < 20:
            continue
        machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
        return _ELF_MACHINES.get(machine, f"ELF machine {machine}")
    return None


def check_bootable(source: ImageRef) -> None:
    """InvalidRequest naming ``source`` when it cannot become a VM disk: no apt and dpkg of its own to install
    the kernel, systemd and the agent's needs with, or binaries for another machine than this host's. Its
    ``reason`` detail says why in a few words."""
    for tool in ("usr/bin/apt-get", "usr/bin/dpkg"):
        if not os.path.lexists(source.rootfs / tool):
            raise InvalidRequest(f"image {source.name!r} cannot boot as a vm: it has no /{tool}, and a vm disk is made "
                                 "by the image's own apt adding Debian's kernel and systemd (use a Debian-based image, "
                                 "or backend='container', 'function' or 'microvm', which run any image)",
                                 image=source.name, reason=f"no /{tool}")
    machine = image_machine(source.rootfs)
    host = _HOST_MACHINE.get(os.uname().machine, os.uname().machine)
    if machine is not None and machine != host:
        raise InvalidRequest(f"image {source.name!r} cannot boot here: its binaries are for {machine}, this host runs "
                             f"{host} guests", image=source.name, reason=f"built for {machine}")
