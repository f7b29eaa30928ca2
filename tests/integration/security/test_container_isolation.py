"""Attacks from inside a real container sandbox; each test asserts that the defence holds.

The sandboxed code is the attacker: it runs as the sandbox's root and tries what agents have tried
(DESIGN.md §7). Every probe prints what happened so that a failing assertion shows the evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from container_support import (
    await_until,
    checked_backend,
    holder_mountinfo,
    py,
    run,
    swept_home,
)
from dsec.backends.base import ImageRef
from dsec.backends.container import PRISTINE_DIR, ContainerBackend
from dsec.errors import DSecError, InvalidRequest
from dsec.isolation.capabilities import CAP_NUMBERS, DEFAULT_CAPS
from dsec.isolation.oci_runtime import INIT_PATH, masked_dirs
from dsec.models import SandboxRecord
from dsec.testing import sandbox

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024
UID_SHIFT = 100000


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, debian_python_image: ImageRef) -> Iterator[Path]:
    """One DSEC_HOME for the module (the static init is built once); swept clean at the end."""
    with swept_home(tmp_path_factory.mktemp("security-home")) as path:
        yield path


@pytest.fixture
async def backend(home: Path) -> AsyncIterator[ContainerBackend]:
    async with checked_backend(home) as b:
        yield b


@pytest.fixture
async def sb(backend: ContainerBackend, debian_python_image: ImageRef) -> AsyncIterator[SandboxRecord]:
    async with sandbox(backend, debian_python_image) as record:
        yield record


def status_fields(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


# ------------------------------------------------------------------------------ users and processes
async def test_root_in_sandbox_is_unprivileged_uid_on_host(backend: ContainerBackend,
                                                           sb: SandboxRecord) -> None:
    r = await run(backend, sb, "id -u; cat /proc/self/uid_map /proc/self/gid_map; touch /workspace/mine; "
                               "echo x > /var/owned-by-root")
    assert r.exit_code == 0, r
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "0"
    assert lines[1].split() == ["0", str(UID_SHIFT), "65536"], lines
    assert lines[2].split() == ["0", str(UID_SHIFT), "65536"], lines
    upper = Path(backend.mount_view(sb, "upper"))
    for created in (upper / "workspace" / "mine", upper / "var" / "owned-by-root"):
        st = created.stat()
        assert (st.st_uid, st.st_gid) == (UID_SHIFT, UID_SHIFT), (created, st.st_uid)
    host_status = status_fields(Path(f"/proc/{sb.backend_state['init_pid']}/status").read_text())
    assert host_status["Uid"].split()[0] == str(UID_SHIFT), host_status["Uid"]


async def test_host_processes_invisible(backend: ContainerBackend, sb: SandboxRecord) -> None:
    r = await run(backend, sb, "ls /proc | grep -c '^[0-9]'; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    count, cmdlines = r.stdout.decode().split("\n", 1)
    # init, the shell, ls/grep/cat: a handful, never the host's hundreds
    assert int(count) <= 6, r.stdout
    assert "pytest" not in cmdlines and "dsec.daemon" not in cmdlines and "nsexec" not in cmdlines, cmdlines
    host_pids = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
    assert host_pids > int(count)
    # the host's pid 1 (systemd/init) is not the sandbox's pid 1
    r = await run(backend, sb, "cat /proc/1/cmdline")
    assert r.stdout.rstrip(b"\0") == b"/dev/.dsec-init", r


# ----------------------------------------------------------------------------------------- syscalls
_SYSCALL_PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if ret >= 0 else ctypes.get_errno()
out = {}
out["mount"] = 0 if libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None) == 0 else ctypes.get_errno()
out["umount2"] = 0 if libc.umount2(b"/proc", 2) == 0 else ctypes.get_errno()
out["unshare_user"] = 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()
out["unshare_mount"] = 0 if libc.unshare(0x00020000) == 0 else ctypes.get_errno()
fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
out["setns"] = 0 if libc.setns(fd, 0) == 0 else ctypes.get_errno()
out["bpf"] = call(321, 0, 0, 0)              # BPF_MAP_CREATE with no attr
out["keyctl"] = call(250, 0, -3, 0)          # KEYCTL_GET_KEYRING_ID of the session keyring
out["add_key"] = call(248, 0, 0, 0, 0, -3)
out["ptrace_attach_init"] = call(101, 16, 1, 0, 0)   # PTRACE_ATTACH pid 1
out["ptrace_traceme"] = call(101, 0, 0, 0, 0)
out["perf_event_open"] = call(298, 0, 0, -1, -1, 0)
out["kexec_load"] = call(246, 0, 0, 0, 0)
out["kexec_file_load"] = call(320, -1, -1, 0, 0, 0)
out["userfaultfd"] = call(323, 0)
out["init_module"] = call(175, 0, 0, 0)
out["open_by_handle_at"] = call(304, -100, 0, 0)
out["clone3"] = call(435, 0, 0)
# clone(CLONE_NEWUSER|SIGCHLD): a child that somehow got created exits at once
pid = libc.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | 17), ctypes.c_long(0), ctypes.c_long(0),
                   ctypes.c_long(0), ctypes.c_long(0))
if pid == 0:
    os._exit(0)
out["clone_newuser"] = 0 if pid > 0 else ctypes.get_errno()
if pid > 0:
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


async def test_dangerous_syscalls_denied(backend: ContainerBackend, sb: SandboxRecord) -> None:
    results = await py(backend, sb, _SYSCALL_PROBE)
    expected_enosys = {"clone3"}  # ENOSYS on purpose: libc falls back to clone, whose flags are checked
    for name, err in results.items():
        want = errno.ENOSYS if name in expected_enosys else errno.EPERM
        assert err == want, f"{name}: errno {err} ({os.strerror(err) if err else 'succeeded'}), want {want}"
    # and the shell tools agents reach for
    r = await run(backend, sb, "mount -t tmpfs none /mnt; echo rc=$?")
    assert b"rc=0" not in r.stdout, r


async def test_ficlone_and_swapext_ioctls_denied(backend: ContainerBackend, sb: SandboxRecord) -> None:
    code = r"""
