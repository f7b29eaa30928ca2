"""Snapshot records and layers in a (directory) image store: layering, exact metadata, GC, the CLI."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec.cli import main
from dsec.errors import InvalidRequest, NotFound
from dsec.images.cache import chunk_key
from dsec.images.image_store import ImageStore
from dsec.trajectory.snapshots import SnapshotStore

pytestmark = pytest.mark.root


def publish(snaps: SnapshotStore, fill: object, below: list[str] | None = None, **meta: object) -> str:
    snap_id, work = snaps.begin()
    fill(work / "tree")  # type: ignore[operator]
    snaps.publish(snap_id, work, {"image": "base", "backend": "container", **meta}, below)
    return snap_id


def upper(root: Path) -> None:
    """What an overlay upper holds: a file with an owner, a hard link, a whiteout, an opaque directory."""
    (root / "d").mkdir()
    (root / "d" / "f").write_text("data\n")
    os.chown(root / "d" / "f", 101234, 104321)
    os.link(root / "d" / "f", root / "d" / "hard")
    os.mknod(root / "gone", 0o600 | 0o020000, os.makedev(0, 0))
    (root / "opaque").mkdir()
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")


def test_a_layer_keeps_owners_links_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    snaps = SnapshotStore(store, tmp_path / "scratch")
    snap = publish(snaps, upper)
    record = snaps.meta(snap)
    assert record["image"] == "base" and len(record["layers"]) == 1 and record["size_bytes"] == 10
    (root,) = snaps.open(record["layers"])
    try:
        st, hard = os.lstat(root / "d" / "f"), os.lstat(root / "d" / "hard")
        assert (st.st_uid, st.st_gid, st.st_nlink, st.st_ino) == (101234, 104321, 2, hard.st_ino)
        gone = os.lstat(root / "gone")
        assert os.major(gone.st_rdev) == 0 and os.minor(gone.st_rdev) == 0 and (gone.st_mode & 0o170000) == 0o020000
        assert os.getxattr(root / "opaque", "trusted.overlay.opaque") == b"y"
        assert snaps.open(record["layers"]) == [root]  # pinned twice, mounted once
        snaps.close([root])
        assert os.path.ismount(root)
    finally:
        snaps.close([root])
    assert not root.exists()  # last pin: unmounted and removed
    assert list((tmp_path / "scratch").glob(".tmp-*")) == []


def test_layers_stack_and_gc_keeps_what_a_snapshot_references(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    snaps = SnapshotStore(store, tmp_path / "scratch")
    base = publish(snaps, lambda root: (root / "big").write_bytes(os.urandom(1 << 20)))
    top = publish(snaps, lambda root: (root / "small").write_text("x"), below=snaps.meta(base)["layers"])
    assert snaps.meta(top)["layers"][1:] == snaps.meta(base)["layers"]
    chunks = {chunk_key(c.digest) for c in store.manifest_by_digest(snaps.meta(base)["layers"][0]).chunks}
    assert store.gc(grace=0).chunks == 0  # both records hold their layers
    snaps.remove(base)
    assert store.gc(grace=0).chunks == 0  # `top` still stacks on base's layer
    assert all(store.blobs.has(k) for k in chunks)
    snaps.remove(top)
    assert store.gc(grace=0).chunks >= len(chunks)
    assert not any(store.blobs.has(k) for k in chunks)
    assert snaps.list() == []


def test_purge_deletes_a_snapshots_own_chunks_but_not_shared_ones(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    snaps = SnapshotStore(store, tmp_path / "scratch")
    data = os.urandom(1 << 20)
    keep = publish(snaps, lambda root: (root / "a").write_bytes(data))
    gone = publish(snaps, lambda root: ((root / "a").write_bytes(data), (root / "b").write_bytes(os.urandom(1 << 20))))
    shared = {chunk_key(c.digest) for c in store.manifest_by_digest(snaps.meta(keep)["layers"][0]).chunks}
    assert store.remove_snapshot(gone, purge=True) >= 1 << 20
    assert all(store.blobs.has(k) for k in shared)
    assert [r["id"] for r in snaps.list()] == [keep]


def test_bad_ids_and_missing_snapshots_are_named(tmp_path: Path) -> None:
    snaps = SnapshotStore(ImageStore(tmp_path / "images"), tmp_path / "scratch")
    with pytest.raises(InvalidRequest, match=re.escape("not a snapshot id: '../x'")):
        snaps.meta("../x")
    with pytest.raises(NotFound, match="snap-0123456789abcdef"):
        snaps.meta("snap-0123456789abcdef")


def test_cli_lists_and_removes_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSEC_IMAGES", str(tmp_path / "images"))
    monkeypatch.delenv("DSEC_IMAGE_STORE", raising=False)
    monkeypatch.delenv("DSEC_SNAPSHOT_STORE", raising=False)
    snaps = SnapshotStore(ImageStore(tmp_path / "images"), tmp_path / "scratch")
    snap = publish(snaps, lambda root: (root / "f").write_text("x"))
    runner = CliRunner()
    listed = runner.invoke(main, ["snapshot", "ls"])
    assert listed.exit_code == 0 and snap in listed.output and "base" in listed.output
    missing = runner.invoke(main, ["snapshot", "rm", "snap-0123456789abcdef"])
    assert missing.exit_code == 1 and "snap-0123456789abcdef" in missing.output
    assert runner.invoke(main, ["snapshot", "rm", snap]).output.strip() == snap
    assert runner.invoke(main, ["snapshot", "ls", "--json"]).output.strip() == "[]"


def test_sweep_releases_layers_an_earlier_daemon_left_mounted(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    snap = publish(SnapshotStore(store, tmp_path / "scratch"), lambda root: (root / "f").write_text("x"))
    earlier = SnapshotStore(store, tmp_path / "scratch")
    (root,) = earlier.open(earlier.meta(snap)["layers"])  # that daemon dies with the layer pinned
    later = SnapshotStore(store, tmp_path / "scratch")
    (again,) = later.open(later.meta(snap)["layers"])  # a re-adopted sandbox re-pins it: not mounted twice
    assert again == root and (root / "f").read_text() == "x"
    later.sweep()
    assert os.path.ismount(root)  # pinned: kept
    later.close([again])
    assert not root.exists()
    (root,) = earlier.open(earlier.meta(snap)["layers"])
    SnapshotStore(store, tmp_path / "scratch").sweep()  # nobody re-pinned it: unmounted, removed
    assert not root.exists()
