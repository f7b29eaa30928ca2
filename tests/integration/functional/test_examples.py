"""The examples run against a real daemon process with real container sandboxes (``debian-python``).

``examples/grade_solutions.py`` (the judge) is run by ``test_function_call.py``; the computer-use example
needs the vm backend and is run by ``test_computer_use_example`` (marked ``vm``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from container_support import daemon_process

pytestmark = [pytest.mark.root, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def daemon(debian_python_image: object) -> Iterator[str]:
    with daemon_process("dsec-ex-") as (unix_url, _):
        yield unix_url


def test_quickstart_runs(daemon: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DSEC_URL": daemon})
    assert proc.returncode == 0, proc.stderr
    assert "hello from" in proc.stdout and "tick 3" in proc.stdout


async def test_rl_rollouts_rewards_follow_what_the_policy_did(daemon: str) -> None:
    rl = load("rl_rollouts")
    summary = await rl.rollouts(6, 3, steps=4, seed=3, url=daemon)
    assert summary["episodes"] == 6 and len(set(summary["sandboxes"])) == 6
    for steps, reward in zip(summary["steps"], summary["rewards"], strict=True):
        assert len(steps) == 4
        writes = [action for action, _ in steps if action.startswith("write_")]
        # The grader's reward is 1 exactly when the last solution the policy wrote was the right one.
        assert reward == (1.0 if writes and writes[-1] == "write_good" else 0.0), steps
    assert 0.0 <= summary["mean_reward"] <= 1.0
    async with dsec.Client(daemon) as client:
        # Every sandbox is gone, and the audit trail kept every step and the grader of each episode.
        assert await dsec.AsyncSandbox.list(labels={"example": "rl-rollouts"}, client=client) == []
        history = await client.sandbox_logs(summary["sandboxes"][0])
        assert len(history) == 5 and "solution" in str(history[0].command)


async def test_rl_rollouts_on_trajectories(daemon: str) -> None:
    rl = load("rl_rollouts")
    summary = await rl.rollouts(2, 2, steps=2, seed=1, trajectory="example-test/run-1", url=daemon)
    assert summary["episodes"] == 2 and all(r in (0.0, 1.0) for r in summary["rewards"])


def test_swe_task_clones_patches_and_resolves(daemon: str, tmp_path: Path) -> None:
    swe = load("swe_task")
    repo = swe.make_demo_repo(tmp_path)
    result = swe.solve(repo, swe.DEMO_PATCH, swe.DEMO_TEST, url=daemon)
    assert result["tests_before"]["exit_code"] != 0 and "FAILED" in result["tests_before"]["output"]
    assert result["patch_applied"] and result["tests_after"]["exit_code"] == 0
    assert "+    return sum(xs) / len(xs)" in result["diff"] and len(result["commit"]) == 40
    assert result["resolved"] and result["head"].endswith("calc")


def test_swe_task_reports_a_patch_that_does_not_apply(daemon: str, tmp_path: Path) -> None:
    swe = load("swe_task")
    repo = swe.make_demo_repo(tmp_path)
    bad = swe.DEMO_PATCH.replace("(len(xs) - 1)", "(len(xs) - 2)")
    result = swe.solve(repo, bad, swe.DEMO_TEST, url=daemon)
    assert not result["patch_applied"] and not result["resolved"] and result["tests_after"] is None
    assert "calc/stats.py" in result["patch_output"]


def test_swe_task_command_line_refuses_half_arguments(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "swe_task.py"), "--repo", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--repo and --patch go together" in proc.stderr


@pytest.mark.vm
@pytest.mark.timeout(2400)
def test_computer_use_example(tmp_path: Path, vm_home: Path) -> None:
    from dsec.guest.vmimage import find_vm_image

    find_vm_image("debian-desktop")  # ImageNotFound names how to build it (./scripts/setup does)
    cu = load("computer_use")
    # on the session's vm home: the template tests/backends/test_vm.py booted is restored, not booted again
    with daemon_process("dsec-cu-", home=vm_home) as (unix_url, _):
        _boot_template(unix_url)
        result = cu.run(tmp_path / "shots", url=unix_url, wait_s=30)
    for shot in (result["before"], result["after"]):
        assert Path(shot).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert result["terminal_opened"]
    assert result["typed"] == "hello from the agent", "the keystrokes did not reach the terminal's shell"


def _boot_template(unix_url: str) -> None:
    """The first vm sandbox of a home without the image's template boots it (minutes under TCG), longer than the
    SDK waits for a create's answer; the daemon finishes it anyway. Wait for it, so the example measures a
    restore like a warm node's."""
    import time

    with dsec.Client(unix_url) as client:
        try:
            dsec.Sandbox.create(image="debian-desktop", backend="vm", memory="1Gi", client=client).close()
            return
        except dsec.ConnectionFailed:
            pass  # the create goes on in the daemon
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            ready = [sb for sb in dsec.Sandbox.list(backend="vm", client=client) if sb.info().state == "running"]
            if ready:
                for sb in ready:
                    sb.close()
                return
            failures = asyncio.run(_overview(unix_url)).failures
            if failures:  # the daemon gave up on the boot: say why (its create_failed event has the reason)
                pytest.fail(f"the vm template did not boot: {failures}: {asyncio.run(_first_failure(unix_url))}")
            time.sleep(5)
    pytest.fail("the vm template did not boot in 25 minutes")


async def _overview(unix_url: str) -> dsec.NodeOverview:
    async with dsec.Client(unix_url) as client:
        return await client.overview()


async def _first_failure(unix_url: str) -> str | None:
    async with dsec.Client(unix_url) as client:
        stream = client.events(0)
        try:
            async for event in stream:
                if event.kind == "create_failed":
                    return event.reason
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    return None