import fcntl, json, os
src = os.open("/workspace/src", os.O_RDWR | os.O_CREAT, 0o644); os.write(src, b"protected" * 100)
dst = os.open("/workspace/dst", os.O_RDWR | os.O_CREAT, 0o644)
out = {}
# The *_HI variants set the upper 32 bits of the request, which the kernel ignores: a filter comparing
# all 64 bits would let them through (CVE-2019-10063).
for name, req in (("FICLONE", 0x40049409), ("XFS_IOC_SWAPEXT", 0xC0C0586D), ("TIOCSTI", 0x5412),
                  ("FICLONE_HI", 0x40049409 | 1 << 32), ("TIOCSTI_HI", 0x5412 | 0xFFFF << 48)):
    try:
        fcntl.ioctl(dst, req, src)
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
out["io_uring_setup"] = 0 if libc.syscall(425, 1, params) >= 0 else ctypes.get_errno()
print(json.dumps(out))
"""
    results = await py(backend, sb, code)
    # EPERM is seccomp's answer; without the filter these would be EOPNOTSUPP/EXDEV/ENOTTY or succeed
    want = {name: errno.EPERM for name in ("FICLONE", "XFS_IOC_SWAPEXT", "TIOCSTI", "FICLONE_HI", "TIOCSTI_HI",
                                           "io_uring_setup")}
    assert results == want, results


# -------------------------------------------------------------------------- capabilities and seccomp
def _caps_mask(names: tuple[str, ...]) -> int:
    return sum(1 << CAP_NUMBERS[n] for n in names)


async def test_capabilities_no_new_privs_and_seccomp_same_for_init_and_every_exec(
        backend: ContainerBackend, sb: SandboxRecord) -> None:
    documented = _caps_mask(DEFAULT_CAPS)
    assert not documented & (1 << CAP_NUMBERS["CAP_SYS_ADMIN"])
    seen = []
    for _ in range(2):  # the first exec and a later one
        r = await run(backend, sb, "cat /proc/1/status; echo ===; cat /proc/self/status")
        init_text, exec_text = r.stdout.decode().split("===\n")
        seen.append((status_fields(init_text), status_fields(exec_text)))
    for init, proc in seen:
        for fields in (init, proc):
            for key in ("CapEff", "CapPrm", "CapBnd"):
                assert int(fields[key], 16) == documented, (key, fields[key], hex(documented))
                assert not int(fields[key], 16) & (1 << CAP_NUMBERS["CAP_SYS_ADMIN"])
            assert int(fields["CapInh"], 16) == 0 and int(fields["CapAmb"], 16) == 0
            assert fields["NoNewPrivs"] == "1", fields["NoNewPrivs"]
            assert fields["Seccomp"] == "2", fields["Seccomp"]
        # an exec carries exactly the init's restrictions, not a superset
        for key in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb", "NoNewPrivs", "Seccomp",
                    "Seccomp_filters"):
            assert init[key] == proc[key], (key, init[key], proc[key])


# ----------------------------------------------------------------------------------------- /proc
async def test_masked_and_readonly_proc_paths(backend: ContainerBackend, sb: SandboxRecord) -> None:
    code = r"""
