"""``dsec bench cluster-sim``: the control plane at fleet scale, against the fleet simulator.

For each fleet size (160, 1,000, 2,000 and 4,000 simulated nodes by default) one run starts a throwaway
PostgreSQL, the fleet simulator (:mod:`dsec.testing.fleet`, one process, every node on its own loopback
address) and the real gateway process (``python -m dsec.cluster gateway --nodes-from``, pinned to one
core), then measures the issue's figures:

- ``decide``: the placement decision alone, one sandbox, and a whole batch (in this process);
- ``idle``: the gateway's CPU with nothing to do but membership and health;
- ``batch``: one ``create_many`` of 32,000 end to end, then its destroy;
- ``single``: creates each followed by a destroy from a client process on the other core, sustained; the
  gateway's CPU per create split by part (py-spy samples), and the CPU per create of what shares the other
  core (the fleet, the client, PostgreSQL);
- ``fill``: the gateway holding ``live`` sandboxes: its memory per live sandbox, the longest answer of a
  health probe (an event-loop stall shows there), ``list`` at that size;
- ``death``: a node holding 3,200 sandboxes dies: time until the gateway reports them all lost;
- ``restart``: the gateway SIGKILLed and started again: time until a create is served;
- ``replicas``: the ``single`` load on the one gateway, then on it and a second replica (on the other cores,
  with the fleet, PostgreSQL and the client: on a 2-core machine it has far less than a core) once the two
  share the cells: both rates, their ratio, and each replica's CPU per create.

Everything runs on this machine's loopback. It measures; the SPECIFICATION lines say what was met.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from dsec._http.http11 import Http11Error
from dsec._ports import free_port
from dsec.api.protocol import NodeAPI
from dsec.bench.container import BenchUnavailable
from dsec.bench.cpu import tree_cpu
from dsec.bench.report import Row, Suite, summarize

__all__ = ["PHASES", "ClusterSimBench", "run"]

PHASES = ("decide", "idle", "batch", "single", "fill", "death", "restart", "replicas")
"""Every phase, in the order a run measures them."""

SPEC: dict[str, Any] = {"image": "debian-python", "backend": "function", "cpu": 0.01, "memory": 16 * 1024**2,
                        "timeout": 86_400}
_NODE_CAPACITY: dict[str, Any] = {"cpu": 4096.0, "memory": 2**44, "slots": {"function": 4000}}


@dataclass(frozen=True)
class ClusterSimBench:
    """Sizes of the cluster-sim benchmark."""

    nodes: tuple[int, ...] = (160, 1000, 2000, 4000)
    """Fleet sizes, one run each."""
    batch: int = 32_000
    """Sandboxes of the one-job batch."""
    fill_batch: int = 10_000
    """Sandboxes per request while filling to ``live``."""
    live: int = 380_000
    """Live sandboxes the gateway holds in the ``fill`` phase (and keeps for ``death`` and ``restart``)."""
    dead_node: int = 3_200
    """Sandboxes on the node that dies."""
    single_seconds: float = 15.0
    concurrency: int = 64
    idle_seconds: float = 20.0
    probe_seconds: float = 10.0
    gateway_cpu: int = 1
    """The core the gateway is pinned to; the fleet, PostgreSQL and the client share the others."""
    phases: tuple[str, ...] = ()
    """Phases to run (empty: all)."""

    def scaled(self, factor: float) -> ClusterSimBench:
        """Counts and durations multiplied by ``factor`` (at least a few)."""
        return replace(self, batch=max(100, round(self.batch * factor)), live=max(1000, round(self.live * factor)),
                       dead_node=max(50, round(self.dead_node * factor)),
                       single_seconds=max(2.0, self.single_seconds * factor),
                       idle_seconds=max(2.0, self.idle_seconds * factor),
                       probe_seconds=max(2.0, self.probe_seconds * factor))

    def wants(self, phase: str) -> bool:
        return not self.phases or phase in self.phases


def _decide(nodes: int, batch: int, samples: int = 2000) -> dict[str, Any]:
    """The placement decision alone, in this process: one sandbox at a time, then one batch."""
    from dsec.cluster.placement import Capacity, Placer
    from dsec.models import SandboxSpec

    def placer() -> Placer:
        p = Placer()
        for i in range(nodes):
            p.set_node(f"n{i}", Capacity(cpu=4096.0, memory=2**44, slots={"function": 100_000}))
        return p

    spec = SandboxSpec.model_validate(SPEC)
    p = placer()
    single = []
    for _ in range(samples):
        start = time.perf_counter()
        p.try_place(spec, 1, "bench")
        single.append(time.perf_counter() - start)
    p = placer()
    p.try_place(spec, 100, "warm")  # the first fill pays numpy's one-time set-up, as a gateway does once
    start = time.perf_counter()
    p.try_place(spec, batch, "bench")
    return {"single": single, "batch_s": time.perf_counter() - start}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class _Env:
    """PostgreSQL, the fleet and the gateway of one fleet size, with the calls the phases need."""

    def __init__(self, cfg: ClusterSimBench, nodes: int, dsn: str, base: Path, progress: Callable[[str], None],
                 pg_pid: int | None = None):
        from dsec.testing.fleet import FleetProcess

        self.cfg, self.nodes, self.dsn, self.base, self.progress = cfg, nodes, dsn, base, progress
        self.pg_pid = pg_pid
        others = sorted(set(os.sched_getaffinity(0)) - {cfg.gateway_cpu}) or [0]
        self.others = ",".join(map(str, others))
        self.fleet = FleetProcess(nodes, _NODE_CAPACITY, cpus=set(others))
        self.admin = secrets.token_urlsafe(24)
        self.token = secrets.token_urlsafe(24)
        (base / "jobs.json").write_text(json.dumps({"admin_token": self.admin, "jobs": {
            "bench": {"token": self.token}}}))
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.second: subprocess.Popen[bytes] | None = None
        """A second gateway replica (the ``replicas`` phase)."""
        self.rss_start = 0
        """The gateway's RSS (KiB) once it took its nodes, before any phase."""

    def start_gateway(self, timeout: float = 1800.0, *, again: bool = False, wait: bool = True) -> float:
        """Start the gateway pinned to its core; seconds until every node is alive in its metrics (``wait``
        false: 0, at once). ``again``: on the address it had, as its supervisor restarts it (the same replica
        name, whose cells it takes back at once rather than when their leases run out)."""
        port = int(self.url.rsplit(":", 1)[1]) if again and self.url else free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = self._gateway(port, str(self.cfg.gateway_cpu), "gateway.log")
        if not wait:
            return 0.0
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if self.metric("dsec_cluster_nodes_alive") >= self.alive_nodes():
                    self.rss_start = _rss_kib(self.proc.pid)
                    return time.perf_counter() - start
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not take its {self.nodes} nodes in {timeout:g} s:\n{self.log_tail()}")

    def _gateway(self, port: int, cpus: str, log: str) -> subprocess.Popen[bytes]:
        args = ["taskset", "-c", cpus, sys.executable, "-m", "dsec.cluster", "gateway",
                "--listen", f"127.0.0.1:{port}", "--db", self.dsn, "--jobs", str(self.base / "jobs.json"),
                "--nodes-from", self.fleet.control + "/fleet/membership", "--admission-wait", "600",
                "--log-level", "WARNING"]
        with (self.base / log).open("ab") as out:
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def start_second(self, timeout: float = 300.0) -> str:
        """A second replica on the other cores; its URL once the two hold half the cells each."""
        import psycopg

        port = free_port()
        self.second = self._gateway(port, self.others, "gateway2.log")
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, autocommit=True) as db:
            while time.monotonic() < deadline:
                if self.second.poll() is not None:
                    raise RuntimeError(f"the second replica exited with {self.second.returncode}")
                held = db.execute("SELECT owner, count(*) FROM dsec_cluster_cells WHERE expires > dsec_now() "
                                  "GROUP BY owner").fetchall()
                if len(held) == 2 and max(n for _, n in held) - min(n for _, n in held) <= 1:
                    time.sleep(3.0)  # the cells handed over are reconciled before they are placed on
                    return f"http://127.0.0.1:{port}"
                time.sleep(0.5)
        raise RuntimeError(f"the two replicas did not share the cells within {timeout:g} s")

    def kill_second(self) -> None:
        if self.second is not None and self.second.poll() is None:
            os.killpg(self.second.pid, 9)
            self.second.wait()

    def alive_nodes(self) -> int:
        return sum(1 for n in self.fleet.membership() if n["alive"])

    def kill_gateway(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.base / "gateway.log").read_text(errors="replace").splitlines()[-lines:])
        return ""

    def metric(self, name: str) -> float:
        op = NodeAPI.metrics_text
        text = httpx.request(op.method, self.url + op.path, headers={"Authorization": f"Bearer {self.admin}"},
                             timeout=60).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise ValueError(f"no metric {name}")

    def gateway_cpu(self) -> float:
        assert self.proc is not None
        return tree_cpu(self.proc.pid)[0]

    def pg_cpu(self) -> float:
        """CPU seconds of the PostgreSQL server and its backends so far (0 when its process is unknown)."""
        return sum(tree_cpu(self.pg_pid)) if self.pg_pid is not None else 0.0

    def load(self, kind: str, **kw: Any) -> dict[str, Any]:
        """Run a :mod:`dsec.bench.sim_load` client process on the other cores; its JSON answer."""
        # "--name=value": a token may begin with "-", which argparse would take for an option.
        argv = [sys.executable, "-m", "dsec.bench.sim_load", kind, f"--url={kw.pop('url', self.url)}",
                f"--token={kw.pop('token', self.token)}", f"--spec={kw.pop('spec', json.dumps(SPEC))}",
                f"--cpus={self.others}"]
        argv += [f"--{key}={value}" for key, value in kw.items()]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the bench client failed: {done.stderr[-2000:]}")
        return dict(json.loads(done.stdout))


