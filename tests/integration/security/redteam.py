"""The red-team suite's framework: the attack registry, the per-backend arena and the host check.

An attack is an async function that plays the agent: it runs code in a sandbox (or calls the files
API with hostile paths) and asserts the SPECIFIC defence that stops it (EPERM from seccomp, not ENOENT
from a missing file; a refused path, not a crash). It is registered with :func:`attack`, which records:

- ``id``: short, stable, kebab-case; the row of the attack table;
- ``description``: what the agent tries;
- ``models``: the production incident or the attack class it stands for;
- ``defence``: the layer the attack asserts, per backend where they differ;
- ``not_applicable``: ``{backend: reason}`` for backends it does not apply to (e.g. network on
  backends that have no network device at all);
- ``fresh``: True if it damages its sandbox (fills the disk, overwrites binaries, kills processes):
  it then gets a sandbox of its own (``spec`` overrides its spec); the others share one sandbox
  per backend, which is what keeps the suite fast.

``test_redteam.py`` runs every attack on every backend (``attack x backend``) and, after each one,
:class:`HostState` checks that the host did not change (kernel knobs, module list, taint, the image's
files, marker files outside the sandbox, the backend still serving). ``conftest.py`` prints the
table attack x backend → blocked / not applicable / FAILED and writes it as JSON
(``tests/artifacts/redteam.json``); ``scripts/gen-security-table`` puts it into ``docs/security.md``.

Attacks live in the ``attacks_*.py`` modules next to this one; importing :data:`ATTACKS` through
:func:`all_attacks` loads them all.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend, ImageRef
from dsec.models import ExecRequest, ExecResult, SandboxRecord
from dsec.testing import sandbox

BACKENDS: tuple[str, ...] = ("container", "function", "microvm", "vm")
"""Every backend the suite knows; one that is not built yet shows as not applicable in the table."""

ATTACK_MODULES = ("attacks_incidents", "attacks_escape", "attacks_files", "attacks_resources", "attacks_network",
                  "attacks_layers", "attacks_calls")

MiB = 1024 * 1024

AttackFn = Callable[["Target"], Awaitable[None]]


@dataclass(frozen=True)
class Attack:
    """One registered attack (see the module docstring for the fields)."""

    id: str
    description: str
    models: str
    defence: str
    fn: AttackFn
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    fresh: bool = False
    spec: Mapping[str, Any] = field(default_factory=dict)
    open_gaps: Mapping[str, str] = field(default_factory=dict)
    """``{backend: why}``: the attack is known to get through there today (a defence still being built);
    it runs and must fail (strict xfail), so the day the defence lands it shows up as XPASS to remove."""

    def reason_not_applicable(self, backend: str) -> str | None:
        """Why this attack does not apply to ``backend`` (None: it applies)."""
        return self.not_applicable.get(backend)


ATTACKS: dict[str, Attack] = {}


def attack(id: str, *, description: str, models: str, defence: str,
           not_applicable: Mapping[str, str] | None = None, fresh: bool = False,
           spec: Mapping[str, Any] | None = None,
           open_gaps: Mapping[str, str] | None = None) -> Callable[[AttackFn], AttackFn]:
    """Register the decorated coroutine function as an attack (ids must be unique)."""

    def register(fn: AttackFn) -> AttackFn:
        if id in ATTACKS:
            raise ValueError(f"attack id {id!r} registered twice ({ATTACKS[id].fn.__qualname__}, {fn.__qualname__})")
        ATTACKS[id] = Attack(id=id, description=description, models=models, defence=defence, fn=fn,
                             not_applicable=dict(not_applicable or {}), fresh=fresh, spec=dict(spec or {}),
                             open_gaps=dict(open_gaps or {}))
        return fn

    return register


def all_attacks() -> list[Attack]:
    """Every registered attack, after importing every attack module (registration order)."""
    for name in ATTACK_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)
    return list(ATTACKS.values())


# Reasons shared by many attacks, so the table reads the same everywhere.
NO_PERSISTENT_PROCS = "every exec is a fresh pid namespace that ends with the command: nothing to race or signal"


# ------------------------------------------------------------------------------------------ target
@dataclass
class Target:
    """What an attack gets: one backend, the sandbox to attack and a way to make more."""

    name: str
    backend: Backend
    image: ImageRef
    sb: SandboxRecord
    home: Path
    host_marker: Path
    """A path on the host that must never come to exist (attacks aim their payloads at it)."""
    reference: Mapping[str, str] = field(default_factory=dict)
    """sha256 of image files as a fresh sandbox saw them, for images whose files the host cannot read (a vm
    image is a disk); see :meth:`image_sha`."""

    def image_sha(self, path: str) -> str:
        """sha256 of the image's file ``path`` (relative: ``"etc/passwd"``) as the image ships it."""
        if path in self.reference:
            return self.reference[path]
        return hashlib.sha256((self.image.rootfs / path).read_bytes()).hexdigest()

    async def sh(self, command: str | list[str], *, timeout: float = 60.0, **kw: Any) -> ExecResult:
        """Run a command in the attacked sandbox."""
        return await self.backend.exec(self.sb, ExecRequest(command=command, timeout=timeout, **kw))

    async def py(self, code: str, *, timeout: float = 60.0) -> Any:
        """Run a python3 snippet that prints one JSON document; return it decoded."""
        r = await self.sh(["python3", "-c", code], timeout=timeout)
        assert r.exit_code == 0, f"probe failed: {r}"
        return json.loads(r.stdout)

    @contextlib.asynccontextmanager
    async def neighbour(self, **spec: Any) -> AsyncIterator[SandboxRecord]:
        """Another sandbox on the same backend (the victim of cross-sandbox attacks), always destroyed."""
        async with sandbox(self.backend, self.image, **spec) as record:
            yield record


