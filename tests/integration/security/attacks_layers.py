"""Attacks on the grading layers: protected and hidden paths, and Landlock (issue 8).

A grader relies on files the agent may read but must not change (tests, the grader's own binaries), and
on commands that cannot write the kernel's knobs even if a mount meant to stop them were missing. Each
attack plays the agent against a sandbox created with ``protected=[...]`` (or the default Landlock) and
asserts the specific answer of the kernel: EROFS / EBUSY from the read-only bind mount, EPERM from
seccomp for the mount family and the extent ioctls, EACCES from Landlock.
"""

from __future__ import annotations

import errno

from redteam import Target, attack, expect_errno, probe

_VM_CONFINED = ("vm: a sandbox with grading paths runs its commands confined by the guest agent as on microvm, and "
                "on a system read-only to them but for the work directories (systemd, udev, modprobe and the "
                "desktop run as unconfined root and execute what is on the disk), with their own /run and no "
                "block devices, in a pid namespace of their own (no service, desktop process or agent to signal "
                "or to read through /proc/<pid>/root)")
_PROTECTED = {"protected": ["/usr/bin", "/etc/passwd"]}


@attack("protected-rewrite", description="rewrite, truncate, chmod, unlink and rename a protected file and a "
                                         "binary in a protected directory, and rename a fake over them",
        models="incident: agents overwrote /bin/bash and test files to subvert later checks",
        defence="container: protected paths are read-only bind mounts (EROFS for writes, EBUSY for the mount "
                "point, EXDEV/EROFS for renames into them); function: the same binds in the zygote's mount "
                "namespace, over a root that is read-only anyway (EROFS before the mount point's EBUSY); microvm: "
                "the same binds made by the guest agent, which runs commands without CAP_SYS_ADMIN; " + _VM_CONFINED +
                " (EROFS from the read-only parent before EBUSY)",
        fresh=True, spec=_PROTECTED)
async def protected_rewrite(t: Target) -> None:
    before = (await t.sh("sha256sum /etc/passwd /usr/bin/bash /usr/bin/python3")).stdout
    res = await probe(t, r"""
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
open("/workspace/fake", "w").write("#!/bin/sh\necho PASS\n")
attempt("append", lambda: open("/etc/passwd", "a").write("x::0:0::/:/bin/sh\n"))
attempt("replace_bash", lambda: open("/usr/bin/bash", "wb").write(b"#!/bin/sh\nexit 0\n"))
attempt("truncate", lambda: os.truncate("/etc/passwd", 0))
attempt("chmod", lambda: os.chmod("/usr/bin/bash", 0o777))
attempt("unlink_mountpoint", lambda: os.unlink("/etc/passwd"))
attempt("unlink_binary", lambda: os.unlink("/usr/bin/python3"))
attempt("rename_mountpoint", lambda: os.rename("/usr/bin", "/usr/bin.old"))
attempt("rename_over_binary", lambda: os.rename("/workspace/fake", "/usr/bin/python3"))
print(json.dumps(out))
""")
    want = {"append": errno.EROFS, "replace_bash": errno.EROFS, "truncate": errno.EROFS, "chmod": errno.EROFS,
            "unlink_mountpoint": errno.EBUSY, "unlink_binary": errno.EROFS, "rename_mountpoint": errno.EBUSY,
            "rename_over_binary": (errno.EXDEV, errno.EROFS)}
    for name, err in want.items():
        function_err = errno.EROFS if err == errno.EBUSY else err  # the read-only parent answers first
        expect_errno(t, name, res[name], {"container": err, "function": function_err, "microvm": err,
                                          "vm": function_err})
    assert (await t.sh("sha256sum /etc/passwd /usr/bin/bash /usr/bin/python3")).stdout == before


@attack("protected-swap-clone-unmount", description="FICLONE / FICLONERANGE / XFS_IOC_SWAPEXT onto a protected "
                                                    "file, then umount, remount read-write or mount over it",
        models="incident: XFS_IOC_SWAPEXT on protected files; container escape classic: undo a read-only mount",
        defence="container, function: seccomp denies the ioctls and the whole mount family (EPERM) and the "
                "sandbox's root has no CAP_SYS_ADMIN; the read-only bind mount stands behind both; microvm: the "
                "bind is read-only (a protected file opens for writing with EROFS, so no ioctl gets a writable "
                "descriptor) and commands have no CAP_SYS_ADMIN (the mount family: EPERM); " + _VM_CONFINED,
        fresh=True, spec=_PROTECTED)
