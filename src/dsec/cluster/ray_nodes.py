"""Ray integration: one node daemon per Ray node, and membership from Ray's own view of the cluster.

:class:`NodeDaemon` is a Ray actor pinned to one node (``NodeAffinitySchedulingStrategy``, hard) that
starts a normal ``dsec serve`` there with its own ``DSEC_HOME``, TCP port and token, restarts it if it
exits, and answers where it listens. :class:`RayNodes` is the gateway's node source: it reads
``ray.nodes()`` (alive or dead, with Ray's death reason), starts a daemon actor on every alive node that
has none (so nodes that join are used at once) and asks each actor for its endpoint. No home-made
membership or failure detection: Ray's health checks decide that a node is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec._ports import free_port
from dsec.api.client import serves
from dsec.cluster.gateway import NodeFacts
from dsec.isolation.procs import meminfo

__all__ = ["GATEWAY_ACTOR", "NAMESPACE", "GatewayProcess", "NodeConfig", "NodeDaemon", "RayNodes", "node_name"]

log = logging.getLogger(__name__)

NAMESPACE = "dsec"
"""Ray namespace of DSec's named actors."""
GATEWAY_ACTOR = "dsec-gateway"
"""Name of the detached actor that runs the gateway (``dsec cluster up``)."""
_PR_SET_PDEATHSIG = 1


def node_name(ray_node_id: str) -> str:
    """DSec's name for a Ray node (the daemon's ``DSEC_NODE`` and the actor's name)."""
    return f"node-{ray_node_id[:12]}"


@dataclass
class NodeConfig:
    """How every node daemon of a cluster is set up (shared storage and per-node defaults)."""

    home_root: str = "/var/lib/dsec/cluster"
    """Each node's ``DSEC_HOME`` is ``<home_root>/<node name>`` (on that node's disk)."""
    images: str | None = None
    """``DSEC_IMAGES`` (the image store's local root; a shared POSIX mount works as the store)."""
    image_store: str | None = None
    """``DSEC_IMAGE_STORE``: a shared path or ``s3://bucket/prefix?endpoint=...``."""
    trajectory_db: str | None = None
    """``DSEC_TRAJECTORY_DB``: the shared PostgreSQL log (``postgresql://...``)."""
    snapshots: str | None = None
    """``DSEC_SNAPSHOT_STORE``: a shared path or ``s3://...`` (default: the image store), so a checkpoint
    taken on one node restores on another."""
    slots: dict[str, int] = field(default_factory=lambda: {"function": 1000, "container": 250})
    """Live sandboxes per backend a node accepts."""
    cpu_overcommit: float = 8.0
    """Sandbox CPU limits may add up to this many times the node's cores (most sandboxes idle)."""
    memory_overcommit: float = 4.0
    """Sandbox memory limits may add up to this many times the node's memory."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the daemon."""
    node_resource: str | None = None
    """Run a daemon only on Ray nodes offering this custom resource (e.g. keep sandboxes off the head)."""


def _set_pdeathsig() -> None:
    # The daemon stops (gracefully: sandboxes stay for the next daemon to adopt) when its actor dies.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _mem_total() -> int:
    try:
        return meminfo("MemTotal")["MemTotal"]
    except (OSError, ValueError, RuntimeError):
        return 0


