"""How each SandboxFusion language is compiled and run, and which program the image needs for it.

Owns the command lines (the same compilers, flags and interpreters SandboxFusion's runners use, so a
program behaves as it does there) and the probe that decides whether an image can run a language. It must
never run a command itself (:mod:`dsec.fusion.runner` does).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LANGUAGES", "Toolchain", "probe_command"]


@dataclass(frozen=True)
class Toolchain:
    """One language: its source file's suffix, the compile step (if any) and the run step, as argv lists in
    which ``{src}`` is the source file; ``needs`` are the programs the image must have on ``PATH``."""

    suffix: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()
    warm: bool = False
    """The run step is a Python program the function backend forks from its warm interpreter
    (``ExecRequest.warm_python``) instead of starting ``python3``."""

    def compile_argv(self, src: str) -> list[str] | None:
        """The compile command for ``src``, or None for an interpreted language."""
        return None if self.compile is None else [a.format(src=src) for a in self.compile]

    def run_argv(self, src: str) -> list[str]:
        """The run command for ``src``."""
        return [a.format(src=src) for a in self.run]


LANGUAGES: dict[str, Toolchain] = {
    "python": Toolchain(".py", ("python3", "{src}"), needs=("python3",), warm=True),
    "pytest": Toolchain(".py", ("python3", "-m", "pytest", "{src}"), needs=("python3", "pytest")),
    "bash": Toolchain(".sh", ("/bin/bash", "{src}"), needs=("bash",)),
    "cpp": Toolchain(".cpp", ("./test",), ("g++", "-std=c++17", "{src}", "-o", "test", "-lpthread"), ("g++",)),
    "c": Toolchain(".c", ("./test",), ("gcc", "{src}", "-o", "test", "-lm", "-lpthread"), ("gcc",)),
    "go": Toolchain(".go", ("./out",), ("go", "build", "-o", "out", "{src}"), ("go",)),
    "rust": Toolchain(".rs", ("./test",), ("rustc", "{src}", "-o", "test"), ("rustc",)),
    "nodejs": Toolchain(".js", ("node", "{src}"), needs=("node",)),
    "perl": Toolchain(".pl", ("perl", "{src}"), needs=("perl",)),
    "ruby": Toolchain(".rb", ("ruby", "{src}"), needs=("ruby",)),
    "php": Toolchain(".php", ("php", "-f", "{src}"), needs=("php",)),
    "lua": Toolchain(".lua", ("lua", "{src}"), needs=("lua",)),
    "R": Toolchain(".R", ("Rscript", "{src}"), needs=("Rscript",)),
    "julia": Toolchain(".jl", ("julia", "{src}"), needs=("julia",)),
}
"""Languages DSec knows how to run; whether a given image can is probed (:func:`probe_command`)."""


def probe_command(toolchain: Toolchain) -> str:
    """A shell command that exits 0 when the image has every program ``toolchain`` needs (``pytest`` is a
    Python module, not a program)."""
    checks = []
    for program in toolchain.needs:
        if program == "pytest":
            checks.append("python3 -c 'import pytest' 2>/dev/null")
        else:
            checks.append(f"command -v {program} >/dev/null")
    return " && ".join(checks) or "true"
