"""SandboxFusion's ``/run_code`` request and response, field for field (``sandbox/server/sandbox_api.py`` and
``sandbox/runners/types.py`` of bytedance/SandboxFusion).

Owns the JSON shapes and their defaults, so that SandboxFusion's client and verl's reward code read DSec's
answers unchanged. It must never run anything.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["CommandRunResult", "CommandRunStatus", "Language", "RunCodeRequest", "RunCodeResponse", "RunStatus"]

Language = Literal["python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
                   "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
                   "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket", "c"]
"""SandboxFusion's languages, plus ``c`` (gcc), which DSec adds. Any other value is refused with FastAPI's
422 naming it, as SandboxFusion does; one of these the image cannot run gets a ``SandboxError`` naming it."""


class CommandRunStatus(StrEnum):
    """How one command (the compile or the run) ended."""

    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    """One command's outcome."""

    status: CommandRunStatus
    execution_time: float | None = None
    """Wall-clock seconds."""
    return_code: int | None = None
    """Exit status (``128 + N`` when killed by signal N); None at a time limit."""
    stdout: str | None = None
    stderr: str | None = None


class RunStatus(StrEnum):
    """The request's outcome: ``Failed`` when a command timed out or exited non-zero, ``SandboxError`` when the
    sandbox side failed (SandboxFusion's client raises on it)."""

    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class RunCodeRequest(BaseModel):
    """``POST /run_code``'s body."""

    compile_timeout: float = Field(10, gt=0, description="compile timeout for compiled languages (seconds)")
    run_timeout: float = Field(10, gt=0, description="code run timeout (seconds)")
    memory_limit_MB: int = Field(-1, description="maximum memory in megabytes (-1: the server's default)")
    code: str = Field(..., examples=['print("hello")'], description="the code to run")
    stdin: str | None = Field(None, examples=[""], description="optional string passed to the run's stdin")
    language: Language = Field(..., examples=["python"], description="the language to run the code in")
    files: dict[str, str | None] = Field({}, description="file path (relative to the working directory) -> base64 "
                                                         "content, written before the code runs")
    fetch_files: list[str] = Field([], description="file paths to return (base64) after the code ran")


class RunCodeResponse(BaseModel):
    """``POST /run_code``'s answer."""

    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    """The node that ran the request (SandboxFusion: its pod)."""
    files: dict[str, str] = {}
