"""The vm backend's disk of any DSec image, derived on first use and kept per image content.

``image="debian-python", backend="vm"`` boots a disk built as ``dsec image build-vm --from`` builds one (the
image's files and owners, its own apt adding Debian's kernel, systemd and the agent's needs), in
``$DSEC_VM_DIR/derived/<key>/`` where the key names the image's content (:func:`source_identity`). Every home and
daemon of the node shares it; builds of one image wait for each other (a file lock); an image that cannot boot
is refused, and the refusal is kept (``<key>.refused``: the content cannot change under its digest).

A daemon builds it in a helper process (:func:`derive_in_helper`): ``unshare`` gives the build a mount and a pid
namespace of its own and is killed with the daemon (``PR_SET_PDEATHSIG``), so a daemon that dies mid-build leaves
no copy, apt or mkfs running and no idmapped mount on the host; its half-made build directory is removed by the
next build of that image.

This module owns the ``derived/`` directory; it must never touch the VM images of ``dsec image build-vm``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dsec.errors import DSecError, InvalidRequest
from dsec.guest.vmimage import (
    BASE_PACKAGES,
    DISK_SIZE,
    VMImage,
    build_into,
    check_bootable,
    default_vm_dir,
    load_vm_image,
)
from dsec.images.image_store import ImageStore
from dsec.images.ref import ImageRef
from dsec.isolation.procs import die_with_parent

__all__ = ["derive_in_helper", "derive_vm_image", "derived_state", "image_backends", "main", "source_identity"]

log = logging.getLogger(__name__)

_REFUSED = 3
"""Exit status of the helper for an image that cannot boot (its stdout: the refusal as JSON)."""


def _derived_dir(identity: str, vm_dir: Path | None) -> Path:
    return (vm_dir or default_vm_dir()) / "derived" / hashlib.sha256(identity.encode()).hexdigest()[:16]


def source_identity(source: ImageRef) -> str:
    """What names a DSec image's content for its derived disk: a chunked image's manifest digest; a directory
    image's root path, inode and mtime."""
    if source.digest is not None:
        return f"digest:{source.digest.removeprefix('sha256:')}"
    st = source.rootfs.stat()
    return f"dir:{source.rootfs.resolve()}:{st.st_ino}:{st.st_mtime_ns}"


def derived_state(identity: str, vm_dir: Path | None = None) -> str:
    """Whether the vm backend can boot the DSec image of ``identity`` now: ``"ready"`` (its disk is built and
    current), ``"cannot boot: <why>"``, or ``"on first use"`` (derived by the first vm create)."""
    d = _derived_dir(identity, vm_dir)
    image = load_vm_image(d, d.name)
    if image is not None and image.current:
        return "ready"
    known = _refusal(d.with_suffix(".refused"))
    return "on first use" if known is None else f"cannot boot: {known[0]}"


def _refusal(path: Path) -> tuple[str, str] | None:
    """(reason, message) of a kept refusal, or None."""
    try:
        data = json.loads(path.read_text())
        return str(data["reason"]), str(data["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def image_backends(store: ImageStore, name: str, vm_dir: Path | None = None) -> dict[str, str]:
    """Backend -> ``"ready"``, ``"on first use"`` or ``"cannot boot: <why>"`` for DSec image ``name`` of ``store``:
    container, function and microvm run any image; vm boots a disk derived from it (:func:`derive_vm_image`)."""
    digest = store.tag(name)
    if digest is not None:
        identity = f"digest:{digest.removeprefix('sha256:')}"
    else:
        identity = source_identity(ImageRef(name=name, rootfs=store.path(name) / "rootfs"))
    return {"container": "ready", "function": "ready", "microvm": "ready", "vm": derived_state(identity, vm_dir)}


def derive_vm_image(source: ImageRef, vm_dir: Path | None = None) -> VMImage:
    """The vm backend's bootable disk of DSec image ``source``, built on first use and kept (see the module
    docstring). Blocking (a first build takes about a minute); builds of one image wait for each other."""
    d = _derived_dir(source_identity(source), vm_dir)
    d.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(d.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another daemon's build of the same image: wait for it, then reuse it
        image = load_vm_image(d, source.name)
        if image is not None and image.current:
            return image
        known = _refusal(d.with_suffix(".refused"))
        if known is not None:
            raise InvalidRequest(known[1], image=source.name, reason=known[0])
        try:
            check_bootable(source)
        except InvalidRequest as e:  # the image's content cannot change under its digest: kept
            d.with_suffix(".refused").write_text(json.dumps({"reason": e.detail.get("reason"), "message": e.message}))
            raise
        for stale in d.parent.glob(f".build-{d.name}-*"):  # of a build whose process died: nobody else builds it
            _remove_stale(stale)
        build_into(d, list(BASE_PACKAGES), False, "bookworm", DISK_SIZE, d.with_suffix(".log"), source)
    finally:
        os.close(fd)
    built = load_vm_image(d, source.name)
    if built is None:
        raise DSecError(f"the vm disk derived from image {source.name!r} is incomplete in {d}")
    return built


def _remove_stale(path: Path) -> None:
    """Remove a dead build's directory, unless something is still mounted below it (an image's root: removing
    through it would delete the image's files); that one is left, with a warning."""
    prefix = f"{path}/"
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        if any(line.split()[4].startswith(prefix) for line in mounts):
            log.warning("a dead build's directory %s still has a mount below it: left as it is", path)
            return
    shutil.rmtree(path, ignore_errors=True)


def derive_in_helper(source: ImageRef, vm_dir: Path | None = None) -> VMImage:
    """:func:`derive_vm_image` in a helper process with mount and pid namespaces of its own that dies with the
    calling process (see the module docstring). Blocking."""
    ref = {"name": source.name, "rootfs": str(source.rootfs), "uid_shift": source.uid_shift,
           "digest": source.digest}
    argv = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--mount-proc",
            sys.executable, "-m", "dsec.guest.vmderive", "--vm-dir", str(vm_dir or default_vm_dir()),
            json.dumps(ref)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, preexec_fn=die_with_parent)
    if proc.returncode == _REFUSED:
        refusal = json.loads(proc.stdout)
        raise InvalidRequest(refusal["message"], image=source.name, reason=refusal["reason"])
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise DSecError(f"deriving the vm disk of image {source.name!r} failed (exit {proc.returncode}):\n{tail}",
                        image=source.name)
    built = load_vm_image(_derived_dir(source_identity(source), vm_dir), source.name)
    if built is None:
        raise DSecError(f"the vm disk derived from image {source.name!r} is missing after its build")
    return built


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.guest.vmderive --vm-dir DIR REF_JSON``: the helper's side of :func:`derive_in_helper`."""
    parser = argparse.ArgumentParser(prog="python -m dsec.guest.vmderive")
    parser.add_argument("--vm-dir", type=Path, required=True)
    parser.add_argument("ref", help='{"name", "rootfs", "uid_shift", "digest"}')
    args = parser.parse_args(argv)
    ref = json.loads(args.ref)
    source = ImageRef(name=ref["name"], rootfs=Path(ref["rootfs"]), uid_shift=int(ref["uid_shift"]),
                      digest=ref["digest"])
    try:
        derive_vm_image(source, args.vm_dir)
    except InvalidRequest as e:
        print(json.dumps({"reason": e.detail.get("reason", ""), "message": e.message}))
        return _REFUSED
    except DSecError as e:
        print(e.message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
