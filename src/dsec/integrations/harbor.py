"""harbor's environment provider ``DSecEnvironment``: Terminal-Bench tasks (and any harbor task) run in DSec
sandboxes with ``harbor run --env dsec.integrations.harbor:DSecEnvironment``, harbor unchanged.

Owns the translation between harbor's ``BaseEnvironment`` contract and the DSec SDK: the task's image (an
``environment/Dockerfile`` built with DSec's Dockerfile builds, named by harbor's content hash so an unchanged
one is a cache hit; a ``docker_image`` that names an image of the store, or a registry reference pulled once),
its resources and network policy (no network, public, an allowlist; changed live between phases), exec as a
user with harbor's environment overlays, file and directory transfer, and destroying the sandbox. The
capabilities it declares are only what it enforces. harbor needs Python >= 3.12: this module runs in a venv
of its own (``scripts/setup`` makes ``.venv-harbor``); it never imports harbor's private modules beyond the
provider API and its tar helpers. Compose tasks are refused with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
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

import dsec
from dsec.errors import DSecError

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

    def _validate_definition(self) -> None:
        if (self.environment_dir / _COMPOSE).exists() and not (self.environment_dir / _DOCKERFILE).exists():
            raise ValueError(f"{self.environment_dir / _COMPOSE}: the dsec environment runs one sandbox per task; "
                             "give the task an environment/Dockerfile or a docker_image instead of a compose file")
        if not (self.environment_dir / _DOCKERFILE).exists() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self.environment_dir}: no {_DOCKERFILE} and no [environment].docker_image "
                                    "in task.toml: the dsec environment needs one of them")

    # ------------------------------------------------------------------ life cycle
    def _require(self) -> dsec.AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec environment is not started: call start() first")
        return self._sandbox

    async def _image(self, client: dsec.Client, force_build: bool) -> str:
        """The task's image in DSec's store: built from its Dockerfile, pulled, or named as it is."""
        if (self.environment_dir / _DOCKERFILE).exists():
            name = "harbor-" + environment_content_hash(self.environment_dir, truncate=16)
            timeout = self.task_env_config.build_timeout_sec
            build = dsec.AsyncSandbox.build_image(
                name, self.environment_dir, replace=True, no_cache=force_build, client=client,
                output=lambda line: self.logger.debug(f"build: {line}"))
            info = await asyncio.wait_for(build, timeout=timeout)
            return str(info.name)
        image = str(self.task_env_config.docker_image)
        if "/" not in image.split(":")[0] and "." not in image.split(":")[0]:
            return image  # a name of DSec's store
        info = await dsec.AsyncSandbox.pull_image(image, insecure=self.options.insecure_registry, replace=True,
                                                  client=client)
        return str(info.name)

    async def start(self, force_build: bool) -> None:
        opts = self.options
        self._client = dsec.Client(opts.url) if opts.url else dsec.Client()
        cpus, memory_mb, storage_mb = self._effective_cpus, self._effective_memory_mb, self._effective_storage_mb
        try:
            image = await self._image(self._client, force_build)
            self._sandbox = await dsec.AsyncSandbox.create(
                image=image, backend=opts.backend, cpu=float(cpus or 1), memory=f"{memory_mb or 2048}Mi",
                disk=f"{storage_mb or 10240}Mi", timeout=opts.lifetime_sec, network=dsec_network(self._network_policy),
                env=self._startup_env(), workdir=self.task_env_config.workdir, client=self._client,
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

