"""``dsec-rtshim`` starting the OCI runtime from the daemon's sealed copy of it (``procs.sealed_executable``)."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from dsec.isolation.binaries import ensure_rtshim
from dsec.isolation.procs import SEALS, sealed_executable

# Only shell builtins look at the stand-in's own /proc entry: an external command would see itself.
_REPORT = ('read c < /proc/$$/comm; echo "comm $c"; read m < /proc/$$/maps; echo "maps $m"; '
           'for f in /proc/$$/fd/*; do echo "fd ${f##*/}"; done; echo "argv $0 $1"')


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def test_the_copy_is_sealed_as_runtimes_expect_and_cannot_be_written(tmp_path: Path) -> None:
    fd = sealed_executable("/bin/sh", "stand-in")
    try:
        # crun and runc skip their own copy only for exactly these seals
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert Path(f"/proc/self/fd/{fd}").read_bytes() == Path("/bin/sh").read_bytes()
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        again = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)  # what /proc/<pid>/exe of a process running it gives
        try:
            with pytest.raises(PermissionError):
                os.write(again, b"x")
        finally:
            os.close(again)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        sealed_executable(str(tmp_path / "missing"), "x")
    script = tmp_path / "wrapper"
    script.write_text("#!/bin/sh\nexec crun \"$@\"\n")
    with pytest.raises(OSError, match="not an ELF binary"):  # it could not run from a close-on-exec fd
        sealed_executable(str(script), "x")


def test_the_shim_runs_the_runtime_from_the_copy_and_passes_the_fd_on_to_nobody(tmp_path: Path) -> None:
    shim = ensure_rtshim(tmp_path / "bin")
    copy = sealed_executable("/bin/sh", "stand-in")
    high = 50  # a number nothing else in the stand-in holds
    os.dup2(copy, high)  # inheritable, as subprocess's pass_fds makes it in the shim
    os.close(copy)
    try:
        errors = tmp_path / "shim.err"
        argv = [str(shim), str(errors), "0", "-", "--", f"/proc/self/fd/{high}", "-c", _REPORT, "zero", "one"]
        out = subprocess.run(argv, capture_output=True, text=True, pass_fds=(high,), timeout=30)
    finally:
        os.close(high)
    assert out.returncode == 0, (out.stderr, errors.read_text() if errors.exists() else "")
    lines = out.stdout.splitlines()
    # named after the copy; before Linux 6.14 execveat(AT_EMPTY_PATH) named a process after the fd's number
    assert ("comm memfd:stand-in" if _kernel() >= (6, 14) else f"comm {high}") in lines, lines
    assert any(line.startswith("maps ") and "/memfd:stand-in" in line for line in lines), lines
    fds = {line.split()[1] for line in lines if line.startswith("fd ")}
    assert {"0", "1", "2"} <= fds and str(high) not in fds, fds
    assert "argv zero one" in lines, lines  # the arguments come through as given


def test_the_shim_names_a_runtime_fd_it_cannot_run(tmp_path: Path) -> None:
    shim = ensure_rtshim(tmp_path / "bin")
    errors = tmp_path / "shim.err"
    out = subprocess.run([str(shim), str(errors), "0", "-", "--", "/proc/self/fd/77", "--version"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 125
    assert errors.read_text().strip() == f"dsec-rtshim: /proc/self/fd/77: {os.strerror(errno.EBADF)}"
