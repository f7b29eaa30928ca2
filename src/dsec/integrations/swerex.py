"""SWE-ReX's deployment ``DSecDeployment``: SWE-agent (or any SWE-ReX user) runs its shell sessions, commands and
file calls in a DSec sandbox, through SWE-ReX's own ``RemoteRuntime``.

Owns starting ``swerex-remote`` inside a sandbox, exposing its port through the node (``sb.expose``; the
sandbox's port token travels as basic auth's password in the runtime's URL, the server's own token as
SWE-ReX's ``X-API-Key``), waiting for it, and stopping it with its sandbox; and the recipe of an image that has
``swerex-remote`` (:func:`build_image`: the wheels are downloaded by this machine's pip and installed from the
build context, so the build itself needs no index). It talks to the node only through the public SDK and must
never reach into the server's protocol: every request after ``start`` is SWE-ReX's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime, RemoteRuntimeConfig

import dsec
from dsec.errors import DSecError, InvalidRequest, SandboxError

__all__ = ["DSecDeployment", "DSecDeploymentConfig", "build_image", "image_dockerfile"]

REMOTE = "swerex-remote"
"""The server's command (SWE-ReX's ``REMOTE_EXECUTABLE_NAME``), looked up on the image's ``PATH``."""


class DSecDeploymentConfig(BaseModel):
    """A DSec deployment's settings, as SWE-ReX's own deployment configs are (``get_deployment()``)."""

    model_config = ConfigDict(extra="forbid")

    image: str = "swerex"
    """An image of the node's store with ``swerex-remote`` on its ``PATH`` (see :func:`build_image`)."""
    backend: Literal["container", "microvm", "vm"] = "container"
    """Any backend with exposed ports (the function backend has none)."""
    port: int = 8000
    """The server's port inside the sandbox."""
    startup_timeout: float = 120.0
    """Seconds for the sandbox and the server to come up."""
    runtime_timeout: float = 60.0
    """The runtime's default timeout per request (SWE-ReX's ``RemoteRuntimeConfig.timeout``)."""
    cpu: float = 1.0
    memory: str = "2Gi"
    disk: str = "8Gi"
    network: str | list[str] = "none"
    """``none``, ``internet``, or an allowlist of hosts; the server is reached through the node either way."""
    timeout: float = 3600.0
    """The sandbox's wall-clock life, seconds."""
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    url: str | None = None
    """The DSec daemon (default ``$DSEC_URL``, else the local one)."""

    type: Literal["dsec"] = "dsec"

    def get_deployment(self) -> DSecDeployment:
        return DSecDeployment.from_config(self)


