"""Calls of a function sandbox, at the backend: ``sb.call`` forked from the sandbox's Python zygote, each call's
own cgroup and limits, and verdicts that name the limit the call itself hit, whatever its neighbours do."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from container_support import run
from dsec._sdk.calls import EXCERPT_BYTES, client_python, decode_reply, encode_call
from dsec.backends.base import ImageRef
from dsec.backends.function import FunctionBackend
from dsec.errors import CallFailed, InvalidRequest, RemoteError, SandboxError
from dsec.models import CallRequest, CallResult, SandboxRecord
from dsec.testing import sandbox
from function_support import function_backend_fixtures

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024

home, backend = function_backend_fixtures("function-calls-home")


async def raw_call(b: FunctionBackend, sb: SandboxRecord, func: Callable[..., Any], *args: Any,
                   **request: Any) -> CallResult:
    return await b.call(sb, CallRequest(payload=encode_call(func, args, {}), client_python=client_python(),
                                        **{"timeout": 60, **request}))


async def call(b: FunctionBackend, sb: SandboxRecord, func: Callable[..., Any], *args: Any, **request: Any) -> Any:
    return decode_reply(await raw_call(b, sb, func, *args, **request))


async def verdict_of(b: FunctionBackend, sb: SandboxRecord, func: Callable[..., Any], *args: Any,
                     **request: Any) -> str:
    """``ok`` or the limit a call hit (``crashed`` without one), as a grader sees it."""
    try:
        await call(b, sb, func, *args, **request)
    except CallFailed as e:
        return f"limit:{e.detail['limit']}" if e.detail.get("limit") else "crashed"
    except RemoteError:
        return "raised"
    return "ok"


def correct(x: int) -> int:
    import time

    time.sleep(0.3)  # long enough to overlap the bad neighbours
    return x * x


def fork_bomb() -> None:
    import os

    while True:
        os.fork()


def memory_hog() -> None:
    hog = []
    while True:
        hog.append(bytearray(16 << 20))


def tmp_filler() -> None:
    with open("/tmp/fill", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 20))


def flood() -> None:
    while True:
        print("x" * 4096)


def spin() -> None:
    while True:
        pass


def probe(hold: float = 0.0) -> dict[str, Any]:
    import os
    import socket
    import time

    time.sleep(hold)
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return {"pid": os.getpid(), "ppid": os.getppid(), "init": open("/proc/1/cmdline", "rb").read().split(b"\0")[0],
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "host": socket.gethostname(),
            "caps": {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
            "nnp": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
            "securebits": libc.prctl(27, 0, 0, 0, 0), "uid": os.getuid(), "cwd": os.getcwd(),
            "net": os.readlink("/proc/self/ns/net"), "mnt": os.readlink("/proc/self/ns/mnt"),
            "cgroup": open("/proc/self/cgroup").read(), "env_home": os.environ.get("HOME"),
            "sched": os.sched_getscheduler(0)}


async def test_a_call_is_confined_like_an_exec(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        got = await call(backend, sb, probe)
        # pid 1 is the call's own init; the call is pid 2, a child of the zygote outside its namespace
        assert got["pid"] == 2 and got["ppid"] == 0 and got["pids"] == [1, 2], got
        assert got["init"] == b"/.dsec/dsec-callinit", got
        assert all(v == 0 for v in got["caps"].values()), got["caps"]
        assert got["nnp"] == "1" and got["seccomp"] == "2" and got["securebits"] == 0b101111, got
        assert got["host"] == "sandbox" and got["uid"] == 0 and got["cwd"] == "/workspace", got
        assert got["env_home"] == "/tmp" and got["sched"] == os.SCHED_OTHER, got
        # two calls at once: each its own mount namespace and cgroup
        a, b = await asyncio.gather(call(backend, sb, probe, 0.5), call(backend, sb, probe, 0.5))
        assert a["mnt"] != b["mnt"] and a["cgroup"] != b["cgroup"], (a, b)
        r = await run(backend, sb, "readlink /proc/self/ns/net")
        assert r.stdout.decode().strip() == got["net"], "sb.call and exec are in different network namespaces"
        assert sb.id in got["cgroup"] and "/zygote" not in got["cgroup"], got["cgroup"]
        # writes: the workspace and /tmp only; the network: refused
        assert await call(backend, sb, _writes) == {"/workspace/w": True, "/tmp/w": True, "/etc/w": False,
                                                    "/.dsec/w": False, "tcp": False}


def _writes() -> dict[str, bool]:
    import socket

    out = {}
    for path in ("/workspace/w", "/tmp/w", "/etc/w", "/.dsec/w"):
        try:
            with open(path, "w") as f:
                f.write("x")
            out[path] = True
        except OSError:
            out[path] = False
    try:
        socket.create_connection(("127.0.0.1", 22), timeout=2)
        out["tcp"] = True
    except OSError:
        out["tcp"] = False
    return out


async def test_neighbours_never_change_a_verdict(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    """A fork bomb, a memory hog and a /tmp filler run beside correct calls (sb.call and exec): each bad one gets
    the verdict of the limit it hit, every correct one its value."""
    async with sandbox(backend, debian_python_image, pids=64, memory="256Mi") as sb:
        bad = [verdict_of(backend, sb, fork_bomb), verdict_of(backend, sb, memory_hog),
               verdict_of(backend, sb, tmp_filler), verdict_of(backend, sb, flood)]
        good = [call(backend, sb, correct, i) for i in range(6)]
        execs = [run(backend, sb, "sleep 0.3; echo ok") for _ in range(3)]
        results = await asyncio.gather(*bad, *good, *execs)
        assert results[:4] == ["limit:pids", "limit:memory", "limit:disk", "limit:output"], results[:4]
        assert results[4:10] == [i * i for i in range(6)], results[4:10]
        assert [(r.exit_code, r.stdout, r.limit) for r in results[10:]] == [(0, b"ok\n", None)] * 3, results[10:]
        # the same through exec
        r = await run(backend, sb, "head -c 200M /dev/zero > /tmp/big")
        assert r.exit_code != 0 and r.limit == "disk", r
        r = await run(backend, sb, ["python3", "-c", "x = bytearray(200 << 20); print(len(x))"])
        assert r.exit_code == 0 and r.limit is None, "a call does not get its sandbox's memory"


async def test_limits_per_call(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, pids=64, memory="256Mi", disk="256Mi") as sb:
        assert await call(backend, sb, _allocate, 100) == 100
        assert await verdict_of(backend, sb, _allocate, 100, memory=64 * MiB) == "limit:memory"
        assert await verdict_of(backend, sb, _children, 8, pids=4) == "limit:pids"
        assert await call(backend, sb, _children, 8) == 8
        assert await verdict_of(backend, sb, _write_tmp, 16, disk=8 * MiB) == "limit:disk"
        assert await call(backend, sb, _write_tmp, 16) == 16  # /tmp: half of 256 MiB of memory
        for field, value in (("memory", 512 * MiB), ("pids", 65), ("disk", 512 * MiB)):
            with pytest.raises(InvalidRequest, match=f"a call's {field}"):
                await raw_call(backend, sb, _allocate, 1, **{field: value})


def _allocate(mib: int) -> int:
    return len(bytearray(mib << 20)) >> 20


def _children(n: int) -> int:
    import subprocess

    procs = [subprocess.Popen(["sleep", "2"]) for _ in range(n)]
    for p in procs:
        p.wait()
    return len(procs)


def _write_tmp(mib: int) -> int:
    with open("/tmp/data", "wb") as f:
        for _ in range(mib):
            f.write(b"\0" * (1 << 20))
    return mib


async def test_failures_carry_a_bounded_excerpt(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        with pytest.raises(CallFailed) as info:
            await call(backend, sb, _noisy_crash)
        assert info.value.detail["exit_code"] == 3 and info.value.detail.get("limit") is None
        stderr = info.value.detail["stderr"]
        assert len(stderr) <= EXCERPT_BYTES + 100 and "left out" in stderr, len(stderr)
        assert stderr.startswith("line 0 ") and stderr.endswith("the end"), stderr[-200:]
        with pytest.raises(RemoteError) as raised:
            await call(backend, sb, _huge_message)
        assert len(raised.value.message) < 3000 and len(raised.value.remote_traceback) < 9000
        assert await verdict_of(backend, sb, spin, timeout=1.5) == "limit:time"


def _noisy_crash() -> None:
    import os
    import sys

    for i in range(2000):
        print(f"line {i} " + "x" * 60, file=sys.stderr)
    print("the end", file=sys.stderr, flush=True)
    os._exit(3)


def _huge_message() -> None:
    raise ValueError("y" * 1_000_000)


async def test_python_zygote_lifecycle(backend: FunctionBackend, debian_python_image: ImageRef, home: Path) -> None:
    """Started at the first call, restarted after it died (the calls it ran fail as the sandbox's error, never as
    a verdict), drained after a mount change (the next call sees the change); no such interpreter: a clear error
    for call while exec works."""
    async with sandbox(backend, debian_python_image, hidden=["/workspace/tests"]) as sb:
        await backend.write_file(sb, "/workspace/tests/answer", b"42", None)
        assert await verdict_of(backend, sb, _read, "/workspace/tests/answer") == "raised"
        await backend.reveal(sb)
        assert await call(backend, sb, _read, "/workspace/tests/answer") == "42"
        running = asyncio.create_task(call(backend, sb, _sleep, 20.0, timeout=60))
        await asyncio.sleep(1.0)
        killed = _python_zygotes(backend, sb)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(SandboxError, match="Python zygote"):
            await running
        # a request sent before the killed zygote has exited fails too (as the sandbox's error): wait for it
        while any(Path(f"/proc/{pid}").exists() for pid in killed):
            await asyncio.sleep(0.05)
        assert await call(backend, sb, correct, 4) == 16
        with pytest.raises(InvalidRequest, match=r"needs Python in the sandbox's image.*no-such-python"):
            await raw_call(backend, sb, correct, 1, python="no-such-python")
        r = await run(backend, sb, "echo exec works")
        assert r.stdout == b"exec works\n", r


def _sleep(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _python_zygotes(b: FunctionBackend, sb: SandboxRecord) -> list[int]:
    zygote = b._zygotes[sb.id].pid
    found = []
    for launcher in Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split():
        found += [int(p) for p in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]
    assert found, "no Python zygote running"
    return found
