"""The writable layer's disk quota and protected paths of a real container sandbox, attacked from inside.

The sandboxed code runs as the sandbox's root and tries what agents did: fill the disk with ``yes``,
exhaust inodes, and rewrite, rename, unlink, clone into, swap extents of, or unmount files the grader
relies on. Each test asserts the specific defence (ENOSPC + ``limit="disk"``, EROFS, EBUSY, EPERM) and
that the host and the protected bytes are unchanged afterwards.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from container_support import INODE_BOMB, checked_backend, holder_mountinfo, leftovers, py, run, swept_home
from dsec.backends.base import ImageRef
from dsec.backends.container import ContainerBackend
from dsec.errors import DSecError, InvalidRequest
from dsec.models import SandboxRecord, SandboxSpec
from dsec.testing import sandbox

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, debian_python_image: ImageRef) -> Iterator[Path]:
    with swept_home(tmp_path_factory.mktemp("disk-home")) as path:
        yield path


@pytest.fixture
async def backend(home: Path) -> AsyncIterator[ContainerBackend]:
    async with checked_backend(home) as b:
        yield b


# ------------------------------------------------------------------------------------------- disk
async def test_yes_fills_only_the_sandbox_disk(backend: ContainerBackend, debian_python_image: ImageRef,
                                               home: Path) -> None:
    async with sandbox(backend, debian_python_image, disk="16Mi") as sb:
        r = await run(backend, sb, "yes > /workspace/flood")
        assert r.exit_code != 0, r
        assert b"No space left on device" in r.stderr, r
        assert r.limit == "disk", r
        stats = await backend.stats(sb)
        assert stats.disk_full and stats.disk_limit_bytes == 16 * MiB, stats
        assert 15 * MiB <= stats.disk_bytes <= 16 * MiB, stats
        # the host's filesystem did not take the writes: the layer is the sandbox's own tmpfs (a free-space
        # comparison would be flaky on a shared machine)
        disk = sb.backend_state["disk"]
        fstypes = [line.split(" - ")[1].split()[0] for line in holder_mountinfo(backend.settings.home)
                   if line.split()[4] == disk]
        assert fstypes == ["tmpfs"], fstypes
        assert Path(sb.backend_state["upper"]).is_relative_to(disk)
        # the sandbox recovers once it frees space, and an unrelated failure is not blamed on the disk
        r = await run(backend, sb, "rm /workspace/flood && echo ok > /workspace/small && cat /workspace/small")
        assert r.exit_code == 0 and r.stdout == b"ok\n", r
        r = await run(backend, sb, "exit 3")
        assert r.exit_code == 3 and r.limit is None, r
        assert not (await backend.stats(sb)).disk_full


async def test_files_api_write_past_the_disk_limit_is_a_clear_error(backend: ContainerBackend,
                                                                    debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, disk="4Mi") as sb:
        with pytest.raises(DSecError, match="disk is full"):
            await backend.write_file(sb, "/workspace/big", b"x" * (8 * MiB), None)
        r = await run(backend, sb, "echo still-alive")
        assert r.stdout == b"still-alive\n", r


async def test_inode_bomb_hits_the_disk_limit(backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, disk="16Mi") as sb:
        out = await py(backend, sb, INODE_BOMB)
        assert out["err"] == errno.ENOSPC and out["n"] < 200000, out
        assert (await backend.stats(sb)).disk_full


def test_disk_spec_is_validated() -> None:
    with pytest.raises(ValidationError, match="disk"):
        SandboxSpec(image="x", disk="512Ki")
    with pytest.raises(ValidationError, match="disk"):
        SandboxSpec(image="x", disk="lots")


# ------------------------------------------------------------------------------------ protected paths
_PROTECTED = ["/usr/bin", "/etc/passwd"]

_ATTACKS = r"""
import ctypes, fcntl, json, os
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("overwrite_file", lambda: open("/etc/passwd", "a").write("evil::0:0::/:/bin/sh\n"))
attempt("replace_bash", lambda: open("/usr/bin/bash", "wb").write(b"#!/bin/sh\nexit 0\n"))
attempt("create_in_dir", lambda: open("/usr/bin/evil", "w").write("x"))
attempt("unlink_file", lambda: os.unlink("/etc/passwd"))
attempt("unlink_in_dir", lambda: os.unlink("/usr/bin/python3"))
attempt("rename_file_away", lambda: os.rename("/etc/passwd", "/etc/passwd.old"))
attempt("rename_dir_away", lambda: os.rename("/usr/bin", "/usr/bin.old"))
open("/workspace/fake", "w").write("#!/bin/sh\necho pwned\n")
attempt("rename_over_file", lambda: os.rename("/workspace/fake", "/etc/passwd"))
attempt("rename_over_binary", lambda: os.rename("/workspace/fake", "/usr/bin/python3"))
attempt("chmod_binary", lambda: os.chmod("/usr/bin/bash", 0o777))
attempt("hardlink_into_dir", lambda: os.link("/workspace/fake", "/usr/bin/evil2"))
attempt("symlink_into_dir", lambda: os.symlink("/workspace/fake", "/usr/bin/evil3"))
attempt("truncate_file", lambda: os.truncate("/etc/passwd", 0))
src = os.open("/workspace/fake", os.O_RDWR)
ro = os.open("/usr/bin/bash", os.O_RDONLY)
for name, req in (("FICLONE", 0x40049409), ("FICLONERANGE", 0x4020940D), ("XFS_IOC_SWAPEXT", 0xC0C0586D)):
    attempt(name, lambda: fcntl.ioctl(ro, req, src))
