"""One ``/run_code`` request on the function backend: a fresh sandbox (:mod:`dsec.fusion.recycle`), the files
written, the compile and the run as two calls, the fetched files read back. A Python program runs forked from
the sandbox's warm interpreter (``ExecRequest.warm_python``), every other language as a fresh process.

Owns the request -> node API calls mapping and the verdict -> SandboxFusion status mapping: a time limit is
``TimeLimitExceeded``, a non-zero exit ``Failed``, output past the cap is cut with ``message`` saying so, and
an infrastructure failure is a ``SandboxError`` (never the program's verdict). No two requests share a sandbox
at once, and a sandbox serves again only once emptied, so nothing of one request (files, processes) is seen by
another. It must never speak HTTP
(:mod:`dsec.fusion.app`) nor decide who may call (the caller's principal arrives as a job label).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import posixpath
import secrets

from dsec.api.protocol import NodeAPI
from dsec.errors import DSecError, FileNotFound, InvalidRequest, NotSupported
from dsec.models import ExecRequest, ExecResult, PoolConfig

from .languages import LANGUAGES, Toolchain, probe_command
from .options import MiB, RunnerSettings
from .recycle import Recycler
from .wire import CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunStatus

__all__ = ["FusionRunner"]

log = logging.getLogger("dsec.fusion")


class _SandboxSide(Exception):
    """A request that fails on the sandbox's side: answered as ``SandboxError`` with this message."""


