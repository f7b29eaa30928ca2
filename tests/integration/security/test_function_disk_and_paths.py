"""A function sandbox's disk quota and its grading paths (protected, hidden, reveal), attacked from inside.

The workspace (all a function sandbox keeps between calls) is a tmpfs of ``disk`` bytes with a
proportional inode count, so many files each under RLIMIT_FSIZE still stop at the quota. Protected
and hidden paths are mounts in the zygote's mount namespace, which every call copies: the tests check
the very first call after create and after reveal (the zygote clones each call ahead of its request,
so a stale copy would show the old mounts), the specific errno of each attack, and that nothing stays
on the host afterwards (``checked_fn_backend``).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from container_support import INODE_BOMB, images_dir
from dsec.backends.base import ImageRef
from dsec.backends.function import FunctionBackend
from dsec.config import Settings
from dsec.errors import DSecError, InvalidRequest, PermissionDenied
from dsec.models import SandboxRecord
from dsec.testing import sandbox
from function_support import fn_leftovers, function_backend_fixtures, py, run

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024


home, backend = function_backend_fixtures("fn-disk-home")


def _fstype(mount_point: str) -> list[str]:
    return [line.split(" - ")[1].split()[0] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4] == mount_point]


# ------------------------------------------------------------------------------------------- disk
async def test_yes_and_many_small_files_stop_at_the_workspace_quota(backend: FunctionBackend,
                                                                     debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, disk="16Mi") as sb:
        assert _fstype(sb.backend_state["disk"]) == ["tmpfs"]
        r = await run(backend, sb, "yes > /workspace/flood")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
        assert r.limit == "disk", r
        stats = await backend.stats(sb)
        assert stats.disk_full and stats.disk_limit_bytes == 16 * MiB, stats
        assert 15 * MiB <= stats.disk_bytes <= 16 * MiB, stats
        # files each under RLIMIT_FSIZE (= disk) add up to the same quota, not beyond it
        r = await run(backend, sb, "rm /workspace/flood; for i in 1 2 3 4; do head -c 6M /dev/zero > /workspace/f$i "
                                   "|| break; done; du -sm /workspace | cut -f1")
        assert r.exit_code == 0 and int(r.stdout.split()[0]) <= 16, r
        assert b"No space left on device" in r.stderr, r
        # the sandbox recovers once it frees space, and an unrelated failure is not blamed on the disk
        r = await run(backend, sb, "rm /workspace/f?; echo ok > /workspace/small && cat /workspace/small")
        assert r.exit_code == 0 and r.stdout == b"ok\n", r
        r = await run(backend, sb, "exit 3")
        assert r.exit_code == 3 and r.limit is None, r
        assert not (await backend.stats(sb)).disk_full


async def test_inode_bomb_and_files_api_hit_the_quota(backend: FunctionBackend, debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, disk="16Mi") as sb:
        out = await py(backend, sb, INODE_BOMB, timeout=120)
        assert out["err"] == errno.ENOSPC and out["n"] < 20000, out
        assert (await backend.stats(sb)).disk_full
        r = await run(backend, sb, "rm -rf /workspace/* && echo freed")
        assert r.stdout == b"freed\n", r
        with pytest.raises(DSecError, match="disk is full"):
            await backend.write_file(sb, "/workspace/big", b"x" * (32 * MiB), None)
        r = await run(backend, sb, "echo still-alive")
        assert r.stdout == b"still-alive\n", r


# ------------------------------------------------------------------------------- protected and hidden
_INSIDE = r"""
import json, os
out = {}
def attempt(name, fn):
    try:
        r = fn(); out[name] = 0 if r is None or isinstance(r, int) else r
    except OSError as e:
        out[name] = e.errno