# ------------------------------------------------------------------------------------------- arena
REFERENCE_FILES = ("etc/passwd", "usr/bin/bash", "usr/bin/sha256sum", "usr/bin/python3.11")
"""Image files the attacks compare against (:meth:`Target.image_sha`)."""

TEMPLATE_SHAPE = {"vm": ("cpu",)}
"""Spec fields that pick a VM template: a fresh sandbox asking for another value would cold-boot a new template
(minutes for a full VM under TCG), so the arena leaves them at the shared sandbox's values there (a vm's
``memory`` up to its default shares that template: it limits the guest's commands, not its RAM)."""


class Arena:
    """One started backend with a shared sandbox for the attacks that do not damage theirs."""

    def __init__(self, name: str, backend: Backend, image: ImageRef, home: Path) -> None:
        self.name, self.backend, self.image, self.home = name, backend, image, home
        self._shared: SandboxRecord | None = None
        self._stack = contextlib.AsyncExitStack()
        self.reference: dict[str, str] = {}

    async def load_reference(self) -> None:
        """Hash :data:`REFERENCE_FILES` in the shared sandbox before any attack ran (for a vm image, whose
        files the host cannot read)."""
        shared = await self.shared()
        paths = [f"/{f}" for f in REFERENCE_FILES]
        r = await self.backend.exec(shared, ExecRequest(command=["sha256sum", *paths], timeout=60))
        assert r.exit_code == 0, f"hashing the image's files failed: {r}"
        for line in r.stdout.decode().splitlines():
            digest, path = line.split(maxsplit=1)
            self.reference[path.lstrip("/")] = digest

    async def shared(self) -> SandboxRecord:
        """The shared sandbox, created on first use and re-created if an attack broke it anyway."""
        if self._shared is not None:
            try:
                r = await self.backend.exec(self._shared, ExecRequest(command="echo ok", timeout=30))
                if r.stdout == b"ok\n":
                    return self._shared
            except Exception:
                pass
            await self.backend.destroy(self._shared)
            self._shared = None
        self._shared = await self._stack.enter_async_context(sandbox(self.backend, self.image))
        return self._shared

    @contextlib.asynccontextmanager
    async def target(self, item: Attack, host_marker: Path) -> AsyncIterator[Target]:
        """The sandbox ``item`` attacks: its own when it is destructive, else the shared one."""
        if item.fresh:
            spec = {k: v for k, v in item.spec.items() if k not in TEMPLATE_SHAPE.get(self.name, ())}
            async with sandbox(self.backend, self.image, **spec) as record:
                yield Target(self.name, self.backend, self.image, record, self.home, host_marker, self.reference)
        else:
            yield Target(self.name, self.backend, self.image, await self.shared(), self.home, host_marker,
                         self.reference)

    async def aclose(self) -> None:
        await self._stack.aclose()


# -------------------------------------------------------------------------------------- host check
def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"<unreadable: {e.errno}>"


def _sha(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        return f"<unreadable: {e.errno}>"


_KERNEL_KNOBS = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/kernel/hostname",
                 "/proc/sys/kernel/domainname", "/proc/sys/kernel/tainted", "/proc/sys/kernel/kexec_load_disabled",
                 "/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/sysrq", "/proc/sys/fs/protected_symlinks")
