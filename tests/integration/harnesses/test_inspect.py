"""inspect-ai on DSec, checked by inspect's own tools: its sandbox compliance suite (``self_check.py``, all 44
checks) against the ``dsec`` sandbox environment on a real daemon, on the container and the microvm backend
(marked ``vm``), and an ``inspect eval`` of a small task with the ``mockllm`` model and ``--sandbox dsec``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="inspect-ai is not installed: pip install 'dsec[inspect]'")

from inspect_ai.util._sandbox.self_check import *  # noqa: F403 (inspect's 44 checks, collected as tests)

from container_support import daemon_process
from dsec.integrations.inspect import DSecSandboxConfig, DSecSandboxEnvironment, DSecService

pytestmark = [pytest.mark.root, pytest.mark.slow]

# The checks run as a user that is not root (root reads and writes past any file mode, and the permission checks
# need a refusal); the image's minbase Debian has no ``adduser``, which test_exec_as_user calls (as root), so
# that check's sandbox gets a stand-in over ``useradd``.
USER = "nobody"
ADDUSER = """#!/bin/sh
# adduser --comment TEXT --disabled-password NAME, as inspect's self-check calls it
exec useradd --create-home --comment "$2" "$4"
"""


@pytest.fixture(scope="module")
def daemon_url() -> Iterator[str]:
    with daemon_process("dsec-inspect-") as (unix_url, _):
        yield unix_url


@pytest.fixture(params=["container", pytest.param("microvm", marks=pytest.mark.vm)])
async def sandbox_env(request: pytest.FixtureRequest, daemon_url: str) -> AsyncIterator[DSecSandboxEnvironment]:
    config = DSecSandboxConfig(backend=request.param, url=daemon_url,
                               services={"default": DSecService(image="debian-python", user=USER)})
    envs = await DSecSandboxEnvironment.sample_init("self-check", config, {})
    env = envs["default"]
    assert isinstance(env, DSecSandboxEnvironment)
    if request.node.originalname == "test_exec_as_user":
        missing = await env.exec(["sh", "-c", "command -v adduser"])
        if not missing.success:
            await env.sandbox.files.write("/usr/local/sbin/adduser", ADDUSER, user="root", mode=0o755)
    try:
        yield env
    finally:
        await DSecSandboxEnvironment.sample_cleanup("self-check", config, envs, interrupted=False)


def test_inspect_eval_with_mockllm(daemon_url: str, tmp_path: Path) -> None:
    """``inspect eval`` (the CLI) of a task on inspect's ``mockllm`` model finds the ``dsec`` sandbox through the
    entry point; both samples score."""
    task = Path(__file__).parent / "inspect_task.py"
    env = dict(os.environ, DSEC_URL=daemon_url, INSPECT_LOG_DIR=str(tmp_path / "logs"),
               INSPECT_DISPLAY="plain")
    inspect = Path(sys.executable).parent / "inspect"
    proc = subprocess.run([str(inspect), "eval", task.name, "--log-format", "json"],
                          env=env, cwd=task.parent, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = list((tmp_path / "logs").glob("*.json"))
    assert len(logs) == 1, logs
    log = json.loads(logs[0].read_text())
    assert log["status"] == "success", log.get("error")
    assert log["eval"]["sandbox"]["type"] == "dsec" and log["eval"]["model"] == "mockllm/model"
    scores = [s["scores"]["answer_file"] for s in log["samples"]]
    assert [s["value"] for s in scores] == ["C", "C"] and {s["answer"] for s in scores} == {"42", "1024"}


async def test_single_service_compose_with_build(daemon_url: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A compose file whose one service has ``build:`` (a Dockerfile of another name, a build arg), environment
    and working_dir: ``task_init`` builds it, the sample's sandbox runs it."""
    (tmp_path / "app.Dockerfile").write_text("FROM debian-python\nARG GREETING\nRUN echo $GREETING > /greeting\n")
    (tmp_path / "compose.yaml").write_text(
        "services:\n  default:\n    build: {context: ., dockerfile: app.Dockerfile, args: {GREETING: hi}}\n"
        "    environment: [MODE=compose]\n    working_dir: /srv\n    network_mode: none\n")
    monkeypatch.setenv("DSEC_URL", daemon_url)
    config = str(tmp_path / "compose.yaml")  # as inspect passes a config file
    await DSecSandboxEnvironment.task_init("compose", config)
    envs = await DSecSandboxEnvironment.sample_init("compose", config, {})
    try:
        result = await envs["default"].exec(["sh", "-c", "cat /greeting; echo $MODE; pwd"])
        assert result.success and result.stdout.split() == ["hi", "compose", "/srv"], result
    finally:
        await DSecSandboxEnvironment.sample_cleanup("compose", config, envs, interrupted=False)