class FusionRunner:
    """Runs ``/run_code`` requests on one node API (a daemon's engine or the cluster gateway)."""

    def __init__(self, api: NodeAPI, settings: RunnerSettings) -> None:
        self.api = api
        self.settings = settings
        self._available: dict[str, bool] = {}
        self.sandboxes = Recycler(api, settings.image, settings.workdir, keep=settings.pool_max)

    async def start(self) -> None:
        """Declare the warm pool the requests of the default memory claim from."""
        s = self.settings
        try:
            await self.api.declare_pool(PoolConfig(image=s.image, backend="function", memory=s.memory,
                                                   workdir=s.workdir, min=s.pool_min, max=s.pool_max))
        except NotSupported as exc:  # the gateway: pools are the nodes' own (their --pool)
            log.info("run_code: no warm pool declared: %s", exc)

    async def aclose(self) -> None:
        """Destroy the sandboxes kept for the next requests."""
        await self.sandboxes.aclose()

    async def run_code(self, request: RunCodeRequest, job: str | None = None) -> RunCodeResponse:
        """Run one request; ``job``: the caller's job, whose label the sandbox carries (None: an admin)."""
        try:
            return await self._run(request, job)
        except _SandboxSide as exc:
            return self._answer(RunStatus.SandboxError, str(exc))
        except DSecError as exc:
            log.warning("run_code failed on the sandbox side: %s", exc)
            return self._answer(RunStatus.SandboxError, f"the sandbox failed to run the code: {exc}")

    def _answer(self, status: RunStatus, message: str, **fields: object) -> RunCodeResponse:
        return RunCodeResponse(status=status, message=message, executor_pod_name=self.settings.node,
                               **fields)

    async def _run(self, request: RunCodeRequest, job: str | None) -> RunCodeResponse:
        toolchain = LANGUAGES.get(request.language)
        if toolchain is None or self._available.get(request.language) is False:
            raise _SandboxSide(self._unsupported(request.language))
        files = _decode_files(request.files)
        lease = await self.sandboxes.claim(self._memory(request), job)
        try:
            return await self._in_sandbox(lease.sandbox_id, request, toolchain, files)
        finally:
            self.sandboxes.release(lease)

    async def _in_sandbox(self, sandbox_id: str, request: RunCodeRequest, toolchain: Toolchain,
                          files: dict[str, bytes]) -> RunCodeResponse:
        await self._check_language(sandbox_id, request.language, toolchain)
        src = f"tmp{secrets.token_hex(4)}{toolchain.suffix}"
        files[src] = request.code.encode()
        await asyncio.gather(*(self._write(sandbox_id, name, data) for name, data in files.items()))
        compile_result = None
        compile_argv = toolchain.compile_argv(src)
        notes: list[str] = []
        if compile_argv is not None:
            done = await self._exec(sandbox_id, compile_argv, request.compile_timeout, None, warm=False)
            compile_result = _command_result(done)
            notes += self._notes("compile", done, request)
        run_result = None
        if compile_result is None or (compile_result.status is CommandRunStatus.Finished
                                      and compile_result.return_code == 0):
            stdin = None if request.stdin is None else request.stdin.encode()
            done = await self._exec(sandbox_id, toolchain.run_argv(src), request.run_timeout, stdin, toolchain.warm)
            run_result = _command_result(done)
            notes += self._notes("run", done, request)
        fetched = await self._fetch(sandbox_id, request.fetch_files)
        status = _status(compile_result, run_result)
        return self._answer(status, " ".join(notes), compile_result=compile_result, run_result=run_result,
                            files=fetched)

    def _memory(self, request: RunCodeRequest) -> int:
        s = self.settings
        memory = s.memory if request.memory_limit_MB <= 0 else request.memory_limit_MB * MiB
        if memory > s.max_memory:
            raise _SandboxSide(f"memory_limit_MB {request.memory_limit_MB} is above this server's maximum of "
                               f"{s.max_memory // MiB} MB: ask for less")
        return max(memory, 16 * MiB)

    async def _check_language(self, sandbox_id: str, language: str, toolchain: Toolchain) -> None:
        if language in self._available:
            return
        probe = await self.api.exec(sandbox_id, ExecRequest(command=probe_command(toolchain), timeout=30))
        self._available[language] = probe.exit_code == 0
        if probe.exit_code != 0:
            raise _SandboxSide(self._unsupported(language))

    def _unsupported(self, language: str) -> str:
        can = sorted(name for name, ok in self._available.items() if ok)
        known = f" (it runs: {', '.join(can)})" if can else ""
        return (f"language {language!r} is not supported by this DSec server: image {self.settings.image!r} has no "
                f"toolchain for it{known}")

    async def _write(self, sandbox_id: str, name: str, data: bytes) -> None:
        path = posixpath.join(self.settings.workdir, name)
        try:
            await self.api.write_file(sandbox_id, path, data)
        except InvalidRequest as exc:
            raise _SandboxSide(f"cannot write files[{name!r}]: {exc}") from None

    async def _exec(self, sandbox_id: str, argv: list[str], timeout: float, stdin: bytes | None, warm: bool
                    ) -> ExecResult:
        return await self.api.exec(sandbox_id, ExecRequest(command=argv, timeout=timeout, stdin=stdin,
                                                           max_output=self.settings.max_output, warm_python=warm))

    def _notes(self, step: str, done: ExecResult, request: RunCodeRequest) -> list[str]:
        """What the statuses alone do not say: output cut at the cap, the memory limit hit."""
        notes = []
        if done.truncated:
            notes.append(f"{step}: output truncated at {self.settings.max_output} bytes per stream and the program "
                         "was killed (limit:output).")
        if done.limit == "memory":
            limit = request.memory_limit_MB if request.memory_limit_MB > 0 else self.settings.memory // MiB
            notes.append(f"{step}: killed at the memory limit of {limit} MB (limit:memory).")
        return notes

    async def _fetch(self, sandbox_id: str, names: list[str]) -> dict[str, str]:
        """The ``fetch_files`` that exist, base64 (a missing one is left out, as SandboxFusion does)."""
        async def one(name: str) -> tuple[str, bytes | None]:
            try:
                return name, await self.api.read_file(sandbox_id, posixpath.join(self.settings.workdir, name))
            except (FileNotFound, InvalidRequest):
                return name, None

        got = await asyncio.gather(*(one(name) for name in names))
        return {name: base64.b64encode(data).decode("ascii") for name, data in got if data is not None}


def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    decoded = {}
    for name, content in files.items():
        if content is None or "IGNORE_THIS_FILE" in name:  # as SandboxFusion's restore_files
            continue
        if not name or "\0" in name:
            raise _SandboxSide(f"files: {name!r} is not a file path")
        try:
            decoded[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise _SandboxSide(f"files[{name!r}] is not base64: encode the file's bytes with base64") from None
    return decoded


def _command_result(done: ExecResult) -> CommandRunResult:
    timed_out = done.limit == "time"
    return CommandRunResult(
        status=CommandRunStatus.TimeLimitExceeded if timed_out else CommandRunStatus.Finished,
        execution_time=done.duration_s, return_code=None if timed_out else done.exit_code,
        stdout=done.stdout.decode("utf-8", "replace"), stderr=done.stderr.decode("utf-8", "replace"))


def _status(*results: CommandRunResult | None) -> RunStatus:
    """SandboxFusion's ``parse_run_status``: a time limit or a non-zero exit fails the request."""
    ran = [r for r in results if r is not None]
    if any(r.status is CommandRunStatus.TimeLimitExceeded or (r.return_code or 0) != 0 for r in ran):
        return RunStatus.Failed
    return RunStatus.Success