@contextlib.contextmanager
def _environment(cfg: ClusterSimBench, nodes: int, progress: Callable[[str], None]) -> Iterator[_Env]:
    from dsec.testing.postgres import postgres_server

    base = Path(tempfile.mkdtemp(prefix="dsec-sim-"))
    with postgres_server() as pg:
        env = _Env(cfg, nodes, pg.dsn, base, progress, pg.pid)
        env.fleet.start()
        try:
            yield env
        finally:
            env.kill_second()
            env.kill_gateway()
            env.fleet.stop()
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def _idle(env: _Env) -> dict[str, Any]:
    before, start = env.gateway_cpu(), time.perf_counter()
    time.sleep(env.cfg.idle_seconds)
    return {"cpu_share": (env.gateway_cpu() - before) / (time.perf_counter() - start)}


def _batch(env: _Env) -> dict[str, Any]:
    cpu0 = env.gateway_cpu()
    got = env.load("batch", count=env.cfg.batch)
    out: dict[str, Any] = {"seconds": got["seconds"], "error": got["error"], "created": len(got["ids"]),
                           "gateway_cpu_s": env.gateway_cpu() - cpu0}
    if got["ids"]:
        ids = env.base / "ids"
        ids.write_text("\n".join(got["ids"]))
        out["destroy"] = env.load("destroy", ids=ids, concurrency=64)
    return out


