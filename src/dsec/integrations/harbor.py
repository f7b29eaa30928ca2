"""harbor's environment provider ``DSecEnvironment``: Terminal-Bench tasks (and any harbor task) run in DSec
sandboxes with ``harbor run --env dsec.integrations.harbor:DSecEnvironment``, harbor unchanged.

Owns the translation between harbor's ``BaseEnvironment`` contract and the DSec SDK: the task's image (an
``environment/Dockerfile`` built with DSec's Dockerfile builds, named by harbor's content hash so an unchanged
one is a cache hit; a ``docker_image`` that names an image of the store, or a registry reference pulled once),
its resources and network policy (no network, public, an allowlist; changed live between phases), exec as a
user with harbor's environment overlays, file and directory transfer, and destroying the sandbox. The
capabilities it declares are only what it enforces. harbor needs Python >= 3.12: this module runs in a venv
of its own (``scripts/setup`` makes ``.venv-harbor``); it never imports harbor's private modules beyond the
provider API and its tar helpers. A task's ``environment/docker-compose.yaml`` of one service is read as
harbor's docker environment reads it (its ``build:`` or ``image:``, else the task's Dockerfile or
``docker_image``; its ``environment:``, ``working_dir:`` and ``user:``; harbor's ``${CONTEXT_DIR}``-style
variables); a compose file of several services is refused, naming them, since a task is one sandbox here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shlex
import uuid
from pathlib import Path
from typing import Any, Literal

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import environment_content_hash
from harbor.environments.options import EnvironmentOptions
from harbor.environments.tar_transfer import (
    extract_dir_from_bytes,
    pack_dir_to_bytes,
    remote_pack_command,
    remote_unpack_command,
    tar_pack_succeeded,
)
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.utils.env import resolve_env_vars

import dsec
from dsec.errors import DSecError
from dsec.integrations.compose import ComposeService, load_compose

__all__ = ["DSecEnvironment", "DSecOptions"]

_DOCKERFILE = "Dockerfile"
_COMPOSE = "docker-compose.yaml"


class DSecOptions(EnvironmentOptions):  # type: ignore[misc]  # harbor is untyped for mypy under 3.11
    """``--ek KEY=VALUE`` options of the DSec environment."""

    backend: Literal["container", "microvm", "vm"] = "container"
    url: str | None = None
    """The DSec daemon (default ``$DSEC_URL``, else the local one)."""
    insecure_registry: bool = False
    """Pull ``docker_image`` references over plain HTTP (a registry on loopback)."""
    lifetime_sec: float = 86400.0
    """The sandbox's wall-clock life: a trial that outlives it finds its sandbox gone."""