class DSecDeployment(AbstractDeployment):
    """SWE-ReX on a DSec sandbox: ``start`` creates the sandbox and its server, ``runtime`` talks to it,
    ``stop`` destroys it. Keyword arguments are the fields of :class:`DSecDeploymentConfig`."""

    def __init__(self, *, logger: logging.Logger | None = None, client: dsec.Client | None = None,
                 **kwargs: Any) -> None:
        self._config = DSecDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("rex-deploy-dsec")
        self._client = client
        self._own_client = client is None
        self._hooks = CombinedDeploymentHook()
        self._sandbox: dsec.AsyncSandbox | None = None
        self._server: dsec.AsyncProcess | None = None
        self._runtime: RemoteRuntime | None = None

    @classmethod
    def from_config(cls, config: DSecDeploymentConfig) -> DSecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> dsec.AsyncSandbox:
        """The sandbox, for what SWE-ReX has no call for (snapshots, forks, its stats)."""
        if self._sandbox is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._sandbox

    @property
    def runtime_config(self) -> RemoteRuntimeConfig:
        """What another client needs to reach this deployment's server (``RemoteRuntime.from_config``): its URL
        through the node, with the sandbox's port token, and the server's token."""
        return self.runtime._config.model_copy()

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime

    async def start(self) -> None:
        """Create the sandbox, start ``swerex-remote`` in it, expose its port and wait until it answers."""
        if self._sandbox is not None:
            self.logger.warning("Deployment is already started. Ignoring duplicate start() call.")
            return
        cfg = self._config
        if self._client is None:
            self._client = dsec.Client(cfg.url) if cfg.url else dsec.Client()
        t0 = time.monotonic()
        self._hooks.on_custom_step("Starting DSec sandbox")
        self._sandbox = await dsec.AsyncSandbox.create(
            image=cfg.image, backend=cfg.backend, cpu=cfg.cpu, memory=cfg.memory, disk=cfg.disk,
            timeout=cfg.timeout, network=cfg.network, env=cfg.env, workdir=cfg.workdir,
            labels={"dsec.integration": "swerex"}, client=self._client)
        try:
            await self._start_server(t0)
        except BaseException:
            await self.stop()
            raise
        self.logger.info("SWE-ReX runtime on sandbox %s up in %.2fs", self._sandbox.id, time.monotonic() - t0)

    async def _start_server(self, t0: float) -> None:
        cfg, sb = self._config, self.sandbox
        found = await sb.exec(["sh", "-c", f"command -v {REMOTE}"])
        if found.exit_code != 0:
            raise InvalidRequest(
                f"image {cfg.image!r} has no {REMOTE} on its PATH: build one with "
                f"dsec.integrations.swerex.build_image() (or `pip install swe-rex` in its Dockerfile)",
                image=cfg.image)
        self._hooks.on_custom_step("Starting runtime")
        token = secrets.token_urlsafe(24)
        self._server = await sb.exec([REMOTE, "--host", "127.0.0.1", "--port", str(cfg.port), "--auth-token", token],
                                     background=True)
        port = await sb.expose(cfg.port)
        assert port.credentials_url is not None  # an http exposure always has a URL
        self._runtime = RemoteRuntime(host=port.credentials_url, auth_token=token, timeout=cfg.runtime_timeout,
                                      logger=self.logger)
        await self._wait_until_alive(cfg.startup_timeout - (time.monotonic() - t0))

    async def _wait_until_alive(self, budget: float) -> None:
        deadline = time.monotonic() + max(budget, 1.0)
        last = IsAliveResponse(is_alive=False, message="no answer yet")
        while time.monotonic() < deadline:
            await self._check_server()
            last = await self.runtime.is_alive(timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            if last:
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(f"{REMOTE} did not answer within {self._config.startup_timeout:.0f}s "
                           f"(startup_timeout); last answer: {last.message}")

    async def _check_server(self) -> None:
        """Raise with the server's output when it has exited."""
        assert self._server is not None
        info = await self._server.info()
        if not info.running:
            result = await self._server.result(timeout=1)
            out = (result.stdout + result.stderr).decode(errors="replace")[-2000:]
            raise SandboxError(f"{REMOTE} exited with status {result.exit_code} in sandbox {self.sandbox.id}:\n{out}")

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """The server's own answer; raises (with its output) when the server has exited."""
        if self._runtime is None or self._server is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        await self._check_server()
        return await self._runtime.is_alive(timeout=timeout)

    async def stop(self) -> None:
        """Close the runtime and destroy the sandbox (safe to call twice, or after a failed start)."""
        if self._runtime is not None:
            with contextlib.suppress(Exception):  # the server may already be gone with its sandbox
                await self._runtime.close()
            self._runtime = None
        self._server = None
        if self._sandbox is not None:
            with contextlib.suppress(DSecError):
                await self._sandbox.aclose()
            self._sandbox = None
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None


def image_dockerfile(base: str = "debian-python", debs: bool = False) -> str:
    """The Dockerfile of :func:`build_image`: ``swe-rex`` in a venv of ``base``'s ``python3`` (3.10 or newer,
    with ``venv``), from the wheels in the context's ``wheels/``, and ``swerex-remote`` on the ``PATH``; a
    ``python`` command (``python3``) where the base has none, as SWE-agent's tools and prompts expect one; with
    ``debs``, the Debian packages in the context's ``debs/`` too."""
    extra = ("COPY debs /tmp/swerex-debs\nRUN dpkg -i /tmp/swerex-debs/*.deb && rm -rf /tmp/swerex-debs\n"
             if debs else "")
    return (f"FROM {base}\n{extra}"
            "COPY wheels /tmp/swerex-wheels\n"
            "RUN python3 -m venv /opt/swerex \\\n"
            " && /opt/swerex/bin/pip install --no-index --find-links /tmp/swerex-wheels swe-rex \\\n"
            " && rm -rf /tmp/swerex-wheels \\\n"
            f" && ln -sf /opt/swerex/bin/{REMOTE} /usr/local/bin/{REMOTE} \\\n"
            " && (command -v python >/dev/null || ln -s \"$(command -v python3)\" /usr/local/bin/python)\n")


def download_wheels(dest: Path, python_version: str = "3.11", version: str | None = None) -> None:
    """``swe-rex`` (this client's version unless given) and its dependencies as wheels for a CPython
    ``python_version`` on this machine's architecture, by this interpreter's pip (its index settings)."""
    version = version or importlib.metadata.version("swe-rex")
    arch = platform.machine()
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet", "--dest", str(dest),
            "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
            "--platform", f"manylinux_2_36_{arch}", "--platform", f"manylinux2014_{arch}", f"swe-rex=={version}"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise InvalidRequest(f"pip could not download swe-rex=={version} for Python {python_version}: "
                             f"{proc.stderr.strip()[-1500:]}")


async def build_image(name: str = "swerex", base: str = "debian-python", *, python_version: str = "3.11",
                      version: str | None = None, debs: Sequence[str | os.PathLike[str]] = (), replace: bool = True,
                      client: dsec.Client | None = None, output: Callable[[str], None] | None = None
                      ) -> dsec.ImageInfo:
    """Build image ``name``: ``base`` (an image of the node's store; its ``python3`` is ``python_version``) with
    ``swerex-remote`` (``version``: default, this client's). A rebuild of the same recipe is the builder's cache
    hit; ``replace=False`` refuses to overwrite an existing ``name``. ``debs``: Debian package files to install
    as well (``apt-get download less``: the build needs no mirror), for a base without tools the agent uses."""
    with tempfile.TemporaryDirectory(prefix="dsec-swerex-") as tmp:
        context = Path(tmp)
        await asyncio.to_thread(download_wheels, context / "wheels", python_version, version)
        if debs:
            (context / "debs").mkdir()
            for deb in map(Path, debs):
                if deb.suffix != ".deb" or not deb.is_file():
                    raise InvalidRequest(f"{deb}: not a Debian package file (.deb)", path=str(deb))
                shutil.copy2(deb, context / "debs" / deb.name)
        (context / "Dockerfile").write_text(image_dockerfile(base, debs=bool(debs)))
        return await dsec.AsyncSandbox.build_image(name, context, network="none", replace=replace,
                                                   output=output, client=client)
