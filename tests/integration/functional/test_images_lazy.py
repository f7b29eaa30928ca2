"""Lazy image loading on real mounts: FUSE blob server, file-backed EROFS, the chunk cache, prefetch, S3.

Every test uses its own DSEC_HOME and image store; mounts and the FUSE server are removed at the end
(the session leak check verifies it).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_support import short_home, sweep, wait_until
from dsec.backends.container import ContainerBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages
from dsec.models import ExecRequest, SandboxSpec
from image_support import make_tree, seaweedfs

pytestmark = [pytest.mark.root]

MiB = 1 << 20


@pytest.fixture
def home() -> Iterator[Path]:
    path = short_home("dsec-lazy-")
    try:
        yield path
    finally:
        asyncio.run(sweep(path, path / "images"))
        shutil.rmtree(path, ignore_errors=True)


def node_for(home: Path, store: ImageStore, **kw: object) -> NodeImages:
    return NodeImages(Settings(home=home, images_dir=store.root), store, **kw)  # type: ignore[arg-type]


def test_a_mount_reads_only_what_is_touched(home: Path, tmp_path: Path) -> None:
    store = ImageStore(home / "images")
    data = make_tree(tmp_path / "src")
    store.import_dir("lazy", tmp_path / "src", uid_shift=0)
    blob = store.manifest("lazy").blob_size
    node = node_for(home, store)
    try:
        ref = node.resolve("lazy")
        assert (ref.rootfs / "etc" / "hello").read_text() == "hello from a lazy image\n"
        assert os.path.getsize(ref.rootfs / "data" / "big.bin") == len(data)  # metadata only: no data fetched
        fetched = node.cache.usage()
        assert fetched < 0.1 * blob, f"fetched {fetched} of {blob} bytes to read one small file"
        assert (ref.rootfs / "data" / "big.bin").read_bytes() == data
        assert node.cache.usage() >= len(data)
        manifest = store.manifest("lazy")
        hexdigest = manifest.digest[7:]
        read = node.cache.access(hexdigest)
        assert len(set(read)) == len(read) and sum(manifest.chunks[i].size for i in read) >= len(data)
        # a second sandbox of the image shares the same mount
        again = node.resolve("lazy")
        assert again.rootfs == ref.rootfs and node.mounted() == {hexdigest: 2}
        node.release(again)
        node.release(ref)
        assert node.mounted() == {hexdigest: 0}, "unused mounts are kept warm"
        assert node.idle(3600) == [] and node.unmount_idle(3600) == [] and ref.rootfs.is_mount()
        assert node.unmount_idle() == [hexdigest] and not ref.rootfs.is_mount()
        # What the node reports to cluster placement is read from the cache itself: the image stays
        # "held" while its chunks are cached, and is gone once they are evicted.
        held = node.cached()
        assert set(held) == {"lazy"} and held["lazy"] >= len(data) + manifest.meta_size
        node.cache.evict(target=0)
        assert node.cached() == {}
    finally:
        node.aclose_sync(unmount=True)


def test_the_manifests_of_unmounted_snapshot_layers_are_not_kept(home: Path, tmp_path: Path) -> None:
    """A node mounts a layer per snapshot it restores or forks (thousands an hour under RL load): a layer's
    parsed manifest goes with its idle mount, and so does its digest in what the node mounted itself; an image's
    manifest, which a tag names, stays for its next create."""
    store = ImageStore(home / "images")
    (tmp_path / "src" / "etc").mkdir(parents=True)
    digests = []
    for name in ("layer", "image"):
        (tmp_path / "src" / "etc" / "name").write_text(name)
        store.import_dir(name, tmp_path / "src", uid_shift=0)
        digests.append(store.manifest(name).digest)
    node = node_for(home, store)
    try:
        node.unpin(node.pin_manifest(digests[0]))
        node.release(node.resolve("image"))
        assert set(node._manifests) == set(digests)
        assert len(node._made) == 2
        assert len(node.unmount_idle()) == 2
        assert set(node._manifests) == {digests[1]}
        assert node._made == set()  # nor is what this node mounted itself, once it is unmounted
    finally:
        node.aclose_sync(unmount=True)


def test_a_restarted_daemon_adopts_the_server_and_the_mounts(home: Path, tmp_path: Path) -> None:
    """The mount is adopted as it is, never mounted again on its path: a restarted daemon starts the function
    sandboxes it re-adopts on that path (new zygotes) while it re-pins the image, and a new daemon, which knows no
    server until it adopts one, took the mount for dead and did so (the zygote then found an empty root). Nor is
    the image mounted anew beside it when its mount is one made afresh after a server died (``<digest16>.1``)."""
    store = ImageStore(home / "images")
    make_tree(tmp_path / "src", big=MiB)
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    first = node_for(home, store)
    try:
        ref = first.resolve("img")
        pid = first.fuse_pid()
        mount = os.stat(ref.rootfs).st_dev  # a mount made again on the same path has another device number
        first.aclose_sync(unmount=False)  # what a daemon does when it stops: mounts and server stay
        second = node_for(home, store)
        again = second.resolve("img")
        assert again.rootfs == ref.rootfs and second.fuse_pid() == pid
        assert os.stat(again.rootfs).st_dev == mount and second.stale(ref.rootfs) is None, "the mount was replaced"
        assert (again.rootfs / "etc" / "hello").read_text().startswith("hello")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=10)
        fresh = second.resolve("img").rootfs
        assert fresh.name.endswith(".1") and second.stale(ref.rootfs) is not None, "not mounted afresh: nothing tested"
        fresh_mount = os.stat(fresh).st_dev
        second.aclose_sync(unmount=False)
        third = node_for(home, store)
        assert third.resolve("img").rootfs == fresh and os.stat(fresh).st_dev == fresh_mount, "mounted anew"
    finally:
        node_for(home, store).aclose_sync(unmount=True)
    assert not ref.rootfs.is_mount() and not (home / "lazy" / "blobs").is_mount()
    assert not any((home / "lazy" / "mnt").iterdir()), "a mount point is left"


def test_a_dead_server_is_replaced_and_a_process_given_its_pid_is_left_alone(home: Path, tmp_path: Path) -> None:
    """The lazy server is killed (OOM killer, crash): its FUSE mount is left dead (ENOTCONN) and its pid file
    stays. The next resolve replaces both; a process that was given the pid since is not signalled."""
    store = ImageStore(home / "images")
    make_tree(tmp_path / "a")
    make_tree(tmp_path / "b")
    (tmp_path / "b" / "etc" / "hello").write_text("hello from b\n")
    store.import_dir("a", tmp_path / "a", uid_shift=0)
    store.import_dir("b", tmp_path / "b", uid_shift=0)
    node = node_for(home, store)
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        node.resolve("a")
        pid = node.fuse_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=10)
        with pytest.raises(OSError) as dead:
            os.listdir(home / "lazy" / "blobs")
        assert dead.value.errno == errno.ENOTCONN, "the killed server's mount is not dead: nothing tested"
        (home / "lazy" / "lazyfs.pid").write_text(str(bystander.pid))  # the pid, given to another process
        assert node.fuse_pid() is None
        ref = node.resolve("b")
        assert (ref.rootfs / "etc" / "hello").read_text() == "hello from b\n"
        assert node.fuse_pid() not in (None, pid, bystander.pid)
        assert bystander.poll() is None, "the daemon signalled a process that is not its lazy server"
    finally:
        node.aclose_sync(unmount=True)
        bystander.kill()
        bystander.wait()
    assert not (home / "lazy" / "blobs").is_mount()


def test_a_cli_done_with_an_image_leaves_the_daemons_mounts_and_server_alone(home: Path, tmp_path: Path) -> None:
    """`dsec image build-vm --from` mounts its source beside a running daemon: when done it unmounts only what
    it mounted and stops the server only if it started it (it used to adopt, unmount and stop everything)."""
    store = ImageStore(home / "images")
    make_tree(tmp_path / "a")
    make_tree(tmp_path / "b")
    store.import_dir("a", tmp_path / "a", uid_shift=0)
    store.import_dir("b", tmp_path / "b", uid_shift=0)
    daemon = node_for(home, store)
    try:
        used = daemon.resolve("a")
        pid = daemon.fuse_pid()
        cli = node_for(home, store, prefetch=False)
        source = cli.resolve("b")
        assert (source.rootfs / "etc" / "hello").read_text().startswith("hello")
        cli.release(source)
        cli.close_own_sync()
        assert not source.rootfs.is_mount(), "the CLI's own mount was left"
        assert used.rootfs.is_mount() and daemon.fuse_pid() == pid, "the CLI took the daemon's images down"
        assert (used.rootfs / "etc" / "hello").read_text().startswith("hello")
    finally:
        daemon.aclose_sync(unmount=True)
    alone = node_for(home, store, prefetch=False)  # no daemon: the CLI started the server, and stops it
    source = alone.resolve("b")
    alone.release(source)
    alone.close_own_sync()
    assert not source.rootfs.is_mount() and alone.fuse_pid() is None
    assert not (home / "lazy" / "blobs").is_mount()


def test_pins_of_images_no_longer_mounted_are_dropped_at_start(home: Path, tmp_path: Path) -> None:
    """Pins are files and mounts are not: after a reboot every pin of the last boot is stale, and the chunks
    of those images could never be evicted again (the cache full of images nothing uses)."""
    store = ImageStore(home / "images")
    make_tree(tmp_path / "src")
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    node = node_for(home, store)
    try:
        ref = node.resolve("img")
        assert ref.digest is not None
        stale = "ab" * 32  # an image mounted before a reboot
        node.cache.pin(stale)
        assert node.drop_stale_pins() == [stale]
        assert sorted(p.name for p in (node.cache.root / "pins").iterdir()) == [ref.digest]
        node.release(ref)
        assert node.drop_stale_pins() == [], "the pin of a mounted image (unused now, warm) was dropped"
    finally:
        node.aclose_sync(unmount=True)


def test_a_daemon_adopting_a_server_of_other_settings_says_so(home: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The lazy server outlives a daemon and cannot be restarted under live sandboxes: a new daemon with another
    cache limit (or store) uses it as it is, and says which settings wait for its restart."""
    store = ImageStore(home / "images")
    make_tree(tmp_path / "src")
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    first = node_for(home, store)
    try:
        first.resolve("img")
        first.aclose_sync(unmount=False)
        same = node_for(home, store)
        with caplog.at_level("WARNING", logger="dsec.images"):
            same.resolve("img")
        assert "kept from an earlier daemon" not in caplog.text, caplog.text
        limited = node_for(home, store, cache_limit=64 * MiB)
        with caplog.at_level("WARNING", logger="dsec.images"):
            limited.resolve("img")
        assert "kept from an earlier daemon" in caplog.text and str(64 * MiB) in caplog.text
        assert limited.fuse_pid() == first.fuse_pid()
    finally:
        node_for(home, store).aclose_sync(unmount=True)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_chunks_of_the_first_start_are_prefetched_later(home: Path, tmp_path: Path) -> None:
    store = ImageStore(home / "images")
    data = make_tree(tmp_path / "src")
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    manifest = store.manifest("img")
    node = node_for(home, store)
    try:
        ref = node.resolve("img")
        with open(ref.rootfs / "data" / "big.bin", "rb") as f:
            f.seek(len(data) // 2)
            assert f.read(2 * MiB) == data[len(data) // 2:len(data) // 2 + 2 * MiB]
        node.release(ref)
        node.aclose_sync(unmount=True)  # the access record goes to the store
        assert store.blobs.has(f"access/{manifest.digest[7:]}")
        node.cache.evict(target=0)
        assert node.cache.usage() == 0
        recorded = json.loads(store.blobs.get(f"access/{manifest.digest[7:]}"))  # what later starts prefetch
        wanted = {manifest.chunks[i].digest for i in recorded}
        later = node_for(home, store)
        later.resolve("img")  # nothing reads the file: only the prefetcher fetches
        assert wait_until(lambda: all(later.cache.has(d) for d in wanted), timeout=30), (
            [later.cache.has(d) for d in wanted], recorded, later.cache.usage())
        assert later.cache.usage() < manifest.blob_size / 2, "prefetch fetched more than the first start read"
    finally:
        node_for(home, store).aclose_sync(unmount=True)


def test_s3_store_on_seaweedfs(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with seaweedfs(monkeypatch) as weed:
        store = ImageStore(home / "images", weed.url())
        data = make_tree(tmp_path / "src", big=4 * MiB)
        info = store.import_dir("s3img", tmp_path / "src", uid_shift=0)
        assert store.names() == ["s3img"] and store.get("s3img") == info
        keys = {k for k, _, _ in store.blobs.keys("chunks/")}
        assert len(keys) >= len({c.digest for c in store.manifest("s3img").chunks})
        node = node_for(home, store)
        try:
            ref = node.resolve("s3img")
            assert (ref.rootfs / "data" / "big.bin").read_bytes() == data
        finally:
            node.aclose_sync(unmount=True)
        store.remove("s3img")
        assert store.names() == [] and store.gc(grace=0).chunks == len(keys)
        assert list(store.blobs.keys("chunks/")) == []


def test_engine_runs_a_container_sandbox_from_an_s3_image(home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with seaweedfs(monkeypatch) as weed:
        store = ImageStore(home / "images", weed.url())
        make_tree(tmp_path / "src", big=2 * MiB)
        store.import_dir("tiny", tmp_path / "src", uid_shift=Settings().uid_shift)

        async def run() -> None:
            settings = Settings(home=home, images_dir=store.root)
            node = NodeImages(settings, store)
            engine = Engine(settings, {"container": ContainerBackend(settings)}, node)
            await engine.start()
            try:
                info = await engine.create(SandboxSpec(image="tiny", backend="container"))
                result = await engine.exec(info.id, ExecRequest(command="cat /etc/hello; md5sum /data/big.bin"))
                assert result.exit_code == 0, result.stderr
                assert result.stdout.startswith(b"hello from a lazy image\n")
                await engine.destroy(info.id)
                assert node.mounted() == {store.manifest("tiny").digest[7:]: 0}
            finally:
                await engine.destroy_all()
                await engine.aclose()
                await node.aclose(unmount=True)

        asyncio.run(run())


def test_the_engine_unmounts_images_idle_past_their_warm_period(home: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.daemon import engine as engine_mod
    from dsec.testing.fake import FakeBackend

    store = ImageStore(home / "images")
    make_tree(tmp_path / "src", big=MiB)
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    monkeypatch.setattr(engine_mod, "IMAGE_IDLE_SECONDS", 0.3)
    settings = Settings(home=home, images_dir=store.root)

    async def run() -> None:
        node = NodeImages(settings, store)
        engine = Engine(settings, {"container": FakeBackend()}, node, reaper_interval=0.05)
        await engine.start()
        try:
            info = await engine.create(SandboxSpec(image="img", backend="container"))
            await asyncio.sleep(0.6)
            assert len(node.mounted()) == 1, "an image in use is never unmounted"
            await engine.destroy(info.id)
            deadline = asyncio.get_running_loop().time() + 10
            while node.mounted() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert node.mounted() == {}
        finally:
            await engine.destroy_all()
            await engine.aclose()
            await node.aclose(unmount=True)

    asyncio.run(run())


def test_mounts_are_found_even_when_the_cache_is_gone(home: Path, tmp_path: Path) -> None:
    store = ImageStore(home / "images")
    make_tree(tmp_path / "src", big=MiB)
    store.import_dir("img", tmp_path / "src", uid_shift=0)
    node = node_for(home, store)
    ref = node.resolve("img")
    node.aclose_sync(unmount=False)  # a daemon stops with the mount in use...
    shutil.rmtree(home / "image-cache")  # ...and its cache is deleted under it
    node_for(home, store).aclose_sync(unmount=True)
    assert not ref.rootfs.is_mount() and not (home / "lazy" / "blobs").is_mount()