import json
out = {}
for p in ("/proc/kcore", "/proc/kpagecgroup", "/proc/kpageflags", "/proc/sysrq-trigger", "/proc/keys",
          "/proc/timer_list", "/proc/kmsg"):
    try:
        with open(p, "rb") as f:
            out[p] = len(f.read(4096))
    except OSError as e:
        out[p] = "err %d" % e.errno
writes = {}
for p in ("/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"):
    try:
        with open(p, "w") as f:
            f.write("1")
        writes[p] = "written"
    except OSError as e:
        writes[p] = e.errno
mounts = {}
for line in open("/proc/self/mountinfo"):
    f = line.split()
    mounts[f[4]] = f[5]
print(json.dumps({"read": out, "write": writes, "sys_opts": mounts.get("/proc/sys", ""),
                  "sysfs_opts": mounts.get("/sys", "")}))
"""
    res = await py(backend, sb, code)
    for path, got in res["read"].items():
        assert got == 0 or str(got).startswith("err"), f"{path} is readable: {got} bytes"
    for path, got in res["write"].items():
        assert got != "written", f"{path} was writable"
    assert "ro" in res["sys_opts"].split(","), res["sys_opts"]
    assert "ro" in res["sysfs_opts"].split(","), res["sysfs_opts"]


async def test_sysfs_is_the_nodes_shared_read_only_one_and_masks_are_empty(backend: ContainerBackend,
                                                                         sb: SandboxRecord) -> None:
    """/sys is the node's one sysfs (a superblock per sandbox costs kernel memory in every memory cgroup),
    read-only, from a network namespace that is gone (it lists no network device, the host's or any other
    sandbox's); the masked directories are empty and cannot be written."""
    code = r"""
import json, os
options = {line.split()[4]: line.split()[5].split(",") for line in open("/proc/self/mountinfo")}
masked = {}
for p in ("/proc/acpi", "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/security"):
    if not os.path.isdir(p):
        continue
    try:
        open(p + "/planted", "w").close()
        masked[p] = [os.listdir(p), "written", options.get(p, [])]
    except OSError as e:
        masked[p] = [os.listdir(p), e.errno, options.get(p, [])]
try:
    open("/sys/kernel/uevent_helper", "w").write("/x")
    sysfs_write = "written"
except OSError as e:
    sysfs_write = e.errno
print(json.dumps({"dev": os.stat("/sys").st_dev, "net": sorted(os.listdir("/sys/class/net")), "masked": masked,
                  "sysfs_write": sysfs_write}))
"""
    res = await py(backend, sb, code)
    assert backend._holder is not None
    assert res["dev"] == os.stat(backend._holder.view(str(backend.sysfs))).st_dev, "/sys is not the node's sysfs"
    assert res["net"] == [], res["net"]
    assert res["masked"], "no masked directory was found to check"
    for path, (entries, wrote, opts) in res["masked"].items():
        assert entries == [] and wrote in (errno.EROFS, errno.EACCES) and "ro" in opts, (path, entries, wrote, opts)
    assert res["sysfs_write"] in (errno.EROFS, errno.EACCES), res["sysfs_write"]


async def test_a_sandbox_makes_five_superblocks_and_dev_lives_on_its_disk(backend: ContainerBackend,
                                                                        sb: SandboxRecord) -> None:
    """Each superblock costs kernel memory in every memory cgroup of the node (docs/design/container.md, "The shrinker
    wall"): a sandbox makes only its overlay, its disk tmpfs (which also holds /dev and /dev/shm), proc,
    devpts and its ipc namespace's mqueue; its sysfs is the node's. /dev is read-only, /dev/shm writable,
    no-exec and as big as the disk."""
    shared = [INIT_PATH, PRISTINE_DIR, *masked_dirs()]  # binds of the node's files, wherever those live
    code = f"SHARED = {shared!r}\n" + r"""
import collections, errno, json, os
devs = collections.defaultdict(set)
for line in open("/proc/self/mountinfo"):
    f = line.split()
    if f[4] not in SHARED:
        devs[f[f.index("-") + 1]].add(f[2])
try:
    open("/dev/planted", "w").close()
    dev_write = "written"
except OSError as e:
    dev_write = e.errno
with open("/dev/shm/x", "w") as f:
    f.write("shared memory")
shm, root = os.statvfs("/dev/shm"), os.statvfs("/")
print(json.dumps({"devs": {k: sorted(v) for k, v in devs.items()}, "dev_write": dev_write,
                  "same_disk": (shm.f_blocks, shm.f_bfree) == (root.f_blocks, root.f_bfree),
                  "shm": open("/dev/shm/x").read(),
                  "shm_opts": [l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == "/dev/shm"]}))
"""
    res = await py(backend, sb, code)
    own = {kind: len(res["devs"].get(kind, [])) for kind in ("overlay", "tmpfs", "proc", "devpts", "mqueue", "sysfs")}
    assert own == {"overlay": 1, "tmpfs": 1, "proc": 1, "devpts": 1, "mqueue": 1, "sysfs": 1}, res["devs"]
    assert res["dev_write"] in (errno.EROFS, errno.EACCES), res["dev_write"]
    assert res["same_disk"] and res["shm"] == "shared memory", res
    assert res["shm_opts"] and all("noexec" in o.split(",") for o in res["shm_opts"]), res["shm_opts"]


# ------------------------------------------------------------------------------------------ network
@pytest.fixture
def host_listener() -> Iterator[tuple[int, list[tuple[str, int]]]]:
    """A TCP listener on the host's 127.0.0.1 that records every connection it accepts."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    accepted: list[tuple[str, int]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(addr)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        stop.set()
        t.join(5)
        srv.close()


async def test_network_off_and_host_loopback_unreachable(
        backend: ContainerBackend, sb: SandboxRecord,
        host_listener: tuple[int, list[tuple[str, int]]]) -> None:
    port, accepted = host_listener
    # the listener works from the host: proof that it is reachable where it should be
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    assert await await_until(lambda: len(accepted) >= 1, timeout=5)
    code = rf"""
import json, os, socket
out = {{"links": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])}}
s = socket.socket(); s.settimeout(5)
try:
    s.connect(("127.0.0.1", {port})); out["connect"] = "connected"