out["listing"] = sorted(os.listdir("/workspace/tests"))
attempt("read", lambda: open("/workspace/tests/test_secret.py").read())
attempt("write_in", lambda: open("/workspace/tests/test_secret.py", "w").write("def test(): pass\n"))
attempt("create_in", lambda: open("/workspace/tests/new.py", "w").write("x"))
attempt("unlink_in", lambda: os.unlink("/workspace/tests/test_secret.py"))
attempt("rename_dir", lambda: os.rename("/workspace/tests", "/workspace/moved"))
attempt("rmdir", lambda: os.rmdir("/workspace/tests"))
open("/workspace/fake.py", "w").write("def test(): pass\n")
attempt("rename_into", lambda: os.rename("/workspace/fake.py", "/workspace/tests/test_secret.py"))
out["docs"] = len(os.listdir("/usr/share/doc"))
attempt("etc_write", lambda: open("/etc/hostname", "a").write("x"))
print(json.dumps(out))
"""


async def test_hidden_then_revealed_tests_in_the_workspace(backend: FunctionBackend,
                                                           debian_python_image: ImageRef) -> None:
    async with sandbox(backend, debian_python_image, hidden=["/workspace/tests", "/usr/share/doc"],
                       protected=["/etc"]) as sb:
        secret = b"def test_answer(): assert 42 == 42\n"
        await backend.write_file(sb, "/workspace/tests/test_secret.py", secret, None)
        assert await backend.read_file(sb, "/workspace/tests/test_secret.py", 1 << 20) == secret
        names = [(e.name, e.path) for e in await backend.list_files(sb, "/workspace/tests")]
        assert names == [("test_secret.py", "/workspace/tests/test_secret.py")], names
        # the very first call (cloned ahead of its request) already sees the covers
        out = await py(backend, sb, _INSIDE, timeout=120)
        assert out["listing"] == [] and out["read"] == errno.ENOENT, out
        for name in ("write_in", "create_in"):
            assert out[name] == errno.EROFS, (name, out)
        assert out["rename_dir"] == errno.EBUSY and out["rmdir"] == errno.EBUSY, out
        assert out["rename_into"] in (errno.EXDEV, errno.EBUSY), out
        assert out["docs"] == 0, f"/usr/share/doc of the image is visible: {out}"
        assert out["etc_write"] in (errno.EROFS, errno.EACCES), out
        # the files API serves hidden paths of the image read-only, and never writes into the shared image
        assert [e.name for e in await backend.list_files(sb, "/usr/share/doc")]
        with pytest.raises(PermissionDenied, match="read-only"):
            await backend.write_file(sb, "/usr/share/doc/planted", b"x", None)

        await backend.reveal(sb)
        out = await py(backend, sb, _INSIDE, timeout=120)  # the first call after the reveal sees it
        assert out["listing"] == ["test_secret.py"] and out["read"] == secret.decode(), out
        for name in ("write_in", "create_in", "unlink_in"):
            assert out[name] == errno.EROFS, (name, out)
        assert out["rename_dir"] == errno.EBUSY and out["rename_into"] in (errno.EXDEV, errno.EBUSY), out
        assert out["docs"] > 0, out
        with pytest.raises(PermissionDenied, match="is read-only: a protected or revealed path"):
            await backend.write_file(sb, "/workspace/tests/test_secret.py", b"tampered", None)
        assert await backend.read_file(sb, "/workspace/tests/test_secret.py", 1 << 20) == secret
        # pristine: every call already runs on the untouched read-only image (the workspace as it is)
        r = await run(backend, sb, "cat /workspace/tests/test_secret.py; touch /usr/bin/x", pristine=True)
        assert r.stdout == secret and b"Read-only" in r.stderr, r


async def test_paths_survive_a_daemon_restart(backend: FunctionBackend, debian_python_image: ImageRef,
                                              home: Path) -> None:
    async with sandbox(backend, debian_python_image, hidden=["/workspace/hidden", "/workspace/later"]) as sb:
        await backend.write_file(sb, "/workspace/hidden/answer", b"42", None)
        await backend.write_file(sb, "/workspace/later/answer", b"43", None)
        await backend.reveal(sb)
        restarted = FunctionBackend(Settings(home=home, images_dir=images_dir()))
        await restarted.start()
        try:
            copy = SandboxRecord.model_validate_json(sb.model_dump_json())
            copy.backend_state["hidden"] = ["/workspace/hidden"]  # as if only "later" had been revealed
            await backend.aclose()
            assert await restarted.recover(copy) is True
            r = await run(restarted, copy, "ls /workspace/hidden; cat /workspace/later/answer; "
                                           "echo x > /workspace/later/answer")
            assert r.stdout == b"43" and b"Read-only" in r.stderr, r
            assert _fstype(copy.backend_state["disk"]) == ["tmpfs"]
            await restarted.destroy(copy)
        finally:
            await restarted.aclose()
    assert not any(fn_leftovers(home).values()), fn_leftovers(home)


async def test_bad_paths_are_clear_errors(backend: FunctionBackend, debian_python_image: ImageRef,
                                          home: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"protected": ["/workspace/tests"]}, "workspace starts empty"),
        ({"protected": ["/no/such/path"]}, "does not exist"),
        ({"hidden": ["/opt/not-in-image"]}, "not a directory of the image"),
        ({"hidden": ["/etc/passwd"]}, "not a directory of the image"),
        ({"protected": ["/bin/bash"]}, "symbolic link"),  # /bin is a symlink to usr/bin in Debian
    ]
    for spec, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            async with sandbox(backend, debian_python_image, **spec):
                pass
        assert not any(fn_leftovers(home).values()), (spec, fn_leftovers(home))
    async with sandbox(backend, debian_python_image) as sb:
        await backend.reveal(sb)  # nothing hidden: a no-op
        r = await run(backend, sb, "echo fine")
        assert r.stdout == b"fine\n", r
