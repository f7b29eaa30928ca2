"""What the operator chooses for a SandboxFusion listener: where it listens, and the sandboxes its requests
run in (image, memory, output cap, warm pool).

Owns those choices and their checks (each error names the option). It must never import the HTTP app or
the node API: ``dsec serve --help`` and the daemon's start read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.e2b.options import parse_listen

__all__ = ["FusionOptions", "MiB", "RunnerSettings"]

MiB = 1024**2


@dataclass(frozen=True)
class RunnerSettings:
    """What the operator chose for the requests' sandboxes."""

    image: str = "debian-python"
    """The image every request runs on."""
    memory: int = 1024 * MiB
    """Memory of a request whose ``memory_limit_MB`` is not positive (and of the warm pool's sandboxes)."""
    max_memory: int = 8 * 1024 * MiB
    """The largest ``memory_limit_MB`` accepted."""
    max_output: int = 8 * MiB
    """Bytes kept per stream of a command; past it the command is killed and ``message`` says so."""
    pool_min: int = 4
    """Ready sandboxes the warm pool keeps (of the default memory)."""
    pool_max: int = 16
    """Ready sandboxes the warm pool never exceeds."""
    workdir: str = "/workspace"
    """The working directory of the code, where ``files`` are written and ``fetch_files`` read."""
    node: str | None = None
    """Reported as ``executor_pod_name``."""


OPTION = "--sandbox-fusion"


@dataclass(frozen=True)
class FusionOptions:
    """One SandboxFusion listener (``dsec serve --sandbox-fusion HOST:PORT``)."""

    listen: str
    """``HOST:PORT`` of the listener."""
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    """The requests' sandboxes: image, memory, output cap, warm pool."""

    def __post_init__(self) -> None:
        parse_listen(self.listen, OPTION)

    @property
    def address(self) -> tuple[str, int]:
        """The listener's ``(host, port)``."""
        return parse_listen(self.listen, OPTION)


