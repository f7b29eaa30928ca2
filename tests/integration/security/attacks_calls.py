"""Calls of one function sandbox against each other: a later call must not observe an earlier one.

A function sandbox keeps one network namespace for all its calls (loopback only, down); every call still has
its own pid, mount, ipc and uts namespaces, cgroup, seccomp filter and process tree. What two calls of one
sandbox can still share is the workspace (by design) and, through the shared network namespace, the name
space of abstract unix sockets while both are alive: a later call can bind a name an earlier one bound only
once that one is gone, and on Landlock ABI 6 and later it cannot connect to another call's socket at all.
These attacks run each probe both as ``exec`` (the zygote's calls) and as ``sb.call`` (the Python zygote's).
Other backends keep processes and files between execs by design: they do not apply.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

from redteam import Target, attack, probe

from dsec._sdk.calls import client_python, decode_reply, encode_call
from dsec.isolation.landlock import landlock_abi
from dsec.models import CallRequest

_PERSIST = "processes, files and sockets persist between execs in this backend's sandboxes by design"
_ONLY_FUNCTION = {"container": _PERSIST, "microvm": _PERSIST, "vm": _PERSIST}
_NAME = "dsec-redteam-abstract"


async def call(t: Target, func: Callable[..., Any], *args: Any, timeout: float = 60) -> Any:
    """``sb.call`` through the backend: the function runs in a process forked from the sandbox's Python zygote."""
    out = await t.backend.call(t.sb, CallRequest(payload=encode_call(func, args, {}), client_python=client_python(),
                                                 timeout=timeout))
    return decode_reply(out)


_SHM_KEY = 0x5EC2E7


def _shm(create: bool) -> int:
    """A System V shared memory segment of a fixed key: made (``create``) or looked up; 0 or the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.shmget(_SHM_KEY, 4096, 0o1600 if create else 0)  # IPC_CREAT | 0600
    return 0 if ret >= 0 else ctypes.get_errno()


def _leave_behind(tag: str) -> dict[str, Any]:
    """An earlier call: start a process that would live on, write outside the workspace, make an IPC object."""
    import os
    import subprocess

    subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(f"/tmp/{tag}", "w") as f:
        f.write("secret")
    return {"pid": os.getpid(), "shm": _shm(create=True)}


def _look_around(tag: str) -> dict[str, Any]:
    """A later call: what of the earlier one can it see?"""
    import os

    procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    procs.append(f.read().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return {"procs": procs, "tmp": os.path.exists(f"/tmp/{tag}"), "shm": _shm(create=False),
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}


@attack("fn-call-leaves-traces", description="one call leaves a process running, a file in /tmp and a shared memory "
                                             "object; the next call of the same sandbox looks for them",
        models="cross-call leaks: a candidate influencing or reading the next candidate's run",
        defence="function: each call has its own pid namespace (its processes die with it), its own /tmp "
                "(a tmpfs of its own mount namespace) and its own ipc namespace",
        not_applicable=_ONLY_FUNCTION, fresh=True)
async def fn_call_leaves_traces(t: Target) -> None:
    r = await t.sh("(sleep 300 &) ; echo secret > /tmp/exec-trace; echo $$", timeout=30)
    assert r.exit_code == 0, r
    made = await call(t, _leave_behind, "call-trace")
    assert made["pid"] == 2 and made["shm"] == 0, f"the earlier call did not run as expected: {made}"
    seen_exec = await probe(t, 'print(json.dumps({"pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), '
                               '"tmp": os.listdir("/tmp")}))')
    assert seen_exec == {"pids": [1, 2], "tmp": []}, f"a later exec sees the earlier calls: {seen_exec}"
    for tag in ("exec-trace", "call-trace"):
        seen = await call(t, _look_around, tag)
        assert not seen["tmp"], f"a later call found {tag} in /tmp: {seen}"
        assert seen["shm"] == errno.ENOENT, f"a later call found the earlier call's shared memory: {seen}"
        assert seen["pids"] == [1, 2], f"a later call sees other processes: {seen}"
        assert not any("sleep" in p for p in seen["procs"]), seen


@attack("fn-call-sees-running-call", description="while one call runs (a sleeper with a secret on its command line), "
                                                 "another call of the same sandbox lists processes and signals pids",
        models="cross-call observation: reading or killing a concurrent candidate",
        defence="function: each call is the init of its own pid namespace (pids 1 and 2 are its own; nothing else is "
                "visible or reachable by kill), and Landlock scopes signals to the call",
        not_applicable=_ONLY_FUNCTION, fresh=True)
async def fn_call_sees_running_call(t: Target) -> None:
    running = asyncio.create_task(t.sh("sleep 20 # dsec-secret-argv", timeout=60))
    try:
        await asyncio.sleep(1.0)
        res = await probe(t, r"""
