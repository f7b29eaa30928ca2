"""Container-escape classics and attacks on the kernel the sandbox runs on.

On ``container`` and ``function`` the sandbox shares the host's kernel: each attack must be refused by
the specific layer named (seccomp answers EPERM, a read-only mount EROFS, a missing node ENOENT, a
foreign pid namespace ESRCH). On ``microvm`` and ``vm`` the command runs on its own guest kernel (microvm:
as root without the capabilities that undo protections; vm: as full root): the same call may succeed
there, and the defence asserted is the VM boundary (a kernel that is not the host's, and a host unchanged
afterwards, which the suite checks after every attack).
"""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Mapping

from redteam import PRELUDE, VM_BACKENDS, Target, attack, expect_errno, guest_kernel_is_own, probe

from dsec.accounts import Identity
from dsec.errors import DSecError
from dsec.models import ExecRequest

EPERM, EROFS, ENOENT, EACCES, ESRCH = errno.EPERM, errno.EROFS, errno.ENOENT, errno.EACCES, errno.ESRCH
SECCOMP = {"container": EPERM, "function": EPERM}
PROC_SYS = {"container": EROFS, "function": EACCES}
"""container: /proc/sys is mounted read-only; function: its files belong to the host's root, which the sandbox's
user namespace does not map (EACCES before any write)."""
PROC_SYS_DEFENCE = "container: /proc/sys read-only (EROFS); function: owned by an unmapped root (EACCES)"
VM_DEFENCE = ("microvm, vm: the guest's own kernel (the call may succeed there; the host is unaffected; "
              "microvm commands also lack CAP_SYS_ADMIN and the other capabilities that undo protections)")


def _syscall_attack(id: str, description: str, models: str, expr: str,
                    want: Mapping[str, int | tuple[int, ...]] | None = None,
                    defence: str = "seccomp denylist: EPERM", fresh: bool = False,
                    breaks_vm: bool = False) -> None:
    """Register an attack that makes one call (``expr`` evaluates to 0 or an errno) and expects ``want``.

    ``breaks_vm``: in a VM the call succeeds and may hang that guest (ptrace-stopping its init, which runs the
    agent): the probe's own failure is then accepted, since only the attacker's VM suffers (the suite checks
    the host and the backend afterwards)."""

    async def run(t: Target) -> None:
        if t.name in VM_BACKENDS and breaks_vm:
            with contextlib.suppress(DSecError, AssertionError):
                await probe(t, f"print(json.dumps({expr}))", timeout=20)
            return
        got = (await probe(t, f"print(json.dumps({expr}))"))
        if t.name in VM_BACKENDS:
            await guest_kernel_is_own(t)
            return
        expect_errno(t, id, got, want or SECCOMP)

    run.__qualname__ = run.__name__ = "attack_" + id.replace("-", "_")
    attack(id, description=description, models=models,
           defence=f"container, function: {defence}; {VM_DEFENCE}", fresh=fresh)(run)


_syscall_attack("mount-tmpfs", "mount(2) a tmpfs over /mnt", "escape classic: mount family",
                'lc(libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None))')
_syscall_attack("umount-proc", "umount2(/proc, MNT_DETACH) to uncover what the masks hide",
                "escape classic: unmasking /proc", 'lc(libc.umount2(b"/proc", 2))',
                fresh=True)  # in a VM it succeeds: that guest then has no /proc
_syscall_attack("pivot-root", "pivot_root(2) to swap the root filesystem", "escape classic: pivot_root",
                'sc(155, 0, 0)',
                defence="seccomp denylist: EPERM")
_syscall_attack("unshare-user", "unshare(CLONE_NEWUSER) to become root of a new user namespace",
                "kernel attack surface: new user namespaces (CVE-2022-0185 class)", "lc(libc.unshare(0x10000000))")
_syscall_attack("unshare-mount-net", "unshare(CLONE_NEWNS|CLONE_NEWNET) to set up private mounts and links",
                "escape classic: unshare", "lc(libc.unshare(0x00020000 | 0x40000000))")