def _single(env: _Env) -> dict[str, Any]:
    from dsec.bench.sim_load import cpu_by_part, record

    assert env.proc is not None
    seconds = env.cfg.single_seconds
    raw = env.base / "spy.txt"
    spy = record(env.proc.pid, seconds, raw)
    gw0, fleet0, pg0 = env.gateway_cpu(), env.fleet.cpu_seconds(), env.pg_cpu()
    got = env.load("cycles", seconds=seconds, concurrency=env.cfg.concurrency)
    gw, fleet, pg = env.gateway_cpu() - gw0, env.fleet.cpu_seconds() - fleet0, env.pg_cpu() - pg0
    if spy is not None:
        spy.wait(60)
    made = max(len(got["creates"]), 1)
    # What the other core does per create+destroy besides a second replica: the fleet, the client, PostgreSQL.
    return {**got, "rate": len(got["creates"]) / got["wall"], "gateway_cpu_per_create_ms": gw / made * 1000,
            "fleet_cpu_per_create_ms": fleet / made * 1000,
            "client_cpu_per_create_ms": got["client_cpu_s"] / made * 1000,
            "postgresql_cpu_per_create_ms": pg / made * 1000, "parts": cpu_by_part(raw) if raw.exists() else {}}


def _replicas(env: _Env) -> dict[str, Any]:
    """The ``single`` load on one gateway, then on two replicas sharing the cells (workers dealt to both)."""
    assert env.proc is not None
    seconds = env.cfg.single_seconds
    gw0 = env.gateway_cpu()
    one = env.load("cycles", seconds=seconds, concurrency=env.cfg.concurrency)
    one_cpu = env.gateway_cpu() - gw0
    second = env.start_second()
    assert env.second is not None
    gw0, sec0 = env.gateway_cpu(), tree_cpu(env.second.pid)[0]
    two = env.load("cycles", url=f"{env.url},{second}", seconds=seconds, concurrency=env.cfg.concurrency)
    cpus = [env.gateway_cpu() - gw0, tree_cpu(env.second.pid)[0] - sec0]
    env.kill_second()
    rate_one, rate_two = len(one["creates"]) / one["wall"], len(two["creates"]) / two["wall"]
    return {"one": {"rate": rate_one, "failed": one["failed"], "creates": one["creates"],
                    "gateway_cpu_per_create_ms": one_cpu / max(len(one["creates"]), 1) * 1000},
            "two": {"rate": rate_two, "failed": two["failed"], "failures": two["failures"], "creates": two["creates"],
                    "replica_cpu_s": cpus, "cpu_per_create_ms": sum(cpus) / max(len(two["creates"]), 1) * 1000},
            "ratio": rate_two / max(rate_one, 1e-9)}


