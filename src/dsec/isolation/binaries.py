"""Builds DSec's static helper binaries from their C sources on first use (not the sandbox init itself:
``init.c`` is one of the sources it builds).

Owns compiling the helpers and caching them (per home and node-wide); must never run a helper or hold a sandbox's state.

- ``dsec-init`` (``init.c``): pid 1 of a container sandbox; reaps orphans, nothing else.
- ``dsec-nsexec`` (``nsexec.c``): the exec helper, one per daemon; starts each command through ``dsec-nsenter``.
- ``dsec-nsenter`` (``nsenter.c``): the last step of an exec into a running sandbox.
- ``dsec-rtshim`` (``rtshim.c``): starts the OCI runtime inside a new sandbox's cgroups.
- ``dsec-zygote`` (``zygote.c`` and its parts, ``zygote_py.c`` among them): the pre-warmed parent of a function
  sandbox's calls, and the launcher of its Python zygotes.
- ``dsec-callinit`` (``callinit.c``): pid 1 of each ``sb.call``'s pid namespace, spawned by the Python zygote.

Binaries are cached in the node's state directory, keyed by the digest of their sources, so an upgrade rebuilds them;
a node-wide copy (``DSEC_HELPERS``, default ``/var/lib/dsec/helpers``, root's) spares every new home the
compiler (tenths of a second each, which a daemon's first start and every test home paid). They need gcc and a
static libc (Debian: ``gcc libc6-dev``). ``dsec-nsenter``, which runs once per exec, ``dsec-init`` and
``dsec-rtshim`` (once per create) are linked against musl when ``musl-gcc`` is there (Debian: ``musl-tools``), and
so are ``dsec-nsexec`` (one per daemon: the small binary) and ``dsec-zygote`` (each call a clone of it): a static
glibc binary probes the CPU with ~20 ``cpuid`` instructions at every start, each a trap to the hypervisor on a VM,
which was the largest user-space cost of an exec (~0.3 ms of CPU); musl's start-up does none, and its binary is
46 KB instead of 800 KB (fewer page faults per exec).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from dsec.errors import BackendUnavailable

__all__ = ["CALLINIT_SOURCE", "HELPERS", "INIT_SOURCE", "NSENTER_SOURCE", "NSEXEC_SOURCE", "RTSHIM_SOURCE",
           "ZYGOTE_PARTS", "ZYGOTE_SOURCE", "binary_path", "ensure_binary", "ensure_callinit", "ensure_init",
           "ensure_nsenter", "ensure_nsexec", "ensure_rtshim", "ensure_zygote", "node_cache"]

INIT_SOURCE = Path(__file__).with_name("init.c")
NSENTER_SOURCE = Path(__file__).with_name("nsenter.c")
NSEXEC_SOURCE = Path(__file__).with_name("nsexec.c")
RTSHIM_SOURCE = Path(__file__).with_name("rtshim.c")
ZYGOTE_SOURCE = Path(__file__).with_name("zygote.c")
CALLINIT_SOURCE = Path(__file__).with_name("callinit.c")
log = logging.getLogger(__name__)

ZYGOTE_PARTS = tuple(Path(__file__).with_name(name) for name in (
    "zygote.h", "zygote_io.c", "zygote_setup.c", "zygote_call.c", "zygote_py.c"))
"""The rest of ``dsec-zygote`` (built with ``zygote.c``): part of the binary's identity (its name's digest)."""


def binary_path(source: Path, name: str, directory: Path, *, musl: bool = False,
                parts: tuple[Path, ...] = ()) -> Path:
    """Where :func:`ensure_binary` keeps ``name`` built from the current ``source`` and its other ``parts`` (the
    ``.c`` files compiled with it and the headers they include), built or not."""
    musl_cc = shutil.which("musl-gcc") if musl else None
    # Every part and the libc are in the key: a change to any file, or installing musl-tools later, rebuilds.
    text = b"".join(path.read_bytes() + b"\0" for path in (source, *parts))
    digest = hashlib.sha256(text + (b"\0musl" if musl_cc else b"")).hexdigest()[:16]
    return directory / f"{name}-{digest}"


def node_cache() -> Path:
    """Where built helpers are shared by every home of the node (``DSEC_HELPERS``)."""
    return Path(os.environ.get("DSEC_HELPERS") or "/var/lib/dsec/helpers")


def _trusted(path: Path) -> bool:
    """Root's and writable by root only (the file and its directory): what a daemon may copy and run."""
    try:
        return all(st.st_uid == 0 and not st.st_mode & 0o022 for st in (path.parent.stat(), path.lstat()))
    except OSError:
        return False


def _share(target: Path) -> None:
    """Offer ``target`` to the other homes of the node (root only; best effort)."""
    cache = node_cache()
    if os.geteuid() != 0 or (cache / target.name).exists():
        return
    try:
        cache.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = cache / f".{target.name}.{os.getpid()}-{threading.get_ident()}"
        shutil.copy2(target, tmp)
        os.replace(tmp, cache / target.name)
    except OSError:
        pass


