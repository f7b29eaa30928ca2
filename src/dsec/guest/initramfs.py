"""Builds the microvm initramfs and the static guest agent, cached by the digest of their inputs.

The initramfs (a gzip'd ``newc`` cpio, written here) holds static busybox, ``init.sh`` as ``/init``,
``dsec-agent`` and the kernel modules the guest needs, with their dependencies, in load order
(``/modules.order``). Modules are found by name in the kernel's tree; dependencies come from each
module's ``.modinfo`` section (the package ships no ``modules.dep``: depmod runs at install time).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
from pathlib import Path

from dsec.errors import BackendUnavailable
from dsec.guest.kernel import GuestKernel
from dsec.isolation.binaries import ensure_binary

__all__ = ["AGENT_PARTS", "AGENT_SOURCE", "GUEST_MODULES", "build_initramfs", "ensure_agent", "module_order"]

AGENT_SOURCE = Path(__file__).with_name("agent.c")
AGENT_PARTS = tuple(Path(__file__).with_name(name) for name in (
    "agent.h", "agent_proto.c", "agent_exec.c", "agent_confine.c", "agent_files.c", "agent_surface.c"))
"""The rest of the agent (built with ``agent.c``): part of the binary's identity (its name's digest)."""
INIT_SCRIPT = Path(__file__).with_name("init.sh")
BUSYBOX = Path("/bin/busybox")

GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "erofs", "overlay")
"""What the guest loads: the virtio-mmio transport (``-M microvm``), the image disk, the agent port,
the NIC of networked sandboxes, the image's filesystem and the writable overlay. Dependencies are added
automatically."""


def ensure_agent(directory: Path) -> Path:
    """The static guest agent, built if needed."""
    return ensure_binary(AGENT_SOURCE, "dsec-agent", directory, parts=AGENT_PARTS)


def _modinfo(ko: Path) -> dict[str, str]:
    """``key=value`` pairs of a module's ``.modinfo`` ELF section."""
    data = ko.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise BackendUnavailable(f"{ko} is not a 64-bit ELF module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end] == b".modinfo":
            out: dict[str, str] = {}
            for item in data[off:off + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    out.setdefault(key, value)
            return out
    return {}


def module_order(kernel: GuestKernel, wanted: tuple[str, ...] = GUEST_MODULES) -> list[Path]:
    """The ``.ko`` files for ``wanted`` and their dependencies, dependencies first."""
    index: dict[str, Path] = {}
    for ko in kernel.modules.rglob("*.ko"):
        index[ko.stem.replace("-", "_")] = ko
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        key = name.replace("-", "_")
        if key in seen:
            return
        if key not in index:
            raise BackendUnavailable(f"guest kernel {kernel.version} has no module {name} "
                                     f"(needed by {' <- '.join(chain) or 'the guest'})")
        seen.add(key)
        for dep in filter(None, _modinfo(index[key]).get("depends", "").split(",")):
            visit(dep, (*chain, name))
        order.append(index[key])

    for name in wanted:
        visit(name, ())
    return order


def _cpio_entry(out: io.BytesIO, ino: int, name: str, mode: int, data: bytes = b"") -> None:
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0)
    out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0")
    out.write(b"\0" * (-out.tell() % 4))
    out.write(data)
    out.write(b"\0" * (-out.tell() % 4))


def _cpio(files: dict[str, tuple[int, bytes]]) -> bytes:
    out = io.BytesIO()
    for ino, (name, (mode, data)) in enumerate(sorted(files.items()), start=1):
        _cpio_entry(out, ino, name, mode, data)
    _cpio_entry(out, 0, "TRAILER!!!", 0)
    return out.getvalue()


def build_initramfs(kernel: GuestKernel, directory: Path) -> Path:
    """Path of the initramfs for ``kernel`` (built into ``directory`` if its inputs changed)."""
    if not BUSYBOX.is_file():
        raise BackendUnavailable("the microvm initramfs needs a static busybox: apt-get install busybox-static")
    agent = ensure_agent(directory)
    modules = module_order(kernel)
    digest = hashlib.sha256()
    for part in (kernel.version.encode(), INIT_SCRIPT.read_bytes(), agent.name.encode(), BUSYBOX.read_bytes(),
                 *(str(m).encode() for m in modules)):
        digest.update(hashlib.sha256(part).digest())
    target = directory / f"initramfs-{digest.hexdigest()[:16]}.cpio.gz"
    if target.exists():
        return target
    files: dict[str, tuple[int, bytes]] = {
        d: (0o040755, b"") for d in ("bin", "dev", "proc", "sys", "modules", "ro", "rw", "newroot")
    }
    files["bin/busybox"] = (0o100755, BUSYBOX.read_bytes())
    files["init"] = (0o100755, INIT_SCRIPT.read_bytes())
    files["dsec-agent"] = (0o100755, agent.read_bytes())
    for ko in modules:
        files[f"modules/{ko.name}"] = (0o100644, ko.read_bytes())
    files["modules.order"] = (0o100644, "".join(f"{ko.name}\n" for ko in modules).encode())
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{target.name}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(_cpio(files), compresslevel=1))
    os.replace(tmp, target)
    return target