def dsec_network(policy: NetworkPolicy) -> str | list[str]:
    """harbor's network policy as DSec's ``network=``: ``none``, ``allow`` (public) or an allowlist."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return "none"
    if policy.network_mode == NetworkMode.PUBLIC:
        return "allow"
    return list(policy.allowed_hosts)


class DSecEnvironment(BaseEnvironment):  # type: ignore[misc]
    """One DSec sandbox per harbor environment."""

    options_model = DSecOptions
    options: DSecOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: dsec.Client | None = None
        self._sandbox: dsec.AsyncSandbox | None = None

    @staticmethod
    def type() -> str:
        return "dsec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # DSec's allowlists take domain names (also "*.example.org") and IPv4 addresses or CIDRs, never IPv6,
        # and a live sandbox's policy can be replaced (sb.set_network).
        return EnvironmentCapabilities(
            disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True, network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True, dynamic_network_policy=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _compose_variables(self) -> dict[str, str]:
        """What ``${VAR}`` means in the task's compose file: this process's environment, the task's
        ``[environment].env`` and the infrastructure variables harbor's docker environment defines."""
        task_env = resolve_env_vars(self.task_env_config.env) if self.task_env_config.env else {}
        infra = {"CONTEXT_DIR": str(self.environment_dir.resolve()), "MAIN_IMAGE_NAME": self._dockerfile_image_name(),
                 "PREBUILT_IMAGE_NAME": str(self.task_env_config.docker_image or "")}
        if self.task_env_config.cpus is not None:
            infra["CPUS"] = str(self.task_env_config.cpus)
        if self.task_env_config.memory_mb is not None:
            infra["MEMORY"] = f"{self.task_env_config.memory_mb}M"
        return {**os.environ, **task_env, **infra}

    def _compose_service(self) -> ComposeService | None:
        """The task's compose service (there must be only one), or ``None`` when the task has no compose file."""
        path = self.environment_dir / _COMPOSE
        if not path.exists():
            return None
        try:
            services = load_compose(path, self._compose_variables())
        except DSecError as e:
            raise ValueError(str(e)) from e
        if len(services) != 1:
            raise ValueError(f"{path}: {len(services)} services ({', '.join(s.name for s in services)}); the dsec "
                             "environment runs one sandbox per task, so its compose file may have only one service")
        return services[0]

    def _validate_definition(self) -> None:
        service = self._compose_service()
        if service is not None and (service.build_context is not None or service.image):
            return
        if not (self.environment_dir / _DOCKERFILE).exists() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self.environment_dir}: no {_DOCKERFILE}, no [environment].docker_image in "
                                    f"task.toml and no build: or image: in a {_COMPOSE}: the dsec environment "
                                    "needs one of them")

    # ------------------------------------------------------------------ life cycle
    def _require(self) -> dsec.AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec environment is not started: call start() first")
        return self._sandbox

    def _dockerfile_image_name(self) -> str:
        return "harbor-" + str(environment_content_hash(self.environment_dir, truncate=16))

    async def _build(self, client: dsec.Client, name: str, context: Path, force_build: bool,
                     dockerfile: Path | None = None, build_args: dict[str, str] | None = None) -> str:
        build = dsec.AsyncSandbox.build_image(
            name, context, dockerfile=dockerfile, build_args=build_args, replace=True, no_cache=force_build,
            client=client, output=lambda line: self.logger.debug(f"build: {line}"))
        info = await asyncio.wait_for(build, timeout=self.task_env_config.build_timeout_sec)
        return str(info.name)

    async def _image(self, client: dsec.Client, service: ComposeService | None, force_build: bool) -> str:
        """The task's image in DSec's store: built from its compose service's ``build:`` or its Dockerfile,
        pulled, or named as it is. Built images are named by content hash, so an unchanged one is a cache hit."""
        if service is not None and service.build_context is not None:
            key = (f"{environment_content_hash(service.build_context)}|{service.dockerfile}|"
                   f"{sorted(service.build_args.items())}")
            name = "harbor-" + hashlib.sha256(key.encode()).hexdigest()[:16]
            dockerfile = service.build_context / service.dockerfile if service.dockerfile else None
            return await self._build(client, name, service.build_context, force_build, dockerfile,
                                     service.build_args)
        image = service.image if service is not None and service.image else None
        if image is None and (self.environment_dir / _DOCKERFILE).exists():
            return await self._build(client, self._dockerfile_image_name(), self.environment_dir, force_build)
        image = image or str(self.task_env_config.docker_image)
        if "/" not in image.split(":")[0] and "." not in image.split(":")[0]:
            return image  # a name of DSec's store
        info = await dsec.AsyncSandbox.pull_image(image, insecure=self.options.insecure_registry, replace=True,
                                                  client=client)
        return str(info.name)

    async def start(self, force_build: bool) -> None:
        opts = self.options
        self._client = dsec.Client(opts.url) if opts.url else dsec.Client()
        cpus, memory_mb, storage_mb = self._effective_cpus, self._effective_memory_mb, self._effective_storage_mb
        service = self._compose_service()
        try:
            image = await self._image(self._client, service, force_build)
            self._sandbox = await dsec.AsyncSandbox.create(
                image=image, backend=opts.backend, cpu=float(cpus or 1), memory=f"{memory_mb or 2048}Mi",
                disk=f"{storage_mb or 10240}Mi", timeout=opts.lifetime_sec, network=dsec_network(self._network_policy),
                env={**(service.environment if service else {}), **self._startup_env()},
                workdir=self.task_env_config.workdir or (service.working_dir if service else None),
                user=service.user if service else None, client=self._client,
                labels={"dsec.integration": "harbor", "harbor.session": self.session_id[:63]})
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        """Destroy the sandbox (``delete=False`` leaves it running for inspection, until its lifetime ends)."""
        if self._sandbox is not None and delete:
            with contextlib.suppress(DSecError):
                await self._sandbox.aclose()
        self._sandbox = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await self._require().set_network(dsec_network(network_policy))

    # ------------------------------------------------------------------ exec
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        """``bash -c command`` (harbor's agents use bash features) as ``user``; a timeout raises as harbor's
        docker environment does."""
        sb = self._require()
        who = self._resolve_user(user)
        result = await sb.exec(["bash", "-c", command], timeout=timeout_sec, cwd=cwd or self.task_env_config.workdir,
                               env=self._merge_env(env), user=None if who is None else str(who))
        if result.limit == "time":
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=result.stdout.decode(errors="replace"), stderr=result.stderr.decode(errors="replace"),
                          return_code=result.exit_code)

    # ------------------------------------------------------------------ files
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        await self._require().files.write(target_path, data, user="root")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        archive = f"/tmp/.dsec-upload-{uuid.uuid4().hex[:12]}.tar.gz"
        data = await asyncio.to_thread(pack_dir_to_bytes, source_dir, compress=True)
        await self._require().files.write(archive, data.getvalue(), user="root")
        result = await self.exec(f"{remote_unpack_command(archive, target_dir, no_same_owner=True)}; "
                                 f"s=$?; rm -f {shlex.quote(archive)}; exit $s", timeout_sec=600, user="root")
        if result.return_code != 0:
            raise RuntimeError(f"unpacking the upload into {target_dir!r} failed: {result.stderr or result.stdout}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._require().files.read(source_path, user="root")
        target = Path(target_path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        archive = f"/tmp/.dsec-download-{uuid.uuid4().hex[:12]}.tar.gz"
        try:
            result = await self.exec(remote_pack_command(source_dir, archive), timeout_sec=600, user="root")
            if not tar_pack_succeeded(result.return_code, stdout=result.stdout, stderr=result.stderr,
                                      logger=self.logger):
                raise RuntimeError(f"packing {source_dir!r} failed: {result.stderr or result.stdout}")
            data = await self._require().files.read(archive, user="root")
            await asyncio.to_thread(extract_dir_from_bytes, data, target_dir)
        finally:
            with contextlib.suppress(DSecError, RuntimeError):
                await self.exec(f"rm -f {shlex.quote(archive)}", timeout_sec=60, user="root")