# net.ipv4.ip_forward is left out: the container backend turns it on for networked sandboxes on purpose
_IMAGE_FILES = ("usr/bin/bash", "usr/bin/python3.11", "usr/bin/sh", "etc/passwd", "etc/shadow")


def _image_state(image: ImageRef) -> dict[str, str]:
    """The image's files as the host keeps them: hashes of a root's files, or for a vm image (a directory of
    a read-only disk, kernel and initramfs, each GBs to hash) each file's size, mtime and mode."""
    if (image.rootfs / "usr").is_dir():
        return {f: _sha(image.rootfs / f) for f in _IMAGE_FILES}
    out = {}
    for p in sorted(image.rootfs.iterdir()):
        st = p.stat()
        out[p.name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_mode:o}"
    return out


@dataclass
class HostState:
    """What the host looks like before an attack; :meth:`assert_unchanged` compares after it."""

    knobs: dict[str, str]
    release_agents: dict[str, str]
    modules: set[str]
    image_files: dict[str, str]
    host_files: dict[str, str]
    disk_free: int

    @classmethod
    def capture(cls, image: ImageRef) -> HostState:
        agents = {str(p): _read(str(p)) for p in Path("/sys/fs/cgroup").glob("*/release_agent")}
        modules = {line.split()[0] for line in _read("/proc/modules").splitlines() if line.strip()}
        return cls(knobs={k: _read(k) for k in _KERNEL_KNOBS}, release_agents=agents, modules=modules,
                   image_files=_image_state(image),
                   host_files={f: _sha(Path(f)) for f in ("/etc/passwd", "/etc/shadow", "/usr/bin/bash")},
                   disk_free=shutil.disk_usage("/").free)

    def assert_unchanged(self, image: ImageRef, host_marker: Path) -> None:
        after = HostState.capture(image)
        assert after.knobs == self.knobs, f"host kernel knobs changed: {_diff(self.knobs, after.knobs)}"
        assert after.release_agents == self.release_agents, "a cgroup release_agent on the host changed"
        assert not after.modules - self.modules, f"kernel modules loaded: {after.modules - self.modules}"
        assert after.image_files == self.image_files, f"the image changed: {_diff(self.image_files, after.image_files)}"
        assert after.host_files == self.host_files, f"host files changed: {_diff(self.host_files, after.host_files)}"
        assert not host_marker.exists(), f"the attack created {host_marker} on the host"
        # other engineers share the disk: only a drop far beyond any sandbox's quota counts
        assert after.disk_free > self.disk_free - 2048 * MiB, "the host's disk filled up"


def _diff(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    return {k: (before.get(k, ""), after.get(k, "")) for k in set(before) | set(after) if before.get(k) != after.get(k)}


def new_host_marker() -> Path:
    """A fresh path under the host's /tmp that no one creates (attacks aim at it)."""
    return Path("/tmp") / f"dsec-redteam-pwned-{uuid.uuid4().hex[:12]}"


def report_path(rootdir: Path) -> Path:
    """Where the session's attack table goes as JSON (``DSEC_REDTEAM_REPORT`` overrides)."""
    return Path(os.environ.get("DSEC_REDTEAM_REPORT") or rootdir / "tests" / "artifacts" / "redteam.json")


# ------------------------------------------------------------------------------------------- report
BLOCKED, NOT_APPLICABLE, FAILED, SKIPPED, OPEN = "blocked", "not applicable", "FAILED", "skipped", "OPEN"


def outcome_of(when: str, outcome: str, skip_reason: str, xfail: bool = False) -> str | None:
    """The table cell for one test phase's report (None: this phase says nothing new)."""
    if outcome == "failed":
        return FAILED
    if outcome == "skipped" and xfail:
        return OPEN
    if outcome == "skipped":
        return NOT_APPLICABLE if "not applicable" in skip_reason else SKIPPED
    return BLOCKED if when == "call" else None


def build_report(cells: Mapping[tuple[str, str], tuple[str, str]]) -> dict[str, Any]:
    """The JSON document: backends, and per attack its metadata and ``{backend: {result, note}}``."""
    attacks = all_attacks()
    rows = []
    for a in attacks:
        results = {}
        for b in BACKENDS:
            result, note = cells.get((a.id, b), ("not run", ""))
            if result == NOT_APPLICABLE and a.reason_not_applicable(b):
                note = a.reason_not_applicable(b) or note
            if result == OPEN:
                note = a.open_gaps.get(b, note)
            results[b] = {"result": result, "note": note}
        rows.append({"id": a.id, "description": a.description, "models": a.models, "defence": a.defence,
                     "results": results})
    return {"backends": list(BACKENDS), "attacks": rows}


def format_table(report: Mapping[str, Any]) -> str:
    """A plain-text table attack x backend for the terminal."""
    backends = report["backends"]
    width = max([len(r["id"]) for r in report["attacks"]] + [6])
    lines = ["attack".ljust(width) + "  " + "  ".join(b.ljust(14) for b in backends)]
    for row in report["attacks"]:
        lines.append(row["id"].ljust(width) + "  " + "  ".join(row["results"][b]["result"].ljust(14) for b in backends))
    counts: dict[str, int] = {}
    for row in report["attacks"]:
        for b in backends:
            counts[row["results"][b]["result"]] = counts.get(row["results"][b]["result"], 0) + 1
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines)