libc = ctypes.CDLL(None, use_errno=True)
def sysret(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), "")
attempt("umount", lambda: sysret(libc.umount2(b"/usr/bin", 2)))
attempt("remount_rw", lambda: sysret(libc.mount(None, b"/usr/bin", None, 32 | 4096, None)))
attempt("mount_over", lambda: sysret(libc.mount(b"/workspace", b"/usr/bin", None, 4096, None)))
print(json.dumps(out))
"""

_WANT = {
    "overwrite_file": errno.EROFS, "replace_bash": errno.EROFS, "create_in_dir": errno.EROFS,
    "unlink_file": errno.EBUSY, "unlink_in_dir": errno.EROFS, "rename_file_away": errno.EBUSY,
    # /etc is bound over itself (the directories above a protected path are pinned): a rename into it
    # crosses a mount edge (EXDEV) before the target's EBUSY
    "rename_dir_away": errno.EBUSY, "rename_over_file": errno.EXDEV, "rename_over_binary": errno.EXDEV,
    "chmod_binary": errno.EROFS, "hardlink_into_dir": errno.EROFS, "symlink_into_dir": errno.EROFS,
    "truncate_file": errno.EROFS,
    # seccomp answers first for the ioctls and the mount family (EPERM); the read-only mount stands behind it
    "FICLONE": errno.EPERM, "FICLONERANGE": errno.EPERM, "XFS_IOC_SWAPEXT": errno.EPERM,
    "umount": errno.EPERM, "remount_rw": errno.EPERM, "mount_over": errno.EPERM,
}


async def _digests(backend: ContainerBackend, sb: SandboxRecord) -> str:
    r = await run(backend, sb, "sha256sum /etc/passwd /usr/bin/bash /usr/bin/python3; ls /usr/bin | sha256sum")
    assert r.exit_code == 0, r
    return r.stdout.decode()


async def test_protected_paths_resist_every_rewrite_trick(backend: ContainerBackend,
                                                          debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, protected=_PROTECTED) as sb:
        before = await _digests(backend, sb)
        out = await py(backend, sb, _ATTACKS)
        wrong = {k: (os.strerror(v) if v else "succeeded") for k, v in out.items() if v != _WANT[k]}
        assert not wrong, f"attacks not stopped as expected: {wrong} (all: {out})"
        assert await _digests(backend, sb) == before
        # readable, and the grader's tools still run
        r = await run(backend, sb, "grep -c root /etc/passwd && python3 -c 'print(6*7)'")
        assert r.exit_code == 0 and r.stdout.split() == [b"1", b"42"], r
        # the files API (the daemon writing from the host) meets the same read-only mount (EROFS)
        with pytest.raises(DSecError, match="read-only path"):
            await backend.write_file(sb, "/etc/passwd", b"root::0:0::/:/bin/sh\n", None)
        # the rest of the sandbox stays writable
        r = await run(backend, sb, "echo ok > /etc/motd && echo ok > /usr/local/bin/mine && cat /etc/motd")
        assert r.exit_code == 0 and r.stdout == b"ok\n", r


async def test_protected_path_must_exist_and_not_pass_a_symlink(backend: ContainerBackend,
                                                                debian_python_image: ImageRef, home: Path) -> None:
    for bad, reason in (("/no/such/grader", "does not exist"), ("/bin", "symbolic link")):
        with pytest.raises(InvalidRequest, match=reason):
            async with sandbox(backend, debian_python_image, protected=[bad]):
                pass
        left = leftovers(home)
        left.pop("shared")  # shared by the home's sandboxes while the backend runs
        assert not any(left.values()), left


@pytest.mark.parametrize("bad", ["relative/path", "/", "/a/../etc", "/a/./b", "/a\0b"])
def test_protected_spec_is_validated(bad: str) -> None:
    with pytest.raises(ValidationError, match="protected and hidden"):
        SandboxSpec(image="x", protected=[bad])


def test_protected_paths_are_normalised() -> None:
    assert SandboxSpec(image="x", protected=["/workspace/tests/"]).protected == ["/workspace/tests"]


async def test_protected_sha_of_bash_matches_the_image(backend: ContainerBackend,
                                                       debian_python_image: ImageRef) -> None:
    """What a grader runs under a protected /usr/bin is the image's own binary, byte for byte."""
    async with sandbox(backend, debian_python_image, protected=["/usr/bin"]) as sb:
        r = await run(backend, sb, "sha256sum /usr/bin/bash")
        assert r.exit_code == 0, r
        image_bash = (debian_python_image.rootfs / "usr/bin/bash").read_bytes()
        assert r.stdout.split()[0].decode() == hashlib.sha256(image_bash).hexdigest()


