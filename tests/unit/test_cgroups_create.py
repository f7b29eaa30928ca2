"""CgroupSet.create against a sibling's destroy that removes the shared parent (a v1 layout in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.isolation.cgroups import CgroupSet, Limits


def test_create_remakes_a_parent_removed_between_its_two_mkdirs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pids").mkdir()
    real_mkdir = Path.mkdir
    raced: list[Path] = []

    def mkdir(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        if self.name == "sb-1" and not raced:  # the last sibling's destroy runs rmdir(parent) right now
            raced.append(self)
            self.parent.rmdir()
        real_mkdir(self, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    made = CgroupSet.create("/dsec-t-fn/sb-1", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path)
    assert raced == [tmp_path / "pids" / "dsec-t-fn" / "sb-1"]
    assert made.dirs == {"pids": str(tmp_path / "pids" / "dsec-t-fn" / "sb-1")}
    assert (tmp_path / "pids" / "dsec-t-fn" / "sb-1" / "pids.max").read_text() == "64"


def test_create_gives_up_when_the_parent_keeps_vanishing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pids").mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        if self.name == "sb-1":
            self.parent.rmdir()
        real_mkdir(self, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(FileNotFoundError):
        CgroupSet.create("/dsec-t-fn/sb-1", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path)
