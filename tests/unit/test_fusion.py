"""The SandboxFusion runner's logic over a scripted node API: statuses, messages, files, languages and the
reuse of sandboxes (the real endpoint: tests/integration/functional/test_sandbox_fusion.py)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

from dsec.config import Settings
from dsec.daemon.server import Daemon, ServeError
from dsec.errors import FileNotFound, InvalidRequest, PermissionDenied, SandboxNotFound
from dsec.fusion.options import FusionOptions, RunnerSettings
from dsec.fusion.runner import FusionRunner
from dsec.fusion.wire import CommandRunStatus, RunCodeRequest, RunStatus
from dsec.models import ExecRequest, ExecResult, FileEntry, PoolConfig, SandboxInfo, SandboxSpec


class ScriptedNode:
    """Just the node operations the runner uses; ``answer(argv)`` decides each exec's result."""

    def __init__(self) -> None:
        self.created: list[SandboxSpec] = []
        self.destroyed: list[str] = []
        self.execs: list[tuple[str, list[str]]] = []
        self.files: dict[tuple[str, str], bytes] = {}
        self.wipe_ok = True
        self.removed = 0
        self.missing: set[str] = set()  # programs the "image" lacks
        self.run_result = ExecResult(exit_code=0, stdout=b"out\n", duration_s=0.01)

    async def declare_pool(self, config: PoolConfig) -> None:
        self.pool = config

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self.created.append(spec)
        return SandboxInfo(id=f"sb{len(self.created)}", image=spec.image, backend="function", state="running",
                           created_at=0.0, expires_at=spec.timeout, labels=spec.labels, spec=spec, node="n")

    async def destroy(self, sandbox_id: str) -> None:
        self.destroyed.append(sandbox_id)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        self.files[sandbox_id, path] = data

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        if (sandbox_id, path) not in self.files:
            raise FileNotFound(path)
        return self.files[sandbox_id, path]

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return [FileEntry(name=p.rsplit("/", 1)[1], path=p, type="file", size=len(data), mode=0o644, mtime=0.0)
                for (sid, p), data in self.files.items() if sid == sandbox_id]

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        if not self.wipe_ok:  # a directory the code made unreadable: the runner falls back to a shell
            raise PermissionDenied(f"{path}: permission denied")
        self.removed += 1
        del self.files[sandbox_id, path]

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        argv = request.argv()
        self.execs.append((sandbox_id, argv))
        text = " ".join(argv)
        if "command -v" in text:
            return ExecResult(exit_code=int(any(p in text for p in self.missing)))
        if "find" in text:  # the wipe
            self.files = {k: v for k, v in self.files.items() if k[0] != sandbox_id}
            return ExecResult(exit_code=0 if self.wipe_ok else 1)
        if argv[0] in ("g++", "gcc"):
            self.files[sandbox_id, "/workspace/test"] = b"\x7fELF"
            return ExecResult(exit_code=0, duration_s=0.5)
        return self.run_result


def _runner(node: ScriptedNode, **settings: Any) -> FusionRunner:
    return FusionRunner(node, RunnerSettings(**settings))  # type: ignore[arg-type]


def _request(**fields: Any) -> RunCodeRequest:
    return RunCodeRequest.model_validate({"code": "print(1)", "language": "python", **fields})