_MUSL_FAILED: set[str] = set()
"""Binaries (by name and digest) that ``musl-gcc`` could not build in this process: built with glibc instead."""


def ensure_binary(source: Path, name: str, directory: Path, *, musl: bool = False,
                  parts: tuple[Path, ...] = ()) -> Path:
    """Path of ``name`` built statically from the current ``source`` and its other ``parts`` (``.c`` files compiled
    with it, headers); builds it if needed (``musl``: with ``musl-gcc`` when installed, else, or when that build
    fails, with gcc and glibc as every other binary), or copies the node's build of the same sources."""
    if musl and shutil.which("musl-gcc"):
        target = binary_path(source, name, directory, musl=True, parts=parts)
        if target.name not in _MUSL_FAILED:
            try:
                return _ensure(target, source, name, directory, musl, parts)
            except BackendUnavailable as exc:
                # musl's headers are the likeliest part to break (the kernel's come after them): glibc works too.
                _MUSL_FAILED.add(target.name)
                log.warning("building %s with musl-gcc failed, so it is built with glibc: %s", name, exc)
    return _ensure(binary_path(source, name, directory, parts=parts), source, name, directory, False, parts)


def _ensure(target: Path, source: Path, name: str, directory: Path, musl: bool, parts: tuple[Path, ...]) -> Path:
    if target.exists():
        return target
    shared = node_cache() / target.name
    if _trusted(shared):
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{target.name}.{os.getpid()}-{threading.get_ident()}"
        shutil.copy2(shared, tmp)
        os.replace(tmp, target)
        return target
    digest = target.name.rsplit("-", 1)[1]
    musl_cc = shutil.which("musl-gcc") if musl else None
    cc = musl_cc or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendUnavailable(f"building {name} needs a C compiler: apt-get install gcc libc6-dev")
    # musl ships no kernel headers: the system's (linux-libc-dev) come after musl's own libc headers.
    headers = ["-idirafter", "/usr/include", "-idirafter", f"/usr/include/{_multiarch()}"] if musl_cc else []
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}-{digest}.{os.getpid()}-{threading.get_ident()}"  # one per building thread
    units = [str(path) for path in (source, *parts) if path.suffix == ".c"]
    proc = subprocess.run([cc, "-static", "-O2", "-s", "-Wall", "-Werror", *headers, "-o", str(tmp), *units],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendUnavailable(f"building {name} failed (apt-get install gcc libc6-dev): "
                                 f"{proc.stderr.strip()[-500:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    _share(target)
    return target


def _multiarch() -> str:
    """Debian's multiarch tuple of this machine (where ``asm/*.h`` lives), e.g. ``x86_64-linux-gnu``."""
    return f"{os.uname().machine}-linux-gnu"


HELPERS = ((INIT_SOURCE, "dsec-init"), (NSENTER_SOURCE, "dsec-nsenter"), (NSEXEC_SOURCE, "dsec-nsexec"),
           (RTSHIM_SOURCE, "dsec-rtshim"))
"""The container backend's binaries (source, name), all linked against musl when it is installed: but for the exec
helper (one per daemon) each runs once per create or exec, where static glibc's start-up ``cpuid`` probes would trap
to the hypervisor every time."""


def ensure_init(directory: Path) -> Path:
    """The container init, built if needed."""
    return ensure_binary(INIT_SOURCE, "dsec-init", directory, musl=True)


def ensure_nsenter(directory: Path) -> Path:
    """The exec entry binary, built if needed."""
    return ensure_binary(NSENTER_SOURCE, "dsec-nsenter", directory, musl=True)


def ensure_nsexec(directory: Path) -> Path:
    """The exec helper, built if needed."""
    return ensure_binary(NSEXEC_SOURCE, "dsec-nsexec", directory, musl=True)


def ensure_rtshim(directory: Path) -> Path:
    """The OCI runtime launcher, built if needed."""
    return ensure_binary(RTSHIM_SOURCE, "dsec-rtshim", directory, musl=True)


def ensure_callinit(directory: Path) -> Path:
    """The init of a function call's pid namespace, built if needed (static: it runs inside any image)."""
    return ensure_binary(CALLINIT_SOURCE, "dsec-callinit", directory, musl=True)


def ensure_zygote(directory: Path) -> Path:
    """The function backend's zygote, built if needed (with musl when there: every call is a clone of it, and
    a clone maps again each page of the parent's text it runs, so a 60 KB binary costs fewer faults a call
    than a static glibc one of 700 KB)."""
    return ensure_binary(ZYGOTE_SOURCE, "dsec-zygote", directory, musl=True, parts=ZYGOTE_PARTS)