async def protected_swap_clone_unmount(t: Target) -> None:
    before = (await t.sh("sha256sum /etc/passwd /usr/bin/bash")).stdout
    res = await probe(t, r"""
import ctypes, fcntl
out = {}
src = os.open("/workspace/src", os.O_RDWR | os.O_CREAT, 0o644); os.write(src, b"fake" * 1024)
for target in ("/usr/bin/bash", "/etc/passwd"):
    out["open_rw" + target] = try_os(lambda: os.close(os.open(target, os.O_RDWR)))
for target, flags in (("/usr/bin/bash", os.O_RDONLY), ("/etc/passwd", os.O_RDONLY)):
    fd = os.open(target, flags)
    for name, req in (("FICLONE", 0x40049409), ("FICLONERANGE", 0x4020940D), ("XFS_IOC_SWAPEXT", 0xC0C0586D)):
        try:
            fcntl.ioctl(fd, req, src); out[name + target] = 0
        except OSError as e:
            out[name + target] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
for name, rc in (("umount", lambda: libc.umount2(b"/usr/bin", 2)),
                 ("remount_rw", lambda: libc.mount(None, b"/usr/bin", None, 32 | 4096, None)),
                 ("mount_over", lambda: libc.mount(b"/workspace", b"/etc/passwd", None, 4096, None))):
    out[name] = 0 if rc() == 0 else ctypes.get_errno()
print(json.dumps(out))
""")
    for name, got in res.items():
        if name.startswith("open_rw"):
            # vm: the desktop's shell runs /usr/bin/bash, and the kernel checks that (ETXTBSY) before the mount
            expect_errno(t, name, got, {"container": errno.EROFS, "function": errno.EROFS, "microvm": errno.EROFS,
                                        "vm": (errno.EROFS, errno.ETXTBSY)})
        elif t.name in ("microvm", "vm") and name.startswith(("FICLONE", "XFS")):
            # a read-only descriptor is all the sandbox can get: the kernel refuses the ioctl before any
            # filesystem sees it (EBADF: not open for writing), or the filesystem has no such ioctl
            # (EFAULT: FICLONERANGE reads its argument struct first, and the probe passes a descriptor)
            refused = (errno.EBADF, errno.EXDEV, errno.EROFS, errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL,
                       errno.EFAULT)
            assert got in refused, (name, got)
        else:
            expect_errno(t, name, got, {"container": errno.EPERM, "function": errno.EPERM, "microvm": errno.EPERM,
                                        "vm": errno.EPERM})
    assert (await t.sh("sha256sum /etc/passwd /usr/bin/bash")).stdout == before


@attack("hidden-tests-then-revealed", description="look for tests hidden until grading, write into their cover, "
                                                  "then after reveal() rewrite, unlink and rename them and rename "
                                                  "a fake over them",
        models="incident: agents read or rewrote the tests that grade them",
        defence="container, function: before reveal an empty read-only tmpfs covers the directory (nothing to "
                "read: ENOENT; writes EROFS; the directory itself EBUSY); after reveal a read-only bind (EROFS, "
                "EBUSY, EXDEV), and the files API reads the grader's bytes unchanged; microvm: the same, the cover "
                "made by the guest agent in the commands' own mount namespace (the agent's view, which the files "
                "API uses, has none; commands cannot reach it: they run in their own pid namespace, where the "
                "agent is not visible, and it is not dumpable; tried through /proc/<pid>/root of every process, "
                "as root and after setuid to each user); " + _VM_CONFINED,
        fresh=True, spec={"hidden": ["/workspace/tests"]})