except OSError as e:
    out["connect"] = e.errno
routes = [l for l in open("/proc/net/route").read().splitlines()[1:] if l.strip()]
out["routes"] = routes
out["route6"] = [l for l in open("/proc/net/ipv6_route").read().splitlines() if not l.split()[-1] == "lo"]
print(json.dumps(out))
"""
    res = await py(backend, sb, code)
    assert res["links"] == ["lo"], res
    assert res["connect"] == errno.ECONNREFUSED, res  # the sandbox's own, empty loopback
    assert res["routes"] == [] and res["route6"] == [], res  # no route to anything beyond lo
    assert len(accepted) == 1, f"the sandbox reached the host's listener: {accepted}"


# ---------------------------------------------------------------------------------- image and files
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_overwriting_bin_bash_stays_in_one_sandbox(backend: ContainerBackend,
                                                         debian_python_image: ImageRef) -> None:
    image_bash = (debian_python_image.rootfs / "usr/bin/bash")
    before = _sha(image_bash)
    async with sandbox(backend, debian_python_image) as a, sandbox(backend, debian_python_image) as b:
        r = await run(backend, a, "printf '#!/bin/sh\\necho pwned\\n' > /bin/bash && /bin/bash")
        assert r.stdout == b"pwned\n", r  # the attack worked inside A...
        r = await run(backend, b, "bash -c 'echo clean'; sha256sum /bin/bash")
        assert r.stdout.splitlines()[0] == b"clean", r  # ...but B runs the real bash
        assert r.stdout.splitlines()[1].split()[0].decode() == before
        async with sandbox(backend, debian_python_image) as c:  # and so does a sandbox created later
            r = await run(backend, c, "bash -c 'echo clean'")
            assert r.stdout == b"clean\n", r
    assert _sha(image_bash) == before, "the image on the host was modified"


async def test_files_api_dotdot_stays_inside(backend: ContainerBackend, sb: SandboxRecord) -> None:
    inside = (await run(backend, sb, "cat /etc/shadow")).stdout
    got = await backend.read_file(sb, "/workspace/../../etc/shadow", MiB)
    assert got == inside, "'..' did not resolve to the sandbox's own /etc/shadow"
    with contextlib.suppress(OSError):
        assert got != Path("/etc/shadow").read_bytes(), "read the host's /etc/shadow"


@pytest.fixture
def host_marker() -> Iterator[Path]:
    path = Path("/tmp") / f"dsec-marker-{uuid.uuid4().hex}"
    path.write_bytes(b"host secret")
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


async def test_files_api_planted_symlinks_never_reach_host(backend: ContainerBackend, sb: SandboxRecord,
                                                           host_marker: Path) -> None:
    name = host_marker.name
    r = await run(backend, sb, f"ln -s {host_marker} /workspace/link && ln -s /tmp /workspace/tmpdir "
                               f"&& ln -s ../../../../..{host_marker} /workspace/rel")
    assert r.exit_code == 0, r
    for path in ("/workspace/link", "/workspace/tmpdir/" + name, "/workspace/rel"):
        try:
            data = await backend.read_file(sb, path, MiB)
        except DSecError:
            continue
        assert data != b"host secret", f"{path} read the host's file"
    for i, path in enumerate(("/workspace/link", f"/workspace/tmpdir/{name}", "/workspace/rel")):
        with contextlib.suppress(DSecError):
            await backend.write_file(sb, path, f"overwrite {i}".encode(), None)
        assert host_marker.read_bytes() == b"host secret", f"write through {path} reached the host"
    # the writes that were accepted landed inside the sandbox, at the link's target there
    r = await run(backend, sb, f"cat {host_marker}")
    assert r.stdout.startswith(b"overwrite"), r
    new_on_host = Path("/tmp") / f"{name}-new"
    with contextlib.suppress(DSecError):
        await backend.write_file(sb, f"/workspace/tmpdir/{name}-new", b"x", None)
    assert not new_on_host.exists(), "a file was created on the host through a planted directory symlink"


async def test_files_api_refuses_magic_links(backend: ContainerBackend, sb: SandboxRecord) -> None:
    r = await run(backend, sb, "ln -s /proc/self/root /workspace/selfroot && "
                               "ln -s /proc/1/root /workspace/r1")
    assert r.exit_code == 0, r
    for path in ("/proc/1/root/etc/hostname", "/proc/self/root/etc/hostname",
                 "/workspace/selfroot/etc/shadow", "/workspace/r1/etc/hostname", "/proc/1/cwd/etc/hostname"):
        with pytest.raises(DSecError):
            await backend.read_file(sb, path, MiB)
    with pytest.raises(DSecError):
        await backend.write_file(sb, "/workspace/selfroot/tmp/dsec-magic-probe", b"x", None)
    assert not Path("/tmp/dsec-magic-probe").exists()


async def test_files_api_never_touches_proc_sys_dev_with_host_privilege(backend: ContainerBackend,
                                                                       sb: SandboxRecord) -> None:
    """The daemon is host root: through the sandbox's procfs it would read real kernel addresses or make a
    sandbox immune to the OOM killer. Only the sandbox's own root filesystem is served."""
    before = (await run(backend, sb, "cat /proc/1/oom_score_adj")).stdout
    for path in ("/proc/kallsyms", "/proc/1/oom_score_adj", "/proc/1/status", "/sys/kernel/mm",
                 "/dev/null", "/dev/shm"):
        with pytest.raises(InvalidRequest, match="not on the sandbox's filesystem"):
            await backend.read_file(sb, path, MiB)
    with pytest.raises(InvalidRequest):
        await backend.write_file(sb, "/proc/1/oom_score_adj", b"-1000", None)
    with pytest.raises(InvalidRequest):
        await backend.list_files(sb, "/proc")
    # a symlink planted in the workspace is followed inside the sandbox, and still refused
    assert (await run(backend, sb, "ln -s /proc/1/oom_score_adj /workspace/oom")).exit_code == 0
    with pytest.raises(InvalidRequest):
        await backend.write_file(sb, "/workspace/oom", b"-1000", None)
    assert (await run(backend, sb, "cat /proc/1/oom_score_adj")).stdout == before
    # the root filesystem itself is served as before
    assert b"root:" in await backend.read_file(sb, "/etc/passwd", MiB)