# ------------------------------------------------------------------------------------------- Landlock
_LANDLOCK_PROBE = r"""
import json, os
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("write_proc_self_comm", lambda: open("/proc/self/comm", "w").write("x"))
attempt("write_proc_self_oom", lambda: open("/proc/self/oom_score_adj", "w").write("0"))
attempt("mkdir_dev", lambda: os.mkdir("/dev/evil"))
attempt("create_dev_file", lambda: open("/dev/evil-file", "w").write("x"))
attempt("write_dev_null", lambda: open("/dev/null", "w").write("x"))
attempt("write_dev_shm", lambda: open("/dev/shm/ok", "w").write("x"))
attempt("write_tmp", lambda: open("/tmp/ok", "w").write("x"))
attempt("write_etc", lambda: open("/etc/ok", "w").write("x"))
attempt("rename_across_dirs", lambda: os.rename("/tmp/ok", "/workspace/ok"))
attempt("mkdir_usr_local", lambda: os.mkdir("/usr/local/ok"))
attempt("mkdir_top_level", lambda: os.mkdir("/app"))
attempt("write_new_top_level_file", lambda: open("/new-file", "w").write("x"))
attempt("mknod_fifo_tmp", lambda: os.mkfifo("/tmp/fifo"))
attempt("open_init_ns", lambda: os.open("/proc/1/ns/mnt", os.O_RDONLY))
print(json.dumps(out))
"""