async def hidden_tests_then_revealed(t: Target) -> None:
    secret = b"def test_answer():\n    assert solve() == 42\n"
    await t.backend.write_file(t.sb, "/workspace/tests/test_grade.py", secret, None)
    snippet = r"""
out = {"listing": sorted(os.listdir("/workspace/tests"))}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("read", lambda: open("/workspace/tests/test_grade.py").read())
attempt("write", lambda: open("/workspace/tests/test_grade.py", "w").write("def test_answer(): pass\n"))
attempt("unlink", lambda: os.unlink("/workspace/tests/test_grade.py"))
attempt("rename_dir", lambda: os.rename("/workspace/tests", "/workspace/elsewhere"))
open("/workspace/fake.py", "w").write("def test_answer(): pass\n")
attempt("rename_over", lambda: os.rename("/workspace/fake.py", "/workspace/tests/test_grade.py"))
print(json.dumps(out))
"""
    before = await probe(t, snippet)
    assert before["listing"] == [] and before["read"] == errno.ENOENT, f"hidden tests visible: {before}"
    expect_errno(t, "write (hidden)", before["write"], {"container": errno.EROFS, "function": errno.EROFS,
                                                         "microvm": errno.EROFS, "vm": errno.EROFS})
    expect_errno(t, "rename_dir (hidden)", before["rename_dir"], {"container": errno.EBUSY, "function": errno.EBUSY,
                                                                  "microvm": errno.EBUSY, "vm": errno.EBUSY})
    if t.name in ("microvm", "vm"):
        # the uncovered view of any process outside the commands' mount namespace (the agent's, a vm's services'
        # and desktop's), through its /proc/<pid>/root: as root, and as each other user after setuid (a service
        # of that user is as dumpable as its peers) -- the commands' pid namespace shows no such process
        res = await probe(t, _PROC_ROOTS)
        assert res["comms"].get("1") == "dsec-pidns-init", res
        assert not {"dsec-agent", "systemd", "Xorg", "dbus-daemon"} & set(res["comms"].values()), res
        leaks = {k: v for k, v in res["views"].items() if v not in ([], errno.EACCES, errno.ENOENT)}
        assert not leaks, f"the hidden tests through /proc/<pid>/root: {leaks}"
    await t.backend.reveal(t.sb)
    after = await probe(t, snippet)
    assert after["listing"] == ["test_grade.py"] and after["read"] == 0, f"revealed tests not visible: {after}"
    for name in ("write", "unlink"):
        expect_errno(t, name, after[name], {"container": errno.EROFS, "function": errno.EROFS, "microvm": errno.EROFS,
                                            "vm": errno.EROFS})
    expect_errno(t, "rename_dir", after["rename_dir"], {"container": errno.EBUSY, "function": errno.EBUSY,
                                                        "microvm": errno.EBUSY, "vm": errno.EBUSY})
    expect_errno(t, "rename_over", after["rename_over"], {"container": (errno.EXDEV, errno.EROFS),
                                                          "function": (errno.EXDEV, errno.EROFS),
                                                          "microvm": (errno.EXDEV, errno.EROFS),
                                                          "vm": (errno.EXDEV, errno.EROFS)})
    assert await t.backend.read_file(t.sb, "/workspace/tests/test_grade.py", 1 << 20) == secret


_PROC_ROOTS = r"""
def view(path):
    try:
        return os.listdir(path)
    except OSError as e:
        return e.errno
def views(tag):
    return {f"{tag}:{pid}": view(f"/proc/{pid}/root/workspace/tests")
            for pid in filter(str.isdigit, os.listdir("/proc"))}
comms, uids = {}, {65534}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        comms[pid] = open(f"/proc/{pid}/comm").read().strip()
        uids.add(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        pass
found = views("root")
for uid in sorted(uids):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setgid(uid); os.setuid(uid)
        os.write(w, json.dumps(views(uid)).encode()); os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        found.update(json.loads(f.read() or "{}"))
    os.wait()
print(json.dumps({"comms": comms, "views": found}))
"""


@attack("landlock-kernel-knobs", description="write /proc/self/{comm,oom_score_adj,attr}, create files in /dev and "
                                             "open the init's /proc/1/ns/* and /proc/1/mem",
        models="container escape classic: /proc and /dev writes, inspecting the sandbox's init",
        defence="container: /proc and /dev mounted read-only (EROFS; device nodes and the shm, mqueue and pts "
                "mounts stay writable), /sys read-only; Landlock (every command) scopes ptrace: no access to the "
                "unconfined init (EACCES)",
        not_applicable={"function": "every call has its own Landlock domain (workspace and /tmp only): see the "
                                    "function backend's attacks",
                        "microvm": "the guest's own kernel: no Landlock inside the guest (the agent's /proc entries: "
                                   "see hidden-tests-then-revealed and ptrace-guest-agent)",
                        "vm": "the guest's own kernel: no Landlock inside the guest; its root owns that VM"})
