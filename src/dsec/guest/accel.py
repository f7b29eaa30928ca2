"""The accelerator QEMU guests run under: KVM when this host's KVM can boot a guest kernel, TCG otherwise.

A host's ``/dev/kvm`` proves nothing by being there: a paravirtual KVM may abort QEMU at once, or let it spin
forever without printing a line. So a short probe boots the guest kernel under KVM and requires it to reach
userspace within :data:`PROBE_SECONDS`. The verdict holds until something that can change it changes, so it
is decided once per *boot key* (the host's boot id, its kernel, the QEMU binary and the guest kernel) and kept
on disk (``$DSEC_GUEST/accel/<key>.json``, or ``DSEC_ACCEL_CACHE``): every later daemon start, every backend
and ``dsec doctor`` read it instead of probing again. Daemons deciding at once share one probe (a file lock).

:class:`Accelerator` decides in a background thread, shared by every backend of the process that needs it, so a
daemon serves from its first second; backends report themselves pending meanwhile and their creates wait for
the verdict with a bound (:meth:`Accelerator.wait_decided`).

This module owns the decision, its cache files and the probe's QEMU. It must never block a caller that did
not ask to wait, and never let the probe's QEMU outlive its bound or the process that started it (it is
killed at the bound and by ``PR_SET_PDEATHSIG`` when that process dies, however it dies).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from dsec.errors import BackendUnavailable
from dsec.guest.kernel import default_guest_dir
from dsec.isolation.procs import die_with_parent

__all__ = ["PROBE_SECONDS", "QEMU", "Accelerator", "Verdict", "boot_key", "cache_dir", "cached", "decide", "health",
           "kvm_usable", "probe"]

log = logging.getLogger(__name__)

QEMU = "qemu-system-x86_64"
PROBE_SECONDS = float(os.environ.get("DSEC_ACCEL_PROBE_SECONDS") or 8.0)
"""How long the probe's guest kernel may take to reach userspace under KVM (``DSEC_ACCEL_PROBE_SECONDS``). A
working KVM gets there in well under a second; a broken one never does."""
_LOCK_POLL = 0.05


@dataclass(frozen=True)
class Verdict:
    """KVM or TCG, and how that was decided."""

    accel: str
    """``"kvm"`` or ``"tcg"``."""
    reason: str
    """What the probe saw (or why none ran)."""
    how: str
    """``"probe"`` (run by this process), ``"cache"`` (an earlier probe of this boot key), ``"no-kvm"`` (no usable
    /dev/kvm: nothing to probe) or ``"failed"`` (the probe itself could not run)."""
    decided_at: float = 0.0
    """Wall-clock time of the probe."""
    probe_seconds: float = 0.0
    """How long the probe ran."""
    key: dict[str, str] = field(default_factory=dict)
    """The boot key it holds for."""
    path: str | None = None
    """The cache file it is kept in, if any."""

    def describe(self) -> str:
        """One line for logs and ``dsec doctor``: the verdict, what the probe saw, and when and where."""
        if self.how in ("no-kvm", "failed"):
            return f"{self.accel.upper()}: {self.reason}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.decided_at))
        where = f"; kept for this boot in {self.path}" if self.path else ""
        origin = "probed now" if self.how == "probe" else "probed earlier this boot"
        return f"{self.accel.upper()}: {self.reason} ({origin}: {self.probe_seconds:.1f} s at {when}{where})"


def cache_dir() -> Path:
    """Where verdicts are kept: ``DSEC_ACCEL_CACHE`` or ``$DSEC_GUEST/accel`` (node-wide, like the kernel)."""
    return Path(os.environ.get("DSEC_ACCEL_CACHE") or default_guest_dir() / "accel")


def _identity(path: str | Path) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def boot_key(kernel: Path) -> dict[str, str]:
    """What a verdict depends on: the host's boot (and its kernel), the QEMU binary, the guest kernel. Cheap
    (a few stats and reads)."""
    qemu = shutil.which(QEMU)
    return {
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "host_kernel": f"{os.uname().release} {os.uname().version}",
        "qemu": _identity(qemu) if qemu else "none",
        "guest_kernel": _identity(kernel),
    }


def _key_file(key: dict[str, str], where: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return where / f"{digest}.json"


def kvm_usable() -> bool:
    """Whether this process may open ``/dev/kvm`` at all (without it there is nothing to probe)."""
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def probe(kernel: Path, timeout: float = PROBE_SECONDS) -> tuple[str, str]:
    """``("kvm" | "tcg", what was seen)``: boot ``kernel`` under KVM and require its "Run /init" line (or the
    panic that follows when there is no init) within ``timeout``. Blocking; never leaves its QEMU behind."""
    cmd = [QEMU, "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", "kvm", "-cpu", "host", "-m", "128",
           "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-kernel", str(kernel),
           "-append", "console=ttyS0 panic=-1 rdinit=/nonexistent", "-serial", "stdio"]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent)
    except OSError as e:
        return "tcg", f"cannot run {QEMU}: {e}"
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    text = out.decode(errors="replace")
    if "Run /" in text or "No working init found" in text:
        return "kvm", "KVM booted the guest kernel"
    last = text.strip().splitlines()[-1:] or ["no output"]
    return "tcg", f"KVM could not boot the guest kernel within {timeout:g} s ({last[0][:120]}); using TCG"


def _read(path: Path, key: dict[str, str]) -> Verdict | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key or data.get("accel") not in ("kvm", "tcg"):
            return None
        return Verdict(accel=data["accel"], reason=str(data["reason"]), how="cache",
                       decided_at=float(data["decided_at"]), probe_seconds=float(data["probe_seconds"]), key=key,
                       path=str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, verdict: Verdict) -> None:
    """Keep ``verdict`` (atomically) and drop verdicts of earlier boots; a cache that cannot be written only
    costs a probe at the next start."""
    data = {k: v for k, v in asdict(verdict).items() if k not in ("how", "path")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        for other in path.parent.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if json.loads(other.read_text())["key"]["boot_id"] != verdict.key["boot_id"]:
                    other.unlink()
                    other.with_suffix(".lock").unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot keep the accelerator verdict in %s (%s): the next start probes again", path, e)


@contextlib.contextmanager
def _probe_lock(path: Path, timeout: float) -> Iterator[None]:
    """One probe per boot key on the host at a time: others wait here, then read its verdict. A holder that does
    not finish within ``timeout`` is not waited for (the caller probes itself)."""
    fd = -1
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("another process's KVM probe (%s) held its lock for %g s; probing anyway", path,
                                timeout)
                    break
                time.sleep(_LOCK_POLL)
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def cached(kernel: Path) -> Verdict | None:
    """The verdict kept for this boot key, without probing (None: not decided yet this boot)."""
    if not kvm_usable():
        return Verdict("tcg", "no usable /dev/kvm", how="no-kvm")
    key = boot_key(kernel)
    return _read(_key_file(key, cache_dir()), key)


def decide(kernel: Path, timeout: float = PROBE_SECONDS, on_probe: threading.Event | None = None) -> Verdict:
    """The verdict for this boot key: the kept one, or a probe's (kept for the next caller). Blocking: up to
    ``timeout`` for the probe, plus as long again while another process probes. ``on_probe`` is set when this
    call starts a probe of its own."""
    if not kvm_usable():
        return Verdict("tcg", "no usable /dev/kvm", how="no-kvm")
    key = boot_key(kernel)
    path = _key_file(key, cache_dir())
    found = _read(path, key)
    if found is not None:
        return found
    with _probe_lock(path.with_suffix(".lock"), timeout + 5):
        found = _read(path, key)
        if found is not None:
            return found
        if on_probe is not None:
            on_probe.set()
        started, at = time.monotonic(), time.time()
        accel, reason = probe(kernel, timeout)
        verdict = Verdict(accel, reason, how="probe", decided_at=at, probe_seconds=time.monotonic() - started,
                          key=key, path=str(path))
        log.info("accelerator: %s", verdict.describe())
        _write(path, verdict)
    return verdict


class Accelerator:
    """The process's one decision for a guest kernel, made in a background thread and awaited by the backends
    that need it (microvm and vm share it: one probe, not one each)."""

    _shared: dict[tuple[str, str, float], Accelerator] = {}
    _shared_lock = threading.Lock()

    def __init__(self, kernel: Path, timeout: float = PROBE_SECONDS) -> None:
        self.kernel = kernel
        self.timeout = timeout
        self.bound = 2 * timeout + 15
        """Seconds a create waits for the verdict at most: a probe, another process's probe, and slack."""
        self._future: concurrent.futures.Future[Verdict] = concurrent.futures.Future()
        self._probing = threading.Event()
        self._since = time.monotonic()
        self._thread: threading.Thread | None = None

    @classmethod
    def shared(cls, kernel: Path, timeout: float = PROBE_SECONDS) -> Accelerator:
        """The process's decision for ``kernel`` (with the QEMU on PATH now), started if it is not yet."""
        key = (str(kernel), shutil.which(QEMU) or "", timeout)
        with cls._shared_lock:
            accelerator = cls._shared.get(key)
            if accelerator is None:
                accelerator = cls._shared[key] = cls(kernel, timeout)
            accelerator.start()
        return accelerator

    def start(self) -> None:
        """Begin deciding in the background (once; later calls do nothing)."""
        if self._thread is not None:
            return
        # A daemon thread: a process exiting mid-probe does not wait for it (its QEMU dies with the process).
        self._thread = threading.Thread(target=self._run, name="dsec-accel-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            verdict = decide(self.kernel, self.timeout, self._probing)
        except Exception as e:  # a probe that cannot even run must not leave creates waiting: TCG always works
            log.exception("the accelerator probe failed")
            verdict = Verdict("tcg", f"the KVM probe failed ({type(e).__name__}: {e}); using TCG", how="failed")
        self._future.set_result(verdict)

    @property
    def verdict(self) -> Verdict | None:
        """The verdict once decided, else None."""
        return self._future.result() if self._future.done() else None

    def pending(self) -> str | None:
        """What the decision waits for, or None once decided."""
        if self._future.done():
            return None
        waited = time.monotonic() - self._since
        if self._probing.is_set():
            return (f"deciding KVM or TCG: a probe boot under KVM has run for {waited:.0f} s "
                    f"(at most {self.timeout:g} s)")
        return f"deciding KVM or TCG: waiting {waited:.0f} s for the probe of another process on this host"

    async def wait_decided(self, timeout: float | None = None) -> Verdict:
        """The verdict, waiting for it up to ``timeout`` (default :attr:`bound`); BackendUnavailable after that."""
        if self._future.done():
            return self._future.result()
        bound = self.bound if timeout is None else timeout
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        def decided(_: concurrent.futures.Future[Verdict]) -> None:
            with contextlib.suppress(RuntimeError):  # the waiting loop is closed: nobody to wake
                loop.call_soon_threadsafe(wake)

        # Not asyncio.wrap_future: a waiter that gives up would cancel the shared decision with it.
        self._future.add_done_callback(decided)
        try:
            await asyncio.wait_for(waiter, bound)
        except TimeoutError:
            raise BackendUnavailable(f"the accelerator (KVM or TCG) was not decided within {bound:g} s: "
                                     f"{self.pending() or 'decided just now'}; retry") from None
        return self._future.result()


def health(accel: str | None, reason: str, accelerator: Accelerator | None
           ) -> tuple[str | None, Literal["degraded", "down"], str | None]:
    """The accelerator as a node component: ``(error, how bad, detail)`` for a backend that chose ``accel``
    (None: not applied yet) for ``reason``, waiting on ``accelerator``. Degraded while undecided (creates wait)
    or when the probe itself failed (guests fall back to TCG); down when KVM was chosen and ``/dev/kvm`` is no
    longer usable (every new guest would fail to start). Non-blocking."""
    verdict = accelerator.verdict if accelerator is not None else None
    if accel is None and verdict is not None:
        accel, reason = verdict.accel, verdict.describe()
    if accel is None:
        pending = accelerator.pending() if accelerator is not None else None
        return (f"{pending or 'not decided'}: microvm and vm creates wait for it", "degraded",
                "deciding KVM or TCG")
    detail = f"{accel}" + (f" ({reason})" if reason else "")
    if verdict is not None and verdict.how == "failed":
        return f"the KVM probe could not run ({verdict.reason}): guests run under TCG", "degraded", detail
    if accel == "kvm" and not kvm_usable():
        return ("KVM was chosen but /dev/kvm is not usable now: new guests fail to start (restart the daemon to "
                "decide again)"), "down", detail
    return None, "degraded", detail