_syscall_attack("clone-newuser", "clone(CLONE_NEWUSER) directly, bypassing unshare",
                "seccomp filter bypass via a sibling syscall",
                "(lambda p: (os._exit(0) if p == 0 else (os.waitpid(p, 0), 0)[1]) if p >= 0 "
                "else ctypes.get_errno())(libc.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | 17), "
                "ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0)))")
_syscall_attack("setns-host", "setns() into pid 1's mount namespace through /proc/1/ns/mnt",
                "escape classic: joining another namespace",
                'lc(libc.setns(os.open("/proc/1/ns/mnt" if os.access("/proc/1/ns/mnt", os.R_OK) '
                'else "/proc/self/ns/mnt", os.O_RDONLY), 0))')
_syscall_attack("keyctl", "keyctl(KEYCTL_GET_KEYRING_ID) and add_key on the kernel keyring",
                "kernel attack surface: keyrings (not namespaced)", "sc(250, 0, -3, 0) or sc(248, 0, 0, 0, 0, -3)")
_syscall_attack("bpf", "bpf(BPF_MAP_CREATE) to load eBPF", "kernel attack surface: eBPF verifier bugs",
                "sc(321, 0, 0, 0)")
_syscall_attack("perf-event-open", "perf_event_open on any cpu", "kernel attack surface: perf, side channels",
                "sc(298, 0, 0, -1, -1, 0)")
_syscall_attack("userfaultfd", "userfaultfd() to stall the kernel in a race", "kernel race exploitation helper",
                "sc(323, 0)")
_syscall_attack("init-module", "init_module / finit_module to load a kernel module", "module loading",
                "sc(175, 0, 0, 0) or sc(313, -1, 0, 0)")
_syscall_attack("kexec", "kexec_load / kexec_file_load to replace the running kernel", "kexec",
                "sc(246, 0, 0, 0, 0) or sc(320, -1, -1, 0, 0, 0)")
_syscall_attack("open-by-handle", "open_by_handle_at to open host inodes by handle", "Shocker (2014)",
                "sc(304, -100, 0, 0)")
_syscall_attack("ptrace-init", "PTRACE_ATTACH to the sandbox's pid 1 to hijack it", "escape classic: ptrace of init",
                "sc(101, 16, 1, 0, 0)", fresh=True, breaks_vm=True)
_syscall_attack("io-uring", "io_uring_setup to get a ring that bypasses the syscall filter",
                "seccomp bypass through io_uring", "sc(425, 1, 0)")


@attack("mknod-devices", description="mknod a block device for the host's disk and open /dev/mem, /dev/kmsg",
        models="escape classic: /dev access",
        defence="container, function: no device nodes but the null/zero/random set (ENOENT) and mknod "
                "refused (function: EPERM, no CAP_MKNOD; container: EACCES, Landlock refuses device nodes "
                "before the capability check, which would say EPERM); " + VM_DEFENCE)
