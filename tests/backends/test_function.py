"""The function backend (zygote + clone per call) against the conformance suite, plus what only it has:
per-call namespaces and restrictions, verdicts with CPU time and peak memory, cleanup and recovery."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from pathlib import Path

import pytest

from container_support import images_dir, run
from dsec.backends.base import ImageRef
from dsec.backends.function import FunctionBackend
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest
from dsec.isolation import zygote as zygote_module
from dsec.models import SandboxRecord
from dsec.testing import CHECKS, new_record, sandbox
from dsec.testing.conformance import Check
from function_support import fn_leftovers, function_backend_fixtures

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024


def _has_cap(number: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> number & 1)
    return False


home, backend = function_backend_fixtures("function-home")


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_function_conforms(check: Check, backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    await asyncio.wait_for(check(backend, debian_python_image), 120)


async def test_each_call_has_fresh_namespaces_and_no_privileges(backend: FunctionBackend,
                                                                debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb, sandbox(backend, debian_python_image) as other:
        probe = ("readlink /proc/self/ns/pid /proc/self/ns/net /proc/self/ns/ipc /proc/self/ns/uts "
                 "/proc/self/ns/mnt /proc/self/ns/user; echo $$; grep -E '^(Cap|NoNewPrivs|Seccomp:)' "
                 "/proc/self/status; cat /proc/self/uid_map; ls /proc | grep -c '^[0-9]'; "
                 "grep -E ':(memory|pids):|^0::' /proc/self/cgroup | sort | tr '\\n' ' '; echo; sleep 1")
        # both alive at once: a freed namespace's inode number may be reused by the next one
        a, b = await asyncio.gather(run(backend, sb, probe), run(backend, sb, probe))
        assert a.exit_code == 0 and b.exit_code == 0, (a, b)
        la, lb = a.stdout.decode().splitlines(), b.stdout.decode().splitlines()
        for kind in ("pid", "ipc", "uts", "mnt"):
            index = ("pid", "net", "ipc", "uts", "mnt").index(kind)
            assert la[index] != lb[index], f"two calls shared a {kind} namespace: {la[index]}"
        # The sandbox's one network namespace (loopback only, down) is every call's; another sandbox has its own.
        assert la[1] == lb[1], "calls of one sandbox are in different network namespaces"
        c = await run(backend, other, probe)
        assert c.stdout.decode().splitlines()[1] != la[1], "two sandboxes share a network namespace"
        assert la[5] == lb[5], "calls of one sandbox share its user namespace"
        host_ns = {Path(f"/proc/self/ns/{k}").readlink().as_posix() for k in ("pid", "net", "user", "mnt")}
        assert not host_ns & set(la[:6]), "a call runs in a host namespace"
        status = dict(line.split(":\t", 1) for line in la[7:14] if ":\t" in line)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[cap], 16) == 0, f"{cap} = {status[cap]}"
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
        uid_map = la[-3].split()
        assert uid_map[0] == "0" and int(uid_map[1]) == backend.settings.uid_shift, la[-3]
        assert int(la[-2]) <= 4, f"a call sees other processes (pid 1, sh, ls, grep): {a.stdout!r}"
        assert la[6] == "2", "the command is not the second process of its own pid namespace"
        # each call in a cgroup of its own (memory and pids), below the sandbox's
        assert la[-1] != lb[-1] and sb.id in la[-1], (la[-1], lb[-1])


async def test_call_is_normally_scheduled_with_locked_securebits(backend: FunctionBackend,
                                                                  debian_python_image: ImageRef) -> None:
    """The zygote runs SCHED_BATCH and drops the bounding set and securebits once for all calls: every
    command must still run SCHED_OTHER at nice 0 and inherit the locked securebits."""
    probe = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), libc.prctl(27, 0, 0, 0, 0))")
    async with sandbox(backend, debian_python_image) as sb:
        for _ in range(2):  # the call cloned at start and one cloned ahead while another ran
            r = await run(backend, sb, f'python3 -c "{probe}"')
            assert r.exit_code == 0, r
            policy, nice, securebits = (int(v) for v in r.stdout.split())
            assert (policy, nice) == (os.SCHED_OTHER, 0), r.stdout
            # NOROOT, NO_SETUID_FIXUP (each locked) and KEEP_CAPS_LOCKED (keep-caps off)
            assert securebits == 0b101111, bin(securebits)
        # Against the node's own processes the calls yield as a group: the sandboxes' cgroup is SCHED_IDLE
        # (cgroups.background_group) while each process keeps SCHED_OTHER (kernels before 5.15: no cpu.idle).
        cpu_dir = next((Path(d) for name, d in sb.backend_state["cgroups"].items() if "cpu" in name.split(",")
                        or name == "unified"), None)
        assert cpu_dir is not None, sb.backend_state["cgroups"]
        if (cpu_dir.parent / "cpu.idle").exists():
            assert int((cpu_dir.parent / "cpu.idle").read_text()) == int(backend.settings.sandbox_cpu_idle)


async def test_daemon_under_another_policy_passes_it_on(backend: FunctionBackend,
                                                       debian_python_image: ImageRef) -> None:
    """A daemon run under SCHED_IDLE (``chrt -i``): the zygote cannot leave that policy without
    CAP_SYS_NICE, so it must not try to, and its calls run (under SCHED_IDLE) rather than fail."""
    def set_policy(policy: int) -> None:  # every thread: the zygote is spawned from a worker thread
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))

    set_policy(os.SCHED_IDLE)
    try:
        context = sandbox(backend, debian_python_image)
        sb = await context.__aenter__()  # the zygote is spawned here, inheriting SCHED_IDLE
    finally:
        set_policy(os.SCHED_OTHER)
    try:
        r = await run(backend, sb, 'python3 -c "import os; print(os.sched_getscheduler(0))"')
        assert r.exit_code == 0, r
        assert int(r.stdout) == os.SCHED_IDLE, r.stdout
    finally:
        await context.__aexit__(None, None, None)


async def test_root_read_only_writes_only_workspace_and_tmp(backend: FunctionBackend,
                                                            debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        for target in ("/etc/passwd", "/usr/bin/python3", "/new-file", "/.dsec/loader.py", "/dev/evil"):
            r = await run(backend, sb, f"echo pwned >> {target}")
            assert r.exit_code != 0, f"wrote {target}: {r}"
        r = await run(backend, sb, "echo ok > /tmp/t && cat /tmp/t && echo ws > /workspace/w && cat w "
                                   "&& echo dn > /dev/null && echo fine")
        assert r.stdout == b"ok\nws\nfine\n", r
        r = await run(backend, sb, "ls /tmp; cat /workspace/w")
        assert r.stdout == b"ws\n", f"/tmp survived its call: {r}"
        # Landlock refuses even where the mount alone would allow: a workspace symlink does not help
        r = await run(backend, sb, "mkdir -p /proc/self/x 2>&1; python3 -c \"import os; "
                                   "os.mkfifo('/dev/shm-fifo')\" 2>&1 | tail -1")
        assert r.exit_code != 0 or b"Error" in r.stdout, r


async def test_call_devices_and_oom_score(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    """/dev is one read-only mount of the kernel's device nodes (made once by the zygote, not a bind mount
    each, which every call would copy), and each command is the OOM killer's first choice (500), never the
    zygote's shield, whatever the host let the zygote set for itself."""
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, "cat /proc/self/oom_score_adj; stat -c '%n %F %t:%T' /dev/null /dev/zero "
                                   "/dev/full /dev/random /dev/urandom /dev/tty; grep -c ' /dev' /proc/self/mounts; "
                                   "head -c 8 /dev/urandom | wc -c; echo x > /dev/null && echo written")
        assert r.exit_code == 0, r
        lines = r.stdout.decode().splitlines()
        assert lines[0] == "500", lines
        assert lines[1:7] == ["/dev/null character special file 1:3", "/dev/zero character special file 1:5",
                              "/dev/full character special file 1:7", "/dev/random character special file 1:8",
                              "/dev/urandom character special file 1:9", "/dev/tty character special file 5:0"]
        assert lines[7:] == ["1", "8", "written"], lines


