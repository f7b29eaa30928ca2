"""A real local cluster on one machine, for tests and ``dsec bench cluster``: a Ray head (no sandboxes)
plus N Ray worker nodes each running a DSec node daemon, a PostgreSQL server and the gateway process,
all inside a network namespace of their own.

Ray rewrites 127.0.0.1 to the host's external address and listens on every interface on the host
network, so the caller's thread enters a fresh network namespace (loopback only) before anything starts:
PostgreSQL, the Ray nodes, the gateway and the node daemons (started by Ray actors) all live there, and
so do the caller's HTTP connections when made from that thread (an asyncio loop run there). Teardown
stops only what was started here: the gateway by its process group, Ray by its cluster handle (never
``ray stop``), leftover daemons by the pid found under their home; then every node home is swept of
sandboxes a killed node left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec._ports import free_port
from dsec.api.client import NodeClient, call_blocking, serves
from dsec.models import BatchDestroyRequest

__all__ = ["Gateway", "LocalCluster", "local_cluster", "own_netns"]

_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


@contextlib.contextmanager
def own_netns() -> Iterator[str]:
    """The calling thread (and every process it spawns) in a new network namespace with only ``lo`` up."""
    name = f"dsec-cl-{os.getpid()}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield name
        finally:
            _setns(home)
    finally:
        os.close(home)
        subprocess.run(["ip", "netns", "del", name], check=False)


def _pids_with(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


@dataclass
class Gateway:
    """The gateway process (``python -m dsec.cluster gateway``), which a test may kill and restart."""

    args: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        """Start it and wait until it answers."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if serves(self.url):
                return
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL it (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class LocalCluster:
    """Everything one local cluster is made of."""

    base: Path
    ray: Any
    gateway: Gateway
    admin: str
    tokens: dict[str, str]
    dsn: str
    workers: list[Any] = field(default_factory=list)

    def node_homes(self) -> list[Path]:
        """The node daemons' ``DSEC_HOME`` directories."""
        root = self.base / "homes"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def wait_nodes(self, count: int, timeout: float = 180.0) -> None:
        """Until ``count`` node daemons have joined the gateway (their actors start lazily)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = call_blocking(self.gateway.url, self.admin, lambda api: api.metrics_text(), timeout=10)
            for line in metrics.decode().splitlines():
                if line.startswith("dsec_cluster_nodes_alive ") and float(line.split()[1]) >= count:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{count} nodes did not join in {timeout} s:\n{self.gateway.log.read_text()[-3000:]}")


@contextlib.contextmanager
def local_cluster(dsn: str, workers: int, jobs: dict[str, dict[str, Any]], slots: dict[str, int],
                  images: Path, *, admission_wait: float = 120.0, image_store: str | None = None,
                  node_env: dict[str, str] | None = None, start_gateway: bool = True,
                  gateway_args: Sequence[str] = ()) -> Iterator[LocalCluster]:
    """A head (no sandboxes) plus ``workers`` Ray nodes with a node daemon each, and the gateway.

    Call inside :func:`own_netns`; ``dsn`` is a PostgreSQL server reachable there (gateway state and
    trajectory log); ``images`` the image store directory the node daemons share, or, with
    ``image_store`` (``s3://...``, reachable in the namespace), only their local scratch root: images
    and snapshots then live in that store. ``node_env``: more environment for the node daemons (S3
    credentials). ``start_gateway=False``: Ray and the files only (``base/jobs.json``, ``base/node.json``)
    for a caller that starts the gateway itself (``dsec cluster up``), listening on ``gateway.url``'s
    port so that teardown still finds it. ``gateway_args``: more options of the gateway (its listeners).
    """
    base = Path(tempfile.mkdtemp(prefix="dsec-cl-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(base / "ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    (base / "ray" / "ray").mkdir(parents=True)
    from ray.cluster_utils import Cluster

    admin = secrets.token_urlsafe(24)
    tokens = {name: secrets.token_urlsafe(24) for name in jobs}
    (base / "jobs.json").write_text(json.dumps({"admin_token": admin, "jobs": {
        name: {"token": tokens[name], **quota} for name, quota in jobs.items()}}))
    (base / "snapshots").mkdir()
    node_config: dict[str, Any] = {
        "home_root": str(base / "homes"), "images": str(images), "trajectory_db": dsn,
        "snapshots": image_store or str(base / "snapshots"), "slots": slots, "node_resource": "dsec_node",
        "extra_env": dict(node_env or {})}
    if image_store:
        node_config["image_store"] = image_store
    (base / "node.json").write_text(json.dumps(node_config))
    # Ray's health checks decide that a node is dead: tuned to seconds (default ~15 s) for the tests.
    # ~8 s, not ~2 s: at a load average of 50-60 on this shared 2-core VM, raylets missed three 0.5 s checks
    # and Ray killed every worker node while the cluster was still starting.
    system = {"health_check_period_ms": 1000, "health_check_failure_threshold": 8,
              "health_check_timeout_ms": 2000, "health_check_initial_delay_ms": 2000}
    small: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 1024**2, "node_ip_address": "127.0.0.1"}
    cluster = None
    gateway = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            **small, "temp_dir": str(base / "ray" / "ray"), "include_dashboard": False, "_system_config": system})
        port = free_port()
        gateway = Gateway(
            [sys.executable, "-m", "dsec.cluster", "gateway", "--listen", f"127.0.0.1:{port}", "--db", dsn,
             "--jobs", str(base / "jobs.json"), "--ray-address", cluster.address,
             "--node-config", str(base / "node.json"), "--admission-wait", str(admission_wait), *gateway_args],
            dict(os.environ), base / "gateway.log", f"http://127.0.0.1:{port}")
        handle = LocalCluster(base, cluster, gateway, admin, tokens, dsn)
        for _ in range(workers):
            handle.workers.append(cluster.add_node(**small, resources={"dsec_node": 1}))
        cluster.wait_for_nodes()
        if start_gateway:
            gateway.start()
            handle.wait_nodes(workers)
        yield handle
    finally:
        _teardown(base, cluster, gateway, admin, images)


async def _destroy_every(api: NodeClient) -> None:
    ids = [info.id for info in await api.list()]
    if ids:
        await api.destroy_many(BatchDestroyRequest(ids=ids))


def _teardown(base: Path, cluster: Any, gateway: Gateway | None, admin: str, images: Path) -> None:
    homes = sorted((base / "homes").iterdir()) if (base / "homes").is_dir() else []
    if gateway is not None:
        with contextlib.suppress(Exception):
            call_blocking(gateway.url, admin, _destroy_every)
        gateway.kill()
    if cluster is not None:
        cluster.shutdown()
    for home in homes:
        # The daemons stop when their actors die (SIGTERM by PR_SET_PDEATHSIG): wait, then insist.
        marker = f"--home\0{home}\0"
        deadline = time.monotonic() + 60
        while _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _pids_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        asyncio.run(sweep_home(home, images))
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(base, ignore_errors=True)


async def sweep_home(home: Path, images: Path) -> list[str]:
    """Destroy every sandbox still under a node home (a killed node leaves its sandboxes); their ids."""
    from dsec.backends.container import ContainerBackend
    from dsec.backends.function import FunctionBackend
    from dsec.backends.microvm import MicroVMBackend
    from dsec.config import Settings

    settings = Settings(home=home, images_dir=images)
    removed: list[str] = []
    for backend in (FunctionBackend(settings), ContainerBackend(settings), MicroVMBackend(settings)):
        if isinstance(backend, ContainerBackend) and (home / "container").is_dir():
            # started, it adopts the home's mount holder (which outlives a killed daemon) and ends it at close
            with contextlib.suppress(Exception):
                await backend.start()
        with contextlib.suppress(Exception):
            removed += await backend.cleanup_orphans(set())
        with contextlib.suppress(Exception):
            await backend.aclose()
    if (home / "lazy").exists():
        from dsec.images.node import NodeImages

        await NodeImages(settings).aclose(unmount=True)
    return removed