def _fill(env: _Env) -> dict[str, Any]:
    assert env.proc is not None
    rss0 = env.rss_start  # before any phase: a batch's answers leave the allocator's arenas grown
    made, seconds, errors = 0, 0.0, []
    while made < env.cfg.live:
        n = min(env.cfg.fill_batch, env.cfg.live - made)
        got = env.load("batch", count=n)
        if got["error"]:
            errors.append(got["error"])
            break
        made += len(got["ids"])
        seconds += got["seconds"]
        env.progress(f"{made} live ({got['seconds']:.1f} s for the last {n})")
    rss = _rss_kib(env.proc.pid)
    probe = env.load("probe", seconds=env.cfg.probe_seconds)
    start = time.perf_counter()
    listing = httpx.request(NodeAPI.list.method, env.url + NodeAPI.list.path,
                            headers={"Authorization": f"Bearer {env.admin}"}, timeout=600)
    return {"live": made, "seconds": seconds, "errors": errors, "rss_kib": [rss0, rss],
            "bytes_per_live": (rss - rss0) * 1024 / max(made, 1), "probe": probe["samples"],
            "list_s": time.perf_counter() - start, "list_status": listing.status_code}


def _death(env: _Env) -> dict[str, Any]:
    """A node joins with a thousand times the others' room, takes one batch of an image no node caches (so
    only its load counts: it is the emptiest by far), and dies."""
    cap = {"cpu": 4096.0 * 1000, "memory": 2**54, "slots": {"function": 4_000_000}}
    name = env.fleet.add(1, cap)[0]
    deadline = time.monotonic() + 120
    while env.metric("dsec_cluster_nodes_alive") < env.alive_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    got = env.load("batch", count=env.cfg.dead_node, spec=json.dumps(dict(SPEC, image="death-probe")))
    on_it = len(env.fleet.sandboxes().get(name, {}))
    live0 = env.metric("dsec_cluster_sandboxes_live")
    start = time.perf_counter()
    env.fleet.fault("die", name)
    deadline = time.monotonic() + 300
    while env.metric("dsec_cluster_sandboxes_live") > live0 - on_it and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"on_node": on_it, "batch_error": got["error"], "seconds": time.perf_counter() - start}