async def test_network_socket_fails(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        async with sandbox(backend, debian_python_image) as sb:
            code = ("import socket\n"
                    f"for addr in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
                    "    s = socket.socket(socket.AF_INET)\n"
                    "    s.settimeout(2)\n"
                    "    try:\n"
                    "        s.connect(addr); print('connected', addr)\n"
                    "    except OSError as e:\n"
                    "        print('refused', type(e).__name__)\n")
            r = await run(backend, sb, ["python3", "-c", code])
            assert r.exit_code == 0 and b"connected" not in r.stdout, r
            assert r.stdout.count(b"refused") == 2, r
            r = await run(backend, sb, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
            assert r.stdout.split() == [b"lo"], f"a call has network interfaces: {r.stdout!r}"
    finally:
        server.close()


async def test_infinite_loop_gets_time_verdict(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, ["python3", "-c", "while True: pass"], timeout=1.5)
        assert r.limit == "time" and r.timed_out and r.signal == 9, r
        assert r.cpu_s is None or r.cpu_s >= 0, r  # killed from outside: no usage report
        r = await run(backend, sb, "echo alive")
        assert r.stdout == b"alive\n"


async def test_cpu_rlimit_scales_with_the_cpu_limit(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    """RLIMIT_CPU, the timeout's backstop, counts every thread of a process: a call using both of its 2 CPUs must
    run until its wall-clock timeout (SIGKILL), not get SIGXCPU at ~3/4 of it (it allowed timeout + 1 s of CPU)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    burn = ("import threading, zlib\n"  # zlib releases the GIL: two threads burn two CPUs
            "data = bytes(range(256)) * 4096\n"
            "def burn():\n"
            "    while True: zlib.compress(data, 9)\n"
            "for _ in range(2): threading.Thread(target=burn, daemon=True).start()\n"
            "print('burning', flush=True)\n"
            "threading.Event().wait()\n")
    async with sandbox(backend, debian_python_image, cpu=2) as sb:
        r = await run(backend, sb, ["python3", "-c", burn], timeout=4)
        assert r.stdout == b"burning\n", r
        assert r.limit == "time" and r.timed_out and r.signal == 9, r


async def test_memory_bomb_gets_memory_verdict(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, memory="128Mi") as sb:
        r = await run(backend, sb, ["python3", "-c", "x = []\nwhile True: x.append(bytearray(8 << 20))"],
                      timeout=60)
        assert r.limit == "memory" and r.exit_code != 0, r
        zygote = backend._zygotes[sb.id].pid
        shielded = Path(f"/proc/{zygote}/oom_score_adj").read_text().strip()
        # -1000 needs CAP_SYS_RESOURCE, which some hosts (this CI's VMs) withhold even from root
        assert shielded == ("-1000" if _has_cap(24) else "0"), shielded
        r = await run(backend, sb, "echo -1000 > /proc/self/oom_score_adj")
        assert r.exit_code != 0, f"a call can shield itself from the OOM killer: {r}"
        r = await run(backend, sb, ["python3", "-c", "x = bytearray(48 << 20); print(len(x))"])
        assert r.exit_code == 0 and r.limit is None, r
        assert r.memory_peak_bytes is not None and r.memory_peak_bytes >= 48 * MiB, r
        assert r.cpu_s is not None and r.cpu_s > 0, r


async def test_memory_bomb_run_by_a_shell_gets_memory_verdict(backend: FunctionBackend,
                                                              debian_python_image: ImageRef) -> None:
    """A string command runs under ``sh -c``, which forks its last command: the bomb's SIGKILL reaches the
    caller as exit code 137 with no signal, and the verdict must still name the memory limit."""
    async with sandbox(backend, debian_python_image, memory="128Mi") as sb:
        r = await run(backend, sb, "python3 -c 'x = bytearray(512 << 20)'; exit $?", timeout=60)
        assert r.limit == "memory" and r.exit_code == 137 and r.signal is None, r
        r = await run(backend, sb, "exit 137")
        assert r.exit_code == 137 and r.limit is None, r


async def test_fork_bomb_gets_pids_verdict(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, pids=64) as sb:
        # at rest the sandbox holds only the zygote, its launcher and the call cloned ahead (a finished call
        # counts until the zygote reaps it, and the first clone ahead may still be under way at start)
        at_rest = 3
        bomb = "import os\nwhile True:\n    os.fork()\n"
        r = await run(backend, sb, ["python3", "-c", bomb], timeout=20)
        assert r.exit_code != 0 and r.limit in ("pids", "time"), r
        # the bomb's processes die with its pid namespace (the kernel reaps them right after the call's pid 1
        # reported)
        async def settled() -> bool:
            return (await backend.stats(sb)).pids <= at_rest

        deadline = asyncio.get_running_loop().time() + 10
        while not await settled() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stats = await backend.stats(sb)
        assert stats.pids <= at_rest, f"the fork bomb outlived its call: {stats}"
        r = await run(backend, sb, "echo alive")
        assert r.stdout == b"alive\n"
        r = await run(backend, sb, "for i in $(seq 80); do sleep 5 & done; wait", timeout=20)
        assert r.limit == "pids" and r.exit_code != 0, r


async def test_cpu_time_is_measured(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, ["python3", "-c", "import time\nt = time.process_time()\n"
                                    "while time.process_time() - t < 0.3: pass"])
        assert r.exit_code == 0 and r.cpu_s is not None and r.cpu_s >= 0.3, r


async def test_concurrent_calls_are_isolated(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        results = await asyncio.gather(*(
            run(backend, sb, f"echo {i} > /tmp/mine; sleep 0.3; cat /tmp/mine; ls /tmp | wc -l")
            for i in range(16)))
        for i, r in enumerate(results):
            assert r.stdout == f"{i}\n1\n".encode(), (i, r)


async def test_destroy_while_call_runs(backend: FunctionBackend, debian_python_image: ImageRef,
                                       home: Path) -> None:
    record = new_record(backend.name, debian_python_image)
    await backend.create(record, debian_python_image)
    task = asyncio.create_task(run(backend, record, "echo started; sleep 60", timeout=90))
    await asyncio.sleep(0.5)
    await backend.destroy(record)
    with pytest.raises(DSecError, match=r"the sandbox's zygote .*went away while running '/bin/sh'"):
        await asyncio.wait_for(task, 20)
    assert not any(fn_leftovers(home).values()), fn_leftovers(home)


async def test_recover_restarts_zygote_keeps_workspace(backend: FunctionBackend, debian_python_image: ImageRef,
                                                       home: Path) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        await backend.write_file(sb, "/workspace/keep", b"kept", None)
        restarted = FunctionBackend(Settings(home=home, images_dir=images_dir()))
        await restarted.start()
        try:
            copy = SandboxRecord.model_validate_json(sb.model_dump_json())
            await backend.aclose()  # the old daemon goes away: its zygotes die with their sockets
            assert await restarted.recover(copy) is True
            r = await run(restarted, copy, "cat keep")
            assert r.stdout == b"kept", r
            await restarted.destroy(copy)
        finally:
            await restarted.aclose()
    assert not any(fn_leftovers(home).values()), fn_leftovers(home)


async def test_cleanup_orphans_spares_known(backend: FunctionBackend, debian_python_image: ImageRef,
                                            home: Path) -> None:
    orphan = new_record(backend.name, debian_python_image)
    await backend.create(orphan, debian_python_image)
    backend._zygotes.pop(orphan.id).close()  # as if created by a daemon that died
    async with sandbox(backend, debian_python_image) as kept:
        assert await backend.cleanup_orphans({kept.id}) == [orphan.id]
        assert not Path(orphan.backend_state["base"]).exists()
        r = await run(backend, kept, "echo still here")
        assert r.stdout == b"still here\n"


async def test_bad_workdir_and_network_are_refused(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    with pytest.raises(DSecError, match="network"):
        async with sandbox(backend, debian_python_image, network="allow"):
            pass
    # refused, not silently ignored (protected/hidden paths: tests/integration/security/test_function_disk_and_paths.py)
    with pytest.raises(InvalidRequest, match="landlock=False"):
        async with sandbox(backend, debian_python_image, landlock=False):
            pass
    with pytest.raises(InvalidRequest, match="allow_privilege_escalation=True"):
        async with sandbox(backend, debian_python_image, allow_privilege_escalation=True):
            pass
    async with sandbox(backend, debian_python_image) as sb:
        # every call already runs on the untouched read-only image: pristine is accepted and changes nothing
        r = await run(backend, sb, "touch /usr/bin/x 2>&1; echo ok", pristine=True)
        assert r.stdout.endswith(b"ok\n") and b"Read-only" in r.stdout, r
        with pytest.raises(DSecError, match="working directory"):
            await run(backend, sb, "pwd", cwd="/no/such/dir")
        r = await run(backend, sb, ["/no/such/binary"])
        assert r.exit_code == 127 and b"cannot execute" in r.stderr, r
        with pytest.raises(DSecError, match="Linux's exec takes at most 131071 per string"):
            await run(backend, sb, ["echo", "x" * (256 * 1024)])
        r = await run(backend, sb, "echo still fine")
        assert r.stdout == b"still fine\n", r


async def test_kernel_attack_surface_is_closed(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    """The container's seccomp profile holds in a call: no new user namespace, no mount, no ptrace, no
    io_uring; the host's processes and the zygote are invisible."""
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def errno_of(ret):\n"
        "    return 0 if ret == 0 else ctypes.get_errno()\n"
        "print('unshare_user', errno_of(libc.unshare(0x10000000)))\n"
        "print('mount', errno_of(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))\n"
        "print('ptrace', errno_of(libc.ptrace(16, 1, None, None)))\n"
        "print('io_uring', errno_of(libc.syscall(425, 1, None)))\n"
        "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, ["python3", "-c", probe])
        assert r.exit_code == 0, r
        got = dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())
        assert got["unshare_user"] == "1" and got["mount"] == "1" and got["ptrace"] == "1", got  # EPERM
        assert got["io_uring"] == "1", got
        assert got["pids"] == "[1, 2]", f"a call sees processes beyond its own pid 1 and itself: {got}"


@pytest.mark.parametrize("grace", [2.0, 0.0], ids=["zygote-reaps", "killed-at-once"])
async def test_destroy_leaves_no_zombie_to_the_daemon(backend: FunctionBackend, debian_python_image: ImageRef,
                                                      grace: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon is a child subreaper once the container backend runs: the zygote's children (the call it
    cloned ahead, calls still running) are handed to it when the zygote dies. Destroy must reap them: each
    left a zombie of the daemon for good (a pid, a dying memory cgroup), one per destroyed sandbox at least.
    Normally the zygote reaps its calls itself; one that does not exit in time is killed, and then the daemon
    reaps what it inherits (``killed-at-once``)."""
    monkeypatch.setattr(zygote_module, "_EXIT_GRACE_S", grace)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER, as ContainerBackend.start sets it
    before = _zombie_children()
    async with sandbox(backend, debian_python_image) as sb:
        busy = asyncio.create_task(run(backend, sb, ["sleep", "300"]))
        r = await run(backend, sb, ["true"])
        assert r.exit_code == 0, r
    with contextlib.suppress(DSecError):
        await asyncio.wait_for(busy, 30)
    await asyncio.sleep(0.5)
    assert _zombie_children() - before == set()


def _zombie_children() -> set[str]:
    me = str(os.getpid())
    found = set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z" and fields[1] == me:
                found.add(proc.name)
    return found
