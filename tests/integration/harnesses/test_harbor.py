"""harbor (Terminal-Bench's harness) on DSec, checked by harbor's own end-to-end run: ``harbor run --env
dsec.integrations.harbor:DSecEnvironment -a oracle`` over five tasks of Terminal-Bench's shape (a Dockerfile
``FROM`` a store image, an instruction, a reference solution, a verifier) must score 1.0 on each; the ``nop``
agent (no solution) must score 0, so the verifiers can fail. harbor needs Python >= 3.12: it runs from the venv
``scripts/setup`` makes with such an interpreter (``.venv-harbor``), with this checkout installed in it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import missing
from container_support import daemon_process

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"
TASKS = Path(__file__).parent / "harbor_tasks"
ENV = "dsec.integrations.harbor:DSecEnvironment"


@pytest.fixture(scope="module")
def daemon_url() -> Iterator[str]:
    if not HARBOR.is_file():
        missing(f"harbor's venv is missing ({HARBOR}): run ./scripts/setup on a host with Python >= 3.12 "
                "(dsec doctor says whether there is one)")
    with daemon_process("dsec-harbor-") as (unix_url, _):
        yield unix_url


def harbor(daemon_url: str, jobs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``harbor run`` (no telemetry, no model-price download: nothing leaves this machine; wide output, unwrapped)."""
    env = dict(os.environ, DSEC_URL=daemon_url, HARBOR_TELEMETRY="0", LITELLM_LOCAL_MODEL_COST_MAP="True",
               COLUMNS="400")
    return subprocess.run([str(HARBOR), "run", "--env", ENV, "-o", str(jobs), "-q", "-n", "2", *args], env=env,
                          cwd=jobs.parent, capture_output=True, text=True, timeout=1200, check=False)


def harbor_run(daemon_url: str, jobs: Path, *args: str) -> dict[str, Any]:
    """A ``harbor run`` that must succeed; its job result."""
    proc = harbor(daemon_url, jobs, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = list(jobs.glob("*/result.json"))
    assert len(results) == 1, (results, proc.stdout[-2000:])
    result: dict[str, Any] = json.loads(results[0].read_text())
    return result


def test_oracle_scores_every_task(daemon_url: str, tmp_path: Path) -> None:
    result = harbor_run(daemon_url, tmp_path / "jobs", "-p", str(TASKS), "-a", "oracle")
    stats = result["stats"]
    (evals,) = stats["evals"].values()
    trials = sorted(t.split("__")[0] for t in evals["reward_stats"]["reward"].get("1.0", []))
    assert (stats["n_errored_trials"], evals["exception_stats"]) == (0, {}), json.dumps(evals, indent=1)
    assert trials == sorted(p.name for p in TASKS.iterdir()), json.dumps(evals, indent=1)
    assert evals["metrics"] == [{"mean": 1.0}]


def test_nop_agent_scores_zero(daemon_url: str, tmp_path: Path) -> None:
    """Without the reference solution the verifier fails: the oracle's score is earned."""
    result = harbor_run(daemon_url, tmp_path / "jobs", "-p", str(TASKS / "hello-file"), "-a", "nop")
    (evals,) = result["stats"]["evals"].values()
    assert evals["metrics"] == [{"mean": 0.0}], json.dumps(evals, indent=1)
    assert result["stats"]["n_errored_trials"] == 0


def test_multi_service_compose_is_refused_by_count(daemon_url: str, tmp_path: Path) -> None:
    """A task is one sandbox: a compose file of two services fails the trial with an error naming them."""
    task = tmp_path / "two-services"
    shutil.copytree(TASKS / "hello-file", task)
    (task / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main: {build: {context: .}}\n  db: {image: debian-python}\n")
    proc = harbor(daemon_url, tmp_path / "jobs", "-p", str(task), "-a", "oracle")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "2 services (main, db)" in output and "only one service" in output, output[-3000:]
