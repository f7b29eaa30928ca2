"""The ``dsec`` command, run through click's CliRunner against a real daemon app and a tmp image store."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
def env(daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dsec.Client]:
    monkeypatch.setenv("DSEC_URL", daemon.unix_url)
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSEC_IMAGES", str(tmp_path / "images"))
    with dsec.Client(url=daemon.unix_url) as client:
        yield client


def invoke(*args: str, input: bytes | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_ps_lists_and_filters_by_label(env: dsec.Client) -> None:
    with (
        dsec.Sandbox.create(image="tiny", labels={"who": "cli"}, client=env) as sb,
        dsec.Sandbox.create(image="tiny", labels={"who": "other"}, client=env) as other,
    ):
        code, out, _ = invoke("ps")
        assert code == 0 and sb.id in out and other.id in out and "tiny" in out and "who=cli" in out
        code, out, _ = invoke("ps", "--label", "who=cli", "--json")
        rows = json.loads(out)
        assert code == 0 and [r["id"] for r in rows] == [sb.id] and rows[0]["state"] == "running"


def test_exec_streams_output_and_returns_the_exit_code(env: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        code, out, err = invoke("exec", sb.id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        assert (code, out, err) == (7, "out\n", "err\n")
        code, out, _ = invoke("exec", sb.id, "-e", "GREETING=hi", "--cwd", "/tmp", "--", "echo $GREETING;pwd")
        assert code == 0 and out.splitlines()[0] == "hi" and out.splitlines()[1].endswith("/tmp")
        code, _, err = invoke("exec", sb.id, "--timeout", "0.2", "--", "sleep 10")
        assert code != 0 and "time limit" in err


def test_exec_forwards_standard_input(env: dsec.Client) -> None:
    """``echo hello | dsec exec ID -- cat`` prints hello (stdin that is no terminal is forwarded); -n keeps it."""
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        assert invoke("exec", sb.id, "--", "cat", input=b"hello\n")[:2] == (0, "hello\n")
        assert invoke("exec", sb.id, "--", "sh", "-c", "wc -c", input=b"x" * 100_000)[1].strip() == "100000"
        assert invoke("exec", sb.id, "-n", "--", "cat", input=b"kept back\n")[:2] == (0, "")


def test_rm_destroys_and_reports_missing(env: dsec.Client) -> None:
    a = dsec.Sandbox.create(image="tiny", client=env)
    b = dsec.Sandbox.create(image="tiny", client=env)
    code, out, _ = invoke("rm", a.id)
    assert code == 0 and out.strip() == a.id
    with pytest.raises(dsec.SandboxNotFound):
        a.info()
    code, out, err = invoke("rm", a.id, b.id)
    assert code == 1 and "error:" in err and a.id in err and out.strip() == b.id
    dsec.Sandbox.create(image="tiny", client=env)
    code, out, _ = invoke("rm", "--all")
    assert code == 0 and dsec.Sandbox.list(client=env) == []
    code, _, err = invoke("rm")
    assert code == 1 and "--all" in err


def test_errors_are_one_red_line_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", f"unix://{tmp_path}/none.sock")
    code, out, err = invoke("ps")
    assert code == 1 and out == ""
    assert err.startswith("error: cannot reach the DSec daemon") and "dsec up" in err
    assert "Traceback" not in err
    code, _, err = invoke("exec", "abc", "--", "true")
    assert code == 1 and err.startswith("error:")


def test_serve_refuses_a_bad_pool_before_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSEC_POOLS", raising=False)
    code, _, err = invoke("serve", "--pool", "debian-python:container:min=9,max=2")
    assert code == 1 and err.startswith("error: pool 'debian-python:container:min=9,max=2'")
    assert "must be >= min" in err and not (tmp_path / "home").exists()


def test_image_commands_against_a_tmp_store(env: dsec.Client, tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("img\n")
    code, out, err = invoke("image", "import", "mini", str(root))
    assert code == 0, err
    assert "imported mini" in out
    code, out, _ = invoke("image", "ls", "--json")
    assert code == 0 and [i["name"] for i in json.loads(out)] == ["mini"]
    code, out, _ = invoke("image", "ls")
    assert code == 0 and "mini" in out
    code, out, _ = invoke("image", "inspect", "mini")
    assert code == 0
    inspected = json.loads(out)
    assert inspected["image"]["files"] >= 2
    storage = inspected["storage"]
    assert storage["chunks"] >= 1 and storage["blob_bytes"] >= 4096 and storage["cached_on_this_node_bytes"] == 0
    assert storage["shared_with_other_images_bytes"] == 0 and storage["store"].endswith("/images/store")
    code, out, _ = invoke("image", "import", "twin", str(root))
    code, out, _ = invoke("image", "inspect", "twin")
    assert json.loads(out)["storage"]["dedup_savings_bytes"] == storage["blob_bytes"]  # identical data
    code, _, err = invoke("image", "import-dir", "mini", str(root))
    assert code == 1 and "already exists" in err
    code, out, err = invoke("image", "copy", "mini", "--to", str(tmp_path / "elsewhere"))
    assert code == 0 and "mini: sha256:" in out, err
    from dsec.images.image_store import ImageStore

    copied = ImageStore(tmp_path / "x", str(tmp_path / "elsewhere"))
    assert copied.manifest("mini") == ImageStore(tmp_path / "images").manifest("mini")
    code, _, err = invoke("image", "copy", "absent", "--to", str(tmp_path / "elsewhere"))
    assert code == 1 and "not found" in err
    code, out, _ = invoke("image", "rm", "mini", "twin")
    assert code == 0 and out.split() == ["mini", "twin"]
    code, out, _ = invoke("image", "gc", "--grace", "0")
    assert code == 0 and "chunks and 2 manifests" in out, out  # data shared, one metadata image each
    assert "builder: not pruned" in out or "builder:" not in out  # the node's build cache serves another store
    assert not [p for p in (tmp_path / "images" / "store" / "chunks").rglob("*") if p.is_file()]
    code, _, err = invoke("image", "inspect", "mini")
    assert code == 1 and err.startswith("error: image 'mini' not found")
    code, _, err = invoke("image", "import", "Bad Name", str(root))
    assert code == 1 and "invalid image name" in err


def test_demo_goes_from_fail_to_pass(env: dsec.Client) -> None:
    # The fake backend runs commands on the host, so this needs the host's python3 (the test's own).
    code, out, _ = invoke("demo")
    assert code == 0, out
    assert "fail -> pass" in out and "container" in out
    assert dsec.Sandbox.list(client=env) == []


def test_help_and_python_dash_m() -> None:
    code, out, _ = invoke("--help")
    assert code == 0
    for command in ("serve", "up", "down", "doctor", "ps", "exec", "rm", "image", "bench", "demo"):
        assert command in out
    proc = subprocess.run([sys.executable, "-m", "dsec", "image", "--help"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and "import" in proc.stdout and "build" in proc.stdout