procs = [open(f"/proc/{p}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()]
killed = {pid: try_os(os.kill, pid, 0) for pid in range(3, 400)}
secret = b"dsec-secret" + b"-argv"  # not spelled out: this probe's own command line must not match
print(json.dumps({"secret": any(secret in p for p in procs),
                  "reachable": sorted(p for p, e in killed.items() if e == 0)}))
""")
        assert not res["secret"], "a call read another call's command line"
        assert res["reachable"] == [], f"a call can signal pids beyond its own: {res}"
        assert not running.done(), "the running call was disturbed"
    finally:
        running.cancel()


def _bind_abstract(name: str, hold: float) -> str:
    import socket
    import time

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0" + name)
        s.listen(1)
    except OSError as e:
        return f"bind: {e.errno}"
    time.sleep(hold)
    return "bound"


def _connect_abstract(name: str) -> dict[str, int]:
    import socket

    out = {}
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect("\0" + name)
        out["connect"] = 0
    except OSError as e:
        out["connect"] = e.errno or -1
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0" + name)
        out["bind"] = 0
    except OSError as e:
        out["bind"] = e.errno or -1
    return out


@attack("fn-call-abstract-socket", description="one call binds an abstract unix socket; another call connects to it "
                                               "while the first lives, and after it ended",
        models="cross-call channel through the sandbox's shared network namespace",
        defence="function: the shared network namespace shares abstract socket names while both calls live (a bind "
                "of the same name fails), Landlock's scope (ABI 6+) refuses the connect (EPERM); once the call ended "
                "its socket is gone (ECONNREFUSED) and the name is free",
        not_applicable=_ONLY_FUNCTION, fresh=True)
async def fn_call_abstract_socket(t: Target) -> None:
    holder = asyncio.create_task(call(t, _bind_abstract, _NAME, 4.0))
    try:
        await asyncio.sleep(1.5)
        during = await call(t, _connect_abstract, _NAME)
        if not holder.done():
            assert during["bind"] == errno.EADDRINUSE, f"the name was not taken while its call lived: {during}"
            if landlock_abi() >= 6:
                assert during["connect"] == errno.EPERM, f"a call connected to another call's socket: {during}"
        assert await holder == "bound"
    finally:
        if not holder.done():
            holder.cancel()
    after = await call(t, _connect_abstract, _NAME)
    assert after == {"connect": errno.ECONNREFUSED, "bind": 0}, f"the ended call's socket lives on: {after}"


_TAMPER = r"""
import builtins, json, os, subprocess, sys, random
subprocess.Popen(["sleep", "300"], start_new_session=True)
open("/tmp/warm-trace", "w").write("secret")
builtins.dsec_secret = "secret"          # the interpreter's state, if it were shared with the next program
sys.modules["dsec_secret"] = sys
os.environ["DSEC_SECRET"] = "secret"
sys.path.insert(0, "/workspace/evil")
print(json.dumps({"pid": os.getpid(), "random": random.random()}))
"""

_LOOK = r"""
import builtins, json, os, sys, random
print(json.dumps({
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "tmp": os.listdir("/tmp"),
    "builtins": hasattr(builtins, "dsec_secret"), "module": "dsec_secret" in sys.modules,
    "env": "DSEC_SECRET" in os.environ, "path": "/workspace/evil" in sys.path,
    "loader": [m for m in ("cloudpickle", "loader") if m in sys.modules], "random": random.random()}))
"""


async def _warm(t: Target, name: str, source: str) -> dict[str, Any]:
    import json

    from dsec.models import ExecRequest

    await t.backend.write_file(t.sb, f"/workspace/{name}", source.encode(), None)
    r = await t.backend.exec(t.sb, ExecRequest(command=["python3", name], warm_python=True, timeout=60))
    assert r.exit_code == 0, r
    out: dict[str, Any] = json.loads(r.stdout)
    return out


@attack("fn-warm-program-leaves-traces", description="a Python program run from the warm interpreter "
                                                     "(run_code's path) leaves a process, a file in /tmp and changes "
                                                     "the interpreter's builtins, modules, environment and path; the "
                                                     "next program of the same sandbox looks for them",
        models="cross-request leaks through the shared, pre-initialised interpreter of run_code",
        defence="function: each program is forked from the Python zygote (which never runs a caller's code) into its "
                "own pid, mount, ipc and uts namespaces, /tmp and cgroup; what it changes dies with it",
        not_applicable=_ONLY_FUNCTION, fresh=True)
async def fn_warm_program_leaves_traces(t: Target) -> None:
    first = await _warm(t, "tamper.py", _TAMPER)
    assert first["pid"] == 2, f"the program did not run as the call's process: {first}"
    seen = await _warm(t, "look.py", _LOOK)
    assert seen["pids"] == [1, 2], f"a later program sees other processes: {seen}"
    assert seen["tmp"] == [], f"a later program sees the earlier one's /tmp: {seen}"
    assert not (seen["builtins"] or seen["module"] or seen["env"] or seen["path"]), \
        f"a later program sees the earlier one's interpreter state: {seen}"
    assert seen["loader"] == [], f"the zygote's own modules are visible to the program: {seen}"
    assert seen["random"] != first["random"], "two programs drew the same random numbers (the zygote's state)"
