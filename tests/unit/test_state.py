"""StateStore: atomic records that survive corrupt neighbours."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.daemon.state import StateStore
from dsec.models import SandboxRecord, SandboxSpec, SandboxState


def _record(sandbox_id: str = "sb-000000000001", state: SandboxState = "running") -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id, spec=SandboxSpec(image="base", labels={"a": "1"}), state=state,
        created_at=1.0, expires_at=2.0, backend_state={"root": "/x", "pids": [1, 2]},
    )


def test_save_load_round_trip_and_replace(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "sandboxes")
    store.save(_record(state="creating"))
    store.save(_record(state="running"))
    loaded = store.load_all()
    assert loaded == [_record(state="running")]
    assert store.load("sb-000000000001") == _record()
    assert [p.name for p in (tmp_path / "sandboxes").iterdir()] == ["sb-000000000001.json"]


def test_corrupt_records_are_moved_aside_and_others_load(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(_record("sb-000000000001"))
    (tmp_path / "sb-000000000002.json").write_text("{not json")
    (tmp_path / "sb-000000000003.json").write_text(_record("sb-000000000004").model_dump_json())
    assert [r.id for r in store.load_all()] == ["sb-000000000001"]
    assert (tmp_path / "sb-000000000002.json.corrupt").exists()
    assert (tmp_path / "sb-000000000003.json.corrupt").exists()
    assert not (tmp_path / "sb-000000000002.json").exists()


def test_stale_tmp_files_are_removed_and_delete_is_idempotent(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    (tmp_path / ".sb-000000000001.json.abcd.tmp").write_text("{half")
    store.save(_record())
    assert len(store.load_all()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sb-000000000001.json"]
    store.delete("sb-000000000001")
    store.delete("sb-000000000001")
    assert store.load_all() == []
    assert store.load("sb-000000000001") is None


def test_missing_directory_loads_nothing(tmp_path: Path) -> None:
    assert StateStore(tmp_path / "absent").load_all() == []


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden"])
def test_ids_that_are_not_file_names_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid sandbox id"):
        StateStore(tmp_path).save(_record(bad))
