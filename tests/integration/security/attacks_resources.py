"""Resource exhaustion: fork, memory, disk, inode and descriptor bombs.

Each runs in a sandbox of its own with small limits and asserts the limit that stops it (the pids
cgroup, the memory cgroup's OOM kill reported as ``limit="memory"``, ENOSPC at the disk size, EMFILE at
the descriptor rlimit). The suite's host check afterwards holds the host's disk to account. Every bomb is
bounded on its own too (a count or ``timeout``), so a missing defence shows as a failed assertion, never
as a host filled up.
"""

from __future__ import annotations

import errno

from redteam import (
    VM_BACKENDS,
    MiB,
    Target,
    assert_vm_disk_bounded,
    attack,
    fill_vm_disk,
    guest_kernel_is_own,
    probe,
)

_VM_DISK = ("vm: the guest's own filesystem on a disk of fixed size (a qcow2 overlay on the host), filled first "
            "but 32 MiB (its 4 GiB would take minutes under TCG): ENOSPC in the guest, the overlay bounded")
_CAP_MIB = 768
"""A disk bomb stops by itself after this much: far beyond the 64 MiB the sandbox may use, far below harm."""


@attack("fork-bomb", description="fork without end (each child forks again), bounded at 20 s",
        models="resource exhaustion: fork bomb",
        defence="container, function, microvm: the pids limit of the sandbox (cgroup pids.max, or the guest's "
                "own process table in its own memory): forks fail with EAGAIN, the host's pid space is untouched",
        fresh=True, spec={"pids": 64})
async def fork_bomb(t: Target) -> None:
    res = await probe(t, r"""
import time
count, err = 0, 0
children = []
deadline = time.monotonic() + 10
while time.monotonic() < deadline and count < 5000:
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    children.append(pid)
    count += 1
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"count": count, "err": err}))
""")
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        assert res["err"] in (0, errno.EAGAIN, errno.ENOMEM), res
        return
    assert res["err"] == errno.EAGAIN, f"forking never failed: {res}"
    assert res["count"] < 64, f"forked {res['count']} processes with pids=64"


@attack("memory-bomb", description="allocate and touch memory without end",
        models="resource exhaustion: memory bomb",
        defence="container, function: the memory cgroup OOM-kills the command (limit='memory'); microvm: the "
                "guest's RAM is the limit (its own OOM killer, limit='memory'); vm: the guest agent's commands "
                "cgroup, whose memory.max the backend sets to the spec's memory, OOM-kills the command "
                "(limit='memory'), the guest, its services and its desktop live on",
        fresh=True, spec={"memory": "128Mi"})
async def memory_bomb(t: Target) -> None:
    r = await t.sh(["python3", "-c", "b = []\nwhile len(b) < 4096: b.append(bytearray(1 << 20))\nprint('survived')"],
                   timeout=120)
    assert b"survived" not in r.stdout, f"allocated 4 GiB with memory=128Mi: {r}"
    assert r.limit == "memory", f"the command ended, but not by the memory limit: {r}"
    if t.name == "vm":
        # the limit is the spec's (128 MiB), not the guest's RAM less the system's share
        cg = await t.sh("cat /sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)/memory.max", timeout=60)
        assert cg.stdout.strip() == str(128 << 20).encode(), f"the commands' memory.max is not memory=128Mi: {cg}"
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)


@attack("disk-fill", description=f"`yes > file` in the workspace until the disk is full (stops itself at "
                                 f"{_CAP_MIB} MiB)",
        models="incident: agents filled tens of GB with `yes`; resource exhaustion: disk bomb",
        defence="microvm: the overlay's size; container, function: the writable layer (function: the workspace) "
                "is a tmpfs of the spec's disk size (ENOSPC at it, limit=\"disk\"); " + _VM_DISK,
        fresh=True, spec={"disk": "64Mi"})
async def disk_fill(t: Target) -> None:
    if t.name == "vm":
        await fill_vm_disk(t)
    r = await t.sh(f"yes | head -c {_CAP_MIB}M > /workspace/fill; echo rc=$?; du -sm /workspace/fill; "
                   "rm -f /workspace/fill", timeout=180)
    lines = r.stdout.decode().split()
    written = int(lines[1]) if len(lines) > 1 and lines[1].isdigit() else 0
    assert written < 128, f"wrote {written} MiB into a sandbox with disk=64Mi: no quota stopped it ({r})"
    assert b"No space left on device" in r.stderr or b"rc=1" in r.stdout, r
    if t.name == "vm":
        assert_vm_disk_bounded(t)


