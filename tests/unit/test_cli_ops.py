"""``dsec ps / top / inspect / logs / audit / events`` against a real daemon app served by uvicorn."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec.cli import main


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("home")) as d:
        yield d


@pytest.fixture
def env(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> Iterator[dsec.Client]:
    monkeypatch.setenv("DSEC_URL", daemon.unix_url)
    with dsec.Client(url=daemon.unix_url) as client:
        yield client


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_ps_filters_by_backend_state_image_job_and_label(env: dsec.Client) -> None:
    with (
        dsec.Sandbox.create(image="tiny", labels={"team": "a", "dsec.job": "j1"}, client=env) as a,
        dsec.Sandbox.create(image="debian-python", labels={"team": "b"}, client=env) as b,
    ):
        b.pause()
        code, out, _ = invoke("ps")
        assert code == 0 and a.id in out and b.id in out and "team=a" in out and "NODE" in out
        assert [r["id"] for r in json.loads(invoke("ps", "--image", "tiny", "--json")[1])] == [a.id]
        assert [r["id"] for r in json.loads(invoke("ps", "--state", "paused", "--json")[1])] == [b.id]
        assert [r["id"] for r in json.loads(invoke("ps", "--job", "j1", "--json")[1])] == [a.id]
        assert [r["id"] for r in json.loads(invoke("ps", "-l", "team=b", "--json")[1])] == [b.id]
        assert json.loads(invoke("ps", "--backend", "vm", "--json")[1]) == []
        code, _, err = invoke("ps", "--label", "no-equals-sign")
        assert code != 0 and "--label" in err


def test_logs_and_audit_show_the_command_history_also_after_destroy(env: dsec.Client) -> None:
    sb = dsec.Sandbox.create(image="tiny", client=env)
    sb.exec("echo first")
    sb.exec(["sh", "-c", "echo oops >&2; exit 4"])
    sb.exec("sleep 5", timeout=0.2)
    sb.close()
    code, out, _ = invoke("logs", sb.id)
    assert code == 0
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "$ echo first" in line)
    assert "exit 0" in lines[first] and lines[first + 1] == "first" and "local" in lines[first]
    assert "oops" in out and "exit 4" in out and "time limit" in out
    code, out, _ = invoke("logs", sb.id, "--json")
    rows = json.loads(out)
    assert [r["outcome"] for r in rows] == ["limit", "nonzero", "ok"] and rows[1]["stderr"] == "oops\n"
    code, out, _ = invoke("audit", "--sandbox", sb.id, "--outcome", "nonzero", "--json")
    assert [r["exit_code"] for r in json.loads(out)] == [4]
    code, out, _ = invoke("audit", "--since", "600")
    assert code == 0 and sb.id in out and "COMMAND" in out
    code, _, err = invoke("logs", "sb-doesnotexist")
    assert code == 1 and "sb-doesnotexist" in err
    code, _, err = invoke("audit", "--since", "-5")
    assert code == 1 and "--since must be a positive" in err


def test_inspect_shows_spec_usage_and_latest_commands(env: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", labels={"k": "v"}, memory="256Mi", client=env) as sb:
        sb.exec("echo hello")
        code, out, _ = invoke("inspect", sb.id)
        assert code == 0 and sb.id in out and "256.0 MiB" in out and "k=v" in out and "echo hello" in out
        doc = json.loads(invoke("inspect", sb.id, "--json")[1])
        assert doc["info"]["id"] == sb.id and doc["stats"] is not None
        assert doc["recent_commands"][0]["command"] == "echo hello"
    code, _, err = invoke("inspect", "sb-nope")
    assert code == 1 and "sb-nope" in err


def test_top_once_and_json(env: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        sb.exec("true")
        code, out, _ = invoke("top", "--once")
        assert code == 0 and sb.id in out and "EXECS/s" in out and "CPU s" in out
        doc = json.loads(invoke("top", "--json")[1])
        assert sb.id in doc["stats"] and doc["overview"]["exec_count"] >= 1
        assert any(s["id"] == sb.id for s in doc["sandboxes"])


def test_top_prints_plain_snapshots_when_not_a_terminal(daemon: Daemon, env: dsec.Client) -> None:
    """Piped (a log, `| head`), `dsec top` prints one plain frame per interval instead of nothing."""
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        proc = subprocess.Popen([sys.executable, "-m", "dsec", "top", "--interval", "0.2"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={"DSEC_URL": daemon.unix_url, "PATH": "/usr/bin:/bin"})
        try:
            assert proc.stdout is not None
            lines: list[str] = []
            deadline = time.monotonic() + 30
            while sum(line.startswith("--- ") for line in lines) < 3 and time.monotonic() < deadline:
                line = proc.stdout.readline().decode()
                if not line:
                    break
                lines.append(line)
        finally:
            proc.kill()
            _, err = proc.communicate()
    assert sum(line.startswith("--- ") for line in lines) == 3, (lines, err.decode(errors="replace")[-2000:])
    assert any(sb.id in line for line in lines) and any("EXECS/s" in line for line in lines)
    assert not any("\x1b[" in line for line in lines), "terminal escapes in a pipe"


def test_ps_and_top_fit_an_80_column_terminal(env: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", labels={"team": "rl-infra"}, client=env) as sb:
        for args in (("ps",), ("top", "--once")):
            result = CliRunner().invoke(main, list(args), env={"COLUMNS": "80"}, catch_exceptions=False)
            lines = result.stdout.splitlines()
            assert result.exit_code == 0 and all(len(line) <= 80 for line in lines), lines
            row = next(line for line in lines if sb.id in line)
            assert "container" in row and "tiny" in row and "running" in row, lines


def test_events_streams_lifecycle_over_http(daemon: Daemon, env: dsec.Client) -> None:
    # A separate process reads the stream live while this one creates and destroys.
    since = daemon.engine.events.statistics()["published"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec", "events", "--json", "--count", "3", "--since", str(since),
         *(a for kind in ("created", "paused", "destroyed") for a in ("--kind", kind))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"DSEC_URL": daemon.unix_url, "PATH": "/usr/bin:/bin"},
    )
    try:
        deadline = time.monotonic() + 20
        while daemon.engine.events.statistics()["subscribers"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        sb = dsec.Sandbox.create(image="tiny", client=env)
        sb.pause()
        sb.resume()  # not a kind asked for: filtered out
        sb.close()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0, err
    assert [(e["kind"], e["sandbox_id"]) for e in events] == [("created", sb.id), ("paused", sb.id),
                                                               ("destroyed", sb.id)]


def test_events_replays_the_kept_history(daemon: Daemon, env: dsec.Client) -> None:
    since = daemon.engine.events.statistics()["published"]
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        pass
    code, out, _ = invoke("events", "--since", str(since), "--count", "2", "--kind", "created", "--kind", "destroyed")
    lines = out.splitlines()
    assert code == 0 and "created" in lines[0] and "destroyed" in lines[1] and sb.id in lines[1]


def test_events_refuses_an_unknown_kind() -> None:
    result = CliRunner().invoke(main, ["events", "--kind", "creatd"])
    assert result.exit_code == 2 and "'creatd' is not one of" in result.stderr and "'created'" in result.stderr


def test_operator_commands_are_listed_in_help() -> None:
    code, out, _ = invoke("--help")
    assert code == 0
    for name in ("ps", "top", "inspect", "logs", "audit", "events"):
        assert f"  {name} " in out


def test_trajectory_ls_log_end_and_rm_with_confirmation(env: dsec.Client) -> None:
    sb = dsec.Sandbox.create(image="tiny", trajectory="cli/[bold]t1", client=env)
    sb.exec("echo hi")
    code, out, _ = invoke("trajectory", "ls", "--prefix", "cli/")
    assert code == 0 and "cli/[bold]t1" in out and sb.id in out and "open" in out  # markup shown, not obeyed
    assert [t["calls"] for t in json.loads(invoke("trajectory", "ls", "--prefix", "cli/", "--json")[1])] == [1]
    code, out, _ = invoke("trajectory", "log", "cli/[bold]t1")
    assert code == 0 and "exec" in out and "echo hi" in out
    code, out, _ = invoke("trajectory", "end", "cli/[bold]t1")
    assert code == 0 and "ended cli/[bold]t1" in out
    assert "ended" in invoke("trajectory", "ls", "--prefix", "cli/")[1]
    result = CliRunner().invoke(main, ["trajectory", "rm", "cli/[bold]t1"], input="n\n")
    assert result.exit_code != 0 and "delete trajectory" in result.stderr
    assert dsec.Trajectory("cli/[bold]t1", env).info().calls == 1  # refused: nothing deleted
    code, out, _ = invoke("trajectory", "rm", "--yes", "cli/[bold]t1")
    assert code == 0 and out.strip() == "cli/[bold]t1"
    assert dsec.Trajectory.list(prefix="cli/", client=env) == []
    result = CliRunner().invoke(main, ["trajectory", "rm", "-y", "cli/none"])
    assert result.exit_code != 0 and "no trajectory 'cli/none'" in result.stderr