async def test_landlock_confines_writes_of_every_command(backend: ContainerBackend,
                                                         debian_python_image: ImageRef) -> None:
    allowed = {"write_dev_null", "write_dev_shm", "write_tmp", "write_etc", "rename_across_dirs", "mkdir_usr_local",
               "mkdir_top_level", "write_new_top_level_file", "mknod_fifo_tmp"}
    async with sandbox(backend, debian_python_image) as sb:
        out = await py(backend, sb, _LANDLOCK_PROBE)
        assert {k for k, v in out.items() if v == 0} == allowed, out
        # /proc and /dev are read-only mounts; Landlock's ptrace scoping keeps the init's /proc entries closed
        refused = {k: v for k, v in out.items() if k not in allowed}
        assert refused == {"write_proc_self_comm": errno.EROFS, "write_proc_self_oom": errno.EROFS,
                           "mkdir_dev": errno.EROFS, "create_dev_file": errno.EROFS,
                           "open_init_ns": errno.EACCES}, out
        # what the probe created at the top level, the next command writes into
        r = await run(backend, sb, "echo ok > /app/file && echo ok >> /new-file && cat /app/file")
        assert r.exit_code == 0 and r.stdout == b"ok\n", r
        # ...and one command may create a top-level directory and write into it at once
        r = await run(backend, sb, "mkdir /app2 && echo x > /app2/f && mkdir -p /opt2/a/b && echo y > /opt2/a/b/g"
                                   " && cat /app2/f /opt2/a/b/g")
        assert r.exit_code == 0 and r.stdout == b"x\ny\n", r
        # a background process started by one command stays confined (Landlock is inherited)
        r = await run(backend, sb, "sh -c 'sleep 0.2; head -c1 /proc/1/environ >/dev/null; echo rc=$? > /tmp/bg' &"
                                   " sleep 0.6; cat /tmp/bg")
        assert r.stdout.startswith(b"rc=") and r.stdout.strip() != b"rc=0", r
        assert b"'/proc/1/environ' for reading: Permission denied" in r.stderr, r
    async with sandbox(backend, debian_python_image, landlock=False) as sb:
        out = await py(backend, sb, _LANDLOCK_PROBE)
        assert out["write_proc_self_comm"] == 0 and out["create_dev_file"] == 0, out


# ------------------------------------------------------------------------------------------- pristine
async def test_pristine_exec_runs_the_images_binaries_on_the_agents_workspace(
        backend: ContainerBackend, debian_python_image: ImageRef) -> None:
    image_bash = hashlib.sha256((debian_python_image.rootfs / "usr/bin/bash").read_bytes()).hexdigest()
    async with sandbox(backend, debian_python_image) as sb:
        # the agent subverts the tools a grader would use, and leaves its work in the workspace
        r = await run(backend, sb, "printf '#!/bin/sh\\necho ALL TESTS PASSED\\n' > /usr/bin/python3.11; "
                                   "cp /usr/bin/python3.11 /usr/bin/bash; echo 'root::0:0::/:/bin/sh' > /etc/passwd; "
                                   "echo 'print(6 * 7)' > /workspace/solution.py; echo scratch > /tmp/agent-tmp")
        assert r.exit_code == 0, r
        assert (await run(backend, sb, "python3 /workspace/solution.py")).stdout == b"ALL TESTS PASSED\n"
        r = await run(backend, sb, "python3 solution.py; sha256sum /usr/bin/bash; grep -c '^root:x:' /etc/passwd; "
                                   "ls /tmp; touch /workspace/from-grader; echo x > /usr/bin/evil",
                      pristine=True)
        lines = r.stdout.decode().splitlines()
        assert lines[0] == "42" and lines[1].split()[0] == image_bash and lines[2] == "1", r
        assert "agent-tmp" not in r.stdout.decode(), r  # a fresh /tmp
        # what a pristine command writes outside the workspace is thrown away with it; the image stays untouched
        r = await run(backend, sb, "ls /usr/bin/evil", pristine=True)
        assert r.exit_code != 0, r
        assert not (debian_python_image.rootfs / "usr/bin/evil").exists()
        # what the grader wrote in the workspace is the sandbox's; the agent's root is as the agent left it
        r = await run(backend, sb, "ls /workspace/from-grader && cat /usr/bin/bash | head -c 9")
        assert r.exit_code == 0 and r.stdout.endswith(b"#!/bin/sh"), r


