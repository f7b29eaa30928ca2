"""The daemon's structured log lines: written with their fields, parsed back, filtered by `dsec logs --daemon`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec.cli import main
from dsec.daemon.health import Health
from dsec.daemon.logs import StructuredFormatter, parse_line, read_lines


def _record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("dsec.daemon.engine", logging.WARNING, __file__, 1, msg, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_fields_are_written_and_parsed_back() -> None:
    text = StructuredFormatter().format(_record("sandbox sb-1 lost: its init died", component="sandbox",
                                                sandbox="sb-1", error='killed by "SIGKILL"\nnow'))
    assert text.endswith(' component=sandbox sandbox=sb-1 error="killed by \\"SIGKILL\\" now"'), text
    line = parse_line(text)
    assert line is not None and line.level == "WARNING" and line.logger == "dsec.daemon.engine"
    assert line.message == "sandbox sb-1 lost: its init died"
    assert line.fields == {"component": "sandbox", "sandbox": "sb-1", "error": 'killed by "SIGKILL" now'}
    assert parse_line(line.text()) == line
    assert parse_line("Traceback (most recent call last):") is None


def test_a_traceback_joins_its_line(tmp_path: Path) -> None:
    log = tmp_path / "dsec.log"
    first = StructuredFormatter().format(_record("one", component="lazy-server"))
    log.write_text(f"{first}\nTraceback (most recent call last):\n  boom\n{first}\n")
    lines = list(read_lines(log))
    assert len(lines) == 2 and lines[0].more == ["Traceback (most recent call last):", "  boom"]


def test_health_logs_a_fault_and_its_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    health = Health()
    with caplog.at_level("INFO", logger="dsec.daemon.health"):
        health.set("mount-holder", None)
        health.set("mount-holder", "gone", state="down")
        health.set("mount-holder", "gone", state="down")
        health.set("mount-holder", None)
    records = [r for r in caplog.records if getattr(r, "component", None) == "mount-holder"]
    assert [r.levelname for r in records] == ["WARNING", "INFO"]
    found = health.get("mount-holder")
    assert found is not None and found.state == "ok" and found.faults == 1 and found.last_error == "gone"
    assert len(found.recovery_seconds) == 1 and health.status() == "ok"


def test_dsec_logs_daemon_filters_by_component_and_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "log").mkdir()
    fmt = StructuredFormatter()
    lines = [fmt.format(_record("lazy image server started", component="lazy-server")),
             fmt.format(_record("sandbox sb-2 lost", component="sandbox", sandbox="sb-2")),
             fmt.format(_record("sandbox sb-3 lost", component="sandbox", sandbox="sb-3"))]
    (tmp_path / "log" / "dsec.log").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    out = CliRunner().invoke(main, ["logs", "--daemon", "--component", "sandbox"])
    assert out.exit_code == 0 and "sb-2" in out.output and "sb-3" in out.output and "lazy" not in out.output
    out = CliRunner().invoke(main, ["logs", "--daemon", "sb-3"])
    assert out.exit_code == 0 and out.output.count("\n") == 1 and "sb-3" in out.output
    out = CliRunner().invoke(main, ["logs"])
    assert out.exit_code != 0 and "--daemon" in out.output
