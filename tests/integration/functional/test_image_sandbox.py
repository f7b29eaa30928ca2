"""A real container sandbox started from images that came through the importers: pulled from a registry on
loopback and imported from a ``docker save`` archive. Files, whiteouts, setuid bits, ownership and the image
config (Env, WorkingDir, User) are checked from *inside* the sandbox."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import missing
from container_support import checked_backend, short_home, sweep
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import InvalidRequest
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages
from dsec.images.oci_import import ImageSource, import_image, open_source
from dsec.images.registry import RegistryClient, pull
from dsec.models import ExecRequest, ExecResult, SandboxSpec
from image_builders import OCI_MANIFEST, Entry, Image, d, f, sha, sym
from registry_support import running_registry

pytestmark = [pytest.mark.root, pytest.mark.slow]

APPLETS = ("sh", "env", "id", "pwd", "cat", "ls", "stat", "echo", "test")


def runnable_image(user: str = "app", extra: tuple[Entry, ...] = ()) -> Image:
    """Busybox (static) over a merged-/usr layout in layer 1; layer 2 writes through the /bin symlink,
    whites out ``ls``, adds a setuid file and a home owned by the image's user."""
    busybox = shutil.which("busybox")
    if busybox is None:
        missing("busybox is not installed: run ./scripts/setup (apt-get install busybox-static)")
        raise AssertionError  # unreachable
    base: list[Entry] = [
        d("usr"), d("usr/bin"), f("usr/bin/busybox", Path(busybox).read_bytes(), mode=0o755),
        *[sym(f"usr/bin/{a}", "busybox") for a in APPLETS],
        sym("bin", "usr/bin"), d("etc"), d("tmp", mode=0o1777), d("root", mode=0o700),
        f("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"),
        f("etc/group", "root:x:0:\napp:x:1000:\nstaff:x:50:app\n"),
    ]
    upper: list[Entry] = [
        f("bin/tool", "#!/bin/sh\necho tool-ran \"$@\"\n", mode=0o755),    # lands in usr/bin via the symlink
        f("usr/bin/.wh.ls"),
        f("usr/bin/suid", "x", mode=0o4755),
        d("home"), d("home/app", mode=0o750, uid=1000, gid=1000),
        f("home/app/notes", "mine\n", uid=1000, gid=1000, mode=0o600),
        *extra,
    ]
    return Image.build([base, upper], compression=["gzip", "zstd"],
                       env=["PATH=/usr/bin:/bin", "GREETING=hello from the image config"],
                       workdir="/home/app/work", user=user)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, ImageStore]]:
    home = short_home("dsec-img-")
    settings = Settings(home=home, images_dir=tmp_path / "images")
    store = ImageStore(tmp_path / "images")
    try:
        async with checked_backend(home) as backend:
            eng = Engine(settings, {"container": backend}, NodeImages(settings, store, tag_ttl=0))
            yield eng, store
    finally:
        removed = await sweep(home, tmp_path / "images")
        shutil.rmtree(home, ignore_errors=True)
        assert removed == []


def source(path: Path) -> ImageSource:
    found = open_source(path)
    assert found is not None
    return found


async def sh(eng: Engine, sandbox_id: str, command: str) -> ExecResult:
    return await eng.exec(sandbox_id, ExecRequest(command=command, timeout=30))


