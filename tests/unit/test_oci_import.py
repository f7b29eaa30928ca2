"""Image import from OCI layouts and ``docker save`` archives: every flattening rule, digests, hostile and
broken archives, concurrent imports. Archives are real tar files written by ``image_builders``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from dsec.errors import DSecError, InvalidRequest
from dsec.images.image_store import ImageStore
from dsec.images.layers import split_entry_name
from dsec.images.oci_import import ImageSource, image_config, import_image, open_source
from image_builders import Entry, Image, check_flattened, d, f, hard, sample_image, sym, tar_dir, write_tar
from image_support import ImageRootFn

pytestmark = [pytest.mark.root]  # ownership (chown to 1000) and setuid bits need root


def load(path: Path, tag: str | None = None) -> ImageSource:
    source = open_source(path, tag)
    assert source is not None
    return source


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


@pytest.mark.parametrize("form", ["layout-dir", "layout-tar", "docker-archive", "layout-multiarch"])
def test_import_flattens_every_rule(image_root: ImageRootFn, form: str, store: ImageStore, tmp_path: Path) -> None:
    img = sample_image()
    if form == "layout-dir":
        src = img.write_layout(tmp_path / "layout")
    elif form == "layout-multiarch":
        src = img.write_layout(tmp_path / "layout", multiarch=True)
    elif form == "layout-tar":
        src = tar_dir(img.write_layout(tmp_path / "layout"), tmp_path / "image.oci.tar")
    else:
        src = img.write_docker_archive(tmp_path / "image.docker.tar")
    source = open_source(src)
    assert source is not None
    info, stats = import_image(store, "t", source, uid_shift=0)
    check_flattened(image_root(store, "t"))
    assert stats.skipped_devices == 2 and stats.whiteouts >= 4
    assert {"trusted.overlay.opaque", "security.selinux"} <= stats.skipped_xattrs
    cfg = info.config
    assert cfg.env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "EMPTY": ""}
    assert (cfg.workdir, cfg.user, cfg.cmd) == ("/home/app", "1000:1000", ["/bin/sh", "-c", "echo hi"])
    assert info.source.startswith("docker-archive:" if form == "docker-archive" else "oci-layout:")
    assert not list(store.root.glob(".import-*"))


def test_whiteouts_never_hide_their_own_layer(image_root: ImageRootFn, store: ImageStore, tmp_path: Path) -> None:
    """OCI: a whiteout hides lower layers only, whatever the entry order; an opaque marker hides lower
    content at every depth but keeps what its layer wrote before it."""
    lower = [d("gone"), f("gone/old", "lower"), d("opaq/sub"), f("opaq/sub/old", "lower"), f("opaq/top", "lower"),
             f("replaced", "lower file")]
    upper = [f("gone/new", "upper, before the whiteout"), f(".wh.gone"),
             f("opaq/sub/new", "upper, before the marker"), f("opaq/.wh..wh..opq"),
             d("replaced"), f("replaced/inner", "upper"), f(".wh.replaced")]
    layout = Image.build([lower, upper]).write_layout(tmp_path / "layout")
    import_image(store, "t", load(layout), uid_shift=0)
    root = image_root(store, "t")
    assert sorted(os.listdir(root / "gone")) == ["new"]
    assert sorted(os.listdir(root / "opaq")) == ["sub"] and sorted(os.listdir(root / "opaq/sub")) == ["new"]
    assert (root / "replaced/inner").read_text() == "upper"


def test_import_shifts_owners(image_root: ImageRootFn, store: ImageStore, tmp_path: Path) -> None:
    src = sample_image().write_layout(tmp_path / "layout")
    import_image(store, "shifted", load(src), uid_shift=100000)
    root = image_root(store, "shifted")
    assert os.lstat(root / "home/app").st_uid == 101000
    assert stat.S_IMODE(os.lstat(root / "bin/tool").st_mode) == 0o4755  # setuid survives the shift's chown


def test_plain_directory_is_not_an_archive(tmp_path: Path) -> None:
    (tmp_path / "rootfs").mkdir()
    assert open_source(tmp_path / "rootfs") is None


# ----------------------------------------------------------------------------- hostile archives


def outside_untouched(tmp_path: Path) -> None:
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["victim"]
    assert (tmp_path / "outside" / "victim").read_text() == "original"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_text("original")
    return tmp_path / "outside"


@pytest.mark.parametrize("entries", [
    [f("../outside/pwned", "x")],
    [f("a/../../outside/pwned", "x")],
    [hard("stolen", "../outside/victim")],
], ids=["dotdot", "nested-dotdot", "hardlink-dotdot"])
def test_dotdot_entries_are_refused(entries: list[Entry], store: ImageStore, tmp_path: Path,
                                    outside: Path) -> None:
    src = Image.build([entries]).write_layout(tmp_path / "layout")
    with pytest.raises(InvalidRequest, match=r"'\.\.' component"):
        import_image(store, "evil", load(src), uid_shift=0)
    outside_untouched(tmp_path)
    assert not store.exists("evil") and not list(store.root.glob(".import-*"))


def test_symlinks_cannot_lead_writes_outside(image_root: ImageRootFn,
                                             store: ImageStore, tmp_path: Path, outside: Path) -> None:
    """Absolute names, symlinked parents (absolute, relative, to '/'), and writes onto a symlink stay inside."""
    layer1 = [
        sym("to-outside", str(outside)),             # absolute: means <root>/<that path> inside the image
        sym("up", "../../../../../../" + str(outside).lstrip("/")),  # climbs: clamped at the image root
        sym("to-root", "/"),
        sym("victim-link", str(outside / "victim")),
    ]
    layer2 = [
        f("/abs.txt", "absolute name"),
        f("to-root/via-root", "in the root"),
        f("victim-link", "replaces the link, not its target"),
        f("to-outside/pwned", "x"),
        f("up/pwned2", "x"),
    ]
    src = Image.build([layer1, layer2]).write_layout(tmp_path / "layout")
    import_image(store, "evil", load(src), uid_shift=0)
    outside_untouched(tmp_path)
    root = image_root(store, "evil")
    assert (root / "abs.txt").read_text() == "absolute name"
    assert (root / "via-root").read_text() == "in the root"
    assert not (root / "victim-link").is_symlink()
    inner = root / str(outside).lstrip("/")
    assert (inner / "pwned").read_text() == "x" and (inner / "pwned2").read_text() == "x"


def test_hardlink_through_symlink_cannot_reach_outside(store: ImageStore, tmp_path: Path, outside: Path) -> None:
    src = Image.build([[sym("o", str(outside)), hard("stolen", "o/victim")]]).write_layout(tmp_path / "layout")
    with pytest.raises(InvalidRequest, match="not in this or an earlier layer"):
        import_image(store, "evil", load(src), uid_shift=0)
    outside_untouched(tmp_path)


def test_whiteout_cannot_remove_outside(store: ImageStore, tmp_path: Path, outside: Path) -> None:
    src = Image.build([[sym("o", str(outside.parent))], [f("o/outside/.wh.victim"), f("o/.wh..wh..opq")]]
                      ).write_layout(tmp_path / "layout")
    import_image(store, "evil", load(src), uid_shift=0)
    outside_untouched(tmp_path)


@pytest.mark.parametrize("name", ["..", "a/../../b", "x\0y"])
def test_split_entry_name_refuses(name: str) -> None:
    with pytest.raises(InvalidRequest):
        split_entry_name(name, "L")


def test_split_entry_name_normalises() -> None:
    assert split_entry_name("./a//b/", "L") == ["a", "b"]
    assert split_entry_name("/etc/passwd", "L") == ["etc", "passwd"]
    assert split_entry_name("./", "L") == []


def test_owner_outside_user_namespace_refused(store: ImageStore, tmp_path: Path) -> None:
    src = Image.build([[f("big-uid", "x", uid=70000)]]).write_layout(tmp_path / "layout")
    with pytest.raises(InvalidRequest, match="uid/gid 70000"):
        import_image(store, "t", load(src), uid_shift=0)


# ----------------------------------------------------------------------------- broken archives


def test_layer_digest_mismatch(store: ImageStore, tmp_path: Path) -> None:
    img = Image.build([[f("a", "original content")], [f("b", "second")]])
    layout = img.write_layout(tmp_path / "layout")
    manifest = json.loads(img.manifest)
    blob = layout / "blobs/sha256" / manifest["layers"][1]["digest"][7:]
    tampered = Image.build([[f("b", "evil!!")]]).layers[0]  # same size, other bytes
    assert len(tampered) == len(img.layers[1])
    blob.write_bytes(tampered)
    with pytest.raises(InvalidRequest, match="digest mismatch"):
        import_image(store, "t", load(layout), uid_shift=0)
    assert not store.exists("t") and not list(store.root.glob(".import-*"))


def test_docker_archive_diff_id_mismatch(store: ImageStore, tmp_path: Path) -> None:
    img = Image.build([[f("a", "one")]])
    img.layers = [Image.build([[f("a", "two")]]).layers[0]]  # archive carries other bytes than the config says
    path = img.write_docker_archive(tmp_path / "x.tar")
    with pytest.raises(InvalidRequest, match=r"rootfs.diff_ids\).*digest mismatch"):
        import_image(store, "t", load(path), uid_shift=0)


def test_config_digest_mismatch(store: ImageStore, tmp_path: Path) -> None:
    img = Image.build([[f("a", "one")]])
    layout = img.write_layout(tmp_path / "layout")
    cfg = layout / "blobs/sha256" / json.loads(img.manifest)["config"]["digest"][7:]
    cfg.write_bytes(cfg.read_bytes().replace(b"/bin/sh", b"/bin/xx"))
    with pytest.raises(InvalidRequest, match=r"config.*digest mismatch"):
        import_image(store, "t", load(layout), uid_shift=0)


@pytest.mark.parametrize("where", ["config", "first-layer", "last-layer", "manifest"])
def test_truncated_docker_archive(where: str, store: ImageStore, tmp_path: Path) -> None:
    path = sample_image().write_docker_archive(tmp_path / "x.tar")
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.size > 10]
    member = {"config": members[0], "first-layer": members[1], "last-layer": members[-2],
              "manifest": members[-1]}[where]
    data = path.read_bytes()
    path.write_bytes(data[: member.offset_data + member.size // 2])  # cut in the middle of that file
    with pytest.raises(InvalidRequest, match=r"truncated|corrupt|missing|mismatch"):
        source = open_source(path)
        assert source is not None
        import_image(store, "t", source, uid_shift=0)
    assert not store.exists("t") and not list(store.root.glob(".import-*"))


def test_corrupt_gzip_layer(store: ImageStore, tmp_path: Path) -> None:
    img = Image.build([[f("a", "x" * 5000)]], compression=["gzip"])
    layout = img.write_layout(tmp_path / "layout")
    blob = layout / "blobs/sha256" / json.loads(img.manifest)["layers"][0]["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(InvalidRequest, match=r"truncated or corrupt|digest mismatch"):
        import_image(store, "t", load(layout), uid_shift=0)


def test_not_an_image_archive(tmp_path: Path) -> None:
    write_tar(tmp_path / "x.tar", {"hello.txt": b"hi"})
    with pytest.raises(InvalidRequest, match="neither a docker-save archive"):
        open_source(tmp_path / "x.tar")
    (tmp_path / "junk.tar").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InvalidRequest, match="not a readable tar archive"):
        open_source(tmp_path / "junk.tar")


def test_unknown_tag_in_layout(store: ImageStore, tmp_path: Path) -> None:
    layout = sample_image().write_layout(tmp_path / "layout", tag="v1")
    with pytest.raises(InvalidRequest, match=r"no image tagged 'v2'.*v1"):
        import_image(store, "t", load(layout, tag="v2"), uid_shift=0)


def test_existing_name_needs_replace(image_root: ImageRootFn, store: ImageStore, tmp_path: Path) -> None:
    layout = Image.build([[f("v", "1")]]).write_layout(tmp_path / "l1")
    import_image(store, "t", load(layout), uid_shift=0)
    layout2 = Image.build([[f("v", "2")]]).write_layout(tmp_path / "l2")
    with pytest.raises(InvalidRequest, match="already exists"):
        import_image(store, "t", load(layout2), uid_shift=0)
    import_image(store, "t", load(layout2), uid_shift=0, replace=True)
    assert (image_root(store, "t") / "v").read_text() == "2"


def test_concurrent_imports_of_one_name(image_root: ImageRootFn, store: ImageStore, tmp_path: Path) -> None:
    """Both start at once: one wins, the other waits for it and then gets a clear error; the image is whole."""
    layouts = [Image.build([[f("who", str(i)), *[f(f"f{j}", "x" * 1000) for j in range(300)]]]
                           ).write_layout(tmp_path / f"l{i}") for i in range(2)]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def one(i: int) -> None:
        source = open_source(layouts[i])
        assert source is not None
        barrier.wait()
        try:
            import_image(store, "same", source, uid_shift=0)
            outcomes.append(f"ok{i}")
        except InvalidRequest as exc:
            assert "already exists" in exc.message
            outcomes.append("exists")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes)[0] == "exists" and sorted(outcomes)[1].startswith("ok")
    root = image_root(store, "same")
    winner = outcomes[0 if outcomes[0] != "exists" else 1][2:]
    assert (root / "who").read_text() == winner and len(os.listdir(root)) == 301
    assert not list(store.root.glob(".import-same-*"))


def test_cli_import_detects_each_source(image_root: ImageRootFn,
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from dsec.cli import main

    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSEC_IMAGES", str(tmp_path / "images"))
    img = sample_image()
    plain = tmp_path / "plain"
    (plain / "etc").mkdir(parents=True)
    (plain / "etc" / "hostname").write_text("plain\n")
    sources = {"from-layout": img.write_layout(tmp_path / "layout"),
               "from-oci-tar": tar_dir(tmp_path / "layout", tmp_path / "l.tar"),
               "from-docker": img.write_docker_archive(tmp_path / "d.tar"),
               "from-dir": plain}
    runner = CliRunner()
    for name, src in sources.items():
        result = runner.invoke(main, ["image", "import", name, str(src)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert f"imported {name}:" in result.stdout
    store = ImageStore(tmp_path / "images")
    assert (image_root(store, "from-dir") / "etc/hostname").read_text() == "plain\n"
    assert store.get("from-docker").source.startswith("docker-archive:")
    assert store.get("from-layout").config.workdir == "/home/app"
    # the device nodes skipped are reported, and a bad archive is a one-line error
    result = runner.invoke(main, ["image", "import", "again", str(sources["from-docker"])])
    assert "2 device nodes/fifos skipped" in result.stderr
    write_tar(tmp_path / "junk.tar", {"a": b"b"})
    result = runner.invoke(main, ["image", "import", "junk", str(tmp_path / "junk.tar")])
    assert result.exit_code == 1 and "error: " in result.stderr and "neither a docker-save archive" in result.stderr
    result = runner.invoke(main, ["image", "import", "from-dir", str(plain)])
    assert result.exit_code == 1 and "already exists" in result.stderr


def test_full_store_filesystem_is_a_host_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A store that runs out of space mid-import: a DSecError naming it (not "bad archive"), no half image."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        store = ImageStore(small / "images")
        layout = Image.build([[f(f"big{i}", os.urandom(300_000)) for i in range(8)]]).write_layout(tmp_path / "l")
        with pytest.raises(DSecError, match="No space left on device") as info:
            import_image(store, "big", load(layout), uid_shift=0)
        assert not isinstance(info.value, InvalidRequest)
        assert not store.exists("big") and not list(store.root.glob(".import-*"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_image_labels_are_kept_and_junk_ones_dropped() -> None:
    config = image_config({"config": {"User": "user", "Labels": {"dsec.e2b.sudo": "true", "n": 1}}})
    assert config.labels == {"dsec.e2b.sudo": "true", "n": "1"} and config.user == "user"
    assert image_config({"config": {"Labels": None}}).labels == {}
    assert image_config({"config": {"Labels": ["not", "a", "map"]}}).labels == {}
