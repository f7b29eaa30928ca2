"""dsec doctor: every probe reports, none raises, and every failure names its fix."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from dsec import doctor
from dsec.config import Settings
from dsec.images.image_store import ImageStore


def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", images_dir=tmp_path / "images")


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def test_run_checks_reports_everything(tmp_path: Path) -> None:
    checks = doctor.run_checks(settings(tmp_path))
    names = [c.name for c in checks]
    assert len(names) == len(set(names))
    for expected in ("root", "kernel", "user namespaces", "cgroups", "overlayfs", "seccomp", "landlock",
                     "kvm", "tool: crun", "tool: runc", "tool: mmdebstrap", "tool: mkfs.erofs", "tool: qemu",
                     "tool: bwrap", "tool: podman", "tool: gcc", "libseccomp", "image store", "image debian-python",
                     "pid limit", "cpu wakeups"):
        assert expected in names
    for c in checks:
        assert isinstance(c.ok, bool) and c.detail
        if not c.ok:
            assert c.fix, f"{c.name} failed without a fix"
    pid = by_name(checks)["pid limit"]
    assert "kernel.pid_max=" in pid.detail and not pid.required
    assert pid.ok == (int(Path("/proc/sys/kernel/pid_max").read_text()) >= doctor.PID_MAX_FOR_DENSITY)
    wake = by_name(checks)["cpu wakeups"]
    assert not wake.required and ("busy CPU runs after" in wake.detail or "not measured" in wake.detail)
    kvm = by_name(checks)["kvm"].detail
    # with the guest kernel fetched, the probe boots it and names the accelerator the microvm backend uses
    assert "microvm accelerator: KVM" in kvm or "microvm accelerator: TCG" in kvm or "TCG" in kvm \
        or "not probed" in kvm


def test_missing_base_image_and_store(tmp_path: Path) -> None:
    checks = by_name(doctor.run_checks(settings(tmp_path)))
    assert not checks["image store"].ok and "does not exist" in checks["image store"].detail
    assert not checks["image debian-python"].ok
    assert checks["image debian-python"].fix == "dsec image build debian-python"
    assert not doctor.healthy(list(checks.values()))


def test_present_base_image(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ImageStore(tmp_path / "images").import_dir("debian-python", src, uid_shift=0)
    checks = by_name(doctor.run_checks(settings(tmp_path)))
    assert checks["image debian-python"].ok
    assert "1 image(s): debian-python" in checks["image store"].detail


def test_missing_tools_name_their_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec.doctor.shutil.which", lambda name: None)
    checks = by_name(doctor.run_checks(settings(tmp_path)))
    assert checks["tool: crun"].fix == "apt-get install crun" and checks["tool: crun"].required
    assert checks["tool: runc"].fix == "apt-get install runc" and not checks["tool: runc"].required
    assert checks["tool: mkfs.erofs"].fix == "apt-get install erofs-utils"
    assert checks["tool: qemu"].fix == "apt-get install qemu-system-x86"
    assert checks["tool: bwrap"].fix == "apt-get install bubblewrap"
    assert checks["tool: mmdebstrap"].fix == "apt-get install mmdebstrap"
    assert not checks["tool: podman"].ok and not checks["tool: podman"].required
    assert "util-linux" in (checks["user namespaces"].fix or "")


def test_a_crashing_probe_is_a_failed_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> doctor.Check:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(doctor, "_seccomp", boom)
    monkeypatch.setattr(doctor, "_cgroups", boom)
    checks = by_name(doctor.run_checks(settings(tmp_path)))
    assert not checks["seccomp"].ok and "probe exploded" in checks["seccomp"].detail
    assert not checks["cgroups"].ok
    assert checks["kernel"].detail.startswith("Linux")  # the others still ran


def test_bad_settings_do_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_UID_SHIFT", "not-a-number")
    checks = doctor.run_checks()
    assert len(checks) == 1 and not checks[0].ok and "DSEC_" in (checks[0].fix or "")


HYBRID = """\
25 1 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 30 0:29 / /sys/fs/cgroup/memory rw,nosuid shared:13 - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:14 - cgroup cgroup rw,cpu,cpuacct
35 30 0:31 / /sys/fs/cgroup/pids rw,nosuid shared:15 - cgroup cgroup rw,pids
"""


def test_cgroup_mode_parsing(tmp_path: Path) -> None:
    assert doctor.cgroup_mode(HYBRID) == ("v1 (hybrid)", ["cpu", "cpuacct", "memory", "pids"])
    legacy = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)
    assert doctor.cgroup_mode(legacy)[0] == "v1 (legacy)"
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    unified = f"30 25 0:26 / {tmp_path} rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert doctor.cgroup_mode(unified) == ("v2 unified", ["cpu", "cpuset", "io", "memory", "pids"])
    assert doctor.cgroup_mode("garbage\n") == ("none", [])


def test_render_and_json(tmp_path: Path) -> None:
    checks = doctor.run_checks(settings(tmp_path))
    buf = io.StringIO()
    doctor.render(checks, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "dsec doctor" in out and "image debian-python" in out and "dsec image build debian-python" in out
    data = json.loads(doctor.as_json(checks))
    assert [d["name"] for d in data] == [c.name for c in checks]
    assert set(data[0]) == {"name", "ok", "detail", "fix", "required"}


def test_landlock_abi_is_an_int() -> None:
    abi = doctor.landlock_abi()
    assert isinstance(abi, int) and abi >= 0


def test_late_wakeups_point_at_housekeeping_cpus() -> None:
    prompt = {"idle_ms": [0.05, 0.07], "busy_ms": [0.08, 0.2], "cpus": [0, 1]}
    late = {"idle_ms": [0.07, 0.09], "busy_ms": [1.9, 2.9], "cpus": [0, 1]}
    assert doctor.wakeup_check(prompt, None).ok
    verdict = doctor.wakeup_check(late, None)
    assert not verdict.ok and not verdict.required
    assert "1.9 ms p50" in verdict.detail and verdict.fix and "DSEC_CONTROL_CPUS=0" in verdict.fix
    pinned = doctor.wakeup_check(late, "0")
    assert pinned.ok and "DSEC_CONTROL_CPUS=0" in pinned.detail
    one_cpu = doctor.wakeup_check({"skipped": "needs two CPUs, this process may use 1"}, None)
    assert one_cpu.ok and "needs two CPUs" in one_cpu.detail


def test_a_failing_wakeup_probe_is_a_warning_with_a_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def broken(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "Traceback ... RuntimeError: no fork")

    monkeypatch.setattr(doctor.subprocess, "run", broken)
    check = doctor._wakeups(settings(tmp_path))
    assert not check.ok and not check.required and "no fork" in check.detail and check.fix

    def slow(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired("probe", 30)

    monkeypatch.setattr(doctor.subprocess, "run", slow)
    check = doctor._wakeups(settings(tmp_path))
    assert not check.ok and not check.required and "TimeoutExpired" in check.detail


def test_harbor_interpreter_is_found_or_named_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSEC_HARBOR_PYTHON is tried first; an interpreter older than 3.12 is not enough, and the check says so."""
    old, new = tmp_path / "old-python", tmp_path / "new-python"
    old.write_text("#!/bin/sh\necho 3 11\n")
    new.write_text("#!/bin/sh\necho 3 13\n")
    old.chmod(0o755)
    new.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("DSEC_HARBOR_PYTHON", str(old))
    monkeypatch.setattr("dsec.integrations.interpreters._PREFIXES", ())
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    check = doctor._harbor_python()
    assert not check.ok and not check.required and "DSEC_HARBOR_PYTHON" in (check.fix or "")
    monkeypatch.setenv("DSEC_HARBOR_PYTHON", str(new))
    check = doctor._harbor_python()
    assert check.ok and str(new) in check.detail and "3.13" in check.detail
    monkeypatch.delenv("DSEC_HARBOR_PYTHON")
    pyenv = tmp_path / "pyenv" / "versions" / "3.12.1" / "bin"
    pyenv.mkdir(parents=True)
    (pyenv / "python3.12").write_text("#!/bin/sh\necho 3 12\n")
    (pyenv / "python3.12").chmod(0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    check = doctor._harbor_python()
    assert check.ok and str(pyenv / "python3.12") in check.detail
