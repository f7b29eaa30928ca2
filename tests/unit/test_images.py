"""ImageStore: names, import with uid shift (checked on the real lazily mounted EROFS image), lookups,
removal, garbage collection, dedup, atomicity and locking."""

from __future__ import annotations

import importlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.backends.base import ImageRef
from dsec.config import Settings
from dsec.errors import ImageCorrupt, ImageNotFound, InvalidRequest, NotSupported, StoreUnavailable
from dsec.images import image_store as store_mod
from dsec.images.build import RECIPES, apt_options, apt_sources, mmdebstrap_command
from dsec.images.image_store import DEFAULT_PATH, ImageStore, validate_name
from dsec.images.node import NodeImages
from dsec.models import ImageConfig, ImageInfo

SHIFT = 100000


def make_tree(src: Path) -> None:
    """Owners 0 and 1000, setuid/setgid files, a symlink, a hard link, an empty dir, a fifo."""
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "bin" / "tool", 0o4755)
    (src / "bin" / "grp").write_bytes(b"g")
    os.chmod(src / "bin" / "grp", 0o2711)
    (src / "home" / "user").mkdir(parents=True)
    (src / "home" / "user" / "notes").write_bytes(b"12345")
    os.chown(src / "home" / "user", 1000, 1000)
    os.chown(src / "home" / "user" / "notes", 1000, 1001)
    os.symlink("../bin/tool", src / "home" / "link")
    os.lchown(src / "home" / "link", 1000, 1000)
    os.link(src / "bin" / "tool", src / "bin" / "tool-hard")
    (src / "empty").mkdir()
    os.chmod(src / "empty", 0o1777)
    os.mkfifo(src / "fifo")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


@pytest.fixture
def node(store: ImageStore, tmp_path: Path) -> Iterator[NodeImages]:
    """Mounts images of ``store`` like a daemon does; everything is unmounted afterwards."""
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=0)
    try:
        yield images
    finally:
        images.aclose_sync(unmount=True)


def rootfs(node: NodeImages, name: str) -> Path:
    """The mounted root of image ``name`` (left mounted, unpinned, until the ``node`` fixture ends)."""
    ref = node.resolve(name)
    node.release(ref)
    return ref.rootfs


@pytest.mark.parametrize("name", ["a", "debian-python", "py3.11_x", "0" * 128])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "A", "-a", ".a", "..", "a/b", "a b", "0" * 129, "é", "../x"])
def test_invalid_names(name: str, store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="invalid image name"):
        validate_name(name)
    with pytest.raises(InvalidRequest):
        store.import_dir(name, tmp_path, uid_shift=0)
    with pytest.raises(InvalidRequest):
        store.get(name)


@pytest.mark.root
def test_import_shifts_ownership_and_keeps_everything(store: ImageStore, node: NodeImages, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src)
    before = {p: p.lstat() for p in src.rglob("*")}
    info = store.import_dir("img", src, uid_shift=SHIFT)
    root = rootfs(node, "img")

    assert root.lstat().st_uid == SHIFT and root.lstat().st_gid == SHIFT
    tool = (root / "bin" / "tool").lstat()
    assert (tool.st_uid, tool.st_gid) == (SHIFT, SHIFT)
    assert stat.S_IMODE(tool.st_mode) == 0o4755, "setuid bit lost in the chown"
    assert stat.S_IMODE((root / "bin" / "grp").lstat().st_mode) == 0o2711, "setgid bit lost"
    notes = (root / "home" / "user" / "notes").lstat()
    assert (notes.st_uid, notes.st_gid) == (SHIFT + 1000, SHIFT + 1001)
    assert (root / "home" / "user").lstat().st_uid == SHIFT + 1000
    link = root / "home" / "link"
    assert link.is_symlink() and os.readlink(link) == "../bin/tool"
    assert (link.lstat().st_uid, link.lstat().st_gid) == (SHIFT + 1000, SHIFT + 1000)
    hard = (root / "bin" / "tool-hard").lstat()
    assert hard.st_ino == tool.st_ino and hard.st_nlink == 2, "hard link not kept"
    assert hard.st_uid == SHIFT, "hard-linked inode shifted twice"
    empty = root / "empty"
    assert empty.is_dir() and list(empty.iterdir()) == []
    assert stat.S_IMODE(empty.lstat().st_mode) == 0o1777
    assert stat.S_ISFIFO((root / "fifo").lstat().st_mode)

    # the source is untouched
    for p, st in before.items():
        now = p.lstat()
        assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode), p
    assert info.files == len(before)
    assert info.size_bytes == len(b"#!/bin/sh\n") + 1 + 5  # tool (hard link counted once), grp, notes
    assert info.uid_shift == SHIFT and info.source == f"dir:{src.resolve()}"
    assert info.config.env["PATH"] == DEFAULT_PATH
    assert store.get("img") == info


