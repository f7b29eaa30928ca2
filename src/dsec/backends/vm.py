"""The ``vm`` backend: a full virtual machine per sandbox (QEMU ``-M q35``), with its own kernel, systemd as
init, kernel modules, and optionally an X desktop that agents see as screenshots and drive with the mouse and
keyboard.

It is the shared QEMU backend (:mod:`dsec.backends.qemu`: the same QEMU process handling, cgroups, QMP client,
guest agent protocol, templates, snapshots and recovery, no hibernation on pause) with another machine profile,
:class:`Q35Profile`. What differs from microvm:

* the disk: a VM image (:mod:`dsec.guest.vmimage`, ``dsec image build-vm``) is an ext4 root filesystem in a
  read-only qcow2 file; each sandbox writes to its own qcow2 overlay (``qemu-img create -b``) in
  ``<home>/vm/sandboxes/<id>/``. A template's or snapshot's saved disk is a copy of the overlay taken while
  the VM is stopped, and clones get an overlay over it, so their RAM and disk agree;
* boot: QEMU loads the image's own kernel and initramfs (copied out of its /boot at build time) and mounts
  the disk as root; systemd starts the agent (``dsec-agent.service``) on the virtio-serial port;
* a display (``-device VGA``), a USB tablet (absolute pointer) and the PS/2 keyboard: :meth:`screenshot`
  (QMP ``screendump`` as PNG), :meth:`mouse` (QMP ``input-send-event``) and :meth:`keyboard` (QMP
  ``send-key``, which QEMU spaces out itself so the guest's keyboard buffer never overflows);
* the NIC of a networked sandbox: ``virtio-net-pci`` (on the same tap in the sandbox's network namespace as a
  microVM's, under the same policies), which the agent configures once systemd has booted (the image runs no
  network manager): the address, route and resolver survive in a template's RAM and disk, so every clone of
  the ``-nic`` template comes up with them. ``network="none"`` has no NIC at all, as on microvm;
* grading: a sandbox with ``protected=``/``hidden=`` has its commands confined by the agent (microvm's CONFINE,
  plus a read-only system, their own ``/run`` and no block devices: the VM's systemd, services and desktop are
  unconfined root), and only such a sandbox runs pristine execs, on the image's base disk attached read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from dsec.backends.base import ImageRef, workdir_of
from dsec.backends.qemu.accel import accel_arg
from dsec.backends.qemu.agent import GuestAgent
from dsec.backends.qemu.backend import QemuBackend, home_tag
from dsec.backends.qemu.machine import chown_to
from dsec.backends.qemu.profile import MiB, Shape
from dsec.backends.qemu.qmp import qmp
from dsec.config import Settings
from dsec.errors import BackendUnavailable, ImageNotFound, InvalidRequest, SandboxError
from dsec.guest.accel import QEMU
from dsec.guest.kernel import default_guest_dir, find_kernel
from dsec.guest.vmderive import derive_in_helper
from dsec.guest.vmimage import AGENT_PORT, default_vm_dir, find_vm_image
from dsec.isolation.network import GUEST_ADDRESS, GUEST_GATEWAY
from dsec.models import ExecRequest, ImageConfig, SandboxRecord

__all__ = ["KEY_NAMES", "MOUSE_ACTIONS", "MOUSE_BUTTONS", "Q35Profile", "VMBackend", "key_chunks", "keys_for_text"]

GUEST_RAM = 1024 * MiB
"""A vm guest's least RAM (the default ``memory``'s, so its template serves every smaller one)."""
_CMDLINE = ("root=/dev/vda rw console=ttyS0 panic=-1 quiet loglevel=4 fsck.mode=skip systemd.show_status=0 "
            "net.ifnames=0 mitigations=off")
_SHELL_READY = ('until p=$(pgrep -x bash -P "$(pgrep -d, -x xterm)") && '
                'stty -a < /proc/$p/fd/0 2>/dev/null | grep -q -- -icanon; do sleep 0.5; done')
"""Returns once the desktop terminal's shell waits at its prompt: readline has put the terminal in
non-canonical mode. Keys typed into an xterm whose shell has not started yet are lost, and under TCG an xterm
takes many seconds to start its shell."""
_SETTLE = ("systemctl is-system-running --wait; "
           "if systemctl -q is-enabled dsec-desktop.service 2>/dev/null; then "
           f"until pgrep -x twm >/dev/null; do sleep 0.5; done; {_SHELL_READY}; sleep 1; fi")
"""Run in a freshly booted guest: returns once boot is over (and, on a desktop image, the window manager runs
and the terminal's shell is ready for keys): a template is saved in that state."""
_PS2_QUEUE = 16
"""Bytes QEMU's PS/2 keyboard queues for the guest (hw/input/ps2.c ``PS2_QUEUE_SIZE``); more are dropped."""
_KEY_BYTES = 4
"""Scancode bytes one key of a combo may take, pressed and released (extended keys: 2 + 2)."""
_HOLD_MS = 20
_ABS_MAX = 0x7FFF
"""QEMU's absolute pointer range (both axes)."""

MOUSE_BUTTONS = ("left", "middle", "right")
MOUSE_ACTIONS = ("click", "double_click", "down", "up", "move", "scroll_up", "scroll_down")

_SHIFTED = {'!': "1", '@': "2", '#': "3", '$': "4", '%': "5", '^': "6", '&': "7", '*': "8", '(': "9", ')': "0",
            '_': "minus", '+': "equal", '{': "bracket_left", '}': "bracket_right", '|': "backslash",
            ':': "semicolon", '"': "apostrophe", '~': "grave_accent", '<': "comma", '>': "dot", '?': "slash"}
_PLAIN = {' ': "spc", '\n': "ret", '\t': "tab", '-': "minus", '=': "equal", '[': "bracket_left",
          ']': "bracket_right", '\\': "backslash", ';': "semicolon", "'": "apostrophe", '`': "grave_accent",
          ',': "comma", '.': "dot", '/': "slash"}
KEY_NAMES: dict[str, str] = {
    **{c: c for c in "abcdefghijklmnopqrstuvwxyz0123456789"},
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
    "enter": "ret", "return": "ret", "ret": "ret", "tab": "tab", "space": "spc", "spc": "spc",
    "backspace": "backspace", "escape": "esc", "esc": "esc", "delete": "delete", "insert": "insert",
    "home": "home", "end": "end", "pageup": "pgup", "pagedown": "pgdn", "up": "up", "down": "down",
    "left": "left", "right": "right", "shift": "shift", "ctrl": "ctrl", "control": "ctrl", "alt": "alt",
    "super": "meta_l", "meta": "meta_l", "minus": "minus", "equal": "equal", "slash": "slash", "dot": "dot",
    "comma": "comma",
}
"""Key names accepted in ``keys=[...]`` (case-insensitive; combos join them with ``+``: ``"ctrl+c"``), mapped to
QEMU qcodes."""


def keys_for_text(text: str) -> list[list[str]]:
    """The key combos (qcodes, modifiers first) that type ``text`` on a US layout; InvalidRequest names the
    first character that has no key."""
    out: list[list[str]] = []
    for i, ch in enumerate(text):
        if "a" <= ch <= "z" or "0" <= ch <= "9":
            out.append([ch])
        elif "A" <= ch <= "Z":
            out.append(["shift", ch.lower()])
        elif ch in _PLAIN:
            out.append([_PLAIN[ch]])
        elif ch in _SHIFTED:
            out.append(["shift", _SHIFTED[ch]])
        else:
            raise InvalidRequest(f"text[{i}]={ch!r} cannot be typed: only printable ASCII, tab and newline "
                                 f"(US keyboard layout)")
    return out


def key_chunks(combos: list[list[str]]) -> list[list[list[str]]]:
    """``combos`` in order, cut into runs whose scancodes fit QEMU's PS/2 queue (a combo bigger than the queue
    goes alone)."""
    chunks: list[list[list[str]]] = []
    for combo in combos:
        if chunks and _KEY_BYTES * sum(map(len, [*chunks[-1], combo])) <= _PS2_QUEUE:
            chunks[-1].append(combo)
        else:
            chunks.append([combo])
    return chunks


def _combo(spec: str) -> list[str]:
    if not isinstance(spec, str) or not spec:
        raise InvalidRequest(f"a key must be a non-empty string like 'enter' or 'ctrl+c', got {spec!r}")
    names = spec.lower().split("+")
    try:
        return [KEY_NAMES[n] for n in names]
    except KeyError as e:
        raise InvalidRequest(f"unknown key {e.args[0]!r} in {spec!r}; known: {', '.join(sorted(KEY_NAMES))}"
                             ) from None


def _png_size(data: bytes) -> tuple[int, int]:
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise SandboxError("QEMU's screendump is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


class Q35Profile:
    """``-M q35`` booting a VM image's own kernel and systemd from a qcow2 overlay per sandbox."""

    name = "vm"
    nic_device = "virtio-net-pci"
    min_memory = 128 * MiB
    """``memory`` limits the guest's commands (its ``commands`` cgroup), not the whole machine."""

    def __init__(self, vm_dir: Path, tag: str, qemu_user: str | None) -> None:
        self.vm_dir = vm_dir
        self.qemu_user = qemu_user
        # QEMU reopens a sandbox's disk as its unprivileged user when it resumes after a migration (restore,
        # snapshot): the overlay must sit where that user can reach it, which DSEC_HOME (often 0700) is not.
        self.sandbox_files = vm_dir / "sandboxes" / tag
        self.boot_timeout = float(os.environ.get("DSEC_VM_BOOT_TIMEOUT") or 900)
        """Seconds for a cold boot to reach the agent, and again for systemd and the desktop to settle: TCG on a
        loaded 2-core host has needed more than 300 s for each."""
        self.restore_timeout = float(os.environ.get("DSEC_VM_RESTORE_TIMEOUT") or 180)
        """A restored desktop guest under TCG on a loaded host has needed more than the microvm's 20 s to
        answer."""

    def available(self) -> str:
        if os.geteuid() != 0:
            return "needs root (cgroups, QEMU as an unprivileged user)"
        for tool, pkg in ((QEMU, "qemu-system-x86"), ("qemu-img", "qemu-utils")):
            if shutil.which(tool) is None:
                return f"{tool} not found: apt-get install {pkg}"
        return "ok"

    async def start(self) -> Path | None:
        self.sandbox_files.mkdir(parents=True, exist_ok=True)
        for d in (self.sandbox_files, self.sandbox_files.parent):
            os.chmod(d, 0o711)
        try:  # the microvm guest kernel is the KVM probe (any kernel will do); without it, no probe
            return find_kernel(default_guest_dir()).vmlinuz
        except BackendUnavailable:
            return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sandbox_files.rmdir()  # only when no sandbox is left

    def check_shape(self, record: SandboxRecord, shape: Shape) -> None:
        """A ``disk`` the host can hold: the overlay is sparse, but a guest may fill it."""
        free = shutil.disk_usage(self.sandbox_files if self.sandbox_files.is_dir() else self.vm_dir).free
        if shape.disk_bytes > free:
            raise InvalidRequest(f"disk={shape.disk_bytes} is more than the {free // MiB} MiB free on the host's "
                                 f"filesystem for vm disks ({self.sandbox_files})")

    def guest_mib(self, memory: int) -> int:
        """At least :data:`GUEST_RAM`: systemd, the services and the desktop need their own memory, and every
        smaller ``memory`` shares that template; :meth:`prepared` caps the commands' cgroup at ``memory``."""
        return max(memory, GUEST_RAM) // MiB

    def resolve_image(self, name: str) -> ImageRef | None:
        """A VM image (``dsec image build-vm``): ``rootfs`` is its directory. One built with another guest agent or
        recipe is refused: the backend and the agent inside must speak the same protocol. None when there is no
        VM image of that name: the engine resolves the DSec image of the store, whose disk :meth:`base_disk`
        derives on first use."""
        try:
            image = find_vm_image(name, self.vm_dir)
        except ImageNotFound:
            return None
        if not image.current:
            raise BackendUnavailable(f"VM image {name!r} was built with another guest agent or recipe than this "
                                     f"DSec's: rebuild it with `dsec image build-vm {name}"
                                     f"{' --desktop' if image.desktop else ''} --replace` (scripts/setup does)")
        return ImageRef(name=name, rootfs=image.dir, config=ImageConfig(workdir="/workspace"))

    async def base_disk(self, image: ImageRef) -> Path:
        """The disk the sandbox boots: the VM image's, or the one derived from a DSec image (built on its first
        vm create, about a minute; kept per image content for every later one)."""
        if image.rootfs.parent == self.vm_dir / "images":
            return find_vm_image(image.name, self.vm_dir).disk
        derived = await asyncio.to_thread(derive_in_helper, image, self.vm_dir)
        return derived.disk

    async def image_user(self, image: ImageRef, user: str | None) -> dict[str, Any]:
        # The image is a disk: SandboxSpec.user is resolved in the guest's own files when a call needs it.
        return {"user": [0, 0], "home": "/root"}

    def template_key(self, disk: Path, shape: Shape, accel: str | None) -> str:
        st = disk.stat()
        # "vm3": the version of what a template holds (the terminal's shell ready, the pristine disk attached)
        return hashlib.sha256(f"vm3:{disk}:{st.st_mtime_ns}:{st.st_ino}:{shape.vcpus}:{shape.mem_mib}:{accel}"
                              .encode()).hexdigest()[:16]

    def command(self, rundir: Path, disk: Path, shape: Shape, memory: list[str], accel: str) -> list[str]:
        return [
            QEMU, "-M", "q35,memory-backend=mem",
            "-accel", accel_arg(accel), "-cpu", "host" if accel == "kvm" else "max",
            "-smp", str(shape.vcpus), "-m", f"{shape.mem_mib}M", "-object", ",".join(memory),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
            "-kernel", str(disk.parent / "vmlinuz"), "-initrd", str(disk.parent / "initrd.img"),
            "-append", _CMDLINE,
            "-chardev", f"socket,id=con,path={rundir / 'console.sock'},server=on,wait=off", "-serial", "chardev:con",
            "-drive", f"id=root,file={disk},format=qcow2,if=none,discard=unmap",
            "-device", "virtio-blk-pci,drive=root",
            # the image's untouched base, read-only at QEMU's level: /dev/vdb, the root of pristine execs
            "-drive", f"id=pristine,file={disk.parent / 'pristine.qcow2'},format=qcow2,if=none,readonly=on",
            "-device", "virtio-blk-pci,drive=pristine",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=agent,path={rundir / 'agent.sock'},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT}",
            "-device", "VGA", "-device", "qemu-xhci", "-device", "usb-tablet",
            "-qmp", f"unix:{rundir / 'qmp.sock'},server=on,wait=off",
            "-pidfile", str(rundir / "qemu.pid"),
        ]

    async def sandbox_disk(self, sandbox_id: str, base: Path, saved: Path | None) -> Path:
        """A fresh qcow2 overlay over the saved disk of ``saved`` (template or snapshot) or the image's base,
        with links to the image's kernel and initramfs beside it."""
        d = self.sandbox_files / sandbox_id
        await asyncio.to_thread(shutil.rmtree, d, True)
        d.mkdir(parents=True)
        backing = saved / "disk.qcow2" if saved is not None else base
        if not backing.is_file():
            raise SandboxError(f"{saved.name if saved else base}: its disk {backing} is missing")
        proc = await asyncio.to_thread(
            subprocess.run, ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(backing),
                             str(d / "disk.qcow2")], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SandboxError(f"qemu-img create of the sandbox's disk failed: {proc.stderr.strip()[-300:]}")
        for name in ("vmlinuz", "initrd.img"):
            (d / name).symlink_to(base.parent / name)
        (d / "pristine.qcow2").symlink_to(base)
        chown_to(d / "disk.qcow2", self.qemu_user)
        chown_to(d, self.qemu_user)
        return d / "disk.qcow2"

    async def saved(self, record: SandboxRecord, target: Path) -> None:
        """Copy the stopped VM's overlay beside its saved state: templates, snapshots and hibernation keep
        the disk that goes with the RAM."""
        disk = Path(record.backend_state.get("erofs") or self.sandbox_files / record.id / "disk.qcow2")
        copy = target.with_name("disk.qcow2")
        tmp = copy.with_name(".disk.qcow2.tmp")
        await asyncio.to_thread(shutil.copyfile, disk, tmp)
        os.chmod(tmp, 0o444)
        os.replace(tmp, copy)

    async def booted(self, record: SandboxRecord, agent: GuestAgent) -> None:
        """Wait until systemd has started everything (and the desktop shows its windows): a template saved
        earlier would make every clone finish booting on its own time."""
        result = await agent.exec(record, ExecRequest(command=_SETTLE, timeout=self.boot_timeout))
        if result.limit == "time":
            raise SandboxError(f"the guest did not settle within {self.boot_timeout:.0f}s (systemd: "
                               f"{result.stdout.decode(errors='replace').strip() or 'starting'}; a desktop image "
                               "also waits for twm and for its terminal's shell at the prompt)")
        if record.backend_state.get("netns"):
            await _guest_network(record, agent)

    async def prepared(self, record: SandboxRecord, agent: GuestAgent) -> None:
        """The host's time: a clone's clock is its template's, which may be days old (the image masks
        timesyncd, and there is no network to sync with); then the disk ``spec.disk`` asks for."""
        r = await agent.system_exec(record, ExecRequest(command=["date", "-u", "-s", f"@{time.time():.3f}"],
                                                        timeout=30))
        if r.exit_code != 0:
            raise SandboxError(f"setting the guest's clock failed: {r.stderr.decode(errors='replace')[:200]}")
        await _limit_commands_memory(record, agent, self.guest_mib(record.spec.memory) * MiB)
        await _grow_disk(record, agent)

    def confines(self, record: SandboxRecord) -> bool:
        """Commands of a vm run confined only when the sandbox has grading paths: confinement takes root's
        capabilities to mount, load modules or set the clock, and makes the system read-only to commands.
        Otherwise a full VM's root keeps every capability and the VM is the boundary."""
        return bool(record.spec.protected or record.spec.hidden)

    def confine_extra(self, record: SandboxRecord) -> list[tuple[str, str]]:
        """What confinement needs besides the paths in a full VM, where systemd, udev, the kernel's modprobe and
        the desktop run as unconfined root: a read-only root but for the work directories (nothing a command
        writes is ever run by them), the commands' own ``/run`` (units, udev rules, modprobe.d, the control
        sockets of systemd and udev live there), and the block devices covered (raw writes to the root disk
        would go around every mount)."""
        writable = dict.fromkeys(("/workspace", workdir_of(record), "/tmp", "/var/tmp", "/home", "/dev/shm"))
        return [("T", "/run"), *(("W", d) for d in writable), ("B", "/dev")]

    def pristine_refusal(self, record: SandboxRecord) -> str | None:
        """The image's base disk is attached read-only (``/dev/vdb``); pristine execs need a confined sandbox."""
        if not self.confines(record):
            return ("pristine execs on the vm backend need a confined sandbox (create it with protected= or "
                    "hidden=): in an unconfined VM, guest root could replace the agent that runs them")
        return None


async def _guest_network(record: SandboxRecord, agent: GuestAgent) -> None:
    """Configure a freshly booted guest's NIC (``eth0``: the image boots with ``net.ifnames=0``) as every
    networked guest's: :data:`GUEST_ADDRESS` on the tap's link, the tap as default route and resolver.
    Done once per cold boot: templates and snapshots carry it to their clones. The guest's root may change
    it; the policy is enforced outside the guest, so that only cuts the guest off."""
    script = (f"for i in $(seq 600); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done; "
              f"[ -e /sys/class/net/eth0 ] || {{ echo 'no eth0 (virtio_net not loaded?)'; exit 1; }}; "
              "sysctl -qw net.ipv6.conf.eth0.disable_ipv6=1; ip link set lo up && ip addr flush dev eth0 && "
              f"ip addr add {GUEST_ADDRESS}/30 dev eth0 && ip link set eth0 up && "
              f"ip route replace default via {GUEST_GATEWAY} && rm -f /etc/resolv.conf && "
              f"echo 'nameserver {GUEST_GATEWAY}' > /etc/resolv.conf 2>&1")
    r = await agent.exec(record, ExecRequest(command=script, timeout=120))
    if r.exit_code != 0:
        raise SandboxError(f"configuring the guest's network failed: "
                           f"{(r.stdout + r.stderr).decode(errors='replace').strip()[-300:]}")


async def _limit_commands_memory(record: SandboxRecord, agent: GuestAgent, ram: int) -> None:
    """Cap the guest's commands at ``spec.memory`` when the guest's RAM is larger: its agent limits them to RAM
    less what the system keeps (``memory.max`` of their ``commands`` cgroup, set at its start, kept in a
    template's RAM), so a smaller ``memory`` is written over it (never raised). No swap, so no ``memory.high``:
    without swap it would only slow an allocating command down before the OOM killer ends it."""
    want = record.spec.memory // 4096 * 4096
    if want >= ram:
        return
    r = await agent.system_exec(record, ExecRequest(command=(
        "cg=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup); "
        'case $cg in */commands) ;; *) echo "commands run in $cg, not in a commands cgroup" >&2; exit 3;; esac; '
        f'cur=$(cat "$cg/memory.max") && {{ [ "$cur" = max ] || [ {want} -lt "$cur" ]; }} && '
        f'echo {want} > "$cg/memory.max"; cat "$cg/memory.max"'), timeout=60))
    got = r.stdout.decode(errors="replace").strip().splitlines()
    if r.exit_code != 0 or not got or not got[-1].isdigit() or int(got[-1]) > want:
        raise SandboxError(f"limiting the guest's commands to memory={record.spec.memory} failed: "
                           f"{(r.stdout + r.stderr).decode(errors='replace').strip()[-300:]}")


async def _grow_disk(record: SandboxRecord, agent: GuestAgent) -> None:
    """Give the guest a disk of ``spec.disk`` bytes: QMP ``block_resize`` of the sandbox's overlay (the
    guest's virtio-blk sees the new capacity at once), then an online ``resize2fs`` of its root
    filesystem. A disk is never shrunk: a ``spec.disk`` below the image's (or snapshot's) size leaves that
    size, which ``backend_state["disk_bytes"]`` reports."""
    vm = agent.machines.get(record)
    blocks = (await qmp(vm.rundir, [("query-block", {})]))[0]
    size = next(int(b["inserted"]["image"]["virtual-size"]) for b in blocks if b.get("device") == "root")
    want = record.spec.disk // 512 * 512
    if want > size:
        await qmp(vm.rundir, [("block_resize", {"device": "root", "size": want})])
        # the capacity change reaches the guest's driver through a config interrupt: wait for it
        r = await agent.system_exec(record, ExecRequest(command=(
            f"for i in $(seq 300); do [ $(blockdev --getsize64 /dev/vda) -ge {want} ] && break; sleep 0.1; done; "
            "resize2fs /dev/vda 2>&1"), timeout=300))
        if r.exit_code != 0:
            raise SandboxError(f"growing the guest's root filesystem to {want} bytes failed: "
                               f"{r.stdout.decode(errors='replace')[-300:]}")
        size = want
    record.backend_state["disk_bytes"] = size


class VMBackend(QemuBackend):
    """Full QEMU q35 VMs booting a VM image's own kernel and systemd; computer use through QMP."""

    name = "vm"

    def __init__(self, settings: Settings | None = None, vm_dir: Path | None = None, accel: str | None = None,
                 fast_start: bool = True, qemu_user: str | None = "nobody") -> None:
        settings = settings or Settings()
        self.vm_dir = vm_dir or default_vm_dir()
        self.profile: Q35Profile = Q35Profile(self.vm_dir, home_tag(settings), qemu_user)
        super().__init__(settings, self.profile, accel=accel or os.environ.get("DSEC_VM_ACCEL"),
                         fast_start=fast_start, qemu_user=qemu_user, hibernate_on_pause=False)
        self.sandbox_files = self.profile.sandbox_files
        self._screens: dict[str, tuple[int, int]] = {}
        """Last known display size per sandbox (pointer coordinates are scaled by it)."""

    async def destroy(self, record: SandboxRecord) -> None:
        self._screens.pop(record.id, None)
        await super().destroy(record)

    # -- computer use -------------------------------------------------------------------------------------

    async def screenshot(self, record: SandboxRecord) -> bytes:
        """The display as PNG bytes (QMP ``screendump``)."""
        vm = self.machines.get(record)
        path = vm.rundir / "screen.png"
        path.unlink(missing_ok=True)
        try:
            await qmp(vm.rundir, [("screendump", {"filename": str(path), "format": "png"})])
            data = await asyncio.to_thread(path.read_bytes)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        self._screens[record.id] = _png_size(data)
        return data

    async def _screen(self, record: SandboxRecord) -> tuple[int, int]:
        if record.id not in self._screens:
            await self.screenshot(record)
        return self._screens[record.id]

    async def mouse(self, record: SandboxRecord, x: int, y: int, button: str = "left", action: str = "click"
                    ) -> None:
        """Move the pointer to pixel (``x``, ``y``) and press, release, click, double-click or scroll there."""
        if button not in MOUSE_BUTTONS:
            raise InvalidRequest(f"button={button!r}: must be one of {', '.join(MOUSE_BUTTONS)}")
        if action not in MOUSE_ACTIONS:
            raise InvalidRequest(f"action={action!r}: must be one of {', '.join(MOUSE_ACTIONS)}")
        vm = self.machines.get(record)
        width, height = await self._screen(record)
        if not (0 <= x < width and 0 <= y < height):
            raise InvalidRequest(f"({x}, {y}) is outside the {width}x{height} display")
        move = [{"type": "abs", "data": {"axis": "x", "value": round(x * _ABS_MAX / max(width - 1, 1))}},
                {"type": "abs", "data": {"axis": "y", "value": round(y * _ABS_MAX / max(height - 1, 1))}}]

        def press(btn: str, down: bool) -> tuple[str, dict[str, Any]]:
            return ("input-send-event", {"events": [{"type": "btn", "data": {"down": down, "button": btn}}]})

        commands: list[tuple[str, dict[str, Any]]] = [("input-send-event", {"events": move})]
        if action in ("scroll_up", "scroll_down"):
            wheel = "wheel-up" if action == "scroll_up" else "wheel-down"
            commands += [press(wheel, True), press(wheel, False)]
        elif action in ("down", "up"):
            commands.append(press(button, action == "down"))
        elif action != "move":
            for _ in range(2 if action == "double_click" else 1):
                commands += [press(button, True), press(button, False)]
        # one QMP command per event: each is its own report to the guest, so a press is never merged with
        # its release
        await qmp(vm.rundir, commands)

    async def keyboard(self, record: SandboxRecord, text: str | None = None, keys: list[str] | None = None
                       ) -> None:
        """Type ``text`` (US layout), or press each combo of ``keys`` (``["ctrl+c", "enter"]``) in order."""
        if (text is None) == (keys is None):
            raise InvalidRequest("give exactly one of text= or keys=")
        if keys is not None and (not isinstance(keys, list) or not keys):
            raise InvalidRequest(f"keys must be a non-empty list of key names, got {keys!r}")
        combos = keys_for_text(text) if text is not None else [_combo(k) for k in keys or []]
        if not combos:
            return
        vm = self.machines.get(record)
        # QEMU's PS/2 keyboard holds 16 bytes for the guest and drops what comes after; a vCPU starved by a
        # loaded host drains it late. Send at most a queue's worth (4 bytes per key of a combo, make and
        # break, extended keys included), let QEMU release it, then make sure the guest has run (an agent
        # round trip: its keyboard interrupt comes first) before the next.
        for chunk in key_chunks(combos):
            await qmp(vm.rundir, [("send-key", {"keys": [{"type": "qcode", "data": k} for k in combo],
                                                      "hold-time": _HOLD_MS}) for combo in chunk])
            await asyncio.sleep(len(chunk) * 2 * _HOLD_MS / 1000 + 0.02)
            await self.agent.client(record).ping(timeout=60)