async def test_sandbox_from_pulled_image(engine: tuple[Engine, ImageStore], tmp_path: Path) -> None:
    eng, store = engine
    img = runnable_image()
    with running_registry(tmp_path / "registry") as reg:
        with RegistryClient(reg.host, insecure=True) as client:
            for digest, blob in img.blobs.items():
                if digest != sha(img.manifest):
                    client.push_blob("agents/busy", blob)
            client.push_manifest("agents/busy", "v1", img.manifest, OCI_MANIFEST)
        info, _ = pull(store, f"{reg.host}/agents/busy:v1", uid_shift=Settings().uid_shift, insecure=True,
                       name="busy")
    assert info.config.user == "app"
    sb = await eng.create(SandboxSpec(image="busy"))
    try:
        assert sb.spec.workdir == "/home/app/work"  # the image's WorkingDir became the sandbox's
        r = await sh(eng, sb.id, 'id -u; id -g; pwd; echo "$GREETING"; echo "$HOME"; tool a b')
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().splitlines() == ["1000", "1000", "/home/app/work", "hello from the image config",
                                                  "/home/app", "tool-ran a b"]
        r = await sh(eng, sb.id, "[ -e /usr/bin/ls ] || [ -L /usr/bin/ls ] || echo no-ls; "
                                 "stat -c '%a %u:%g' /usr/bin/suid /home/app /home/app/notes; "
                                 "cat /home/app/notes; readlink /bin")
        assert r.stdout.decode().splitlines() == ["no-ls", "4755 0:0", "750 1000:1000", "600 1000:1000", "mine",
                                                  "usr/bin"], r.stderr
        # the spec still wins over the image, per call and per sandbox
        r = await eng.exec(sb.id, ExecRequest(command="pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "call"}))
        assert r.stdout.decode().split() == ["/tmp", "call"]
    finally:
        await eng.destroy(sb.id)
    sb = await eng.create(SandboxSpec(image="busy", workdir="/srv/mine", env={"GREETING": "spec"}))
    try:
        r = await sh(eng, sb.id, "pwd; echo $GREETING")
        assert r.stdout.decode().split() == ["/srv/mine", "spec"]
    finally:
        await eng.destroy(sb.id)


async def test_sandbox_from_docker_archive_as_root_and_numeric_user(engine: tuple[Engine, ImageStore],
                                                                    tmp_path: Path) -> None:
    eng, store = engine
    shift = Settings().uid_shift
    import_image(store, "busy-root", source(runnable_image(user="").write_docker_archive(tmp_path / "root.tar")),
                 uid_shift=shift)
    import_image(store, "busy-num", source(runnable_image(user="1234:staff").write_docker_archive(tmp_path / "n.tar")),
                 uid_shift=shift)
    for name, expected in (("busy-root", ["0", "0", "/root"]), ("busy-num", ["1234", "50", "/"])):
        sb = await eng.create(SandboxSpec(image=name))
        try:
            r = await sh(eng, sb.id, 'id -u; id -g; echo "$HOME"')
            assert r.stdout.decode().split() == expected, r.stderr
        finally:
            await eng.destroy(sb.id)


async def test_image_symlinks_on_mount_points_stay_in_the_sandbox(engine: tuple[Engine, ImageStore],
                                                                  tmp_path: Path) -> None:
    """An image whose /sys, /dev and /.dsec-pristine are symlinks to host paths: the backend mounts the node's
    sysfs, the disk's /dev and the pristine image on real directories of the sandbox's root, never through the
    links, on the host or in the mount holder."""
    eng, store = engine
    backend = eng.backends.loaded["container"]
    assert isinstance(backend, ContainerBackend) and backend._holder is not None
    holder_root = Path(f"/proc/{backend._holder.pid}/root")  # /dev is mounted in the holder's namespace
    bait = {name: Path(tempfile.mkdtemp(prefix=f"dsec-bait-{name}-")) for name in ("sys", "pristine", "dev")}
    try:
        image = runnable_image(user="", extra=(sym("sys", str(bait["sys"])), sym("dev", str(bait["dev"])),
                                               sym(".dsec-pristine", str(bait["pristine"]))))
        import_image(store, "linked", source(image.write_docker_archive(tmp_path / "linked.tar")),
                     uid_shift=Settings().uid_shift)
        sb = await eng.create(SandboxSpec(image="linked"))
        try:
            r = await sh(eng, sb.id, "test -d /sys/kernel && ! test -L /sys && test -x /.dsec-pristine/usr/bin/busybox"
                                     " && test -c /dev/null && ! test -L /dev && echo inside")
            assert r.stdout.decode().split() == ["inside"], r.stderr
            for name, path in bait.items():
                for seen_from in (path, holder_root / path.relative_to("/")):
                    assert not os.path.ismount(seen_from) and list(Path(seen_from).iterdir()) == [], \
                        f"the {name} mount followed the link ({seen_from})"
        finally:
            await eng.destroy(sb.id)
    finally:
        for path in bait.values():
            shutil.rmtree(path, ignore_errors=True)


async def test_unknown_image_user_fails_create_cleanly(engine: tuple[Engine, ImageStore], tmp_path: Path) -> None:
    eng, store = engine
    import_image(store, "nouser", source(runnable_image(user="ghost").write_layout(tmp_path / "layout")),
                 uid_shift=Settings().uid_shift)
    with pytest.raises(InvalidRequest, match="'ghost' is not in the image's /etc/passwd"):
        await eng.create(SandboxSpec(image="nouser"))
    assert await eng.list() == []