@attack("inode-bomb", description="create empty files until no inode is left (stops itself at 25,000)",
        models="resource exhaustion: inode bomb",
        defence="microvm: the guest's overlay tmpfs's inode limit; container: the writable layer's tmpfs inode "
                "limit; function: the workspace tmpfs's inode limit (each disk / 16 KiB, at least 16,384); vm: the "
                "guest's own ext4 on a disk of fixed size (a fixed inode table, disk / 16 KiB), filled first but "
                "64 KiB (its 262,144 inodes would take many minutes under TCG): the directory cannot grow, ENOSPC, "
                "and the host's overlay stays bounded",
        fresh=True, spec={"disk": "64Mi"})
async def inode_bomb(t: Target) -> None:
    if t.name == "vm":
        await fill_vm_disk(t, leave_kib=64)  # a directory of a few thousand names needs more
    # (On the vm, the disk filled but 64 KiB: ext4's reservations may leave no block for the directory itself.)
    res = await probe(t, r"""
n, err = 0, 0
try:
    os.makedirs("/workspace/inodes", exist_ok=True)
except OSError as e:
    err = e.errno  # not even the directory: nothing left to create names in
while n < 25000 and not err:
    try:
        os.close(os.open("/workspace/inodes/%d" % n, os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as e:
        err = e.errno
        break
    n += 1
import shutil
shutil.rmtree("/workspace/inodes", ignore_errors=True)
print(json.dumps({"n": n, "err": err}))
""", timeout=240)  # 25,000 creates take most of a minute in an emulated (TCG) VM
    assert res["err"] in (errno.ENOSPC, errno.EDQUOT), f"created {res['n']} files without hitting a limit: {res}"
    if t.name == "vm":
        assert_vm_disk_bounded(t)


@attack("fd-bomb", description="open descriptors until the table is full",
        models="resource exhaustion: descriptor bomb",
        defence="container, function: RLIMIT_NOFILE (EMFILE at the sandbox's limit, never the host's file-max); "
                "microvm: the guest's own limits")
async def fd_bomb(t: Target) -> None:
    res = await probe(t, r"""
import resource
fds, err = [], 0
while len(fds) < 1 << 20:
    try:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        err = e.errno
        break
n = len(fds)
for fd in fds:
    os.close(fd)
print(json.dumps({"n": n, "err": err, "limit": resource.getrlimit(resource.RLIMIT_NOFILE)}))
""")
    assert res["err"] in (errno.EMFILE, errno.ENFILE), res
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        return
    assert res["err"] == errno.EMFILE and res["limit"][1] <= 65536, f"descriptor limit too high: {res}"


@attack("output-bomb-binary", description="64 MiB of output on stdout and 8 MiB on stderr as fast as possible",
        models="resource exhaustion: output bomb aimed at the daemon's memory",
        defence="all: each stream captured up to max_output, the rest drained and dropped (truncated=True)")
async def output_bomb(t: Target) -> None:
    r = await t.sh("head -c 64M /dev/zero | tr '\\0' x; head -c 8M /dev/zero >&2", max_output=2 * MiB,
                   timeout=120)
    assert r.truncated and len(r.stdout) <= 2 * MiB and len(r.stderr) <= 2 * MiB, \
        f"output not capped: {len(r.stdout)} + {len(r.stderr)} bytes, truncated={r.truncated}"


@attack("disk-fill-many-files", description="fill the disk with many files each under the size limit "
                                            "(6 x 40 MiB into a sandbox with disk=64Mi)",
        models="resource exhaustion: disk bomb that dodges a per-file size limit",
        defence="microvm: the overlay's size; container: the writable layer's tmpfs size; function: the "
                "workspace is a tmpfs of the disk size (ENOSPC at it, limit=\"disk\"); " + _VM_DISK,
        fresh=True, spec={"disk": "64Mi"})
async def disk_fill_many_files(t: Target) -> None:
    if t.name == "vm":
        await fill_vm_disk(t)
    r = await t.sh("for i in 1 2 3 4 5 6; do head -c 40M /dev/zero > /workspace/f$i || break; done; "
                   "du -sm /workspace | cut -f1; rm -f /workspace/f?", timeout=180)
    total = int(r.stdout.split()[0]) if r.stdout.split() and r.stdout.split()[0].isdigit() else -1
    assert 0 <= total < 128, f"{total} MiB written into a sandbox with disk=64Mi ({r})"
    if t.name == "vm":
        assert_vm_disk_bounded(t)
