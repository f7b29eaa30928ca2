"""Housekeeping CPUs (``DSEC_CONTROL_CPUS``) on a real daemon process: the daemon, its exec helper and its zygotes
run on the control CPUs; what a sandbox runs (a container's commands and their children, a function sandbox's
calls, a microVM's QEMU with its vCPU threads) gets the daemon's original CPUs back. Without the option nothing
resets a mask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from conftest import missing
from container_support import daemon_process
from dsec.errors import DSecError
from dsec.guest.kernel import default_guest_dir, find_kernel
from dsec.isolation.affinity import cpu_list

pytestmark = [pytest.mark.root, pytest.mark.slow]

NODE = frozenset(os.sched_getaffinity(0))
CONTROL = min(NODE)
REPORT = ["sh", "-c", "grep Cpus_allowed_list /proc/self/status; sh -c 'grep Cpus_allowed_list /proc/self/status'"]


def allowed(pid: int | str, tid: int | str | None = None) -> str:
    status = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid is not None else "") + "/status").read_text()
    return status.split("Cpus_allowed_list:")[1].split()[0]


def processes(needle: str) -> list[int]:
    """Pids whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def pinned(debian_python_image: object) -> Iterator[str]:
    if len(NODE) < 2:
        pytest.skip(f"needs two CPUs, this process may use {cpu_list(NODE)}")
    with daemon_process("dsec-cpus-", DSEC_CONTROL_CPUS=str(CONTROL)) as (unix_url, _):
        yield unix_url


def home_of(unix_url: str) -> str:
    """The DSEC_HOME of the daemon answering on ``unix_url`` (its socket is ``$DSEC_HOME/run/dsec.sock``)."""
    return unix_url.removeprefix("unix://").rsplit("/run/", 1)[0]


def daemon_pid(unix_url: str) -> int:
    home = home_of(unix_url)
    pids = processes(f"dsec.daemon serve --home {home}")
    assert len(pids) == 1, pids
    return pids[0]


def test_the_control_path_runs_on_the_control_cpus(pinned: str) -> None:
    pid = daemon_pid(pinned)
    threads = os.listdir(f"/proc/{pid}/task")
    assert {allowed(pid, tid) for tid in threads} == {str(CONTROL)}, "every daemon thread is pinned"
    with dsec.Client(pinned) as client, dsec.Sandbox.create(image="debian-python", client=client) as sandbox:
        assert sandbox.exec(["true"]).exit_code == 0  # the exec helper is started
        helpers = [p for p in processes("dsec-nsexec-") if Path(f"/proc/{p}/stat").read_text().split()[3] == str(pid)]
        assert helpers and {allowed(p) for p in helpers} == {str(CONTROL)}


def test_container_commands_and_their_children_get_the_node_cpus(pinned: str) -> None:
    with dsec.Client(pinned) as client, dsec.Sandbox.create(image="debian-python", client=client) as sandbox:
        result = sandbox.exec(REPORT)
    assert result.exit_code == 0, result
    assert result.stdout.decode().split() == ["Cpus_allowed_list:", cpu_list(NODE)] * 2


def test_function_calls_get_the_node_cpus_and_the_zygote_stays(pinned: str) -> None:
    with dsec.Client(pinned) as client, \
            dsec.Sandbox.create(image="debian-python", backend="function", client=client) as sandbox:
        result = sandbox.exec(REPORT)
        home = home_of(pinned)
        zygotes = [p for p in processes("dsec-zygote") if f"{home}/function/" in Path(f"/proc/{p}/cmdline").read_text()]
        assert zygotes and {allowed(p) for p in zygotes} == {str(CONTROL)}
    assert result.exit_code == 0, result
    assert result.stdout.decode().split() == ["Cpus_allowed_list:", cpu_list(NODE)] * 2


@pytest.mark.vm
def test_microvm_qemu_and_its_vcpu_threads_get_the_node_cpus(pinned: str) -> None:
    try:
        find_kernel(default_guest_dir())
    except DSecError as e:
        missing(str(e))
    home = home_of(pinned)
    with dsec.Client(pinned) as client, \
            dsec.Sandbox.create(image="debian-python", backend="microvm", client=client) as sandbox:
        assert sandbox.exec(["true"]).exit_code == 0
        qemus = [p for p in processes("qemu-system") if home in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(qemus) == 1, qemus
        threads = os.listdir(f"/proc/{qemus[0]}/task")
        assert len(threads) > 1
        assert {allowed(qemus[0], tid) for tid in threads} == {cpu_list(NODE)}


def test_without_the_option_commands_keep_the_daemon_mask(debian_python_image: object) -> None:
    """An operator's own ``taskset`` of the daemon reaches its sandboxes untouched when the option is off."""
    if len(NODE) < 2:
        pytest.skip(f"needs two CPUs, this process may use {cpu_list(NODE)}")
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CONTROL})  # the daemon process inherits it (set back below)
    try:
        with daemon_process("dsec-cpus-off-", DSEC_CONTROL_CPUS="") as (unix_url, _):
            os.sched_setaffinity(0, mask)
            with dsec.Client(unix_url) as client:
                results = []
                for backend in ("container", "function"):
                    with dsec.Sandbox.create(image="debian-python", backend=backend, client=client) as sandbox:
                        results.append(sandbox.exec(REPORT))
    finally:
        os.sched_setaffinity(0, mask)
    for result in results:
        assert result.exit_code == 0, result
        assert result.stdout.decode().split() == ["Cpus_allowed_list:", str(CONTROL)] * 2


@pytest.mark.parametrize("entry", [["dsec"], ["dsec.daemon"]], ids=["cli", "daemon-module"])
def test_a_control_cpu_the_daemon_may_not_use_stops_it_with_the_value_named(entry: list[str], tmp_path: Path) -> None:
    import subprocess
    import sys

    outside = max(NODE) + 1
    proc = subprocess.run([sys.executable, "-m", *entry, "serve"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DSEC_HOME=str(tmp_path), DSEC_CONTROL_CPUS=f"{CONTROL},{outside}"))
    assert proc.returncode == 1, proc.stderr
    assert f"DSEC_CONTROL_CPUS='{CONTROL},{outside}': CPU {outside} is not one this daemon may run on" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "dsec.sock").exists()


@pytest.mark.parametrize("value", ["0,x", "1-0"])
def test_a_bad_control_cpus_option_is_named_as_the_option(value: str, tmp_path: Path) -> None:
    """Given as ``--control-cpus`` (over an environment that sets none), the error names the option, not the
    variable the user never set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DSEC_CONTROL_CPUS"}
    proc = subprocess.run([sys.executable, "-m", "dsec", "serve", "--control-cpus", value], capture_output=True,
                          text=True, timeout=120, env=dict(env, DSEC_HOME=str(tmp_path)))
    assert proc.returncode == 1, proc.stderr
    assert f"--control-cpus={value!r}: " in proc.stderr and "DSEC_CONTROL_CPUS" not in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "dsec.sock").exists()
