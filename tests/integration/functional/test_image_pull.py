"""Pulling images from a real registry (Debian's docker-registry on loopback): anonymous, basic and bearer-token
auth, tags, digests, multi-arch indexes, and every fault the issue names (unknown name or tag, refused
credentials, a blob whose bytes do not match its digest)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import missing
from dsec.errors import ImageNotFound, InvalidRequest, Unauthorized
from dsec.images.image_store import ImageStore
from dsec.images.registry import RegistryClient, parse_reference, pull
from image_builders import OCI_INDEX, OCI_MANIFEST, Image, check_flattened, f, sample_image, sha
from image_support import ImageRootFn
from registry_support import PASSWORD, USER, Registry, running_registry

pytestmark = [pytest.mark.root]  # the flattened images keep ownership (chown)

def push(registry: Registry, repo: str, tag: str, img: Image, auth: bool = False) -> str:
    """Push ``img``'s blobs and manifest with our own client (the registry's upload API); return its digest."""
    creds = {"username": USER, "password": PASSWORD} if auth else {}
    with RegistryClient(registry.host, insecure=True, **creds) as client:
        for digest, blob in img.blobs.items():
            if digest != sha(img.manifest):
                assert client.push_blob(repo, blob) == digest
        return client.push_manifest(repo, tag, img.manifest, OCI_MANIFEST)


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Registry]]:
    if shutil.which("docker-registry") is None:
        missing("docker-registry is not installed: run ./scripts/setup (apt-get install docker-registry)")
    base = tmp_path_factory.mktemp("registries")
    with (running_registry(base / "none", "none") as anon, running_registry(base / "basic", "basic") as basic,
          running_registry(base / "token", "token") as token):
        img = sample_image()
        for reg in (anon, basic, token):
            push(reg, "team/app", "v1", img, auth=reg.mode != "none")
        yield {"none": anon, "basic": basic, "token": token}


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


@pytest.mark.parametrize("mode", ["none", "basic", "token"])
def test_pull_flattens_the_image(image_root: ImageRootFn,
                                 mode: str, registries: dict[str, Registry], store: ImageStore) -> None:
    reg = registries[mode]
    creds = {"username": USER, "password": PASSWORD} if mode != "none" else {}
    info, stats = pull(store, f"{reg.host}/team/app:v1", uid_shift=0, insecure=True, **creds)
    assert info.name == "app-v1" and info.source == f"registry:{reg.host}/team/app:v1"
    check_flattened(image_root(store, "app-v1"))
    assert info.config.workdir == "/home/app" and info.config.env["LANG"] == "C.UTF-8"
    assert stats.skipped_devices == 2
    if mode == "token":
        assert reg.token is not None and reg.token.issued > 0
    assert not list(store.root.glob(".import-*"))


def test_pull_by_digest_and_multiarch_index(image_root: ImageRootFn,
                                            registries: dict[str, Registry], store: ImageStore) -> None:
    reg = registries["none"]
    img = Image.build([[f("which", "amd64")]])
    other = Image.build([[f("which", "arm64")]])
    push(reg, "multi", "amd64-only", img)
    push(reg, "multi", "arm64-only", other)
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": OCI_MANIFEST, "digest": sha(other.manifest), "size": len(other.manifest),
         "platform": {"os": "linux", "architecture": "arm64"}},
        {"mediaType": OCI_MANIFEST, "digest": sha(img.manifest), "size": len(img.manifest),
         "platform": {"os": "linux", "architecture": "amd64"}},
    ]}).encode()
    with RegistryClient(reg.host, insecure=True) as client:
        client.push_manifest("multi", "latest", index, OCI_INDEX)
    pull(store, f"{reg.host}/multi", uid_shift=0, insecure=True, name="multi")
    assert (image_root(store, "multi") / "which").read_text() == "amd64"
    pull(store, f"{reg.host}/multi@{sha(other.manifest)}", uid_shift=0, insecure=True, name="pinned")
    assert (image_root(store, "pinned") / "which").read_text() == "arm64"


def test_unknown_repository_and_tag(registries: dict[str, Registry], store: ImageStore) -> None:
    reg = registries["none"]
    with pytest.raises(ImageNotFound, match=r"team/app:nope.*not found in registry"):
        pull(store, f"{reg.host}/team/app:nope", uid_shift=0, insecure=True)
    with pytest.raises(ImageNotFound, match=r"no/such.*not found"):
        pull(store, f"{reg.host}/no/such:v1", uid_shift=0, insecure=True)
    assert store.list() == [] and not list(store.root.glob(".import-*"))


@pytest.mark.parametrize("mode", ["basic", "token"])
def test_refused_credentials(mode: str, registries: dict[str, Registry], store: ImageStore) -> None:
    ref = f"{registries[mode].host}/team/app:v1"
    with pytest.raises(Unauthorized, match=r"credentials|--username"):
        pull(store, ref, uid_shift=0, insecure=True)
    with pytest.raises(Unauthorized, match=r"credentials|--username"):
        pull(store, ref, uid_shift=0, insecure=True, username=USER, password="wrong")
    assert store.list() == []


def test_blob_not_matching_its_digest(registries: dict[str, Registry], store: ImageStore, tmp_path: Path) -> None:
    reg = registries["none"]
    img = Image.build([[f("a", "genuine bytes")], [f("b", "second layer")]])
    push(reg, "tampered", "v1", img)
    layer = json.loads(img.manifest)["layers"][1]["digest"]
    data = reg.blob_path(layer)
    data.write_bytes(Image.build([[f("b", "evil bytes!!")]]).layers[0])
    with pytest.raises(InvalidRequest, match=f"layer {layer}: digest mismatch"):
        pull(store, f"{reg.host}/tampered:v1", uid_shift=0, insecure=True)
    assert store.list() == [] and not list(store.root.glob(".import-*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("dsec-pull")]  # downloads stopped


def test_https_to_plain_http_registry_says_insecure(registries: dict[str, Registry], store: ImageStore) -> None:
    with pytest.raises(Exception, match="--insecure"):
        pull(store, f"{registries['none'].host}/team/app:v1", uid_shift=0)


def test_reference_parsing() -> None:
    r = parse_reference("127.0.0.1:5000/team/app:v1")
    assert (r.registry, r.repository, r.tag, r.digest) == ("127.0.0.1:5000", "team/app", "v1", None)
    r = parse_reference("debian")
    assert (r.registry, r.repository, r.tag) == ("registry-1.docker.io", "library/debian", "latest")
    r = parse_reference("localhost/app@sha256:" + "a" * 64)
    assert (r.registry, r.tag, r.ref) == ("localhost", None, "sha256:" + "a" * 64)
    for bad in ("Upper/Case", "host:5000/app:bad tag", "app@md5:abc", "a//b"):
        with pytest.raises(InvalidRequest):
            parse_reference(bad)


def test_cli_pull(image_root: ImageRootFn,
                  registries: dict[str, Registry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.cli import main

    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSEC_IMAGES", str(tmp_path / "images"))
    monkeypatch.setenv("DSEC_REGISTRY_PASSWORD", PASSWORD)
    ref = f"{registries['token'].host}/team/app:v1"
    result = CliRunner().invoke(main, ["image", "pull", ref, "--insecure", "--username", USER, "--name", "cli"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "pulled cli:" in result.stdout
    assert (image_root(ImageStore(tmp_path / "images"), "cli") / "etc" / "motd").is_file()
    result = CliRunner().invoke(main, ["image", "pull", f"{registries['none'].host}/team/app:gone", "--insecure"])
    assert result.exit_code == 1 and "error: " in result.stderr and "not found" in result.stderr


async def test_daemon_pulls_over_http(image_root: ImageRootFn, registries: dict[str, Registry], tmp_path: Path) -> None:
    """POST /v1/images/pull on the real app: the image lands in the node's store; errors keep their type."""
    import httpx

    from dsec.config import Settings
    from dsec.daemon.app import create_app
    from dsec.daemon.engine import Engine
    from dsec.testing.fake import FakeBackend

    store = ImageStore(tmp_path / "images")
    engine = Engine(Settings(home=tmp_path / "home"), {"container": FakeBackend(root=tmp_path / "fake")}, store)
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as http:
        body = {"reference": f"{registries['basic'].host}/team/app:v1", "insecure": True, "name": "via-api",
                "username": USER, "password": PASSWORD}
        r = await http.post("/v1/images/pull", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["name"] == "via-api" and r.json()["config"]["workdir"] == "/home/app"
        assert (await http.get("/v1/images/via-api")).status_code == 200
        r = await http.post("/v1/images/pull", json={**body, "password": "wrong", "name": "other"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
        missing_tag = f"{registries['basic'].host}/team/app:no"
        r = await http.post("/v1/images/pull", json={**body, "name": "x", "reference": missing_tag})
        assert r.status_code == 404 and r.json()["error"]["type"] == "ImageNotFound"
        r = await http.post("/v1/images/pull", json={"reference": "x", "bogus": 1})
        assert r.status_code == 400
    root = image_root(store, "via-api")  # stored with the node's uid shift, like every daemon image
    assert (root / "etc/motd").read_text() == "hello from layer 3\n"
    assert os.lstat(root / "home/app").st_uid == Settings().uid_shift + 1000
