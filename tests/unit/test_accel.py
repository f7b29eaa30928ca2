"""The KVM-or-TCG decision (dsec.guest.accel) with a stand-in QEMU on PATH: a probe that hangs is bounded and
killed, a verdict is probed once per boot key and kept on disk, concurrent deciders share one probe, and the
probe's QEMU dies with the process that started it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsec.errors import BackendUnavailable
from dsec.guest import accel


def stand_in(bin_dir: Path, body: str) -> Path:
    """A ``qemu-system-x86_64`` on PATH that logs its pid to ``probes`` beside it, then runs ``body``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / accel.QEMU
    # only probe boots count (`dsec doctor` asks the stand-in its --version too)
    script.write_text(f'#!/bin/sh\ncase "$*" in *"-accel kvm"*) echo $$ >> "{bin_dir / "probes"}";; esac\n{body}\n')
    script.chmod(0o755)
    return script


HANG = "exec sleep 1000"
"""A paravirtual KVM's QEMU: spins, never prints a line."""
BOOTS = 'echo "[    0.61] Run /init as init process"; exit 0'


def probes(bin_dir: Path) -> list[int]:
    path = bin_dir / "probes"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(the stand-in's directory, first on PATH; a guest kernel file), with the verdicts kept under tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("DSEC_ACCEL_CACHE", str(tmp_path / "accel"))
    monkeypatch.setattr(accel, "kvm_usable", lambda: True)  # the stand-in needs no /dev/kvm
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"not a kernel: the stand-in never reads it")
    return bin_dir, kernel


def test_a_probe_that_hangs_is_bounded_killed_and_kept_for_the_boot(host: tuple[Path, Path]) -> None:
    bin_dir, kernel = host
    stand_in(bin_dir, HANG)
    started = time.monotonic()
    verdict = accel.decide(kernel, timeout=0.5)
    assert time.monotonic() - started < 10
    assert verdict.accel == "tcg" and verdict.how == "probe"
    assert "within 0.5 s (no output)" in verdict.reason
    [pid] = probes(bin_dir)
    assert not alive(pid), "the probe's QEMU outlived its bound"
    assert verdict.path is not None and Path(verdict.path).is_file()
    again = accel.decide(kernel, timeout=0.5)  # the same boot key: read, not probed
    assert (again.accel, again.how, again.reason) == ("tcg", "cache", verdict.reason)
    assert len(probes(bin_dir)) == 1
    cached = accel.cached(kernel)
    assert cached is not None and "probed earlier this boot" in cached.describe()


def test_a_kvm_that_boots_the_guest_kernel(host: tuple[Path, Path]) -> None:
    bin_dir, kernel = host
    stand_in(bin_dir, BOOTS)
    verdict = accel.decide(kernel)
    assert (verdict.accel, verdict.reason) == ("kvm", "KVM booted the guest kernel")
    assert verdict.describe().startswith("KVM: KVM booted the guest kernel (probed now:")


def test_a_new_qemu_or_guest_kernel_is_probed_again(host: tuple[Path, Path]) -> None:
    bin_dir, kernel = host
    qemu = stand_in(bin_dir, BOOTS)
    assert accel.decide(kernel).how == "probe"
    assert accel.decide(kernel).how == "cache"
    qemu.write_text(qemu.read_text().replace("Run /init", "Run /init (upgraded)"))  # another QEMU binary
    assert accel.decide(kernel).how == "probe"
    kernel.write_bytes(b"another guest kernel")
    assert accel.decide(kernel).how == "probe"
    assert len(probes(bin_dir)) == 3


def test_verdicts_of_earlier_boots_are_dropped(host: tuple[Path, Path], tmp_path: Path) -> None:
    bin_dir, kernel = host
    stand_in(bin_dir, BOOTS)
    old = tmp_path / "accel" / "0123456789abcdef.json"
    old.parent.mkdir()
    old.write_text('{"key": {"boot_id": "an-earlier-boot"}, "accel": "kvm"}')
    accel.decide(kernel)
    assert not old.exists()
    assert len(list(old.parent.glob("*.json"))) == 1


