"""StateStore: atomic records in one SQLite database that survive corrupt neighbours, a corrupt database, a
writer killed mid-save, and the JSON files of an older daemon."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec._sqlite import private_database
from dsec.daemon.state import StateStore
from dsec.models import SandboxRecord, SandboxSpec, SandboxState


def _record(sandbox_id: str = "sb-000000000001", state: SandboxState = "running") -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id, spec=SandboxSpec(image="base", labels={"a": "1"}), state=state,
        created_at=1.0, expires_at=2.0, backend_state={"root": "/x", "pids": [1, 2]},
    )


def test_save_load_round_trip_and_replace(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "home" / "sandboxes.db")
    store.save(_record(state="creating"))
    store.save(_record(state="running"))
    store.save(_record("sb-000000000000"))
    assert store.load_all() == [_record("sb-000000000000"), _record(state="running")]
    assert store.load("sb-000000000001") == _record()
    assert store.ids() == ["sb-000000000000", "sb-000000000001"]
    store.close()
    # another store on the same file (the next daemon) reads the same
    again = StateStore(tmp_path / "home" / "sandboxes.db")
    assert again.load("sb-000000000001") == _record()
    # records hold the sandboxes' environments: nobody else reads them
    for name in ("sandboxes.db", "sandboxes.db-wal"):
        assert stat.S_IMODE(os.stat(tmp_path / "home" / name).st_mode) == 0o600, name
    again.close()


def test_corrupt_records_are_moved_aside_and_others_load(tmp_path: Path) -> None:
    path = tmp_path / "sandboxes.db"
    store = StateStore(path)
    store.save(_record("sb-000000000001"))
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("insert into records values (?, ?)", ("sb-000000000002", "{not json"))
        other = _record("sb-000000000004").model_dump_json()
        db.execute("insert into records values (?, ?)", ("sb-000000000003", other))
    store = StateStore(path)
    assert [r.id for r in store.load_all()] == ["sb-000000000001"]
    assert store.ids() == ["sb-000000000001"]
    with sqlite3.connect(path) as db:
        kept = {row[0]: row[1] for row in db.execute("select id, error from corrupt")}
    assert set(kept) == {"sb-000000000002", "sb-000000000003"}
    assert "does not match its key" in kept["sb-000000000003"]
    assert store.load("sb-000000000002") is None
    with sqlite3.connect(path) as db:  # a row under another sandbox's key
        misplaced = _record("sb-000000000006").model_dump_json()
        db.execute("insert into records values (?, ?)", ("sb-000000000005", misplaced))
    assert store.load("sb-000000000005") is None
    store.close()


def test_delete_is_idempotent_and_a_missing_database_loads_nothing(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "absent" / "sandboxes.db")
    assert store.load_all() == []
    store.save(_record())
    store.delete("sb-000000000001")
    store.delete("sb-000000000001")
    assert store.load_all() == [] and store.load("sb-000000000001") is None
    store.close()


def test_an_unreadable_database_is_moved_aside_and_a_new_one_started(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sandboxes.db"
    path.write_bytes(b"this is not a database, " * 200)
    store = StateStore(path)
    assert store.load_all() == []
    store.save(_record())
    assert store.ids() == ["sb-000000000001"]
    (aside,) = tmp_path.glob("sandboxes.db.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    assert "is unreadable" in caplog.text and str(aside) in caplog.text
    store.close()


def test_a_locked_database_is_an_error_and_is_never_moved_aside(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holding the database (an operator's sqlite3 shell, a backup) is no corruption: moving the
    file aside would have the daemon start empty and destroy every live sandbox as an orphan."""
    path = tmp_path / "sandboxes.db"
    store = StateStore(path)
    store.save(_record())
    store.close()
    monkeypatch.setattr(StateStore, "BUSY_TIMEOUT_S", 0.1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("pragma locking_mode=exclusive")
    holder.execute("begin exclusive")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            StateStore(path).load_all()
    finally:
        holder.execute("rollback")
        holder.close()
    assert not list(tmp_path.glob("*.corrupt-*"))
    again = StateStore(path)
    assert again.load_all() == [_record()]
    again.close()


def test_private_mode_reaches_the_wal_and_shm_a_dead_daemon_left(tmp_path: Path) -> None:
    """A database an older daemon made 0644 and left with its -wal and -shm (it died with them open): SQLite
    reuses those as they are, so they get the mode too, not only the main file."""
    path = tmp_path / "trajectories.db"
    old_umask = os.umask(0o022)
    try:
        left = sqlite3.connect(path)
        left.execute("pragma journal_mode=wal")
        left.execute("create table t (x)")
        left.execute("insert into t values ('a command and its output')")
        left.commit()
    finally:
        os.umask(old_umask)
    try:
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o644] * 3
        private_database(path)
        assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o600] * 3
    finally:
        left.close()


