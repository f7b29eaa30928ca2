"""A real local Ray cluster for cluster-mode tests, inside a network namespace of its own.

Ray rewrites 127.0.0.1 to the host's external address and listens on every interface on the host
network, so the test enters a fresh network namespace (loopback only) in its main thread before it
starts anything: PostgreSQL, the Ray head and worker nodes, the gateway and the node daemons (started by
Ray actors) all live there, and so do the test's own HTTP connections (made from the main thread's
event loop). Teardown stops only what the fixture started: the gateway by its pid, the Ray cluster by its
handle (never ``ray stop``), leftover daemons by the pid found under their home, then sweeps each node
home for sandboxes a killed node left behind.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from container_support import SESSION_TAGS, home_tag, images_dir, sweep
from postgres_support import PgServer

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


@contextlib.contextmanager
def own_netns() -> Iterator[str]:
    """The calling thread (and everything it spawns) in a new network namespace with only ``lo`` up."""
    name = f"dsec-t10-{os.getpid()}-{secrets.token_hex(3)}"
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pids_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (the fixture's own homes: only processes it started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


@dataclass
class Gateway:
    """The gateway process (``python -m dsec.cluster gateway``) that the test may kill and restart."""

    args: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class LocalCluster:
    """Everything one test module's cluster is made of."""

    base: Path
    ray: Any
    gateway: Gateway
    admin: str
    tokens: dict[str, str]
    workers: list[Any] = field(default_factory=list)

    def node_homes(self) -> list[Path]:
        root = self.base / "homes"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.gateway.url + "/v1/health", timeout=10).json())

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` node daemons answer through the gateway (their actors start lazily)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = httpx.get(self.gateway.url + "/metrics", timeout=10,
                                headers={"Authorization": f"Bearer {self.admin}"}).text
            for line in metrics.splitlines():
                if line.startswith("dsec_cluster_nodes_alive ") and float(line.split()[1]) >= count:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{count} nodes did not join in {timeout} s:\n{self.gateway.log.read_text()[-3000:]}")


@contextlib.contextmanager
def local_cluster(pg: PgServer, workers: int, jobs: dict[str, dict[str, Any]],
                  slots: dict[str, int]) -> Iterator[LocalCluster]:
    """A head (no sandboxes) plus ``workers`` Ray nodes each running a DSec node daemon, and a gateway."""
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
    (base / "node.json").write_text(json.dumps({
        "home_root": str(base / "homes"), "images": str(images_dir()), "trajectory_db": pg.dsn,
        "snapshots": str(base / "snapshots"), "slots": slots, "node_resource": "dsec_node"}))
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
              "health_check_timeout_ms": 1000, "health_check_initial_delay_ms": 1000}
    cluster = None
    gateway = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": 80 * 1024**2, "node_ip_address": "127.0.0.1",
            "temp_dir": str(base / "ray" / "ray"), "include_dashboard": False, "_system_config": system})
        handle = LocalCluster(base, cluster, None, admin, tokens)  # type: ignore[arg-type]
        for _ in range(workers):
            handle.workers.append(cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2,
                                                   node_ip_address="127.0.0.1", resources={"dsec_node": 1}))
        cluster.wait_for_nodes()
        port = free_port()
        env = dict(os.environ)
        gateway = Gateway(
            [sys.executable, "-m", "dsec.cluster", "gateway", "--listen", f"127.0.0.1:{port}", "--db", pg.dsn,
             "--jobs", str(base / "jobs.json"), "--ray-address", cluster.address,
             "--node-config", str(base / "node.json"), "--admission-wait", "120", "--log-level", "INFO"],
            env, base / "gateway.log", f"http://127.0.0.1:{port}")
        handle.gateway = gateway
        gateway.start()
        handle.wait_nodes(workers)
        for home in handle.node_homes():
            SESSION_TAGS.add(home_tag(home))
        yield handle
    finally:
        _teardown(base, cluster, gateway)


def _teardown(base: Path, cluster: Any, gateway: Gateway | None) -> None:
    homes = sorted((base / "homes").iterdir()) if (base / "homes").is_dir() else []
    if gateway is not None:
        with contextlib.suppress(Exception):
            httpx_destroy_all(gateway)
        gateway.kill()
    if cluster is not None:
        cluster.shutdown()
    for home in homes:
        SESSION_TAGS.add(home_tag(home))
        deadline = time.monotonic() + 60
        while pids_with(f"--home\0{home}\0") and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids_with(f"--home\0{home}\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        import asyncio

        asyncio.run(_sweep_node(home))
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(base, ignore_errors=True)


def httpx_destroy_all(gateway: Gateway) -> None:
    """Best effort: destroy what the tests left, through the gateway as admin (reads the jobs file)."""
    jobs = json.loads((Path(gateway.args[gateway.args.index("--jobs") + 1])).read_text())
    headers = {"Authorization": f"Bearer {jobs['admin_token']}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        for info in http.get("/v1/sandboxes").json():
            http.delete(f"/v1/sandboxes/{info['id']}")


async def _sweep_node(home: Path) -> None:
    from dsec.backends.function import FunctionBackend
    from dsec.config import Settings

    fn = FunctionBackend(Settings(home=home, images_dir=images_dir()))
    with contextlib.suppress(Exception):
        await fn.cleanup_orphans(set())
    with contextlib.suppress(Exception):
        await fn.aclose()
    await sweep(home, images_dir())