async def test_sandbox_cannot_stop_its_own_init(backend: ContainerBackend, sb: SandboxRecord) -> None:
    r = await run(backend, sb, "kill -TERM 1; kill -INT 1; echo sent")
    assert r.stdout == b"sent\n", r
    await asyncio.sleep(0.2)
    assert (await run(backend, sb, "echo alive")).stdout == b"alive\n"


async def test_commands_are_first_oom_victims_and_overlay_is_nosuid_nodev(backend: ContainerBackend,
                                                                         sb: SandboxRecord) -> None:
    assert (await run(backend, sb, "cat /proc/self/oom_score_adj")).stdout == b"500\n"
    rootfs = sb.backend_state["rootfs"]
    # the daemon's copy in the home's mount holder, and the sandbox's own root
    held = [line.split()[5] for line in holder_mountinfo(backend.settings.home) if line.split()[4] == rootfs]
    own = [line.split()[5] for line in Path(f"/proc/{sb.backend_state['init_pid']}/mountinfo").read_text().splitlines()
           if line.split()[4] == "/"]
    for options in (held, own):
        assert options and "nosuid" in options[0].split(",") and "nodev" in options[0].split(","), options


async def test_no_platform_socket_inside(backend: ContainerBackend, sb: SandboxRecord) -> None:
    r = await run(backend, sb, "find / \\( -path /proc -o -path /sys \\) -prune -o "
                               "\\( -type s -o -name '*.sock' \\) -print 2>/dev/null; echo end")
    assert r.stdout == b"end\n", f"sockets visible in the sandbox: {r.stdout!r}"
    # nor is one inherited: no descriptor of the exec (or of init) is a socket
    r = await run(backend, sb, "ls -l /proc/self/fd/ /proc/1/fd/ 2>&1")
    assert b"socket:" not in r.stdout, r.stdout
    # the daemon's and the helper's files are not in the sandbox's filesystem
    r = await run(backend, sb, "ls /run /var/run /tmp 2>&1; ls -a /dev")
    assert b"dsec.sock" not in r.stdout and b"nsexec" not in r.stdout, r.stdout


async def test_sandboxes_cannot_see_each_other(backend: ContainerBackend,
                                               debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as a, sandbox(backend, debian_python_image) as b:
        secret = uuid.uuid4().hex
        await backend.write_file(b, f"/workspace/{secret}", b"b's file", None)
        r = await run(backend, b, "sleep 1000 >/dev/null 2>&1 & echo $!")
        assert r.exit_code == 0, r
        # find prints only paths it found (its own command line, which holds the name, is not output)
        r = await run(backend, a, f"find / \\( -path /proc -o -path /sys \\) -prune -o -name '{secret}*' "
                                  "-print 2>/dev/null; echo end")
        assert r.stdout == b"end\n", f"A found B's file: {r.stdout!r}"
        r = await run(backend, a, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; hostname")
        out = r.stdout.decode()
        assert "sleep 1000" not in out, f"A sees B's processes: {out}"
        assert out.strip().splitlines()[-1] == a.id, out
        # the host paths of B's root and writable layer do not exist in A's filesystem
        paths = f"/run/dsec {b.backend_state['rootfs']} {b.backend_state['upper']}"
        r = await run(backend, a, f"ls -d {paths} 2>/dev/null; echo end")
        assert r.stdout == b"end\n", r.stdout