async def landlock_kernel_knobs(t: Target) -> None:
    res = await probe(t, r"""
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("proc_self_comm", lambda: open("/proc/self/comm", "w").write("x"))
attempt("proc_self_oom", lambda: open("/proc/self/oom_score_adj", "w").write("-1000"))
attempt("dev_file", lambda: open("/dev/evil", "w").write("x"))
attempt("init_ns", lambda: os.open("/proc/1/ns/mnt", os.O_RDONLY))
attempt("init_mem", lambda: os.open("/proc/1/mem", os.O_RDONLY))
print(json.dumps(out))
""")
    for name, got in res.items():
        expect_errno(t, name, got, {"container": errno.EACCES if name.startswith("init_") else errno.EROFS})


@attack("pristine-grader-binaries", description="replace sha256sum and python3 in the sandbox's own layer with "
                                                "scripts that print what a grader wants, then let the grader run",
        models="incident: agents overwrote /bin/bash to subvert later checks",
        defence="container, microvm: pristine=True runs the grader on the image's untouched root (a fresh overlay "
                "over the image; microvm: its read-only disk mounted afresh), so it runs the image's binaries "
                "whatever the sandbox's layer holds; function: the root is read-only anyway (EROFS) and pristine "
                "runs on the image the same way; vm: the image's base disk, attached read-only, mounted afresh "
                "(pristine execs need a confined sandbox there, hence the grading path of this attack's spec, "
                "and the agent writes the fakes: the system is read-only to confined commands)",
        fresh=True, spec={"hidden": ["/workspace/tests"]})
async def pristine_grader_binaries(t: Target) -> None:

    fake = "#!/bin/sh\\necho 0000000000000000000000000000000000000000000000000000000000000000  PASS\\n"
    r = await t.sh(f"for f in /usr/bin/sha256sum /usr/bin/python3.11; do printf '{fake}' > $f; echo $?; done")
    replaced = r.stdout.split() == [b"0", b"0"]
    if t.name == "vm":  # the confined commands' system is read-only: the fakes come through the files API
        assert not replaced, f"a confined vm command rewrote /usr/bin: {r}"
        for f in ("/usr/bin/sha256sum", "/usr/bin/python3.11"):
            await t.backend.write_file(t.sb, f, fake.replace("\\n", "\n").encode(), 0o755)
        replaced = True
    assert replaced or t.name == "function", f"the sandbox's own layer refused a write: {r}"
    files = ("usr/bin/sha256sum", "usr/bin/python3.11")
    want = [t.image_sha(f) for f in files]
    graded = await t.sh(["sha256sum", *(f"/{f}" for f in files)], pristine=True)
    assert graded.exit_code == 0, graded
    got = [line.split()[0] for line in graded.stdout.decode().splitlines()]
    assert got == want, f"the pristine grader ran something else than the image's binaries: {graded}"
    if replaced:  # without pristine, the grader would have been fooled: the attack itself worked
        fooled = await t.sh(["sha256sum", "/usr/bin/python3.11"])
        assert b"PASS" in fooled.stdout, fooled


@attack("grading-path-parent-rename", description="rename the directory above a hidden path away (the cover moves "
                                                  "with it), make a plain directory in its place, and wait for the "
                                                  "grader to write its tests there",
        models="incident: agents read or rewrote the tests that grade them (a mount moves with a renamed parent)",
        defence="container, function, microvm: every directory above a protected or hidden path is bound over "
                "itself when the paths are mounted (the daemon's helper; microvm: the guest agent), so none can be "
                "renamed or removed (EBUSY) and the grader's files land beneath the cover",
        fresh=True, spec={"hidden": ["/workspace/grading/tests"]})
async def grading_path_parent_rename(t: Target) -> None:
    await t.backend.write_file(t.sb, "/workspace/grading/tests/test_grade.py", b"assert solve() == 42\n", None)
    r = await t.sh("mv /workspace/grading /workspace/moved; echo rc=$?; rmdir /workspace/grading 2>/dev/null; "
                   "mkdir -p /workspace/grading/tests; true")
    assert b"rc=0" not in r.stdout and b"busy" in r.stderr, f"the parent of a hidden path was renamed: {r}"
    late = b"assert solve(7) == 49\n"
    await t.backend.write_file(t.sb, "/workspace/grading/tests/test_late.py", late, None)
    r = await t.sh("ls -A /workspace/grading/tests; cat /workspace/grading/tests/test_late.py; ls -A /workspace")
    assert b"test_" not in r.stdout and late not in r.stdout, f"the grader's tests are visible: {r}"
    await t.backend.reveal(t.sb)
    r = await t.sh("cat /workspace/grading/tests/test_late.py")
    assert r.stdout == late, f"the revealed tests are not the grader's: {r}"