def _restart(env: _Env) -> dict[str, Any]:
    """The gateway SIGKILLed and started again on its address (as its supervisor restarts it): time until a
    create is served, asked every 50 ms from this process (a client process each try would add its start)."""
    from dsec.bench.sim_load import Client

    async def first_create(started: float, deadline: float) -> tuple[float, int]:
        client = Client(env.url, env.token, connections=1)
        tries = 0
        try:
            while time.monotonic() < deadline:
                tries += 1
                with contextlib.suppress(Http11Error):
                    status, _ = await client.call(NodeAPI.create, body=json.dumps(SPEC).encode(), timeout=60.0)
                    if status == NodeAPI.create.status:
                        return time.perf_counter() - started, tries
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        raise RuntimeError(f"no create was served within 600 s of the restart:\n{env.log_tail()}")

    env.kill_gateway()
    started = time.perf_counter()
    env.start_gateway(again=True, wait=False)
    first, tries = asyncio.run(first_create(started, time.monotonic() + 600))
    return {"first_create_s": first, "tries": tries}


def _one_size(cfg: ClusterSimBench, nodes: int, progress: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    if cfg.wants("decide"):
        progress(f"{nodes} nodes: placement decisions in-process")
        out["decide"] = _decide(nodes, cfg.batch)
    if not [p for p in PHASES[1:] if cfg.wants(p)]:
        return out
    with _environment(cfg, nodes, progress) as env:
        progress(f"{nodes} nodes: fleet up, starting the gateway")
        out["start_s"] = env.start_gateway()
        progress(f"gateway took its nodes in {out['start_s']:.1f} s")
        for phase, work in (("idle", _idle), ("batch", _batch), ("single", _single), ("replicas", _replicas),
                            ("fill", _fill), ("death", _death), ("restart", _restart)):
            if cfg.wants(phase):
                progress(f"{nodes} nodes: {phase}")
                try:
                    out[phase] = work(env)
                except Exception as exc:  # keep the other phases' figures
                    out[phase] = {"error": f"{type(exc).__name__}: {exc}", "log": env.log_tail()}
        out["fleet"] = env.fleet.statistics()
    return out


def _rows(runs: list[dict[str, Any]]) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    latencies: dict[str, Any] = {}
    for r in runs:
        n = r["nodes"]
        if "decide" in r:
            s = summarize(r["decide"]["single"])
            latencies[f"decision_{n}"] = s
            rows.append(Row(f"{n} nodes: placement decision, one sandbox (p50)", "ms", s.p50 * 1000,
                            target="≤ 0.05 ms at 2,000" if n == 2000 else None,
                            passed=s.p50 <= 50e-6 if n == 2000 else None))
            rows.append(Row(f"{n} nodes: 32,000 batch decided", "s", r["decide"]["batch_s"],
                            target="≤ 0.5 s at 2,000" if n == 2000 else None,
                            passed=r["decide"]["batch_s"] <= 0.5 if n == 2000 else None))
        if "start_s" in r:
            rows.append(Row(f"{n} nodes: gateway start until every node is used", "s", r["start_s"]))
        rows += _env_rows(n, r, latencies)
    return rows, latencies


def _env_rows(n: int, r: dict[str, Any], latencies: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    at2k = n == 2000
    if "error" not in r.get("idle", {"error": 1}):
        share = r["idle"]["cpu_share"] * 100
        rows.append(Row(f"{n} nodes: idle gateway CPU", "% core", share, target="≤ 5%" if at2k else None,
                        passed=share <= 5 if at2k else None))
    b = r.get("batch", {})
    if "seconds" in b:
        ok = not b["error"]
        rows.append(Row(f"{n} nodes: batch end to end", "s", b["seconds"] if ok else None,
                        target="≤ 5 s at 2,000" if at2k else None, passed=(ok and b["seconds"] <= 5) if at2k else None,
                        note=f"gateway CPU {b.get('gateway_cpu_s', 0):.2f} s" if ok else f"refused: {b['error']}"))
    s = r.get("single", {})
    if s.get("creates"):
        lat = summarize(s["creates"])
        latencies[f"single_create_{n}"] = lat
        rows.append(Row(f"{n} nodes: creates + destroys, one gateway core", "/s", s["rate"], better="higher",
                        target="≥ 2,500/s, p99 ≤ 50 ms", passed=s["rate"] >= 2500 and lat.p99 <= 0.05,
                        note=f"p99 {lat.p99 * 1000:.1f} ms, {s['failed']} failed"))
        rows.append(Row(f"{n} nodes: gateway CPU per create+destroy", "ms", s["gateway_cpu_per_create_ms"],
                        note=", ".join(f"{k} {v * 100:.0f}%" for k, v in s["parts"].items())))
        others = {key: s.get(f"{key}_cpu_per_create_ms", 0.0) for key in ("fleet", "client", "postgresql")}
        rows.append(Row(f"{n} nodes: the other cores' CPU per create+destroy (fleet, client, PostgreSQL)", "ms",
                        sum(others.values()), note=", ".join(f"{k} {v:.2f} ms" for k, v in others.items())))
    rp = r.get("replicas", {})
    if "ratio" in rp:
        two = rp["two"]
        rows.append(Row(f"{n} nodes: creates + destroys, 2 replicas vs 1 (same run)", "x", rp["ratio"],
                        better="higher", target="≥ 1.6x", passed=rp["ratio"] >= 1.6,
                        note=f"{rp['one']['rate']:.0f}/s -> {two['rate']:.0f}/s, {two['failed']} failed; "
                             f"CPU per create {rp['one']['gateway_cpu_per_create_ms']:.2f} -> "
                             f"{two['cpu_per_create_ms']:.2f} ms over both"))
    f = r.get("fill", {})
    if f.get("live"):
        rows.append(Row(f"{n} nodes: gateway memory per live sandbox ({f['live']} live)", "KiB",
                        f["bytes_per_live"] / 1024, target="≤ 1 KiB", passed=f["bytes_per_live"] <= 1024))
        if f["probe"]:
            worst = max(f["probe"]) * 1000
            rows.append(Row(f"{n} nodes: longest health answer at {f['live']} live", "ms", worst,
                            target="≤ 50 ms", passed=worst <= 50))
        rows.append(Row(f"{n} nodes: list of every sandbox at {f['live']} live", "s", f["list_s"]))
    d = r.get("death", {})
    if "seconds" in d:
        rows.append(Row(f"{n} nodes: node with {d['on_node']} dies, all reported lost", "s", d["seconds"],
                        target="≤ 2 s", passed=d["seconds"] <= 2))
    rs = r.get("restart", {})
    if "first_create_s" in rs:
        rows.append(Row(f"{n} nodes: restart, first create served", "s", rs["first_create_s"],
                        target="≤ 10 s", passed=rs["first_create_s"] <= 10))
    return rows


def run(cfg: ClusterSimBench, progress: Callable[[str], None] = lambda _m: None) -> Suite:
    """Every fleet size of ``cfg``, one after the other; the suite of rows."""
    from dsec.testing.postgres import pg_bin

    if pg_bin() is None:
        raise BenchUnavailable("PostgreSQL is not installed: apt-get install postgresql (./scripts/setup)")
    unknown = [p for p in cfg.phases if p not in PHASES]
    if unknown:
        raise BenchUnavailable(f"unknown cluster-sim phase {unknown[0]!r}; known: {', '.join(PHASES)}")
    runs = []
    for nodes in cfg.nodes:
        runs.append(_one_size(cfg, nodes, progress))
    suite = Suite(name="cluster-sim")
    suite.rows, suite.latencies = _rows(runs)
    for r in runs:  # raw samples are summarised above; keep the JSON readable
        parts = [r.get(key) for key in ("decide", "single", "fill")]
        parts += [r["replicas"].get(key) for key in ("one", "two")] if isinstance(r.get("replicas"), dict) else []
        for part in parts:
            for field in ("single", "creates", "destroys", "probe"):
                if isinstance(part, dict) and field in part:
                    samples = part.pop(field)
                    part[field + "_summary"] = asdict(summarize(samples)) if samples else None
    suite.extra = {"config": asdict(cfg), "runs": runs, "load_average": list(os.getloadavg()),
                   "cores": len(os.sched_getaffinity(0))}
    return suite