async def _settle(runner: FusionRunner) -> None:
    """Let the background wipes and destroys run."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_success_files_and_fetch() -> None:
    node = ScriptedNode()
    runner = _runner(node)
    data = base64.b64encode(b"abc").decode()
    node.files["sb1", "/workspace/result.txt"] = b"r"  # written by the "program"
    r = await runner.run_code(_request(files={"in/a.txt": data, "skip": None}, stdin="x",
                                       fetch_files=["result.txt", "missing.txt"]), job="j1")
    assert r.status is RunStatus.Success and r.message == "" and r.compile_result is None
    assert r.run_result is not None and r.run_result.stdout == "out\n" and r.run_result.return_code == 0
    assert r.files == {"result.txt": base64.b64encode(b"r").decode()}
    assert node.created[0].labels == {"dsec.job": "j1"} and node.created[0].backend == "function"
    assert node.created[0].memory == 1024**3
    run_argv = node.execs[-1][1]
    assert run_argv[0] == "python3" and run_argv[1].startswith("tmp") and run_argv[1].endswith(".py")


async def test_compile_then_run_and_a_failed_compile_skips_the_run() -> None:
    node = ScriptedNode()
    runner = _runner(node)
    r = await runner.run_code(_request(language="cpp", code="int main(){}"))
    assert r.compile_result is not None and r.compile_result.return_code == 0 and r.status is RunStatus.Success
    assert [argv[0] for _, argv in node.execs][-2:] == ["g++", "./test"]

    async def failing(sandbox_id: str, request: ExecRequest) -> ExecResult:
        return ExecResult(exit_code=1, stderr=b"error: x")

    node.exec = failing  # type: ignore[method-assign]
    r = await runner.run_code(_request(language="cpp", code="int main(){"))  # cpp: its probe is remembered
    assert r.status is RunStatus.Failed and r.run_result is None and r.compile_result is not None
    assert r.compile_result.stderr == "error: x"


@pytest.mark.parametrize(("result", "status", "message"), [
    (ExecResult(exit_code=137, duration_s=3, limit="time"), CommandRunStatus.TimeLimitExceeded, ""),
    (ExecResult(exit_code=137, limit="memory"), CommandRunStatus.Finished, "memory limit of 256 MB"),
    (ExecResult(exit_code=137, stdout=b"x" * 10, truncated=True, limit="output"), CommandRunStatus.Finished,
     "output truncated at"),
    (ExecResult(exit_code=2), CommandRunStatus.Finished, ""),
])
async def test_verdicts_map_to_statuses(result: ExecResult, status: CommandRunStatus, message: str) -> None:
    node = ScriptedNode()
    node.run_result = result
    r = await _runner(node).run_code(_request(memory_limit_MB=256))
    assert r.status is RunStatus.Failed and r.run_result is not None and r.run_result.status is status
    assert message in r.message and (message or r.message == "")
    assert r.run_result.return_code == (None if result.limit == "time" else result.exit_code)
    assert node.created[0].memory == 256 * 1024**2


async def test_bad_input_and_unsupported_languages_are_sandbox_errors() -> None:
    node = ScriptedNode()
    runner = _runner(node)
    r = await runner.run_code(_request(files={"a.bin": "%%%"}))
    assert r.status is RunStatus.SandboxError and "files['a.bin'] is not base64" in r.message
    r = await runner.run_code(_request(memory_limit_MB=1 << 20))
    assert r.status is RunStatus.SandboxError and "memory_limit_MB" in r.message
    node.missing = {"go"}
    r = await runner.run_code(_request(language="go", code="package main"))
    assert r.status is RunStatus.SandboxError and "language 'go' is not supported" in r.message
    probes = sum("command -v go" in " ".join(argv) for _, argv in node.execs)
    r = await runner.run_code(_request(language="go", code="package main"))  # remembered: no second probe
    assert r.status is RunStatus.SandboxError and "language 'go' is not supported" in r.message
    assert sum("command -v go" in " ".join(argv) for _, argv in node.execs) == probes == 1
    r = await runner.run_code(_request(language="java", code="class A {}"))  # not one DSec knows how to run
    assert r.status is RunStatus.SandboxError and "'java'" in r.message


async def test_an_infrastructure_failure_is_a_sandbox_error() -> None:
    node = ScriptedNode()

    async def gone(sandbox_id: str, request: ExecRequest) -> ExecResult:
        raise SandboxNotFound(f"sandbox {sandbox_id} not found")

    node.exec = gone  # type: ignore[method-assign]
    r = await _runner(node).run_code(_request())
    assert r.status is RunStatus.SandboxError and "not found" in r.message and r.run_result is None


async def test_sandboxes_are_reused_only_once_wiped_and_never_across_jobs_or_memory() -> None:
    node = ScriptedNode()
    runner = _runner(node)
    await runner.run_code(_request(), job="a")
    await _settle(runner)
    await runner.run_code(_request(), job="a")
    assert len(node.created) == 1, "a wiped sandbox serves the next request of its shape"
    assert node.removed >= 1 and not any("find" in " ".join(argv) for _, argv in node.execs), "no shell to wipe"
    await _settle(runner)
    await runner.run_code(_request(), job="b")
    await runner.run_code(_request(memory_limit_MB=512), job="a")
    assert len(node.created) == 3, "another job or another memory size gets a sandbox of its own"
    await _settle(runner)
    node.wipe_ok = False
    await runner.run_code(_request(), job="a")
    await _settle(runner)
    assert "sb1" in node.destroyed, "a sandbox whose wipe failed is destroyed"
    await runner.run_code(_request(), job="a")
    assert len(node.created) == 4
    await runner.aclose()
    assert set(node.destroyed) == {"sb1", "sb2", "sb3", "sb4"}


async def test_a_request_waits_for_a_wipe_under_way_rather_than_take_a_new_sandbox() -> None:
    node = ScriptedNode()
    wiping = asyncio.Event()
    list_files = node.list_files

    async def slow_list(sandbox_id: str, path: str) -> list[FileEntry]:
        wiping.set()
        await asyncio.sleep(0.05)
        return await list_files(sandbox_id, path)

    node.list_files = slow_list  # type: ignore[method-assign]
    runner = _runner(node)
    first = await runner.run_code(_request())
    await wiping.wait()  # the first request's sandbox is being wiped
    second = await runner.run_code(_request())
    assert first.status is second.status is RunStatus.Success
    assert len(node.created) == 1, "the second request took a new sandbox instead of the one being wiped"
    assert {sid for sid, _ in node.execs} == {"sb1"}
    await runner.aclose()


def test_the_listener_needs_an_address_and_a_token(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="--sandbox-fusion must look like HOST:PORT"):
        FusionOptions("nonsense")
    assert FusionOptions("127.0.0.1:0").address == ("127.0.0.1", 0)
    with pytest.raises(ServeError, match="refusing to serve --sandbox-fusion without a token"):
        Daemon(Settings(home=tmp_path), fusion=FusionOptions("127.0.0.1:0"))