async def mknod_devices(t: Target) -> None:
    res = await probe(t, r"""
out = {"mknod": try_os(os.mknod, "/tmp/.sda", 0o600 | 0o060000, os.makedev(8, 0))}
for dev in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/sda", "/dev/vda"):
    out[dev] = try_os(lambda d: os.close(os.open(d, os.O_RDONLY)), dev)
out["devs"] = sorted(os.listdir("/dev"))
print(json.dumps(out))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    expect_errno(t, "mknod", res["mknod"], {"container": EACCES, "function": EPERM})
    for dev in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/sda", "/dev/vda"):
        expect_errno(t, dev, res[dev], {"container": ENOENT, "function": ENOENT})


@attack("proc-sys-write", description="write /proc/sys/kernel/hostname, vm/drop_caches and /proc/sysrq-trigger",
        models="escape classic: /proc/sys writes",
        defence=PROC_SYS_DEFENCE + ", sysrq-trigger masked; " + VM_DEFENCE)
async def proc_sys_write(t: Target) -> None:
    res = await probe(t, r"""
def w(p):
    with open(p, "w") as f:
        f.write("1")
print(json.dumps({p: try_os(w, p) for p in ("/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches",
                                            "/proc/sysrq-trigger")}))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    for path in ("/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"):
        expect_errno(t, path, res[path], PROC_SYS)
    assert res["/proc/sysrq-trigger"] != 0, "sysrq-trigger was writable"


@attack("core-pattern", description="set core_pattern to a pipe to a script, then crash a process so the host's "
                                    "kernel runs it as root on the host",
        models="escape classic: core_pattern (CVE-2019-5736 class host-side execution)",
        defence=PROC_SYS_DEFENCE + "; " + VM_DEFENCE)
async def core_pattern(t: Target) -> None:
    res = await probe(t, f"""
def w(p):
    with open(p, "w") as f:
        f.write("|/bin/sh -c 'touch {t.host_marker}'")
out = {{"write": try_os(w, "/proc/sys/kernel/core_pattern")}}
import resource, signal
resource.setrlimit(resource.RLIMIT_CORE, (resource.getrlimit(resource.RLIMIT_CORE)[1],) * 2)
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGSEGV)
out["child"] = os.waitpid(pid, 0)[1]
print(json.dumps(out))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    expect_errno(t, "core_pattern", res["write"], PROC_SYS)


@attack("cgroup-release-agent", description="mount a cgroup v1 hierarchy and set release_agent + notify_on_release",
        models="escape classic: cgroup release_agent (CVE-2022-0492)",
        defence="container, function: mount denied by seccomp (EPERM); /sys/fs/cgroup not writable; "
                + VM_DEFENCE)
async def cgroup_release_agent(t: Target) -> None:
    res = await probe(t, f"""
os.makedirs("/tmp/cg", exist_ok=True)
out = {{"mount": lc(libc.mount(b"cgroup", b"/tmp/cg", b"cgroup", 0, b"rdma"))}}
def w(p, data):
    with open(p, "w") as f:
        f.write(data)
import glob
agents = glob.glob("/sys/fs/cgroup/*/release_agent") + glob.glob("/tmp/cg/release_agent")
out["agents"] = {{p: try_os(w, p, "{t.host_marker}") for p in agents}}
print(json.dumps(out))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    expect_errno(t, "mount cgroup", res["mount"], SECCOMP)
    assert all(err != 0 for err in res["agents"].values()), f"a release_agent was writable: {res['agents']}"


@attack("proc-self-exe", description="open /proc/self/exe and /proc/1/exe for writing to overwrite the runtime "
                                     "binary on the host",
        models="runc CVE-2019-5736",
        defence="container, function: the exec'd binary is busy (ETXTBSY) or read-only (EROFS/EACCES), and the "
                "sandbox's binaries are its own copies, never the host runtime's; container: crun itself runs from "
                "a sealed memfd copy (writes EPERM), never from /usr/bin/crun; " + VM_DEFENCE)
async def proc_self_exe(t: Target) -> None:
    res = await probe(t, r"""
print(json.dumps({p: try_os(lambda q: os.close(os.open(q, os.O_WRONLY)), p)
                  for p in ("/proc/self/exe", "/proc/1/exe")}))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    for path, err in res.items():
        assert err in (errno.ETXTBSY, EROFS, EACCES, EPERM, ENOENT), f"{path}: opened for writing ({err})"


@attack("signal-host", description="kill -9 the host's pids (1, the test runner's pid, the daemon's)",
        models="escape classic: signals to host processes",
        defence="container, function: own pid namespace (ESRCH for every host pid); " + VM_DEFENCE)
async def signal_host(t: Target) -> None:
    import os

    victims = sorted({os.getpid(), os.getppid()})
    res = await probe(t, f"""
print(json.dumps({{str(p): try_os(os.kill, p, 0) for p in {victims}}}))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    for pid, err in res.items():
        # a pid that happens to exist inside the sandbox too answers; it is not ours
        assert err == ESRCH or int(pid) < 50, f"pid {pid} reachable from the sandbox (errno {err})"


@attack("ptrace-guest-agent", description="as root of the guest: ptrace-attach to the agent (pid 1), write its "
                                          "memory through /proc/1/mem and process_vm_writev, SIGSTOP it, lower "
                                          "Yama's ptrace_scope and re-enable module loading",
        models="attacking the executor: stopping or rewriting the guest agent (hangs or subverts its own VM)",
        defence="microvm: commands run in a pid namespace of their own where the agent is not visible (pid 1 "
                "there is a waiting init, the kernel ignores the SIGSTOP its namespace sends it); Yama ptrace_scope "
                "3 set by the guest's init before the agent starts (EPERM even with CAP_SYS_PTRACE, which commands "
                "do not have, and it cannot be lowered: /proc/sys is read-only for commands, EROFS), module loading "
                "and kexec disabled for good; the agent answers afterwards. vm: root owns that VM (it may stop its "
                "agent, a systemd service): the VM boundary; the host and the backend carry on",
        not_applicable={"container": "no agent inside: commands enter from the host; the init is covered by "
                                     "ptrace-init",
                        "function": "no agent inside: each call is its own pid namespace's init, spawned by "
                                    "the zygote outside (ptrace-init)"},
        fresh=True)
async def ptrace_guest_agent(t: Target) -> None:
    if t.name == "vm":
        await guest_kernel_is_own(t)
        with contextlib.suppress(DSecError, AssertionError):  # it may hang its own agent: only its VM suffers
            await probe(t, _PTRACE_AGENT.replace("os.kill(1,", "os.kill(int(os.popen('pidof dsec-agent').read()),"),
                        timeout=30)
        return
    res = await probe(t, _PTRACE_AGENT)
    await guest_kernel_is_own(t)
    assert res["scope"] == "3" and res["modules_disabled"] == "1" and res["kexec_disabled"] == "1", res
    assert res["agents"] == [], f"the agent is visible to commands: {res}"
    for what in ("attach", "seize", "mem", "vm_writev"):
        assert res[what] in (errno.EPERM, errno.EACCES), (what, res)
    # /proc/sys is read-only for commands (EROFS); were it not, the knobs are one-way (EINVAL) and need
    # capabilities commands lack (EPERM)
    assert res["lower_scope"] == errno.EROFS and res["enable_modules"] == errno.EROFS, res
    r = await t.sh("echo agent-alive; cat /proc/sys/kernel/yama/ptrace_scope")  # SIGSTOP did not stop pid 1
    assert r.stdout == b"agent-alive\n3\n", r


_PTRACE_AGENT = r"""
import signal
out = {"scope": open("/proc/sys/kernel/yama/ptrace_scope").read().strip(),
       "modules_disabled": open("/proc/sys/kernel/modules_disabled").read().strip(),
       "kexec_disabled": open("/proc/sys/kernel/kexec_load_disabled").read().strip()}
def comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""
out["agents"] = [pid for pid in os.listdir("/proc") if pid.isdigit() and comm(pid) == "dsec-agent"]
out["attach"] = sc(101, 16, 1, 0, 0)          # PTRACE_ATTACH
out["seize"] = sc(101, 0x4206, 1, 0, 0)       # PTRACE_SEIZE
out["mem"] = try_os(lambda: os.close(os.open("/proc/1/mem", os.O_RDWR)))
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
out["vm_writev"] = sc(311, 1, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0)
def lower(path, value):
    with open(path, "w") as f:
        f.write(value)
out["lower_scope"] = try_os(lower, "/proc/sys/kernel/yama/ptrace_scope", "0")
out["enable_modules"] = try_os(lower, "/proc/sys/kernel/modules_disabled", "0")
os.kill(1, signal.SIGSTOP)
print(json.dumps(out))
"""


_NOBODY = Identity(uid=65534, gid=65534, home="/", name="nobody")
_SUID_COPY = "cp /usr/bin/python3.11 /usr/local/bin/suid-python && chmod 4755 /usr/local/bin/suid-python"
_SUID_PROBE = r"""
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
os.makedirs("/tmp/m", exist_ok=True)
out = {"euid": os.geteuid(), "nnp": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
       "bounding": int(status["CapBnd"], 16), "effective": int(status["CapEff"], 16)}
if out["euid"] == 0:
    out.update({
        "mount": lc(libc.mount(b"tmpfs", b"/tmp/m", b"tmpfs", 0, None)),
        "umount-protected": lc(libc.umount2(b"/etc/passwd", 2)),
        "umount-hidden": lc(libc.umount2(b"/srv", 2)),
        "remount-protected": lc(libc.mount(None, b"/etc/passwd", None, 0x20 | 0x1000 | 0x20000, None)),
        "write-protected": try_os(lambda: os.close(os.open("/etc/passwd", os.O_WRONLY | os.O_APPEND))),
        "hidden-listing": os.listdir("/srv"),
        "unshare-user": lc(libc.unshare(0x10000000)),
        "mknod": try_os(os.mknod, "/tmp/.sda", 0o600 | 0o060000, os.makedev(8, 0)),
        "proc-sys": try_os(lambda: open("/proc/sys/kernel/hostname", "w").write("x")),
        "seccomp-off": lc(libc.prctl(22, 0, 0, 0, 0)),
        "cap-sys-admin": libc.prctl(23, 21, 0, 0, 0),
        "ptrace-init": sc(101, 16, 1, 0, 0),
    })
print(json.dumps(out))
"""


@attack("setuid-sudo", description="with allow_privilege_escalation on, a non-root user runs a setuid-root binary "
                                   "(sudo's way to root) and as that root tries to undo seccomp, Landlock, the "
                                   "mounts and the protected and hidden paths",
        models="sudo in agent images (E2B's base template): setuid must reach no further than user='root'",
        defence="container: seccomp and Landlock are installed before the exec helper gives up CAP_SYS_ADMIN, so "
                "they hold without no_new_privs; the bounding set caps the setuid root at the sandbox root's "
                "capabilities (mount, umount, unshare, ptrace, seccomp changes: EPERM; device nodes: EACCES; "
                "/proc/sys, protected paths: EROFS); without the opt-in the setuid bit is ignored "
                "(no_new_privs)",
        not_applicable={"function": "allow_privilege_escalation is refused: every call runs with no_new_privs",
                        "microvm": "allow_privilege_escalation is refused: the guest agent confines every "
                                   "command with no_new_privs",
                        "vm": "a vm without protected or hidden paths runs setuid binaries anyway (its guest "
                              "kernel is the boundary); with them the opt-in is refused"},
        fresh=True, spec={"allow_privilege_escalation": True, "protected": ["/etc/passwd"], "hidden": ["/srv"]})
async def setuid_sudo(t: Target) -> None:
    async def escalate(target: Target) -> dict[str, object]:
        r = await target.sh(_SUID_COPY)
        assert r.exit_code == 0, r
        run = ExecRequest(command=["/usr/local/bin/suid-python", "-c", PRELUDE + _SUID_PROBE], timeout=60)
        r = await target.backend.exec(target.sb, run, _NOBODY)
        assert r.exit_code == 0, r
        result: dict[str, object] = json.loads(r.stdout)
        return result

    root_caps = await escalate(t)
    # the setuid exec did make the sandbox's root: what follows is that root failing, not a non-root user
    assert root_caps["euid"] == 0 and root_caps["nnp"] == "0" and root_caps["seccomp"] == "2", root_caps
    assert root_caps["bounding"] == root_caps["effective"], root_caps  # no more than user="root" gets
    assert root_caps["cap-sys-admin"] == 0, root_caps
    for what in ("mount", "umount-protected", "umount-hidden", "remount-protected", "unshare-user", "ptrace-init"):
        assert root_caps[what] == EPERM, (what, root_caps)
    assert root_caps["seccomp-off"] == errno.EINVAL, root_caps  # a filter is never removed, only stacked
    assert root_caps["write-protected"] == EROFS and root_caps["proc-sys"] == EROFS, root_caps
    assert root_caps["mknod"] == EACCES and root_caps["hidden-listing"] == [], root_caps
    async with t.neighbour() as plain:  # no opt-in: the setuid bit gives nothing
        without = await escalate(Target(t.name, t.backend, t.image, plain, t.home, t.host_marker, t.reference))
    assert without["euid"] == _NOBODY.uid and without["nnp"] == "1" and "mount" not in without, without
