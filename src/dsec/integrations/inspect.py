"""inspect-ai's sandbox environment ``dsec``: an eval's samples run in DSec sandboxes, unchanged.

Owns the translation between inspect's ``SandboxEnvironment`` contract and the DSec SDK: the config (an
image, a Dockerfile or a compose file; backend, limits, network), building or pulling the images at
``task_init``, one sandbox per service at ``sample_init`` (the ``default`` service, else the first, comes
first), destroying them at ``sample_cleanup`` (also when the eval is cancelled) and anything left at
``task_cleanup``, and the mapping of results and errors onto what inspect expects (``TimeoutError``,
``FileNotFoundError``, ``IsADirectoryError``, ``OutputLimitExceededError``...). Registered through the
``inspect_ai`` entry point, so ``sandbox="dsec"`` works once ``dsec[inspect]`` is installed. It talks to
the node only through the public SDK and never re-encodes an API route.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shlex
from pathlib import Path
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel, Field

import dsec
from dsec.errors import DSecError, InvalidRequest, NotFound, UserNotFound
from dsec.integrations.compose import load_compose

__all__ = ["DSecSandboxConfig", "DSecSandboxEnvironment", "DSecService"]

_LABEL = "dsec.integration"


class DSecService(BaseModel, extra="forbid"):
    """One sandbox of a sample: its image (a name in DSec's store or a registry reference) or a build."""

    image: str | None = None
    """Image name in the node's store, or ``host[:port]/repo:tag`` to pull."""
    build: str | None = None
    """Build context directory (its ``Dockerfile`` unless ``dockerfile`` says otherwise)."""
    dockerfile: str | None = None
    """Dockerfile path (relative to the build context)."""
    build_args: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    """The user commands and file calls run as when inspect names none (compose's ``user:``): ``name``, ``uid``,
    ``name:group`` or ``uid:gid``; default: the image's user."""


class DSecSandboxConfig(BaseModel, extra="forbid"):
    """``sandbox=("dsec", DSecSandboxConfig(...))``; a compose file or a Dockerfile path works too."""

    services: dict[str, DSecService] = Field(default_factory=lambda: {"default": DSecService(image="debian-python")})
    """The sandboxes of each sample, by name; ``default`` (else the first) is ``sandbox()``."""
    backend: Literal["container", "microvm", "vm", "function"] = "container"
    cpu: float = 1.0
    memory: str = "1Gi"
    disk: str = "4Gi"
    network: str | list[str] = "none"
    """``none``, ``internet``, or an allowlist of hosts (DSec's network policies)."""
    timeout: float = 3600
    """Wall-clock life of each sandbox, seconds."""
    insecure_registry: bool = False
    """Pull ``image:`` references over plain HTTP (a registry on loopback)."""
    url: str | None = None
    """The DSec daemon (default ``$DSEC_URL``, else the local one)."""


def load_config(config: SandboxEnvironmentConfigType | None) -> DSecSandboxConfig:
    """The config as a model: given as one, as a dict, or as the path of a compose file or a Dockerfile."""
    if config is None:
        return DSecSandboxConfig()
    if isinstance(config, DSecSandboxConfig):
        return config
    if isinstance(config, BaseModel):
        return DSecSandboxConfig.model_validate(config.model_dump())
    if isinstance(config, dict):
        return DSecSandboxConfig.model_validate(config)
    path = Path(config)
    if not path.is_file():
        raise InvalidRequest(f"dsec sandbox config {config!r}: no such compose file or Dockerfile")
    if path.suffix in (".yaml", ".yml"):
        return _from_compose(path)
    return DSecSandboxConfig(services={"default": DSecService(build=str(path.parent), dockerfile=path.name)})


def _from_compose(path: Path) -> DSecSandboxConfig:
    """A compose file's services (``${VAR}`` from this process's environment, as compose does)."""
    services = load_compose(path, os.environ)
    config = {s.name: DSecService(image=s.image if s.build_context is None else None,
                                  build=str(s.build_context) if s.build_context else None, dockerfile=s.dockerfile,
                                  build_args=s.build_args, env=s.environment, workdir=s.working_dir, user=s.user)
              for s in services}
    network = "none" if all(s.network_mode == "none" for s in services) else "internet"
    return DSecSandboxConfig(services=config, network=network)


def _image_name(service: DSecService) -> str:
    """A built service's image name: the hash of its Dockerfile, context path and args (rebuilt when they change)."""
    context = Path(service.build or ".").resolve()
    dockerfile = context / (service.dockerfile or "Dockerfile")
    digest = hashlib.sha256(dockerfile.read_bytes() + str(context).encode() +
                            repr(sorted(service.build_args.items())).encode()).hexdigest()[:16]
    return f"inspect-{digest}"


def _client(config: DSecSandboxConfig) -> dsec.Client:
    return dsec.Client(config.url) if config.url else dsec.Client()


@sandboxenv(name="dsec")
class DSecSandboxEnvironment(SandboxEnvironment):
    """One DSec sandbox as an inspect sandbox environment."""

    def __init__(self, sandbox: dsec.AsyncSandbox, workdir: str, user: str | None, client: dsec.Client) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.client = client
        self.workdir = workdir
        self.default_user = user

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def config_files(cls) -> list[str]:
        return ["compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml", "Dockerfile"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return DSecSandboxConfig.model_validate(config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Build the services' Dockerfiles (a rebuild of an unchanged one is a cache hit) and pull the
        registry images the node does not have."""
        cfg = load_config(config)
        client = _client(cfg)
        try:
            for service in cfg.services.values():
                await _prepare(client, cfg, service)
        finally:
            await client.aclose()

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = load_config(config)
        client = _client(cfg)
        order = sorted(cfg.services, key=lambda n: n != "default")
        made: dict[str, SandboxEnvironment] = {}
        try:
            for name in order:
                service = cfg.services[name]
                sb = await dsec.AsyncSandbox.create(
                    image=_image_name(service) if service.build else _store_name(service.image or "debian-python"),
                    backend=cfg.backend, cpu=cfg.cpu, memory=cfg.memory, disk=cfg.disk, timeout=cfg.timeout,
                    network=cfg.network, env=service.env, workdir=service.workdir, user=service.user,
                    client=client,
                    labels={_LABEL: "inspect", "inspect.task": _label(task_name), "inspect.service": _label(name)})
                info = await sb.info()
                made[name] = cls(sb, info.spec.workdir or "/workspace", service.user, client)
        except BaseException:
            await cls.sample_cleanup(task_name, cfg, made, interrupted=True)
            await client.aclose()
            raise
        return made

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        """Destroy the sample's sandboxes, whether it finished, failed or was cancelled."""
        clients: dict[int, dsec.Client] = {}
        for env in environments.values():
            if isinstance(env, DSecSandboxEnvironment):
                clients[id(env.client)] = env.client
                with contextlib.suppress(DSecError):
                    await env.sandbox.aclose()
        for client in clients.values():
            await client.aclose()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        """Destroy any sandbox of this task that a crashed sample left behind."""
        if cleanup:
            await _destroy_labelled(load_config(config), {_LABEL: "inspect", "inspect.task": _label(task_name)})

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup dsec [ID]``: one sandbox, or every sandbox inspect made."""
        cfg = DSecSandboxConfig()
        if id is not None:
            client = _client(cfg)
            try:
                with contextlib.suppress(NotFound):
                    await (await dsec.AsyncSandbox.connect(id, client=client)).aclose()
            finally:
                await client.aclose()
            return
        await _destroy_labelled(cfg, {_LABEL: "inspect"})

    # ------------------------------------------------------------------ commands and files
    def _path(self, file: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, file))

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            result = await self.sandbox.exec(
                list(cmd), timeout=timeout if timeout is not None else 86400.0,
                cwd=self._path(cwd) if cwd is not None else self.workdir, env=env or None,
                stdin=input.encode() if isinstance(input, str) else input, max_output=limit + 1, user=user)
        except UserNotFound as exc:
            return ExecResult(False, 126, "", exc.message)  # what `docker exec --user ghost` says, and fails
        except InvalidRequest as exc:
            if "not found" in exc.message or "No such file" in exc.message:
                return ExecResult(False, 127, "", exc.message)
            if "ermission denied" in exc.message or "EACCES" in exc.message:
                raise PermissionError(exc.message) from None
            raise
        if result.limit == "time":
            raise TimeoutError(f"command timed out after {timeout} s: {shlex.join(cmd)[:200]}")
        if result.exit_code == 126 and b"ermission denied" in result.stderr:
            raise PermissionError(result.stderr.decode(errors="replace").strip())
        if len(result.stdout) > limit or len(result.stderr) > limit:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                                           result.stdout[-limit:].decode(errors="replace"))
        return ExecResult(success=result.exit_code == 0, returncode=result.exit_code,
                          stdout=result.stdout.decode(errors="replace"),
                          stderr=result.stderr.decode(errors="replace"))

    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        data = contents.encode() if isinstance(contents, str) else contents
        try:
            await self.sandbox.files.write(path, data)
        except DSecError as exc:
            raise _file_error(exc, file) from None

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        try:
            data = await self.sandbox.files.read(self._path(file))
        except DSecError as exc:
            raise _file_error(exc, file) from None
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data.decode("utf-8") if text else data

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """A shell in the sandbox for a human: ``dsec exec -t [--user USER] ID -- bash -l``."""
        as_user = f"--user {shlex.quote(user)} " if user is not None else ""
        return SandboxConnection(type="dsec", command=f"dsec exec -t {as_user}{self.sandbox.id} -- bash -l",
                                 container=self.sandbox.id)


def _file_error(exc: DSecError, file: str) -> Exception:
    """The builtin error inspect expects for a failed file call, naming ``file``. DSec's file errors that are
    already builtins keep their class; the others are told apart by what they say."""
    for builtin in (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError):
        if isinstance(exc, builtin):
            return builtin(f"{exc.message}: {file}")
    text = exc.message.lower()
    if isinstance(exc, NotFound) or "no such file" in text:
        return FileNotFoundError(f"file not found: {file}")
    if "not a regular file" in text or "is a directory" in text:
        return IsADirectoryError(f"{file} is a directory")
    if "permission denied" in text:
        return PermissionError(f"permission denied: {file}")
    return exc


def _label(value: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in value)[:63] or "-"


def _store_name(reference: str) -> str:
    """The store name a pulled reference lands under (the repository's last part, plus ``-TAG``)."""
    if "/" not in reference or not any(c in reference.split("/", 1)[0] for c in ".:"):
        return reference
    from dsec.images.registry import default_name, parse_reference

    return default_name(parse_reference(reference))


async def _prepare(client: dsec.Client, cfg: DSecSandboxConfig, service: DSecService) -> None:
    if service.build:
        name = _image_name(service)
        context = Path(service.build)
        dockerfile = context / (service.dockerfile or "Dockerfile")
        try:
            await dsec.AsyncSandbox.build_image(name, context, dockerfile=dockerfile, build_args=service.build_args,
                                                client=client)
        except InvalidRequest as exc:
            if isinstance(exc, dsec.BuildFailed) or "already exists" not in exc.message:
                raise  # the name is a hash of the Dockerfile, context and args: existing means built
        return
    image = service.image or "debian-python"
    if _store_name(image) != image:
        await dsec.AsyncSandbox.pull_image(image, insecure=cfg.insecure_registry, client=client)


async def _destroy_labelled(cfg: DSecSandboxConfig, labels: dict[str, str]) -> None:
    client = _client(cfg)
    try:
        for sb in await dsec.AsyncSandbox.list(labels=labels, client=client):
            with contextlib.suppress(DSecError):
                await sb.aclose()
    finally:
        await client.aclose()