async def test_pristine_exec_in_a_directory_the_agent_made(backend: ContainerBackend,
                                                           debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        r = await run(backend, sb, "mkdir -p /srv/agent/made && echo mine > /srv/agent/made/f")
        assert r.exit_code == 0, r
        r = await run(backend, sb, "cat f; ls /srv/agent", cwd="/srv/agent/made", pristine=True)
        assert r.exit_code == 0 and r.stdout == b"mine\nmade\n", r
        with pytest.raises(InvalidRequest, match="/no/such/dir"):
            await run(backend, sb, "pwd", cwd="/no/such/dir", pristine=True)


# ------------------------------------------------------------------------------------------- hidden
async def test_hidden_paths_are_invisible_until_revealed(backend: ContainerBackend,
                                                         debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, hidden=["/workspace/tests", "/opt/grader"]) as sb:
        # the grader puts its tests in through the files API, beneath the cover
        await backend.write_file(sb, "/workspace/tests/test_secret.py", b"ANSWER = 42\n", None)
        await backend.write_file(sb, "/opt/grader/key", b"s3cret\n", None)
        assert await backend.read_file(sb, "/workspace/tests/test_secret.py", 1024) == b"ANSWER = 42\n"
        assert [e.name for e in await backend.list_files(sb, "/workspace/tests")] == ["test_secret.py"]
        # the agent looks everywhere it can, and tries to get under the cover
        r = await run(backend, sb, "ls -A /workspace/tests /opt/grader; grep -rs s3cret /workspace /opt /tmp /root; "
                                   "find / -path /proc -prune -o -name 'test_secret*' -print 2>/dev/null; echo done",
                      timeout=120)
        assert r.stdout.split(b"\n")[-2:] == [b"done", b""] and b"s3cret" not in r.stdout, r
        assert b"test_secret" not in r.stdout, r
        out = await py(backend, sb, r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
attempt("write_into", lambda: open("/workspace/tests/planted.py", "w").write("x"))
attempt("rename_cover", lambda: os.rename("/workspace/tests", "/workspace/t2"))
attempt("rmdir_cover", lambda: os.rmdir("/opt/grader"))
out["umount"] = 0 if libc.umount2(b"/workspace/tests", 2) == 0 else ctypes.get_errno()
print(json.dumps(out))
""")
        assert out == {"write_into": errno.EROFS, "rename_cover": errno.EBUSY, "rmdir_cover": errno.EBUSY,
                       "umount": errno.EPERM}, out
        # a pristine exec before the reveal does not see them either
        r = await run(backend, sb, "ls -A tests", pristine=True)
        assert r.stdout == b"", r
        await backend.reveal(sb)
        r = await run(backend, sb, "cat /workspace/tests/test_secret.py /opt/grader/key; echo x >> /opt/grader/key")
        assert r.stdout == b"ANSWER = 42\ns3cret\n" and b"Read-only file system" in r.stderr, r
        r = await run(backend, sb, "python3 -c 'import sys; sys.path.insert(0, \"tests\"); import test_secret; "
                                   "print(test_secret.ANSWER)'", pristine=True)
        assert r.stdout == b"42\n", r
        # after the reveal, the files API sees the sandbox's own (read-only) view
        with pytest.raises(DSecError, match="read-only path"):
            await backend.write_file(sb, "/workspace/tests/late.py", b"", None)