def test_concurrent_deciders_share_one_probe(host: tuple[Path, Path]) -> None:
    bin_dir, kernel = host
    stand_in(bin_dir, f"sleep 1; {BOOTS}")
    verdicts: list[accel.Verdict] = []
    threads = [threading.Thread(target=lambda: verdicts.append(accel.decide(kernel))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [v.accel for v in verdicts] == ["kvm"] * 3
    assert sorted(v.how for v in verdicts) == ["cache", "cache", "probe"]
    assert len(probes(bin_dir)) == 1


def test_the_probe_dies_with_the_process_that_started_it(host: tuple[Path, Path], tmp_path: Path) -> None:
    """However its process ends (SIGKILL here), the probe's QEMU does not spin on (PR_SET_PDEATHSIG)."""
    bin_dir, kernel = host
    stand_in(bin_dir, HANG)
    code = (f"from pathlib import Path\nfrom dsec.guest import accel\naccel.kvm_usable = lambda: True\n"
            f"accel.decide(Path({str(kernel)!r}), timeout=600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while not probes(bin_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        [pid] = probes(bin_dir)
        assert alive(pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid), "the probe's QEMU outlived the process that started it"


async def test_the_shared_decision_is_pending_then_waited_for_with_a_bound(host: tuple[Path, Path]) -> None:
    bin_dir, kernel = host
    stand_in(bin_dir, HANG)
    decision = accel.Accelerator.shared(kernel, timeout=1.5)
    assert accel.Accelerator.shared(kernel, timeout=1.5) is decision  # one probe per process, not one per backend
    deadline = time.monotonic() + 10
    while not probes(bin_dir) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    pending = decision.pending()
    assert pending is not None and "a probe boot under KVM has run for" in pending
    with pytest.raises(BackendUnavailable, match=r"not decided within 0\.1 s"):
        await decision.wait_decided(timeout=0.1)
    verdict = await decision.wait_decided()
    assert verdict.accel == "tcg" and decision.pending() is None
    assert decision.verdict == verdict


async def test_health_tells_pending_decided_failed_and_a_kvm_gone(host: tuple[Path, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, kernel = host
    assert accel.health(None, "", None)[:2] == ("not decided: microvm and vm creates wait for it", "degraded")
    stand_in(bin_dir, HANG)
    hanging = accel.Accelerator(kernel, timeout=1.5)
    hanging.start()
    error, state, _ = accel.health(None, "", hanging)
    assert state == "degraded" and error is not None and "deciding KVM or TCG" in error
    await hanging.wait_decided()
    error, _, detail = accel.health(None, "", hanging)  # decided, not yet applied by a create: told as decided
    assert error is None and detail is not None and detail.startswith("tcg (TCG: ")

    stand_in(bin_dir, BOOTS)
    (tmp_path / "kvm-cache").mkdir()
    monkeypatch.setenv("DSEC_ACCEL_CACHE", str(tmp_path / "kvm-cache"))
    booting = accel.Accelerator(kernel, timeout=5)
    booting.start()
    verdict = await booting.wait_decided()
    assert verdict.accel == "kvm" and accel.health("kvm", verdict.describe(), booting)[0] is None
    monkeypatch.setattr(accel, "kvm_usable", lambda: False)  # /dev/kvm went away after the verdict
    error, state, _ = accel.health("kvm", verdict.describe(), booting)
    assert state == "down" and error is not None and "/dev/kvm is not usable now" in error
    assert accel.health("tcg", "forced", None)[0] is None

    def broken(*args: object) -> accel.Verdict:
        raise OSError("no room for the probe")

    monkeypatch.setattr(accel, "decide", broken)
    failing = accel.Accelerator(kernel, timeout=1.5)
    failing.start()
    assert (await failing.wait_decided()).how == "failed"
    error, state, _ = accel.health("tcg", "", failing)
    assert state == "degraded" and error is not None and "the KVM probe could not run" in error
