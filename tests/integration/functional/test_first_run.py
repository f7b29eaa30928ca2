"""A daemon's first run on a host whose KVM hangs: it answers at once, serves containers meanwhile, decides the
accelerator once per boot, and leaves nothing behind however it ends (issue 29).

The hanging KVM is a stand-in ``qemu-system-x86_64`` first on PATH that never prints (a paravirtual KVM's QEMU
spins forever). The daemons are real (``dsec up``, ``python -m dsec.daemon serve``) on fresh homes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec
from container_support import home_tag, images_dir, short_home, wait_until
from dsec import doctor
from dsec.config import Settings
from dsec.daemon.server import ServeError, down, restart, up
from dsec.daemon.startup import find_daemon, read_status
from dsec.guest import accel
from dsec.guest.kernel import default_guest_dir, find_kernel

pytestmark = [pytest.mark.root]

HANG = "exec sleep 1000"
BOOTS = 'echo "[    0.61] Run /init as init process"; exit 0'


def stand_in(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / accel.QEMU
    # only probe boots count (`dsec doctor` asks the stand-in its --version too)
    script.write_text(f'#!/bin/sh\ncase "$*" in *"-accel kvm"*) echo $$ >> "{bin_dir / "probes"}";; esac\n{body}\n')
    script.chmod(0o755)


def probes(bin_dir: Path) -> list[int]:
    path = bin_dir / "probes"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def traces(home: Path) -> list[str]:
    """Everything of ``home``'s daemon still on the host: processes (the daemon's helpers, the lazy image server,
    the mount holder, the janitor), mounts, cgroups, run directories."""
    tag = home_tag(home)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid() or not alive(int(proc.name)):
            continue
        with contextlib.suppress(OSError):
            argv = proc.joinpath("cmdline").read_bytes()
            if str(home).encode() in argv or tag.encode() in argv:
                command = argv.replace(b"\0", b" ")[:160].decode(errors="replace")
                found.append(f"process {proc.name}: {command}")
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if str(home) in line or f"/{tag}" in line.split()[4]]
    found += [f"cgroup {cg}" for cg in Path("/sys/fs/cgroup").glob(f"*/dsec-{tag}*")]
    found += [f"directory {d}" for d in (*Path("/run/dsec").glob(f"{tag}*"), *Path("/run/dsec-vm").glob(f"{tag}*"),
                                         *Path("/dev/shm").glob(f"dsec-{tag}"))]
    return found


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Settings, Path]]:
    """A fresh home; a stand-in QEMU directory first on PATH (fill it with :func:`stand_in`); the accelerator's
    verdicts kept in tmp_path. Whatever a test leaves running is stopped at teardown."""
    try:
        find_kernel(default_guest_dir())
    except dsec.DSecError as exc:
        pytest.skip(f"no guest kernel: {exc}")
    home = short_home("dsec-first-")
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("DSEC_ACCEL_CACHE", str(tmp_path / "accel"))
    monkeypatch.setenv("DSEC_IMAGES", str(images_dir()))
    settings = Settings(home=home, images_dir=images_dir())
    try:
        yield settings, bin_dir
    finally:
        with contextlib.suppress(ServeError):
            down(settings, destroy=True)
        for pid in probes(bin_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


def health(settings: Settings) -> dict[str, str]:
    transport = httpx.HTTPTransport(uds=str(settings.socket_path))
    with httpx.Client(transport=transport, base_url="http://dsec", timeout=30) as c:
        backends: dict[str, str] = c.get("/v1/health").raise_for_status().json()["backends"]
        return backends


@pytest.mark.slow
def test_a_hanging_kvm_probe_delays_nothing_and_a_killed_daemon_leaves_nothing(
        host: tuple[Settings, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    settings, bin_dir = host
    stand_in(bin_dir, HANG)
    monkeypatch.setenv("DSEC_ACCEL_PROBE_SECONDS", "600")  # the probe outlasts the test: only orderings matter
    pid = up(settings, timeout=60)
    assert wait_until(lambda: probes(bin_dir), timeout=30), "the daemon never started its accelerator probe"
    [probe] = probes(bin_dir)
    backends = health(settings)
    assert alive(probe), "health must be answered while the probe still runs"
    assert backends["container"] == "ok"
    for name in ("microvm", "vm"):
        assert backends[name].startswith("pending: deciding KVM or TCG: a probe boot under KVM has run for"), backends
    with dsec.Client(f"unix://{settings.socket_path}") as client, \
            dsec.Sandbox.create(image="debian-python", backend="container", client=client) as sb:
        assert sb.exec("echo served meanwhile").stdout == b"served meanwhile\n"
    assert alive(probe) and health(settings)["microvm"].startswith("pending:")

    status = read_status(settings)
    assert status is not None and status.janitor is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(probe), timeout=10), "the probe's QEMU outlived the SIGKILLed daemon"
    assert wait_until(lambda: not alive(status.janitor[0]), timeout=60), "the janitor did not finish"
    assert traces(settings.home) == []


@pytest.mark.slow
def test_the_probe_runs_once_per_boot_key(host: tuple[Settings, Path]) -> None:
    """Later starts (by hand, then a restart) reuse the verdict, and so does `dsec doctor`."""
    settings, bin_dir = host
    stand_in(bin_dir, BOOTS)
    up(settings, timeout=60)
    assert wait_until(lambda: health(settings)["microvm"] == "ok", timeout=30), health(settings)
    assert health(settings)["vm"] == "ok"
    assert len(probes(bin_dir)) == 1  # one probe for both backends
    assert down(settings)

    proc = _serve(settings)
    try:
        assert wait_until(lambda: settings.socket_path.exists() and health(settings)["microvm"] == "ok", timeout=60)
        assert len(probes(bin_dir)) == 1
        [kvm] = [c for c in doctor.run_checks() if c.name == "kvm"]
        assert kvm.ok and kvm.detail.startswith("microvm and vm accelerator: KVM: KVM booted the guest kernel "
                                                "(probed earlier this boot"), kvm
        # `dsec up --restart` and `dsec down` find a daemon they did not start (no pid file): socket and lock
        assert not settings.pid_file.exists() and find_daemon(settings) == proc.pid
        pid = restart(settings, timeout=60)
        assert proc.wait(30) == 0 and pid != proc.pid and find_daemon(settings) == pid
        assert health(settings)["microvm"] == "ok" and len(probes(bin_dir)) == 1
        assert down(settings)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert traces(settings.home) == []


def _serve(settings: Settings) -> subprocess.Popen[bytes]:
    log = settings.home / "serve.log"
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "dsec.daemon", "serve", "--home", str(settings.home)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, cwd="/")


@pytest.mark.slow
def test_up_names_the_phase_a_stuck_daemon_is_in_and_leaves_nothing(host: tuple[Settings, Path]) -> None:
    """A daemon that stops making progress (frozen here with SIGSTOP in whatever phase it reached) is given up after
    the phase timeout: `dsec up` names that phase, shows the log, and its failure leaves nothing behind (the mount
    holder a failed start used to leave included)."""
    settings, bin_dir = host
    stand_in(bin_dir, BOOTS)
    frozen: list[str] = []

    def freeze() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = read_status(settings)
            if status is not None and alive(status.pid) and status.phase == "starting the microvm backend":
                os.kill(status.pid, signal.SIGSTOP)
                stopped = read_status(settings)
                assert stopped is not None
                frozen.append(stopped.phase)
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=freeze)
    watcher.start()
    with pytest.raises(ServeError) as err:
        up(settings, timeout=3)
    watcher.join()
    assert frozen, "the daemon was not caught in a start-up phase"
    message = str(err.value)
    assert f"made no progress for 3 s in its start-up phase {frozen[0]!r}" in message
    tail = message.split("log tail:\n", 1)[1]
    assert f"start-up phase: {frozen[0]}" in tail
    assert traces(settings.home) == []


@pytest.mark.slow
@pytest.mark.vm
def test_a_killed_daemon_leaves_no_qemu_of_an_unfinished_create(host: tuple[Settings, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILLed while a microvm's first create boots its template, the daemon leaves no QEMU spinning: its janitor
    ends what nobody will re-adopt; the next daemon drops the half-made sandbox."""
    settings, bin_dir = host
    monkeypatch.setenv("PATH", os.environ["PATH"].removeprefix(f"{bin_dir}:"))  # the real QEMU this time
    monkeypatch.setenv("DSEC_MICROVM_ACCEL", "tcg")
    pid = up(settings, timeout=60)
    tag = home_tag(settings.home)

    def qemus() -> list[int]:
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and alive(int(p.name))
                and f"/run/dsec-vm/{tag}/".encode() in _cmdline(p)]

    def create() -> None:
        with contextlib.suppress(dsec.DSecError), dsec.Client(f"unix://{settings.socket_path}") as client:
            dsec.Sandbox.create(image="debian-python", backend="microvm", client=client)

    creating = threading.Thread(target=create, daemon=True)
    creating.start()
    assert wait_until(qemus, timeout=120), "no QEMU started for the create"
    status = read_status(settings)
    assert status is not None and status.janitor is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not qemus(), timeout=60), "the unfinished create's QEMU outlived the killed daemon"
    assert wait_until(lambda: not alive(status.janitor[0]), timeout=60)
    creating.join(60)
    up(settings, timeout=60)  # re-adopts nothing: the half-made sandbox is dropped
    with dsec.Client(f"unix://{settings.socket_path}") as client:
        assert dsec.Sandbox.list(client=client) == []
    assert down(settings)
    assert traces(settings.home) == []


def _cmdline(proc: Path) -> bytes:
    try:
        return proc.joinpath("cmdline").read_bytes()
    except OSError:
        return b""