def test_a_reader_changes_nothing_and_an_existing_file_gets_the_private_mode(tmp_path: Path) -> None:
    path = tmp_path / "sandboxes.db"
    with pytest.raises(sqlite3.OperationalError):  # read-only never creates the database
        StateStore(path, read_only=True).load_all()
    assert not path.exists()
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    store = StateStore(path)
    store.save(_record())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with sqlite3.connect(path) as db:
        db.execute("insert into records values (?, ?)", ("sb-000000000002", "{not json"))
    reader = StateStore(path, read_only=True)
    assert reader.load_all() == [_record()]
    assert reader.ids() == ["sb-000000000001", "sb-000000000002"]  # the corrupt row is skipped, not moved
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.save(_record("sb-000000000003"))
    reader.close()
    store.close()


def test_records_of_an_older_daemons_files_are_moved_in(tmp_path: Path) -> None:
    legacy = tmp_path / "sandboxes"
    legacy.mkdir()
    (legacy / "sb-000000000001.json").write_text(_record().model_dump_json())
    (legacy / "sb-000000000002.json").write_text("{not json")
    (legacy / ".sb-000000000003.json.abcd.tmp").write_text("{half")  # its daemon was killed mid-write
    store = StateStore(tmp_path / "sandboxes.db", legacy)
    assert store.load_all() == [_record()]
    assert sorted(p.name for p in legacy.iterdir()) == ["sb-000000000002.json.corrupt"]
    (legacy / "sb-000000000002.json.corrupt").unlink()
    assert store.load_all() == [_record()]
    assert not legacy.exists()  # gone once nothing is left in it
    store.close()


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden"])
def test_ids_that_are_not_names_are_refused(tmp_path: Path, bad: str) -> None:
    store = StateStore(tmp_path / "sandboxes.db")
    with pytest.raises(ValueError, match="not a valid sandbox id"):
        store.save(_record(bad))
    store.close()


_WRITER = """
import sys
from dsec._sqlite import private_database
from dsec.daemon.state import StateStore
from dsec.models import SandboxRecord, SandboxSpec
store = StateStore(__import__("pathlib").Path(sys.argv[1]))
spec = SandboxSpec(image="base", env={"PAD": "x" * 3000})
print("ready", flush=True)
n = 0
while True:
    n += 1
    store.save(SandboxRecord(id=f"sb-{n % 50:012d}", spec=spec, state="running", created_at=n, expires_at=n + 1))
    if n % 7 == 0:
        store.delete(f"sb-{(n // 7) % 50:012d}")
"""


def test_a_writer_killed_mid_save_leaves_every_record_whole(tmp_path: Path) -> None:
    """What a daemon SIGKILLed in the middle of saving leaves: every record readable, none half-written."""
    path = tmp_path / "sandboxes.db"
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True) as writer:
        try:
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
            time.sleep(0.5)
        finally:
            writer.send_signal(signal.SIGKILL)
    store = StateStore(path)
    records = store.load_all()
    assert records and all(r.spec.env == {"PAD": "x" * 3000} for r in records)
    with sqlite3.connect(path) as db:
        assert db.execute("select count(*) from corrupt").fetchone() == (0,)
    store.close()