def write_report(report: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


# ----------------------------------------------------------------------------------- probe helpers
PRELUDE = r"""
import ctypes, errno, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if ret >= 0 else ctypes.get_errno()
def lc(ret):
    return 0 if ret >= 0 else ctypes.get_errno()
def try_os(fn, *args):
    try:
        fn(*args)
        return 0
    except OSError as e:
        return e.errno
"""
"""Helpers for attack snippets: ``sc(nr, *args)`` a raw syscall, ``lc(ret)`` a libc call's result and
``try_os(fn, *args)``, each returning 0 on success or the errno."""


async def probe(t: Target, body: str, timeout: float = 60.0) -> Any:
    """Run ``PRELUDE + body`` (which prints one JSON document) in the sandbox; return it decoded."""
    return await t.py(PRELUDE + body, timeout=timeout)


async def guest_kernel_is_own(t: Target) -> None:
    """On VM backends the guest's kernel is the boundary: assert the attack ran on a kernel that is not
    the host's (so whatever it did to that kernel stays in that VM)."""
    # uname needs no /proc (an attack may have unmounted the guest's); boot_id tells two equal releases apart
    r = await t.sh("uname -r; cat /proc/sys/kernel/random/boot_id 2>/dev/null; true")
    assert r.exit_code == 0, r
    release, *boot = r.stdout.decode().split()
    host_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert release != os.uname().release or (boot and boot[0] != host_boot), "the sandbox runs on the host's kernel"


VM_BACKENDS = ("microvm", "vm")


async def fill_vm_disk(t: Target, leave_kib: int = 32 * 1024) -> None:
    """vm: leave only ``leave_kib`` free on the guest's root filesystem, root's reserved blocks included (one
    fallocate, no data written): a VM's disk is the image's (4 GiB, grown by ``disk=``, never shrunk), so the
    disk bombs meet its end quickly. ext4 keeps ``reserved_clusters`` (2% or 4096 blocks) that only its own
    metadata may use: a fallocate reaching into them fails with ENOSPC (it did, with 64 KiB left), so they are
    not counted as free."""
    free = ("$(( $(stat -f -c '%f*%S' /) - $(cat /sys/fs/ext4/vda/reserved_clusters) * $(stat -f -c %S /) ))")
    r = await t.sh(f"fallocate -l $(( {free} - {leave_kib} * 1024 )) /dsec-fill && echo $(( {free} / 1024 ))",
                   timeout=120)
    assert r.exit_code == 0 and int(r.stdout.split()[-1]) <= leave_kib + 8192, f"could not fill the vm's disk: {r}"


def assert_vm_disk_bounded(t: Target) -> None:
    """vm: the sandbox's disk on the host (a qcow2 overlay of fixed virtual size) holds far less than the
    guest wrote at it: the guest's filesystem ended the bomb, not the host's."""
    overlay = Path(t.sb.backend_state["erofs"])
    allocated = overlay.stat().st_blocks * 512
    assert allocated < 512 * MiB, f"the vm's overlay on the host holds {allocated // MiB} MiB"


def expect_errno(t: Target, what: str, got: int, want: Mapping[str, int | tuple[int, ...]]) -> None:
    """``got`` must be the errno ``want`` names for this backend (VM backends: checked by the caller)."""
    expected = want[t.name]
    allowed = expected if isinstance(expected, tuple) else (expected,)
    name = errno.errorcode.get(got, "success" if got == 0 else str(got))
    assert got in allowed, f"{what}: got {name}, want {' or '.join(errno.errorcode[e] for e in allowed)}"
