"""CgroupSet.create against a sibling's destroy that removes the shared parent, and the CPU class of the
sandboxes' group (v1 layouts in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.config import Settings
from dsec.isolation.cgroups import CPU_SHARES_BUSY, CPU_SHARES_IDLE, CgroupSet, Limits, background_group, v2_make


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


def _stand_in_cgroupfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v2: bool = False) -> None:
    """A v1 (or v2) layout whose cpu hierarchy gives every new directory a ``cpu.idle`` of 0, as the kernel's
    does (and on v2 a ``cgroup.subtree_control``)."""
    if v2:
        (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
        (tmp_path / "cgroup.subtree_control").write_text("")
    else:
        for name in ("cpu,cpuacct", "pids", "memory"):
            (tmp_path / name).mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        real_mkdir(self, mode, parents, exist_ok)
        if (v2 or "cpu,cpuacct" in self.parts) and not (self / "cpu.idle").exists():
            (self / "cpu.idle").write_text("0\n")
            if v2:
                (self / "cgroup.subtree_control").write_text("")

    monkeypatch.setattr(Path, "mkdir", mkdir)


def test_the_group_a_create_makes_gets_the_cpu_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_cgroupfs(tmp_path, monkeypatch)
    group = tmp_path / "cpu,cpuacct" / "dsec-t"
    made = CgroupSet.create("/dsec-t/sb-1", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path,
                            background=True)
    assert int((group / "cpu.idle").read_text()) == 1
    assert int((group / "sb-1" / "cpu.idle").read_text()) == 0  # the class of the group, not of the sandbox
    made.set_cpu_class(busy=False)  # a sandbox ranks against its siblings by weight
    assert int((group / "sb-1" / "cpu.shares").read_text()) == CPU_SHARES_IDLE
    assert int((group / "sb-1" / "cpu.idle").read_text()) == 0
    # A group that is already there keeps what it has (start() sets the class of a kept group).
    (group / "cpu.idle").write_text("0\n")
    CgroupSet.create("/dsec-t/sb-2", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path, background=True)
    assert int((group / "cpu.idle").read_text()) == 0
    # Nested sandboxes (the microvm backend's dsec-<tag>/microvm/...) give the class to the top-level group.
    CgroupSet.create("/dsec-u/microvm/sb-3", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path,
                     background=True)
    assert int((tmp_path / "cpu,cpuacct" / "dsec-u" / "cpu.idle").read_text()) == 1
    assert int((tmp_path / "cpu,cpuacct" / "dsec-u" / "microvm" / "cpu.idle").read_text()) == 0


def test_v2_a_group_removed_by_a_sibling_is_made_again_with_its_class(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The function backend removes its group with its last sandbox: a create racing with that (the group gone
    between its mkdir and the sandbox's) makes it again, and must give it the class again."""
    _stand_in_cgroupfs(tmp_path, monkeypatch, v2=True)
    group = tmp_path / "dsec-t-fn"
    CgroupSet.create("/dsec-t-fn/sb-1", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path, background=True)
    assert int((group / "cpu.idle").read_text()) == 1
    assert set((tmp_path / "cgroup.subtree_control").read_text().replace("+", "").split()) == {"cpu", "memory", "pids"}
    (group / "cpu.idle").write_text("0\n")  # so that only a remade group can show 1 below
    stand_in_mkdir = Path.mkdir
    raced: list[Path] = []

    def mkdir(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        if self.name == "sb-2" and not raced:  # the last sibling's destroy removes the whole group right now
            raced.append(self)
            for p in sorted(group.rglob("*"), reverse=True):
                p.rmdir() if p.is_dir() else p.unlink()
            group.rmdir()
        stand_in_mkdir(self, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    CgroupSet.create("/dsec-t-fn/sb-2", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path, background=True)
    assert raced and int((group / "cpu.idle").read_text()) == 1
    assert (group / "sb-2" / "memory.max").read_text() == str(1 << 30)
    assert not (group / "sb-1").exists()


def test_background_group_sets_a_kept_group_and_makes_none_unless_asked(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_cgroupfs(tmp_path, monkeypatch)
    background_group("dsec-t", True, root=tmp_path, make=False)
    assert not any((tmp_path / name / "dsec-t").exists() for name in ("cpu,cpuacct", "pids", "memory"))
    background_group("dsec-t", True, root=tmp_path)
    assert all((tmp_path / name / "dsec-t").is_dir() for name in ("cpu,cpuacct", "pids", "memory"))
    assert int((tmp_path / "cpu,cpuacct" / "dsec-t" / "cpu.idle").read_text()) == 1
    background_group("dsec-t", False, root=tmp_path, make=False)  # DSEC_SANDBOX_CPU_IDLE=0 on a restart
    assert int((tmp_path / "cpu,cpuacct" / "dsec-t" / "cpu.idle").read_text()) == 0
    for bad in ("dsec-t/microvm", "/", ""):
        with pytest.raises(ValueError, match="not a top-level cgroup"):
            background_group(bad, True, root=tmp_path)


def test_a_group_without_cpu_idle_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before 5.15 (or on v2 without the cpu controller) there is no ``cpu.idle``: nothing is written or logged,
    and creates go on (the class is best effort)."""
    for name in ("cpu,cpuacct", "pids"):
        (tmp_path / name).mkdir()
    made = CgroupSet.create("/dsec-t/sb-1", Limits(memory=1 << 30, cpu=1.0, pids=64), root=tmp_path,
                            background=True)
    assert not (tmp_path / "cpu,cpuacct" / "dsec-t" / "cpu.idle").exists()
    background_group("dsec-t", True, root=tmp_path, make=False)
    assert not (tmp_path / "cpu,cpuacct" / "dsec-t" / "cpu.idle").exists() and not caplog.records
    made.set_cpu_class(busy=True)
    assert (tmp_path / "cpu,cpuacct" / "dsec-t" / "sb-1" / "cpu.shares").read_text() == str(CPU_SHARES_BUSY)


def test_the_setting_reads_the_usual_false_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("0", False), ("false", False), ("No", False), (" off ", False), ("1", True),
                            ("yes", True)):
        monkeypatch.setenv("DSEC_SANDBOX_CPU_IDLE", value)
        assert Settings().sandbox_cpu_idle is expected, value
    monkeypatch.delenv("DSEC_SANDBOX_CPU_IDLE")
    assert Settings().sandbox_cpu_idle is True


def test_v2_make_enables_the_controllers_down_to_a_nested_cgroup(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The microvm backend's QEMU cgroup sits two levels down (dsec-<tag>/microvm/<id>): every directory above
    it must list memory, cpu and pids in its subtree_control, or its limit files do not exist."""
    _stand_in_cgroupfs(tmp_path, monkeypatch, v2=True)
    v2_make(tmp_path / "dsec-t" / "microvm" / "sb-1", root=tmp_path)
    assert (tmp_path / "dsec-t" / "microvm" / "sb-1").is_dir()
    for d in (tmp_path, tmp_path / "dsec-t", tmp_path / "dsec-t" / "microvm"):
        assert set((d / "cgroup.subtree_control").read_text().replace("+", "").split()) == {"cpu", "memory", "pids"}, d
    v2_make(tmp_path / "dsec-t" / "microvm" / "sb-1", root=tmp_path)  # again: nothing to do, no error