@pytest.mark.root
def test_resolve_warm_pins_a_mounted_image_without_blocking(store: ImageStore, tmp_path: Path) -> None:
    """resolve_warm answers (and pins) only an image this node mounted under a tag it checked within tag_ttl;
    anything else is None, for resolve() to do the blocking work."""
    src = tmp_path / "src"
    make_tree(src)
    store.import_dir("img", src, uid_shift=SHIFT)
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60)
    try:
        assert images.resolve_warm("img") is None  # never resolved: not mounted
        ref = images.resolve("img")
        warm = images.resolve_warm("img")
        assert warm is not None and (warm.rootfs, warm.uid_shift, warm.digest) == (ref.rootfs, SHIFT, ref.digest)
        assert images.resolve_warm("other") is None
        images.release(ref)
        assert not images.idle(), "the warm resolve holds its own pin"
        images.release(warm)
        assert images.idle(), "each resolve (warm or not) is one pin, released once"
        images.tag_ttl = 0  # the tag must be checked again in the store: not warm
        assert images.resolve_warm("img") is None
    finally:
        images.aclose_sync(unmount=True)


@pytest.mark.root
def test_a_mount_in_progress_does_not_block_the_warm_path(store: ImageStore, tmp_path: Path) -> None:
    """resolve_warm and release run on the daemon's event loop: while another thread holds the images' lock
    (a first mount: a lazy server start, a metadata fetch, seconds) they return at once, and the release is
    done once the lock is free."""
    src = tmp_path / "src"
    make_tree(src)
    store.import_dir("img", src, uid_shift=SHIFT)
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60)
    try:
        ref = images.resolve("img")
        held, done = threading.Event(), threading.Event()

        def mounting() -> None:
            with images._lock:
                held.set()
                done.wait(30)

        holder = threading.Thread(target=mounting)
        holder.start()
        assert held.wait(10)
        started = time.monotonic()
        assert images.resolve_warm("img") is None  # the blocking path (a thread) will do it
        images.release(ref)
        assert time.monotonic() - started < 1.0, "the warm path waited for the lock"
        assert images._mounts[ref.digest].refs == 1, "released before the lock was free"  # (mounted() locks)
        done.set()
        holder.join(10)
        deadline = time.monotonic() + 10
        while images.mounted() != {ref.digest: 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert images.mounted() == {ref.digest: 0}
    finally:
        images.aclose_sync(unmount=True)


@pytest.mark.root
def test_the_digest_a_tag_names_is_known_without_io_within_its_ttl_and_follows_a_reimport(
        store: ImageStore, tmp_path: Path) -> None:
    """What a warm-pool claim asks (ImagePins.known_digest): known_digest answers from memory with its freshness,
    current_digest asks the store once the answer is older than tag_ttl, so a re-import is seen; a store that
    cannot be reached is not asked again before tag_ttl passes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "v").write_bytes(b"1")
    store.import_dir("img", src, uid_shift=0)
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60)
    first = store.tag("img")
    assert first is not None
    assert images.known_digest("img") == (None, False)  # never looked up
    assert images.current_digest("img") == first[7:]
    assert images.known_digest("img") == (first[7:], True)
    (src / "v").write_bytes(b"2")
    store.import_dir("img", src, uid_shift=0, replace=True)
    second = store.tag("img")
    assert second is not None and second != first
    assert images.current_digest("img") == first[7:]  # within tag_ttl: the remembered answer
    images.tag_ttl = 0
    assert images.known_digest("img") == (first[7:], False)
    assert images.current_digest("img") == second[7:]
    asked = []

    def down(name: str) -> str | None:
        asked.append(name)
        raise StoreUnavailable("the store is down")

    images.store.tag = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        images.current_digest("img")
    images.tag_ttl = 60
    assert images.current_digest("img") == second[7:] and asked == ["img"], "a down store was asked again at once"
    del images.store.tag  # the instance attribute: the method again
    assert images.current_digest("no-such-image") is None


@pytest.mark.root
def test_import_keeps_file_capabilities(store: ImageStore, node: NodeImages, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "ping").write_bytes(b"x")
    caps = bytes.fromhex("01000002" "00200000" "00000000" "00000000" "00000000")  # v2, cap_net_raw+p
    try:
        os.setxattr(src / "ping", "security.capability", caps)
    except OSError as exc:
        pytest.skip(f"cannot set file capabilities here: {exc}")
    store.import_dir("caps", src, uid_shift=SHIFT)
    got = os.getxattr(rootfs(node, "caps") / "ping", "security.capability")
    assert got == caps


@pytest.mark.root
def test_import_refuses_already_shifted_tree(store: ImageStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    os.chown(src / "f", SHIFT, SHIFT)
    with pytest.raises(InvalidRequest, match="already shifted"):
        store.import_dir("img", src, uid_shift=SHIFT)
    assert_clean(store)


def assert_clean(store: ImageStore) -> None:
    left = [p.name for p in store.root.iterdir() if not p.name.startswith(".lock-")]
    assert left == [], f"import left {left} behind"


@pytest.mark.root
def test_import_config_and_source(store: ImageStore, node: NodeImages, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    config = ImageConfig(env={"LANG": "C.UTF-8", "PATH": "/opt/bin"}, workdir="/srv")
    info = store.import_dir("cfg", src, uid_shift=0, source="test:thing", config=config)
    assert info.source == "test:thing"
    assert info.config.env == {"LANG": "C.UTF-8", "PATH": "/opt/bin"}
    with pytest.raises(NotSupported, match="stored chunked"):
        store.resolve("cfg")  # the store itself never mounts
    ref = node.resolve("cfg")
    assert ref.rootfs.is_mount() and ref.rootfs.is_relative_to(tmp_path / "home" / "lazy")
    assert ref.config.workdir == "/srv" and ref.uid_shift == 0 and ref.name == "cfg"
    assert config.env == {"LANG": "C.UTF-8", "PATH": "/opt/bin"}  # caller's object not mutated


def test_import_rejects_non_directories(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    for bad in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(InvalidRequest, match="not a directory"):
            store.import_dir("img", bad, uid_shift=0)
    with pytest.raises(InvalidRequest, match="uid_shift"):
        store.import_dir("img", tmp_path, uid_shift=-1)


@pytest.mark.root
def test_import_existing_needs_replace(store: ImageStore, node: NodeImages, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "v").write_bytes(b"1")
    store.import_dir("img", src, uid_shift=0)
    (src / "v").write_bytes(b"2")
    with pytest.raises(InvalidRequest, match="already exists"):
        store.import_dir("img", src, uid_shift=0)
    assert (rootfs(node, "img") / "v").read_bytes() == b"1"
    store.import_dir("img", src, uid_shift=0, replace=True)
    assert (rootfs(node, "img") / "v").read_bytes() == b"2"
    assert_clean_except(store, {"store"})


def assert_clean_except(store: ImageStore, names: set[str]) -> None:
    left = {p.name for p in store.root.iterdir() if not p.name.startswith(".lock-")}
    assert left == names


def test_not_found_lists_available_and_suggests_the_name_meant(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match="store is empty") as exc:
        store.resolve("debian-python")
    assert "dsec image build debian-python" in str(exc.value)
    with pytest.raises(ImageNotFound, match="store is empty") as exc:
        store.resolve("nope")
    assert "dsec image import NAME SOURCE" in str(exc.value) and "debian-python" not in str(exc.value)
    src = tmp_path / "src"
    src.mkdir()
    store.import_dir("one", src, uid_shift=0)
    store.import_dir("two", src, uid_shift=0)
    store.import_dir("debian-python", src, uid_shift=0)
    with pytest.raises(ImageNotFound) as exc:
        store.get("nope")
    assert "'nope'" in str(exc.value) and "available: debian-python, one, two" in str(exc.value)
    assert exc.value.detail == {"image": "nope", "available": ["debian-python", "one", "two"], "suggestions": []}
    with pytest.raises(ImageNotFound) as exc:  # a typo: the name meant, not a build command
        store.get("debian-pyhton")
    assert "did you mean 'debian-python'?" in str(exc.value) and "dsec image build" not in str(exc.value)
    assert exc.value.detail["suggestions"] == ["debian-python"]


def test_list_and_remove(store: ImageStore, tmp_path: Path) -> None:
    assert store.list() == []
    src = tmp_path / "src"
    src.mkdir()
    for name in ("b", "a", "c"):
        store.import_dir(name, src, uid_shift=0)
    (store.root / "not-an-image").mkdir()  # no image.json: ignored
    assert [i.name for i in store.list()] == ["a", "b", "c"]
    store.remove("b")
    assert store.names() == ["a", "c"] and not store.path("b").exists()
    with pytest.raises(ImageNotFound):
        store.remove("b")
    with pytest.raises(ImageNotFound):
        store.resolve("b")
    assert store.exists("a") and not store.exists("b")


def test_failed_import_leaves_nothing(store: ImageStore, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")

    def boom(root: Path, shift: int) -> tuple[int, int]:
        assert (root / "f").exists()  # the copy happened
        raise OSError("disk on fire")

    monkeypatch.setattr(store_mod, "_shift_tree", boom)
    with pytest.raises(OSError, match="disk on fire"):
        store.import_dir("img", src, uid_shift=0)
    assert_clean(store)
    assert not store.exists("img") and store.list() == []
    assert (src / "f").read_bytes() == b"x"


@pytest.mark.root
def test_failed_replace_keeps_old_image(store: ImageStore, node: NodeImages, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"old")
    store.import_dir("img", src, uid_shift=0)
    monkeypatch.setattr(store_mod, "_copy_tree", lambda a, b: (_ for _ in ()).throw(OSError("no space")))
    with pytest.raises(OSError, match="no space"):
        store.import_dir("img", src, uid_shift=0, replace=True)
    assert (rootfs(node, "img") / "f").read_bytes() == b"old"
    assert_clean_except(store, {"store"})


def test_leftovers_of_a_killed_import_are_swept(store: ImageStore, tmp_path: Path) -> None:
    store.root.mkdir(parents=True)
    (store.root / ".tmp-img-abc123").mkdir()
    (store.root / ".tmp-img-other-abc123").mkdir()  # belongs to image "img-other": untouched
    src = tmp_path / "src"
    src.mkdir()
    store.import_dir("img", src, uid_shift=0)
    assert not (store.root / ".tmp-img-abc123").exists()
    assert (store.root / ".tmp-img-other-abc123").exists()


def test_concurrent_imports_of_one_name_do_not_race(store: ImageStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(50):
        (src / "d" / str(i)).write_bytes(b"x" * i)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            store.import_dir("img", src, uid_shift=0, replace=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.get("img").files == 51
    assert_clean_except(store, {"store"})


def test_mmdebstrap_command_passes_host_apt_files(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "apt.conf.d").mkdir()
    (apt / "sources.list").write_text("# only a comment\n")
    (apt / "sources.list.d" / "debian.sources").write_text("Types: deb\n")
    (apt / "sources.list.d" / "old.list.disabled").write_text("deb x y\n")
    (apt / "apt.conf.d" / "99proxy").write_text('Acquire::http::Proxy "http://p";\n')
    (apt / "apt.conf.d" / "10other").write_text('APT::Install-Recommends "0";\n')
    assert apt_sources(apt) == [apt / "sources.list.d" / "debian.sources"]
    assert apt_options(apt) == [apt / "apt.conf.d" / "99proxy"]
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap not installed")
    argv = mmdebstrap_command(["python3", "git"], "bookworm", tmp_path / "out", apt)
    assert argv[1:] == ["--variant=minbase", "--mode=root", "--format=directory", "--include=python3,git",
                        f"--aptopt={apt / 'apt.conf.d' / '99proxy'}", "bookworm", str(tmp_path / "out"),
                        str(apt / "sources.list.d" / "debian.sources")]
    with pytest.raises(InvalidRequest):
        mmdebstrap_command(["python3; rm -rf /"], "bookworm", tmp_path / "out", apt)
    assert "python3" in RECIPES["debian-python"]


def test_build_without_mmdebstrap_names_the_package(store: ImageStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.errors import BackendUnavailable
    build_mod = importlib.import_module("dsec.images.build")

    monkeypatch.setattr(build_mod.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailable, match="apt-get install mmdebstrap"):
        build_mod.build(store, "debian-python")
    assert [p.name for p in store.root.iterdir()] == []  # the build directory is gone
    with pytest.raises(InvalidRequest, match="no recipe"):
        build_mod.build(store, "unknown-image")


def test_base_image_is_shifted_and_usable(debian_python_image: ImageRef) -> None:
    """The image scripts/setup builds: root-owned files stored shifted, with the tools the checks use."""
    root = debian_python_image.rootfs
    assert debian_python_image.uid_shift > 0
    assert root.lstat().st_uid == debian_python_image.uid_shift
    for tool in ("bin/sh", "usr/bin/python3", "usr/bin/git", "usr/bin/gcc", "usr/bin/yes", "usr/bin/head"):
        assert (root / tool).exists(), tool
    su = (root / "usr/bin/su").lstat()
    assert su.st_uid == debian_python_image.uid_shift and su.st_mode & stat.S_ISUID
    assert debian_python_image.config.env["PATH"] == DEFAULT_PATH


def test_two_images_sharing_a_base_store_it_once(store: ImageStore, tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "usr" / "lib").mkdir(parents=True)
    for i in range(20):
        (base / "usr" / "lib" / f"lib{i}.so").write_bytes(os.urandom(400_000 + i * 1000))
    derived = tmp_path / "derived"
    shutil.copytree(base, derived, symlinks=True)
    (derived / "app").mkdir()
    (derived / "app" / "data").write_bytes(os.urandom(300_000))
    store.import_dir("base", base, uid_shift=0)
    store.import_dir("derived", derived, uid_shift=0)
    base_stats, derived_stats = store.stats("base"), store.stats("derived")
    stored = sum(size for _, size, _ in store.blobs.keys("chunks/"))
    # the base's data is stored once: most of it is shared, and the store holds about base + app data
    assert base_stats.shared_bytes > 0.7 * base_stats.unique_bytes
    assert derived_stats.shared_bytes == base_stats.shared_bytes
    assert stored < base_stats.unique_bytes + derived_stats.unique_bytes - 0.7 * base_stats.unique_bytes
    assert derived_stats.chunks == len(store.manifest("derived").chunks)


def test_gc_removes_only_unreferenced_objects(store: ImageStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep").write_bytes(os.urandom(100_000))
    store.import_dir("kept", src, uid_shift=0)
    (src / "gone").write_bytes(os.urandom(200_000))
    store.import_dir("dropped", src, uid_shift=0)
    kept = store.manifest("kept")
    store.remove("dropped")
    assert store.gc().chunks == 0, "young objects are kept (an import may be about to tag them)"
    result = store.gc(grace=0)
    assert result.manifests == 1 and result.chunks >= 1 and result.bytes >= 200_000
    for chunk in kept.chunks:
        assert store.blobs.has(f"chunks/sha256/{chunk.digest[7:9]}/{chunk.digest[7:]}")
    assert store.manifest("kept") == kept
    assert store.gc(grace=0).chunks == 0


@pytest.mark.root
def test_legacy_directory_images_are_adopted(store: ImageStore, node: NodeImages, tmp_path: Path) -> None:
    legacy = store.root / "old" / "rootfs"
    legacy.mkdir(parents=True)
    (legacy / "hello").write_bytes(b"hi")
    os.chown(legacy / "hello", SHIFT, SHIFT)
    info = ImageInfo(name="old", created_at=1.0, size_bytes=2, files=1, source="dir:/x", uid_shift=SHIFT)
    (store.root / "old" / "image.json").write_text(info.model_dump_json())
    assert store.resolve("old").rootfs == legacy  # still readable as a directory
    assert node.resolve("old").rootfs == legacy
    store.adopt_legacy("old")
    assert store.adopt_legacy("old") == info  # idempotent
    root = rootfs(node, "old")
    assert root != legacy and (root / "hello").read_bytes() == b"hi"
    assert (root / "hello").lstat().st_uid == SHIFT, "already shifted owners are kept, not shifted twice"


def test_node_reports_missing_images(store: ImageStore, node: NodeImages) -> None:
    with pytest.raises(ImageNotFound, match="'nope' not found"):
        node.resolve("nope")
    assert node.mounted() == {}


def test_copy_image_between_stores(store: ImageStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_bytes(b"hi\n" * 50_000)
    store.import_dir("img", src, uid_shift=0)
    other = ImageStore(tmp_path / "other")
    manifest = other.copy_image(store, "img")
    assert other.manifest("img") == store.manifest("img") == manifest
    for digest in [manifest.meta_digest, *(c.digest for c in manifest.chunks)]:
        assert other.blobs.has(store_mod.chunk_key(digest))
    with pytest.raises(ImageNotFound):
        other.copy_image(store, "absent")
    # A corrupt chunk in the source is refused and the copy is not tagged.
    key = store_mod.chunk_key(manifest.chunks[0].digest)
    store.blobs.put(key, b"garbage")
    third = ImageStore(tmp_path / "third")
    with pytest.raises(ImageCorrupt, match="does not match its digest"):
        third.copy_image(store, "img")
    assert third.tag("img") is None


@pytest.mark.root
def test_idle_snapshot_layers_stay_bounded(store: ImageStore, tmp_path: Path) -> None:
    """Untagged images (snapshot layers, pinned by digest) kept mounted while idle are capped at idle_layers, the
    longest idle going first, however young; a tagged image stays for its warm period."""
    src = tmp_path / "src"
    make_tree(src)
    digests = []
    for n in range(6):
        (src / "generation").write_text(f"{n}\n")
        store.import_dir(f"layer{n}", src, uid_shift=SHIFT)
        digests.append(store.tag(f"layer{n}"))
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60, idle_layers=2)
    try:
        tagged = images.resolve("layer0")
        images.release(tagged)
        for digest in digests[1:]:
            assert digest is not None
            images.unpin(images.pin_manifest(digest))
            images.unmount_idle(600)
            assert len(images.mounted()) <= 1 + 2, images.mounted()
        held = images.pin_manifest(digests[1])  # a layer in use is never unmounted
        images.unmount_idle(600)
        kept = {f"sha256:{h}" for h in images.mounted()}
        assert kept == {digests[0], digests[1], digests[4], digests[5]}, "the tagged image, the one in use and the "\
            "two layers used last"
        assert held.is_mount()
        images.unpin(held)
        assert images.idle(600) == [digests[4][7:]], "three idle layers now: the longest idle of them is excess"
    finally:
        images.aclose_sync(unmount=True)


@pytest.mark.root
def test_a_mount_that_cannot_be_unmounted_does_not_stop_the_others(store: ImageStore, tmp_path: Path) -> None:
    """An idle mount something this manager does not count still uses (umount: EBUSY) is kept and logged, and
    goes to the back of the queue; it used to end the pass first, every pass, so nothing idle went any more."""
    src = tmp_path / "src"
    make_tree(src)
    for n in range(2):
        (src / "generation").write_text(f"{n}\n")
        store.import_dir(f"img{n}", src, uid_shift=SHIFT)
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60)
    try:
        busy, free = (images.resolve(f"img{n}") for n in range(2))
        images.release(busy)
        images.release(free)
        with open(busy.rootfs / "home" / "user" / "notes", "rb"):
            assert images.unmount_idle() == [free.digest]
            assert busy.rootfs.is_mount() and not free.rootfs.is_mount()
            assert images.idle(600) == [], "the busy mount comes first again at the next pass"
        assert images.unmount_idle() == [busy.digest]
    finally:
        images.aclose_sync(unmount=True)


@pytest.mark.root
def test_tag_answers_not_looked_up_for_long_are_forgotten(store: ImageStore, tmp_path: Path) -> None:
    """A long-lived node resolves many names once, and images are removed: an answer not looked up for 60 tag_ttl
    (or one the store no longer has) is forgotten at the next unmount pass, and with it the manifest of the image
    it named once that is unmounted; a mounted image resolved by a tag is still no snapshot layer meanwhile."""
    src = tmp_path / "src"
    make_tree(src)
    store.import_dir("img", src, uid_shift=SHIFT)
    (src / "generation").write_text("other\n")
    store.import_dir("gone", src, uid_shift=SHIFT)
    images = NodeImages(Settings(home=tmp_path / "home", images_dir=store.root), store, tag_ttl=60, idle_layers=0)
    try:
        ref = images.resolve("img")
        images.release(ref)
        digest = "sha256:" + str(ref.digest)
        assert images.current_digest("gone") is not None
        store.remove("gone")
        images.tag_ttl = 0  # (asked of the store again)
        assert images.current_digest("gone") is None and "gone" not in images._tags  # a store miss
        images.tag_ttl = 60
        images._tags["img"] = (digest, time.monotonic() - 60 * 60 - 1)  # looked up an hour ago
        assert images.unmount_idle(600) == [], "the image was taken for a snapshot layer (over idle_layers)"
        assert images._tags == {} and images._tag_files == {}
        assert images.check(deep=False).get("image:img") is None and "image:img" in images.check(deep=False)
        assert images.unmount_idle() == [ref.digest]
        assert digest not in images._manifests, "an image no fresh tag names kept its manifest"
        again = images.resolve("img")  # asks the store again
        assert again.digest == ref.digest and images._tags["img"][0] == digest
        images.release(again)
    finally:
        images.aclose_sync(unmount=True)