class _Supervisor:
    """Runs one child process in a Ray actor and restarts it when it exits (until :meth:`_halt`)."""

    def _start_supervised(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self._argv, self._child_env, self._log_path = argv, env, log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._restarts = 0
        self._spawn()
        threading.Thread(target=self._supervise, name="dsec-supervisor", daemon=True).start()

    def _spawn(self) -> None:
        with open(self._log_path, "ab") as out:
            self._proc = subprocess.Popen(self._argv, env=self._child_env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=_set_pdeathsig,
                                          start_new_session=True)

    def _supervise(self) -> None:
        while not self._stopping:
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._stopping:
                self._restarts += 1
                log.warning("%s exited with %s; restarting", self._argv[:4], proc.returncode)
                time.sleep(min(5.0, 0.2 * self._restarts))
                self._spawn()
            time.sleep(0.2)

    def _halt(self, timeout: float = 60.0) -> None:
        self._stopping = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class NodeDaemon(_Supervisor):
    """Supervises ``dsec serve`` on this node (instantiated as a Ray actor by :class:`RayNodes`)."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        import ray

        self.name = name
        self.config = NodeConfig(**config)
        self.host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.port = free_port(self.host)
        self.token = secrets.token_urlsafe(32)
        self.home = Path(self.config.home_root) / name
        self.home.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "dsec.daemon", "serve", "--home", str(self.home),
                "--tcp", f"{self.host}:{self.port}"]
        self._start_supervised(argv, self._env(), self.home / "daemon.log")

    def _env(self) -> dict[str, str]:
        c = self.config
        env = dict(os.environ, DSEC_HOME=str(self.home), DSEC_NODE=self.name, DSEC_TOKEN=self.token,
                   **c.extra_env)
        for key, value in (("DSEC_IMAGES", c.images), ("DSEC_IMAGE_STORE", c.image_store),
                           ("DSEC_TRAJECTORY_DB", c.trajectory_db), ("DSEC_SNAPSHOT_STORE", c.snapshots)):
            if value:
                env[key] = value
        # Exposed ports listen where the daemon does (not on loopback): the gateway relays to them, and the SDK,
        # which follows the sandbox's endpoint to this address, reaches them directly.
        env.setdefault("DSEC_PORTS_BIND", self.host)
        return env

    def endpoint(self, wait: float = 30.0) -> dict[str, Any]:
        """URL, token and capacity of the daemon once it answers (raises TimeoutError otherwise)."""
        url = f"http://{self.host}:{self.port}"
        deadline = time.monotonic() + wait
        while True:
            if serves(url):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"dsec serve on {self.name} did not answer at {url} within {wait:g} s "
                                   f"(see {self.home / 'daemon.log'})")
            time.sleep(0.1)
        c = self.config
        capacity = {"cpu": (os.cpu_count() or 1) * c.cpu_overcommit,
                    "memory": int(_mem_total() * c.memory_overcommit), "slots": dict(c.slots)}
        return {"url": url, "token": self.token, "capacity": capacity, "home": str(self.home),
                "pid": self._proc.pid if self._proc else None, "restarts": self._restarts}

    def stop(self, destroy: bool = False) -> None:
        """Stop the daemon: SIGTERM leaves sandboxes for the next daemon; ``destroy`` removes them first."""
        if destroy and self._proc is not None and self._proc.poll() is None:
            from dsec.daemon.server import ServeError, destroy_every

            try:
                destroy_every(f"http://{self.host}:{self.port}", token=self.token)
            except ServeError as exc:  # still stopped: the next daemon on this home re-adopts what is left
                log.error("%s: %s", self.name, exc)
        self._halt()


class GatewayProcess(_Supervisor):
    """Supervises the gateway process (``python -m dsec.cluster gateway``) as a detached Ray actor.

    A replica of several (``replica_listen`` given) may run on any node: the files it needs come along as
    text (``files``: option -> content, written next to its log, readable by its owner only), and it
    advertises its node's address to the other replicas when it listens on every interface."""

    def __init__(self, args: list[str], log_path: str, files: dict[str, str] | None = None,
                 replica_listen: str | None = None) -> None:
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        args = list(args)
        for option, text in (files or {}).items():
            path = log.with_name(f"{log.stem}{option.replace('--', '-')}.json")
            path.touch(mode=0o600)
            path.write_text(text)
            args += [option, str(path)]
        self.url: str | None = None
        if replica_listen is not None:
            self.url = _advertised(replica_listen)
            args += ["--listen", replica_listen, "--advertise", self.url]
        self._start_supervised([sys.executable, "-m", "dsec.cluster", "gateway", *args], dict(os.environ), log)

    def address(self) -> str | None:
        """The URL this replica is reached at (None: a single gateway, at the address it was told)."""
        return self.url

    def stop(self) -> None:
        """Stop the gateway (sandboxes and node daemons keep running)."""
        self._halt()


def _advertised(listen: str) -> str:
    """The URL of a gateway listening on ``listen`` as other nodes reach it (its node's address for
    ``0.0.0.0``)."""
    import ray

    host, _, port = listen.rpartition(":")
    if host.strip("[]") in ("", "0.0.0.0", "::"):
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return f"http://{host}:{port}"


class RayNodes:
    """The gateway's node source over a Ray cluster (call from the gateway process after ``ray.init``)."""

    def __init__(self, config: NodeConfig, *, start_timeout: float = 60.0) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self._endpoints: dict[str, NodeFacts] = {}
        self._starting: dict[str, Any] = {}

    @property
    def settling(self) -> bool:
        """Whether node daemons are still starting (the gateway then reads membership often)."""
        return bool(self._starting)

    def _actor_for(self, ray_node_id: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = node_name(ray_node_id)
        with contextlib.suppress(ValueError):
            return ray.get_actor(name, namespace=NAMESPACE)
        remote = ray.remote(NodeDaemon).options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray_node_id, soft=False))
        return remote.remote(name, self.config.__dict__)

    def _poll_sync(self) -> list[NodeFacts]:
        import ray

        out: list[NodeFacts] = []
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            ray_id = str(node["NodeID"])
            name = node_name(ray_id)
            if not node.get("Alive"):
                reason = str(node.get("DeathReasonMessage") or node.get("DeathReason") or "Ray reports it dead")
                out.append(NodeFacts(name, alive=False, reason=reason))
                self._endpoints.pop(name, None)
                self._starting.pop(name, None)
                continue
            wanted = self.config.node_resource
            if wanted and not dict(node.get("Resources") or {}).get(wanted):
                continue
            known = self._endpoints.get(name)
            if known is not None:
                out.append(known)
                continue
            pending = self._starting.get(name)
            if pending is None:
                pending = self._starting[name] = self._actor_for(ray_id).endpoint.remote(self.start_timeout)
            ready, _ = ray.wait([pending], timeout=0)
            if not ready:
                continue
            del self._starting[name]
            try:
                info = ray.get(pending)
            except Exception as exc:
                log.error("node daemon on %s failed to start: %s", name, exc)
                continue
            facts = NodeFacts(name, True, info["url"], info["token"], info["capacity"])
            self._endpoints[name] = facts
            out.append(facts)
        return out

    async def __call__(self) -> list[NodeFacts]:
        """One membership report (Ray's calls block, so they run in a worker thread)."""
        return await asyncio.to_thread(self._poll_sync)

    def stop_all(self, destroy: bool = False) -> None:
        """Stop every node daemon actor of this cluster (``dsec cluster down``)."""
        import ray

        for node in ray.nodes():  # type: ignore[no-untyped-call]
            with contextlib.suppress(ValueError):
                actor = ray.get_actor(node_name(str(node["NodeID"])), namespace=NAMESPACE)
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(destroy), timeout=120)
                ray.kill(actor)
