"""The exec helper binary (``dsec-nsexec``, ``isolation/nsexec.c``) on its own: started as the container backend
starts it, fed requests over its socketpair, with a stand-in for ``dsec-nsenter`` that reports what it got
(argv, environment, fds, session) and this test process as the sandbox's "init" (its own pid namespace).

What reaches a command through a real sandbox is the container backend's tests; these pin the helper's own
contract: the field layout, the fds 0-5 and nothing else, the pid and exit reports, and that no malformed
request, missing binary or vanished sandbox takes it down."""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.isolation.binaries import ensure_nsexec
from dsec.isolation.exec_client import MAX_MESSAGE, encode_request

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the helper joins pid namespaces: root only")

# The stand-in for dsec-nsenter: what it was given, as JSON on stderr, then it exits with the number it was told.
# Its environment comes from /proc/self/environ: os.environ gains LC_CTYPE from Python's locale coercion.
FAKE_NSENTER = r"""#!/usr/bin/python3 -I
import json, os, sys
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
links = {}
for fd in range(6):
    try:
        links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the listing's own fd, closed again
        pass
env = dict(e.split("=", 1) for e in open("/proc/self/environ").read().split("\0") if e)
print(json.dumps({"argv": sys.argv[1:], "env": env, "fds": fds, "links": links,
                  "sid": os.getsid(0) == os.getpid(), "pidns": os.readlink("/proc/self/ns/pid")}),
      file=sys.stderr, flush=True)
if "SLEEP" in env:
    import time; time.sleep(float(env["SLEEP"]))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


class Helper:
    def __init__(self, binary: Path, nsenter: Path, bpf: bytes = b"\x06\x00\x00\x00\x00\x00\xff\x7f") -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([str(binary), str(theirs.fileno()), str(nsenter), "3"], stdin=subprocess.PIPE,
                                     stderr=subprocess.PIPE, pass_fds=(theirs.fileno(),))
        theirs.close()
        assert self.proc.stdin is not None
        self.proc.stdin.write(bpf)
        self.proc.stdin.close()
        self.sock = ours

    def send(self, message: bytes, nfds: int = 4) -> dict[str, int]:
        """Send ``message`` with ``nfds`` pipe ends (stdin, stdout, stderr, status...); returns our ends."""
        pipes = [os.pipe() for _ in range(nfds)]
        theirs = [r if i == 0 else w for i, (r, w) in enumerate(pipes)]
        ours = {name: (w if i == 0 else r) for i, (name, (r, w)) in enumerate(zip(
            ["stdin", "stdout", "stderr", "status", "extra1", "extra2"], pipes, strict=False))}
        self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs).tobytes())])
        for fd in theirs:
            os.close(fd)
        return ours

    def close(self) -> int:
        self.sock.close()
        code = self.proc.wait(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return code


def read_all(fd: int, timeout: float = 10.0) -> bytes:
    """Everything written to pipe ``fd`` until every writer closed it."""
    out = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(end - time.monotonic(), 0))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"pipe still open after {timeout} s: {out!r}")


def request(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {"init_pid": os.getpid(), "uid": 1000, "gid": 1001, "capmask": 0xA80425FB,
                               "nofile": 4096, "landlock": True, "pristine": False, "cwd": "/work dir",
                               "cgroup_procs": ["/sys/fs/cgroup/a/cgroup.procs", "/sys/fs/cgroup/b/cgroup.procs"],
                               "argv": ["/bin/echo", "two words", ""], "env": {"PATH": "/bin", "EXIT": "3"}}
    base.update(changes)
    return base


def stand_in(directory: Path) -> Path:
    """``FAKE_NSENTER`` as an executable in ``directory``."""
    nsenter = directory / "fake-nsenter"
    nsenter.write_text(FAKE_NSENTER)
    nsenter.chmod(0o755)
    return nsenter


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_nsexec(tmp_path_factory.mktemp("bin"))


@pytest.fixture
def helper(binary: Path, tmp_path: Path) -> Iterator[Helper]:
    running = Helper(binary, stand_in(tmp_path))
    try:
        yield running
    finally:
        if running.proc.poll() is None:
            assert running.close() == 0


def test_a_command_gets_its_fields_fds_and_session_and_its_exit_is_reported(helper: Helper) -> None:
    ends = helper.send(encode_request(request()))
    os.close(ends["stdin"])
    seen = json.loads(read_all(ends["stderr"]))
    status = read_all(ends["status"]).decode().splitlines()
    assert read_all(ends["stdout"]) == b""
    assert seen["argv"] == ["1000", "1001", "a80425fb", "4096", "1", "3", "/work dir",
                            "/sys/fs/cgroup/a/cgroup.procs", "/sys/fs/cgroup/b/cgroup.procs",
                            "--", "/bin/echo", "two words", ""]
    assert seen["env"] == {"PATH": "/bin", "EXIT": "3"}
    # 0-2 the command's pipes, 3 the status pipe, 4 a pidfd of the init, 5 the sealed seccomp program; no other
    # fd of the helper (its socket, other commands' pipes) reaches the sandbox.
    assert seen["fds"][:6] == [0, 1, 2, 3, 4, 5] and len(seen["fds"]) == 7, seen["fds"]  # + the listing's own
    assert seen["links"]["4"] == "anon_inode:[pidfd]" and "memfd:dsec-seccomp" in seen["links"]["5"]
    assert seen["sid"], "the command leads a session of its own (killpg reaches all it starts)"
    assert status[0].startswith("pid ") and status[1:] == [f"exit {3 << 8}"], status
    os.close(ends["stdout"]), os.close(ends["stderr"]), os.close(ends["status"])


def test_pristine_and_no_landlock_flags_and_an_empty_environment(helper: Helper) -> None:
    ends = helper.send(encode_request(request(landlock=False, pristine=True, env={}, cgroup_procs=[],
                                              argv=["/bin/true"])))
    seen = json.loads(read_all(ends["stderr"]))
    assert seen["argv"] == ["1000", "1001", "a80425fb", "4096", "2", "3", "/work dir", "--", "/bin/true"]
    assert seen["env"] == {} and read_all(ends["status"]).decode().splitlines()[1] == "exit 0"


@pytest.mark.parametrize(("message", "expected"), [
    (b"1\x002\x00", "error request: malformed (2 fields)"),
    (b"no terminating NUL", "error request: not NUL-terminated"),
    (b"", "error request: not NUL-terminated"),  # with its fds: a request, not the daemon hanging up
    # The counts must add up: two cgroups announced, one given.
    (b"1\x000\x000\x000\x001024\x001\x00/\x002\x00/cg\x001\x00/bin/true\x000\x00", "error request: malformed"),
    (b"-5\x000\x000\x000\x001024\x001\x00/\x000\x001\x00/bin/true\x000\x00", "error request: malformed"),
])
def test_a_malformed_request_is_answered_and_the_helper_serves_on(helper: Helper, message: bytes,
                                                                   expected: str) -> None:
    ends = helper.send(message)
    assert read_all(ends["status"]).decode().startswith(expected)
    ends = helper.send(encode_request(request(env={"EXIT": "0"})))
    assert read_all(ends["status"]).decode().splitlines()[1] == "exit 0"


def test_a_request_without_its_four_fds_is_dropped_and_the_next_is_served(helper: Helper) -> None:
    ends = helper.send(encode_request(request()), nfds=2)
    assert read_all(ends["stdout"]) == b""  # closed unanswered: the helper kept none of them
    ends = helper.send(encode_request(request(env={"EXIT": "0"})))
    assert read_all(ends["status"]).decode().splitlines()[1] == "exit 0"


def test_a_vanished_sandbox_or_a_missing_nsenter_is_named(binary: Path, helper: Helper, tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    ends = helper.send(encode_request(request(init_pid=gone.pid)))
    assert read_all(ends["status"]).decode().startswith(f"error open sandbox init {gone.pid}: No such process")
    missing = Helper(binary, tmp_path / "no-such-nsenter")
    try:
        ends = missing.send(encode_request(request()))
        assert read_all(ends["status"]).decode() == (f"error spawn {tmp_path / 'no-such-nsenter'}: "
                                                     "No such file or directory\n")
    finally:
        assert missing.close() == 0


def test_an_oversized_request_is_answered(helper: Helper) -> None:
    helper.sock.setsockopt(socket.SOL_SOCKET, 32, 4 * MAX_MESSAGE)  # SO_SNDBUFFORCE: root
    ends = helper.send(encode_request(request(env={"BIG": "x" * MAX_MESSAGE})))
    assert read_all(ends["status"]).decode() == f"error request: the request is larger than {MAX_MESSAGE} bytes\n"


def test_the_helper_reaps_its_commands_and_exits_when_the_daemon_hangs_up(helper: Helper) -> None:
    """A stopping daemon kills the commands it cut off and closes its end: the helper waits for them (up to
    2 s), reports each exit and is gone, leaving no zombie to whatever inherits it."""
    ends = helper.send(encode_request(request(env={"SLEEP": "60"})))
    pid = int(os.read(ends["status"], 100).decode().split()[1])
    assert b"argv" in os.read(ends["stderr"], 65536)  # started, and sleeping now
    helper.sock.close()  # hung up first: the command is reaped in the helper's last 2 s, not its main loop
    time.sleep(0.3)
    assert helper.proc.poll() is None, "the helper waits for its running command"
    os.killpg(pid, signal.SIGKILL)
    assert helper.close() == 0
    assert read_all(ends["status"]).decode() == f"exit {signal.SIGKILL}\n"  # reported after its waitpid


def test_commands_are_born_in_their_sandbox_pid_namespace(helper: Helper) -> None:
    sandbox = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    try:
        inner = _wait_for_child(sandbox.pid)
        ends = helper.send(encode_request(request(init_pid=inner, env={})))
        seen = json.loads(read_all(ends["stderr"]))
        assert seen["pidns"] == os.readlink(f"/proc/{inner}/ns/pid") != os.readlink("/proc/self/ns/pid")
        ends = helper.send(encode_request(request(env={})))  # the next command, for a sandbox in our namespace
        assert json.loads(read_all(ends["stderr"]))["pidns"] == os.readlink("/proc/self/ns/pid")
    finally:
        sandbox.kill()
        sandbox.wait()


def test_without_a_seccomp_program_fd_5_is_absent(binary: Path, tmp_path: Path) -> None:
    bare = Helper(binary, stand_in(tmp_path), bpf=b"")
    try:
        ends = bare.send(encode_request(request(env={})))
        seen = json.loads(read_all(ends["stderr"]))
        assert seen["fds"][:5] == [0, 1, 2, 3, 4] and len(seen["fds"]) == 6, seen  # + the listing's own
        assert "5" not in seen["links"], seen
    finally:
        assert bare.close() == 0


def _wait_for_child(parent: int, timeout: float = 10.0) -> int:
    """The first child of ``parent`` once it has exec'd (``unshare --fork``'s pid 1 of the new namespace)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        if children and Path(f"/proc/{children[0]}/exe").resolve().name == "sleep":
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError(f"unshare {parent} started no sleep")


def test_encode_request_refuses_what_the_fields_cannot_carry() -> None:
    from dsec.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="a NUL byte in 'a\\\\x00b'"):
        encode_request(request(argv=["a\0b"]))
    with pytest.raises(InvalidRequest, match="environment names"):
        encode_request(request(env={"A=B": "c"}))
    assert encode_request(request(cwd="/caf\udce9")).split(b"\0")[6] == b"/caf\xe9"  # undecodable bytes survive


def test_a_command_of_many_short_arguments_is_started(helper: Helper) -> None:
    """70,000 one-letter arguments (140 KB: within what execve takes) are as many fields: all reach nsenter."""
    helper.sock.setsockopt(socket.SOL_SOCKET, 32, 4 * MAX_MESSAGE)  # SO_SNDBUFFORCE, as the daemon does past 128 KiB
    ends = helper.send(encode_request(request(argv=["/bin/true", *["a"] * 70_000], env={})))
    seen = json.loads(read_all(ends["stderr"]))
    assert len(seen["argv"]) == 7 + 2 + 1 + 70_001 and seen["argv"][-1] == "a"  # fields, cgroups, --, command
