"""``dsec bench startup``: a daemon's first start on a host, to its first health answer and its first container
exec, on this host as it is and on a host whose KVM hangs.

Each sample is a first run: a fresh ``DSEC_HOME`` and no accelerator verdict kept (``DSEC_ACCEL_CACHE`` in a fresh
directory), so the KVM probe runs during the start, as on a newly booted host. The hanging host is this one with
a stand-in ``qemu-system-x86_64`` first on PATH that never prints (a paravirtual KVM's QEMU spins forever): the
daemon must answer as fast there. The daemon is ``python -m dsec.daemon serve`` (what ``dsec up`` runs), timed
from its spawn; the peer is the floor any Python daemon pays, the same interpreter importing the daemon's server
module and exiting. After each sample the daemon is stopped and anything of its home still running (the probe's
QEMU, a helper) is counted as a leak. Nothing asserts a timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import dsec
from dsec.bench.container import BenchUnavailable
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings
from dsec.daemon.server import daemon_answers
from dsec.guest.accel import QEMU

__all__ = ["HEALTH_TARGET_S", "HOSTS", "run"]

HEALTH_TARGET_S = 1.0
EXEC_TARGET_S = 1.5
HOSTS = ("this host", "KVM hangs")
_HANG = "#!/bin/sh\nexec sleep 1000\n"


@contextlib.contextmanager
def _stand_in() -> Iterator[Path]:
    """A directory whose ``qemu-system-x86_64`` never prints (put it first on PATH)."""
    with tempfile.TemporaryDirectory(prefix="dsec-bench-kvm-") as tmp:
        qemu = Path(tmp) / QEMU
        qemu.write_text(_HANG)
        qemu.chmod(0o755)
        yield Path(tmp)


def _processes_of(*needles: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and any(n.encode() in argv for n in needles):
                    found.append(int(proc.name))
    return found


@dataclass
class _Start:
    """One first start, in seconds from the daemon's spawn."""

    health_s: float = 0.0
    exec_s: float = 0.0
    accel_s: float = 0.0
    """Until microvm and vm were no longer pending (their KVM-or-TCG verdict)."""
    leaks: list[int] = field(default_factory=list)
    """Pids of the home's processes (or of the stand-in QEMU) still running after the daemon stopped."""


async def _sample(images: Path, path_prefix: Path | None) -> _Start:
    """One first start: seconds to health, to the first container exec, to the accelerator's verdict."""
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-up-", dir="/var/tmp"))
    verdicts = Path(tempfile.mkdtemp(prefix="dsec-bench-accel-"))
    settings = Settings(home=home, images_dir=images)
    env = dict(os.environ, DSEC_HOME=str(home), DSEC_IMAGES=str(images), DSEC_ACCEL_CACHE=str(verdicts))
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    log = (home / "daemon.log").open("wb")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dsec.daemon", "serve"], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=log, env=env, start_new_session=True, cwd="/")
    out = _Start()
    try:
        while not daemon_answers(settings):
            if proc.poll() is not None:
                raise BenchUnavailable(f"the daemon exited at start: {(home / 'daemon.log').read_text()[-800:]}")
            if time.monotonic() - started > 120:
                raise BenchUnavailable("the daemon did not answer within 120 s")
            await asyncio.sleep(0.002)
        out.health_s = time.monotonic() - started
        async with dsec.Client(f"unix://{settings.socket_path}") as client:
            async with await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client) as sb:
                result = await sb.exec(["true"])
                out.exec_s = time.monotonic() - started
                if result.exit_code != 0:
                    raise BenchUnavailable(f"`true` exited {result.exit_code} in the first sandbox")
            while True:  # when the backends that wait for KVM-or-TCG could create (reported, not a target)
                backends = (await client.health()).backends
                if not any(str(backends.get(n, "")).startswith("pending") for n in ("microvm", "vm")):
                    break
                await asyncio.sleep(0.05)
            out.accel_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        log.close()
        # the janitor of a daemon that did not close by itself cleans up; then nothing of the home may run
        deadline = time.monotonic() + 30
        while _processes_of(str(home)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        out.leaks = _processes_of(str(home)) + ([] if path_prefix is None else _processes_of("sleep 1000"))
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(verdicts, ignore_errors=True)
    return out


def _peer(samples: int) -> list[float]:
    """The interpreter start and the daemon's imports alone (the floor of any Python daemon's first answer)."""
    took = []
    for _ in range(samples):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", "import dsec.daemon.server"], check=True)
        took.append(time.monotonic() - start)
    return took


async def run(samples: int = 5, progress: Callable[[str], None] = lambda m: None,
              node: Settings | None = None) -> Suite:
    """Every figure of the suite; :class:`BenchUnavailable` when this host cannot run container sandboxes."""
    if os.geteuid() != 0:
        raise BenchUnavailable("needs root (the daemon creates namespaces, cgroups and mounts)")
    node = node or Settings()
    from dsec.images.image_store import ImageStore

    if not ImageStore(node.images, node.image_store).exists("debian-python"):
        raise BenchUnavailable(f"image 'debian-python' is not in the store at {node.images}: run ./scripts/setup")
    suite = Suite(name="startup")
    peer = _peer(samples)
    suite.latencies["peer: python -c 'import dsec.daemon.server'"] = summarize(peer)
    leaks: list[str] = []
    with _stand_in() as hanging:
        for host, prefix in zip(HOSTS, (None, hanging), strict=True):
            health, first_exec, accel = [], [], []
            for i in range(samples):
                progress(f"{host}: first start {i + 1}/{samples} (fresh home, no kept KVM verdict)")
                got = await _sample(node.images, prefix)
                health.append(got.health_s)
                first_exec.append(got.exec_s)
                accel.append(got.accel_s)
                leaks += [f"{host}: pid {pid}" for pid in got.leaks]
            h, e, a = summarize(health), summarize(first_exec), summarize(accel)
            suite.latencies[f"{host}: start → health"] = h
            suite.latencies[f"{host}: start → first container exec"] = e
            suite.latencies[f"{host}: start → microvm and vm decided"] = a
            suite.rows += [
                Row(f"start → health ({host})", "ms", h.p50 * 1000, summarize(peer).p50 * 1000,
                    "python + the daemon's imports", "lower", f"≤ {HEALTH_TARGET_S * 1000:.0f} ms",
                    h.p50 <= HEALTH_TARGET_S),
                Row(f"start → first container exec ({host})", "ms", e.p50 * 1000,
                    target=f"≤ {EXEC_TARGET_S * 1000:.0f} ms", passed=e.p50 <= EXEC_TARGET_S),
                Row(f"start → KVM-or-TCG decided ({host})", "ms", a.p50 * 1000, note="reported"),
            ]
    suite.extra["samples"] = samples
    suite.extra["leaks"] = leaks
    suite.extra["load"] = os.getloadavg()
    return suite
