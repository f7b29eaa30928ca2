"""Dockerfile builds with the real builder (Debian's buildah, rootless as the build user) into a real store:
``FROM`` a store image and a registry image on loopback, build args, multi-stage, ``.dockerignore``, the layer
cache on rebuild, the errors (failing ``RUN``, missing base, unknown instruction) leaving nothing behind, the
HTTP route and the SDK, and a container sandbox started from a built image."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from conftest import missing
from container_support import short_home
from dsec.config import Settings
from dsec.errors import BuildFailed, ImageNotFound, InvalidRequest
from dsec.images.builder import Builder, build_user
from dsec.images.dockerfile import build_dockerfile
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages
from dsec.images.oci_import import import_image, open_source
from dsec.images.registry import RegistryClient
from dsec.models import ImageBuildRequest
from image_builders import OCI_MANIFEST, Image, d, f, sha, sym
from registry_support import running_registry

pytestmark = [pytest.mark.root, pytest.mark.slow]

APPLETS = ("sh", "cat", "echo", "ls", "id", "test", "mkdir", "touch", "env", "true")


def busybox_image() -> Image:
    busybox = shutil.which("busybox")
    if busybox is None:
        missing("busybox is not installed: run ./scripts/setup (apt-get install busybox-static)")
        raise AssertionError  # unreachable
    return Image.build([[
        d("bin"), f("bin/busybox", Path(busybox).read_bytes(), mode=0o755),
        *[sym(f"bin/{a}", "busybox") for a in APPLETS],
        d("etc"), d("tmp", mode=0o1777), d("root", mode=0o700),
        f("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"),
        f("etc/group", "root:x:0:\napp:x:1000:\n"),
    ]], env=["PATH=/bin"])


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ImageStore, NodeImages, Settings]]:
    """A store holding the busybox image ``bb``, the node's mounts of it, and a build root of this test's own
    (removed with the builder's runtime directory at teardown)."""
    if shutil.which("buildah") is None or build_user() is None:
        missing("Dockerfile builds need buildah and the dsec-build user: run ./scripts/setup")
    base = Path("/var/lib/dsec-build")
    build_root = base / f"test-{secrets.token_hex(6)}"  # no "_": buildah names base exports after their path
    build_root.mkdir()
    monkeypatch.setenv("DSEC_BUILD_ROOT", str(build_root))
    home = short_home("dsec-bld-")
    settings = Settings(home=home, images_dir=tmp_path / "images")
    store = ImageStore(tmp_path / "images")
    layout = busybox_image().write_layout(tmp_path / "bb-layout")
    source = open_source(layout)
    assert source is not None
    import_image(store, "bb", source, uid_shift=settings.uid_shift)
    images = NodeImages(settings, store, tag_ttl=0)
    runtime = Builder(settings).runtime_dir
    try:
        yield store, images, settings
    finally:
        images.aclose_sync(unmount=True)
        shutil.rmtree(build_root, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def context(root: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    return root


MULTI_STAGE = """\
ARG BASE=bb
FROM ${BASE} AS builder
ARG GREETING=unset
RUN echo "$GREETING" > /greeting
COPY . /ctx
FROM bb
COPY --from=builder /greeting /greeting
COPY --from=builder /ctx /ctx
RUN mkdir -p /home/app && touch /home/app/made && id -u > /built-as
ENV MODE=test
WORKDIR /srv
USER app
"""


def build(node: tuple[ImageStore, NodeImages, Settings], ctx: Path, lines: list[str] | None = None,
          **fields: object) -> dsec.ImageInfo:
    store, images, settings = node
    request = ImageBuildRequest.model_validate({"network": "none", **fields})
    return build_dockerfile(store, images, request, ctx, settings, output=(lines if lines is not None else []).append)


def test_multi_stage_build_from_the_store_with_args_and_dockerignore(
        node: tuple[ImageStore, NodeImages, Settings], tmp_path: Path) -> None:
    _, images, settings = node
    ctx = context(tmp_path / "ctx", MULTI_STAGE, {"keep.txt": "kept\n", "secret.txt": "no\n",
                                                  ".dockerignore": "secret.txt\n"})
    lines: list[str] = []
    info = build(node, ctx, lines, name="app", build_args={"GREETING": "hello"})
    assert any("STEP" in line and "RUN echo" in line for line in lines), lines
    assert info.config.env["MODE"] == "test" and info.config.workdir == "/srv" and info.config.user == "app"
    ref = images.resolve("app")
    try:
        root = ref.rootfs
        assert (root / "greeting").read_text() == "hello\n"
        assert (root / "ctx/keep.txt").read_text() == "kept\n"
        assert not (root / "ctx/secret.txt").exists()
        assert (root / "built-as").read_text() == "0\n"
        st = os.lstat(root / "home/app/made")
        assert st.st_uid == settings.uid_shift  # the image's root, shifted like every stored image
    finally:
        images.release(ref)

    # The same build again: every step comes from the layer cache and the store already holds the result.
    again: list[str] = []
    info2 = build(node, ctx, again, name="app", build_args={"GREETING": "hello"}, replace=True)
    assert sum("Using cache" in line for line in again) >= 5, again
    assert any("is unchanged" in line for line in again)
    assert info2.created_at == info.created_at
    # A changed build arg invalidates the steps after it, not the ones before.
    changed: list[str] = []
    build(node, ctx, changed, name="app", build_args={"GREETING": "bye"}, replace=True)
    ref = images.resolve("app")
    try:
        assert (ref.rootfs / "greeting").read_text() == "bye\n"
    finally:
        images.release(ref)


def builder_images(builder: Builder) -> tuple[set[str], int]:
    """The names in the builder's storage, and how many images (cache layers included) it holds."""
    tmp = Path(tempfile.mkdtemp(dir=builder.work))
    builder.give(tmp)
    try:
        images = json.loads(builder.run(builder.argv("images", "--all", "--json"), tmp, "listing images") or "[]")
    finally:
        shutil.rmtree(tmp)
    return {n for image in images for n in image.get("names") or []}, len(images)


def test_prune_keeps_the_cache_of_stored_images_only(node: tuple[ImageStore, NodeImages, Settings],
                                                     tmp_path: Path) -> None:
    """``dsec image gc``'s builder half: an image the store dropped loses its builder image and cache layers, a
    crashed build's work directory goes, a stored image keeps its cache; a builder serving another store is
    left alone."""
    store, _, settings = node
    build(node, context(tmp_path / "a", "FROM bb\nRUN echo a > /a\n"), name="keep")
    build(node, context(tmp_path / "b", "FROM bb\nRUN echo b > /b\nRUN echo c > /c\n"), name="drop")
    store.remove("drop")
    builder = Builder(settings)
    (builder.work / "build-crashed").mkdir()
    elsewhere = Builder(Settings(home=settings.home, images_dir=tmp_path / "other-images"))
    assert elsewhere.prune(set(), grace=0).skipped
    names, before = builder_images(builder)
    assert "localhost/dsec-build/drop:latest" in names
    pruned = builder.prune(set(store.names()), grace=0)
    assert pruned.skipped is None and pruned.images >= 1 and pruned.work_dirs == 1 and pruned.bytes > 0, pruned
    names, after = builder_images(builder)
    assert "localhost/dsec-build/keep:latest" in names and "localhost/bb:latest" in names, names
    assert "localhost/dsec-build/drop:latest" not in names
    assert before - after >= 2  # drop's two RUN layers (its image is the last), not keep's
    again: list[str] = []
    build(node, context(tmp_path / "a", "FROM bb\nRUN echo a > /a\n"), again, name="keep", replace=True)
    assert any("Using cache" in line for line in again) and any("is unchanged" in line for line in again), again


def test_failing_run_names_the_step_and_stores_nothing(node: tuple[ImageStore, NodeImages, Settings],
                                                        tmp_path: Path) -> None:
    store, _, settings = node
    ctx = context(tmp_path / "ctx", "FROM bb\nRUN echo before\nRUN echo oops >&2 && exit 7\nRUN echo after\n")
    with pytest.raises(BuildFailed) as err:
        build(node, ctx, name="broken")
    assert err.value.detail["step"] == "RUN echo oops >&2 && exit 7"
    assert err.value.detail["exit_status"] == 7
    assert "oops" in err.value.detail["output"] and "exited 7" in str(err.value)
    assert not store.exists("broken")
    builder = Builder(settings)
    assert list(builder.work.iterdir()) == []
    containers = subprocess.run(builder.argv("containers", "--quiet"), capture_output=True, text=True,
                                user=builder.user.pw_uid if builder.user else None, env=builder.env(Path("/")),
                                cwd="/", check=True)
    assert containers.stdout.strip() == ""  # --force-rm: the failed step's container is gone too


def test_bad_dockerfiles_are_refused_before_building(node: tuple[ImageStore, NodeImages, Settings],
                                                      tmp_path: Path) -> None:
    store, _, _ = node
    with pytest.raises(ImageNotFound, match=r"FROM nosuch \(Dockerfile line 2\).*available: bb|bb\)"):
        build(node, context(tmp_path / "a", "# base\nFROM nosuch\n"), name="x")
    with pytest.raises(InvalidRequest, match="line 2: unknown instruction FOO"):
        build(node, context(tmp_path / "b", "FROM bb\nFOO bar\n"), name="x")
    with pytest.raises(InvalidRequest, match="no Dockerfile 'Other'"):
        build(node, context(tmp_path / "c", "FROM bb\n"), name="x", dockerfile="Other")
    with pytest.raises(InvalidRequest, match="already exists"):
        build(node, context(tmp_path / "d", "FROM bb\n"), name="bb")
    assert store.names() == ["bb"]


def test_from_a_registry_on_loopback(node: tuple[ImageStore, NodeImages, Settings], tmp_path: Path) -> None:
    if shutil.which("docker-registry") is None:
        missing("docker-registry is not installed: run ./scripts/setup")
    _, images, _ = node
    img = busybox_image()
    with running_registry(tmp_path / "registry", "none") as registry:
        with RegistryClient(registry.host, insecure=True) as client:
            for digest, blob in img.blobs.items():
                if digest != sha(img.manifest):
                    client.push_blob("team/bb", blob)
            client.push_manifest("team/bb", "v1", img.manifest, OCI_MANIFEST)
        ctx = context(tmp_path / "ctx", f"FROM {registry.host}/team/bb:v1\nRUN echo pulled > /from-registry\n")
        build(node, ctx, name="pulled", insecure=True)
    ref = images.resolve("pulled")
    try:
        assert (ref.rootfs / "from-registry").read_text() == "pulled\n"
    finally:
        images.release(ref)


def test_sdk_builds_through_the_daemon(node: tuple[ImageStore, NodeImages, Settings], tmp_path: Path) -> None:
    """AsyncSandbox.build_image (and its sync twin) over the daemon's POST /v1/images/build: output streamed,
    a Dockerfile outside the context sent beside it, errors re-raised with their detail."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "unit"))  # the SDK tests' daemon helper lives there
    from sdk_daemon import running_daemon

    _, images, _ = node
    ctx = context(tmp_path / "ctx", "FROM bb\nCOPY data.txt /data.txt\n", {"data.txt": "via the api\n"})
    outside = tmp_path / "elsewhere.Dockerfile"
    outside.write_text("FROM bb\nARG N\nRUN echo $N > /n && exit $N\n")
    home = short_home("dsec-bld-d-")
    try:
        with running_daemon(home, images=images) as daemon:
            client = dsec.Client(daemon.unix_url)
            lines: list[str] = []
            info = dsec.Sandbox.build_image("via-sdk", ctx, output=lines.append, client=client, network="none")
            assert info.name == "via-sdk" and any("COPY data.txt" in line for line in lines)
            with pytest.raises(dsec.BuildFailed) as err:
                dsec.Sandbox.build_image("bad-sdk", ctx, dockerfile=outside, build_args={"N": "3"}, client=client,
                                         network="none")
            assert err.value.detail["exit_status"] == 3 and err.value.detail["step"].startswith("RUN echo $N")
            client.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)  # the daemon has stopped
    ref = images.resolve("via-sdk")
    try:
        assert (ref.rootfs / "data.txt").read_text() == "via the api\n"
    finally:
        images.release(ref)


def test_context_tar_cannot_escape(tmp_path: Path) -> None:
    """The daemon unpacks a context tar with tarfile's data filter: ``..`` and absolute names are refused."""
    import io
    import tarfile

    from dsec.images.dockerfile import _extract

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    raw.seek(0)
    (tmp_path / "ctx").mkdir()
    with pytest.raises(InvalidRequest, match="not a usable tar"):
        _extract(raw, tmp_path / "ctx")
    assert not (tmp_path / "evil").exists()
