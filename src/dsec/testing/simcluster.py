"""A cluster of real gateway replicas over the fleet simulator, for the invariant tests and the benchmark.

Owns the processes: the fleet (:class:`~dsec.testing.fleet.FleetProcess`) and any number of real gateway
replicas (``python -m dsec.cluster gateway --nodes-from <the fleet>``) sharing one PostgreSQL, each on its
own loopback port, optionally pinned to a core; a replica can be SIGKILLed and started again. The
PostgreSQL server is the caller's (:func:`dsec.testing.postgres.postgres_server`). Everything it starts
it stops, by process group, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec._ports import free_port
from dsec.api.client import call_blocking, serves
from dsec.errors import DSecError
from dsec.testing.fleet import FleetProcess

__all__ = ["Replica", "SimCluster", "sim_cluster"]


@dataclass
class Replica:
    """One gateway replica process."""

    name: str
    port: int
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it (answering comes later: :meth:`SimCluster.wait_ready`)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def kill(self) -> None:
        """SIGKILL it (its process group) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM it (a graceful stop hands its cells back), SIGKILL after 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class SimCluster:
    """The fleet, the replicas, the jobs and their tokens."""

    fleet: FleetProcess
    replicas: list[Replica]
    admin: str
    tokens: dict[str, str]
    base: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def metric(self, replica: Replica, name: str) -> float:
        """One gauge or counter of a replica's ``/metrics``."""
        text = call_blocking(replica.url, self.admin, lambda api: api.metrics_text()).decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise ValueError(f"{replica.name} has no metric {name}")

    def wait_ready(self, replica: Replica, timeout: float = 120.0) -> None:
        """Until ``replica`` answers ``/v1/health``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not replica.alive():
                raise RuntimeError(f"replica {replica.name} exited:\n{replica.tail()}")
            if serves(replica.url, timeout=5):
                return
            time.sleep(0.2)
        raise RuntimeError(f"replica {replica.name} did not answer in {timeout:g} s:\n{replica.tail()}")

    def placing(self) -> int:
        """Nodes placed on by the live replicas together (each node by one replica)."""
        return int(sum(self.metric(r, "dsec_cluster_nodes_alive") for r in self.replicas if r.alive()))

    def wait_placing(self, nodes: int, timeout: float = 180.0) -> None:
        """Until the live replicas together place on ``nodes`` nodes."""
        deadline = time.monotonic() + timeout
        got = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(DSecError, ValueError):
                got = self.placing()
                if got >= nodes:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the replicas place on {got} of {nodes} nodes after {timeout:g} s:\n"
                           + "\n".join(f"--- {r.name}\n{r.tail()}" for r in self.replicas))


@contextlib.contextmanager
def sim_cluster(dsn: str, nodes: int, jobs: dict[str, dict[str, Any]], *, replicas: int = 1, cells: int = 8,
                lease_ttl: float = 2.0, capacity: dict[str, Any] | None = None, admission_wait: float = 60.0,
                cpus: list[int] | None = None, fleet_cpus: set[int] | None = None) -> Iterator[SimCluster]:
    """The fleet of ``nodes`` and ``replicas`` gateway replicas over PostgreSQL ``dsn``; every replica answers
    when this yields (``cpus``: pin replica i to ``cpus[i % len(cpus)]``)."""
    base = Path(tempfile.mkdtemp(prefix="dsec-simcl-"))
    admin = secrets.token_urlsafe(24)
    tokens = {name: secrets.token_urlsafe(24) for name in jobs}
    (base / "jobs.json").write_text(json.dumps({"admin_token": admin, "jobs": {
        name: {"token": tokens[name], **quota} for name, quota in jobs.items()}}))
    fleet = FleetProcess(nodes, capacity, cpus=fleet_cpus)
    fleet.start()
    cluster = SimCluster(fleet, [], admin, tokens, base)
    try:
        for i in range(replicas):
            port = free_port()
            pin = ["taskset", "-c", str(cpus[i % len(cpus)])] if cpus else []
            argv = [*pin, sys.executable, "-m", "dsec.cluster", "gateway", "--listen", f"127.0.0.1:{port}",
                    "--db", dsn, "--jobs", str(base / "jobs.json"), "--nodes-from",
                    fleet.control + "/fleet/membership", "--admission-wait", str(admission_wait),
                    "--name", f"r{i}", "--cells", str(cells), "--lease-ttl", str(lease_ttl),
                    "--log-level", os.environ.get("DSEC_SIM_LOG_LEVEL", "INFO")]
            replica = Replica(f"r{i}", port, argv, base / f"r{i}.log")
            replica.start()
            cluster.replicas.append(replica)
        for replica in cluster.replicas:
            cluster.wait_ready(replica)
        yield cluster
    finally:
        for replica in cluster.replicas:
            replica.kill()
        fleet.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)
