"""Attacks on the daemon's files API, which runs with host privileges on paths the sandbox controls.

Symlink and hard-link races, ``..`` traversal, magic links and malformed paths: the daemon must
resolve every path inside the sandbox's root (``openat2`` RESOLVE_IN_ROOT on container and function,
the guest agent inside the VM on microvm) and answer bad input with a clear error, never a host file.
"""

from __future__ import annotations

import asyncio
import contextlib

from redteam import MiB, Target, attack

from dsec.errors import DSecError
from dsec.models import ExecRequest

_RACE_SECONDS = 8


@attack("files-symlink-race", description="flip a workspace directory between a real directory and a symlink to "
                                          "the host's /tmp while the files API writes and reads through it",
        models="escape classic: symlink race (TOCTOU) in a privileged file copier (docker cp CVE-2018-15664)",
        defence="container, function: every path resolved by openat2(RESOLVE_IN_ROOT) against the sandbox's root in "
                "one step (a symlink to /tmp is the sandbox's /tmp); microvm: paths resolved by the guest agent",
        fresh=True)
async def files_symlink_race(t: Target) -> None:
    name = t.host_marker.name
    flip = (f"end=$(($(date +%s)+{_RACE_SECONDS})); while [ $(date +%s) -lt $end ]; do "
            "rm -rf /workspace/d; mkdir /workspace/d; rm -rf /workspace/d; ln -s /tmp /workspace/d; done; echo done")
    racer = asyncio.create_task(t.backend.exec(t.sb, ExecRequest(command=flip, timeout=60)))
    attempts = 0
    try:
        while not racer.done():
            with contextlib.suppress(DSecError):
                await t.backend.write_file(t.sb, f"/workspace/d/{name}", b"pwned", None)
            with contextlib.suppress(DSecError):
                await t.backend.read_file(t.sb, "/workspace/d/../../../../etc/shadow", MiB)
            attempts += 1
            assert not t.host_marker.exists(), f"the files API wrote {t.host_marker} on the host"
    finally:
        r = await racer
    assert r.stdout.endswith(b"done\n"), r
    assert attempts > 10, f"only {attempts} writes raced the flip"


@attack("files-hardlink", description="hard-link the image's /etc/passwd into the workspace and overwrite the link "
                                      "through the files API",
        models="escape classic: hard-link attack on a privileged writer (write through a link into a shared file)",
        defence="container, microvm: the link is in the sandbox's own layer (copy-up), so the image and every other "
                "sandbox keep the original; function: the root is read-only and a cross-mount link fails (EXDEV)",
        fresh=True)
async def files_hardlink(t: Target) -> None:
    image_passwd = t.image_sha("etc/passwd")
    r = await t.sh("ln /etc/passwd /workspace/pw; echo rc=$?")
    if t.name == "function":
        assert b"rc=0" not in r.stdout and b"Invalid cross-device link" in r.stderr, r
    with contextlib.suppress(DSecError):
        await t.backend.write_file(t.sb, "/workspace/pw", b"root::0:0::/root:/bin/sh\n", None)
    assert t.image_sha("etc/passwd") == image_passwd, \
        "the image's /etc/passwd was changed through a hard link"
    async with t.neighbour() as other:
        r = await t.backend.exec(other, ExecRequest(command="sha256sum /etc/passwd"))
        assert r.stdout.split()[0].decode() == image_passwd, f"a neighbour sees a changed /etc/passwd: {r}"


@attack("files-bad-paths", description="files API with '..' escapes, magic links, NUL bytes, relative, empty and "
                                       "overlong paths",
        models="API abuse: path traversal into the host",
        defence="all: paths validated and resolved inside the sandbox (InvalidRequest or the sandbox's own file; "
                "never the host's)")
async def files_bad_paths(t: Target) -> None:
    with open("/etc/shadow", "rb") as f:
        host_shadow = f.read()
    try:
        own_shadow: bytes | None = await t.backend.read_file(t.sb, "/etc/shadow", MiB)
    except DSecError:  # function: the files API serves only its own mounts, not the image's lower files
        own_shadow = None
    assert own_shadow != host_shadow, "test setup: the image's /etc/shadow equals the host's"
    for path in ("/../../../../../etc/shadow", "/workspace/../../../etc/shadow", "/proc/1/root/etc/shadow",
                 "/proc/self/root/etc/shadow", "/etc/shadow\0.txt", "etc/shadow", "", "/" + "a/" * 3000):
        try:
            data = await t.backend.read_file(t.sb, path, MiB)
        except DSecError:
            continue
        assert data != host_shadow, f"{path!r} returned the host's /etc/shadow"
        assert data == own_shadow, f"{path!r} returned something other than the sandbox's /etc/shadow"
    for path in ("/../../../../.." + str(t.host_marker), "/proc/self/root" + str(t.host_marker),
                 str(t.host_marker) + "\0x"):
        with contextlib.suppress(DSecError):
            await t.backend.write_file(t.sb, path, b"pwned", None)
        assert not t.host_marker.exists(), f"{path!r} wrote on the host"
