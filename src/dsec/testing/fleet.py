"""A fleet simulator: one lightweight process that answers the node API as N node daemons would.

Owns the simulated nodes of ``dsec bench cluster-sim`` and of the cluster invariant tests: each node
listens on its own loopback address (``127.1.x.y``, any free port) and answers the node API a gateway
calls -- health, create and batch create, destroy and batch destroy, info, list, the lifecycle event
stream with its ``node`` events (image cache, drain) -- at once,
from byte templates (no pydantic, no FastAPI, no sandbox), so that thousands of them fit in one process
and a gateway in front of them is the only thing doing real work. Each node keeps its own count of what
it holds against the capacity it reported: a create that would put it over is refused and counted
(``over_capacity``), which is the invariant "no node is ever over capacity" measured by the fleet itself.

Faults: a node dies (stops listening, drops its connections, loses its sandboxes; membership reports it
dead), drains (refuses creates with ``DaemonStopping`` and ``kept=0``, as a daemon that stops does), is
slow (answers after a delay), the whole fleet has extra latency, or a node's event stream lags (the next
events are dropped for its subscribers, who get one ``lagged`` event instead).

A control API on its own address (``/fleet/...``) reports membership (what Ray would say), statistics
(the process's CPU, counts) and every node's sandboxes, and takes faults. :class:`FleetProcess` runs the
fleet as a child process and speaks that API. This module must never run a sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import httpx

from dsec.bench.cpu import tree_cpu
from dsec.daemon.server import loop_factory
from dsec.models import id_hash
from dsec.testing.fleet_http import Answer, HttpConnection, Request, Stream, close_all, serve_http

__all__ = ["Fleet", "FleetProcess", "SimNode", "main", "node_address"]

JOB_LABEL = "dsec.job"
BATCH_LABEL = "dsec.batch"

_NOT_FOUND = b'{"error":{"type":"SandboxNotFound","message":"no sandbox %s","detail":{"sandbox_id":"%s"}}}'
_UNAUTHORIZED = b'{"error":{"type":"Unauthorized","message":"missing or wrong token","detail":{}}}'
_INFO = (b'{"id":"%s","backend":"%s","image":%s,"state":"running","created_at":%.6f,"expires_at":%.6f,'
         b'"labels":%s,"spec":%s,"node":"%s"}')
_EVENT = (b'{"seq":%d,"at":%.6f,"kind":"%s","sandbox_id":"%s","backend":"%s","image":%s,"labels":%s,'
          b'"node":"%s"}\n')


def _error(kind: str, message: str, **detail: Any) -> bytes:
    return json.dumps({"error": {"type": kind, "message": message, "detail": detail}}).encode()


def node_address(index: int) -> str:
    """The loopback address of simulated node ``index`` (127.1.0.1, 127.1.0.2, ...; 250 per /24)."""
    return f"127.{1 + index // 62_500}.{index // 250 % 250}.{index % 250 + 1}"


@dataclass(slots=True)
class _Sandbox:
    spec: bytes
    """The spec's JSON as the node answers it (one object shared by a whole batch)."""
    backend: bytes
    image: bytes
    labels: bytes
    cpu: float
    memory: int
    job: str | None
    batch: str | None
    created: float
    expires: float


@dataclass
class _Subscriber:
    queue: asyncio.Queue[bytes]


@dataclass
class SimNode:
    """One simulated node daemon."""

    name: str
    host: str
    token: str
    capacity: dict[str, Any]
    alive: bool = True
    reason: str | None = None
    draining: bool = False
    delay: float = 0.0
    port: int = 0
    sandboxes: dict[str, _Sandbox] = field(default_factory=dict)
    cpu: float = 0.0
    memory: int = 0
    live: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    over_capacity: int = 0
    """Creates refused because they would have put the node over the capacity it reported."""
    requests: int = 0
    seq: int = 0
    history: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=2000))
    subscribers: list[_Subscriber] = field(default_factory=list)
    lag_next: int = 0
    """Events still to drop for every subscriber (the lag fault); then one ``lagged`` event."""
    lag_dropped: int = 0
    lag_from: int = 0
    placed: int = 0
    """Sandboxes with a job label (made through a gateway), and the XOR of their ids' hashes: what
    ``/v1/health`` reports as ``placed`` and ``digest``."""
    digest: int = 0
    fences: dict[str, int] = field(default_factory=dict)
    """Cell -> the newest lease epoch a request named (``X-DSec-Fence``); older creates are refused."""
    fenced: int = 0
    """Creates refused for an old fence (a count)."""
    images: dict[str, int] = field(default_factory=dict)
    """Images this node has created sandboxes of (its cache, as ``/v1/health`` reports it)."""
    server: asyncio.Server | None = None
    connections: set[HttpConnection] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- capacity ------------------------------------------------------------------------------------------

    def _fits(self, count: int, backend: str, cpu: float, memory: int) -> bool:
        slots = int(self.capacity.get("slots", {}).get(backend, 0))
        return (self.live.get(backend, 0) + count <= slots
                and self.cpu + count * cpu <= float(self.capacity.get("cpu", 0)) + 1e-6
                and self.memory + count * memory <= int(self.capacity.get("memory", 0)))

    def _add(self, sid: str, sb: _Sandbox) -> None:
        self.sandboxes[sid] = sb
        backend = sb.backend.decode()
        self.live[backend] = self.live.get(backend, 0) + 1
        self.cpu += sb.cpu
        self.memory += sb.memory
        self.peak = max(self.peak, len(self.sandboxes))
        if sb.job is not None:
            self.placed += 1
            self.digest ^= id_hash(sid)
        self._publish(b"created", sid, sb)

    def _remove(self, sid: str, kind: bytes = b"destroyed") -> _Sandbox | None:
        sb = self.sandboxes.pop(sid, None)
        if sb is not None:
            backend = sb.backend.decode()
            self.live[backend] -= 1
            self.cpu = max(0.0, self.cpu - sb.cpu)
            self.memory = max(0, self.memory - sb.memory)
            if sb.job is not None:
                self.placed -= 1
                self.digest ^= id_hash(sid)
            self._publish(kind, sid, sb)
        return sb

    def expire(self, count: int) -> int:
        """The oldest ``count`` sandboxes pass their timeout: destroyed by the node, an ``expired`` event each."""
        ids = list(self.sandboxes)[:count]
        for sid in ids:
            self._remove(sid, b"expired")
        return len(ids)

    # -- events --------------------------------------------------------------------------------------------

    def _publish(self, kind: bytes, sid: str, sb: _Sandbox) -> None:
        self.seq += 1
        line = _EVENT % (self.seq, time.time(), kind, sid.encode(), sb.backend, sb.image, sb.labels,
                         self.name.encode())
        self.history.append((self.seq, line))
        if self.lag_next > 0:
            if not self.lag_dropped:
                self.lag_from = self.seq
                # As a node's event bus does: the notice follows the burst, once the subscriber catches up.
                asyncio.get_running_loop().call_soon(self._lagged)
            self.lag_next -= 1
            self.lag_dropped += 1
            return
        for sub in self.subscribers:
            sub.queue.put_nowait(line)

    def _state(self) -> bytes:
        """The node's state as a ``node`` event (its image cache, whether it drains)."""
        return json.dumps({"seq": self.seq, "at": time.time(), "kind": "node", "node": self.name, "detail": {
            "images": self.images, "stopping": "the simulated node drains" if self.draining else None,
        }}).encode() + b"\n"

    def publish_state(self) -> None:
        """Say the node's state on its stream (its image cache or drain changed), as a node daemon does."""
        self.seq += 1
        line = self._state()
        self.history.append((self.seq, line))
        for sub in self.subscribers:
            sub.queue.put_nowait(line)

    def _lagged(self) -> None:
        lagged = json.dumps({"seq": self.lag_from, "at": time.time(), "kind": "lagged", "node": self.name,
                             "reason": "this subscriber read too slowly",
                             "detail": {"dropped": self.lag_dropped}}).encode() + b"\n"
        self.lag_dropped = self.lag_next = 0
        for sub in self.subscribers:
            sub.queue.put_nowait(lagged)

    def _events(self, request: Request) -> Stream:
        since = int(request.query.get("since", "0") or 0)
        sub = _Subscriber(asyncio.Queue())
        self.subscribers.append(sub)

        def closed() -> None:
            with contextlib.suppress(ValueError):
                self.subscribers.remove(sub)

        first = [self._state()] if request.query.get("node_state") == "true" else []
        return Stream(first + [line for seq, line in self.history if seq > since], sub.queue, closed)

    # -- the node API --------------------------------------------------------------------------------------

    def handle(self, request: Request, _conn: HttpConnection) -> Answer | Stream:
        """Answer one request of the node API (what a gateway calls)."""
        self.requests += 1
        delay = self.delay + _FLEET_LATENCY[0]
        path = request.path
        if path == "/v1/health":
            return Answer(200, self._health(), delay)
        if request.headers.get(b"authorization") != b"Bearer " + self.token.encode():
            return Answer(401, _UNAUTHORIZED, delay)
        if path == "/v1/events":
            return self._events(request)
        method = request.method
        fence = request.headers.get(b"x-dsec-fence")
        if fence is not None and not self._fence_ok(fence.decode()):
            self.fenced += 1
            return Answer(409, _error("Fenced", f"node {self.name} has seen a newer lease on cell {fence.decode()}: "
                                                "this gateway replica no longer owns it"), delay)
        try:
            if path == "/v1/sandboxes":
                if method == "POST":
                    return Answer(*self._create(request.body, 1, single=True), delay)
                return Answer(200, self._list(request.query), delay)
            if path == "/v1/sandboxes/batch" and method == "POST":
                raw = json.loads(request.body)
                return Answer(*self._create(json.dumps(raw["spec"], separators=(",", ":")).encode(),
                                            int(raw["count"]), single=False), delay)
            if path == "/v1/sandboxes/destroy" and method == "POST":
                return Answer(200, self._destroy_many(json.loads(request.body)), delay)
            if path.startswith("/v1/sandboxes/"):
                sid = path[len("/v1/sandboxes/"):]
                if method == "DELETE":
                    if self._remove(sid) is None:
                        return Answer(404, _NOT_FOUND % (sid.encode(), sid.encode()), delay)
                    return Answer(204, None, delay)
                if method == "GET" and sid in self.sandboxes:
                    return Answer(200, self._info(sid, self.sandboxes[sid]), delay)
                return Answer(404, _NOT_FOUND % (sid.encode(), sid.encode()), delay)
        except (ValueError, KeyError, TypeError) as exc:
            return Answer(400, _error("InvalidRequest", f"the simulated node could not read the body: {exc}"), delay)
        return Answer(404, _error("NotFound", f"the simulated node has no route {method} {path}"), delay)

    def _destroy_many(self, raw: dict[str, Any]) -> bytes:
        job = raw.get("job")
        destroyed: list[str] = []
        missing: list[str] = []
        for sid in raw["ids"]:
            sb = self.sandboxes.get(sid)
            if sb is None or (job is not None and sb.job != job):
                missing.append(sid)
            else:
                self._remove(sid)
                destroyed.append(sid)
        return json.dumps({"destroyed": destroyed, "missing": missing, "failed": {}}).encode()

    def _fence_ok(self, fence: str) -> bool:
        cell, _, raw = fence.partition(":")
        epoch = int(raw or 0)
        if epoch < self.fences.get(cell, 0):
            return False
        self.fences[cell] = epoch
        return True

    def _health(self) -> bytes:
        slots = self.capacity.get("slots", {})
        return json.dumps({
            "node": self.name, "version": "sim", "backends": {b: "ok" for b, n in slots.items() if n},
            "sandboxes": len(self.sandboxes), "images": self.images,
            "stopping": "the simulated node drains" if self.draining else None,
            "placed": self.placed, "digest": f"{self.digest:016x}",
        }).encode()

    def _info(self, sid: str, sb: _Sandbox) -> bytes:
        return _INFO % (sid.encode(), sb.backend, sb.image, sb.created, sb.expires, sb.labels, sb.spec,
                        self.name.encode())

    def _list(self, query: dict[str, str]) -> bytes:
        wanted = query.get("label")
        key, _, value = (wanted or "").partition("=")
        items = [self._info(sid, sb) for sid, sb in self.sandboxes.items()
                 if wanted is None or json.loads(sb.labels).get(key) == value]
        return b"[" + b",".join(items) + b"]"

    def _create(self, spec_json: bytes, count: int, *, single: bool) -> tuple[int, bytes]:
        if self.draining:
            return 503, _error("DaemonStopping", f"node {self.name} is stopping: creates are refused", kept=0)
        spec = json.loads(spec_json)
        backend = str(spec.get("backend", "container"))
        cpu = float(spec.get("cpu", 1.0))
        memory = spec.get("memory", 1024**3)
        if not isinstance(memory, int) or count < 1:
            raise ValueError("memory must be a number of bytes and count at least 1")
        if not self._fits(count, backend, cpu, memory):
            self.over_capacity += 1
            return 429, _error("QuotaExceeded", f"node {self.name} would be over its capacity with {count} more "
                                                f"{backend} sandbox(es)", node=self.name)
        labels = spec.get("labels") or {}
        if spec.get("image") and str(spec["image"]) not in self.images:
            self.images[str(spec["image"])] = 1 << 20
            self.publish_state()
        now = time.time()
        template = _Sandbox(spec_json, backend.encode(), json.dumps(spec.get("image")).encode(),
                            json.dumps(labels, separators=(",", ":")).encode(), cpu, memory,
                            labels.get(JOB_LABEL), labels.get(BATCH_LABEL), now, now + float(spec.get("timeout", 3600)))
        made = []
        for _ in range(count):
            sid = "sb-" + secrets.token_hex(6)
            self._add(sid, template)
            made.append(self._info(sid, template))
        if single:
            return 201, made[0]
        return 201, b"[" + b",".join(made) + b"]"

    # -- faults --------------------------------------------------------------------------------------------

    def die(self, reason: str) -> int:
        """Stop answering for good: the listener and every connection go, and so do its sandboxes."""
        self.alive, self.reason = False, reason
        if self.server is not None:
            close_all(self.server, self.connections)
        lost = len(self.sandboxes)
        self.sandboxes.clear()
        self.live.clear()
        self.cpu, self.memory, self.placed, self.digest = 0.0, 0, 0, 0
        return lost


_FLEET_LATENCY = [0.0]
"""Extra seconds every simulated node waits before answering (the ``latency`` fault)."""


class Fleet:
    """N simulated nodes and the control API (``/fleet/...``) in the running event loop."""

    def __init__(self, nodes: int, capacity: dict[str, Any], *, first: int = 0) -> None:
        self.capacity = capacity
        self.nodes: dict[str, SimNode] = {}
        self._next = first
        self._want = nodes
        self.control_url = ""
        self.version = 0
        """Bumped whenever membership changes (its ETag)."""
        self._control: asyncio.Server | None = None

    async def start(self, control_host: str = "127.0.0.1") -> None:
        """Bind every node's listener and the control API."""
        await self.add(self._want)
        server, _ = await serve_http(self._control_handle, control_host, 0)
        self._control = server
        self.control_url = f"http://{control_host}:{server.sockets[0].getsockname()[1]}"

    async def add(self, count: int, capacity: dict[str, Any] | None = None) -> list[str]:
        """``count`` more nodes (they join: membership reports them alive), with the fleet's capacity or
        ``capacity``."""
        names = []
        for _ in range(count):
            index = self._next
            self._next += 1
            node = SimNode(f"sim-{index:05d}", node_address(index), f"simtoken-{index}-{secrets.token_hex(8)}",
                           json.loads(json.dumps(capacity or self.capacity)))
            node.server, node.connections = await serve_http(node.handle, node.host, 0)
            node.port = int(node.server.sockets[0].getsockname()[1])
            self.nodes[node.name] = node
            names.append(node.name)
        self.version += 1
        return names

    def membership(self) -> list[dict[str, Any]]:
        """What Ray would report: every node, alive or dead (with why), and how to reach the live ones."""
        return [{"name": n.name, "alive": n.alive, "url": n.url if n.alive else None,
                 "token": n.token if n.alive else None, "capacity": n.capacity, "reason": n.reason}
                for n in self.nodes.values()]

    def statistics(self) -> dict[str, Any]:
        """The process's CPU and the fleet's counts (the invariant ``over_capacity`` among them)."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        alive = [n for n in self.nodes.values() if n.alive]
        return {"cpu_user": usage.ru_utime, "cpu_system": usage.ru_stime, "nodes": len(self.nodes),
                "alive": len(alive), "live": sum(len(n.sandboxes) for n in alive),
                "over_capacity": sum(n.over_capacity for n in self.nodes.values()),
                "fenced": sum(n.fenced for n in self.nodes.values()),
                "requests": sum(n.requests for n in self.nodes.values()),
                "peak": max((n.peak for n in self.nodes.values()), default=0),
                "max_rss_kib": usage.ru_maxrss}

    def sandboxes(self) -> dict[str, dict[str, list[str | None]]]:
        """Every live node's sandboxes: node -> sandbox id -> [job label, batch label]."""
        return {n.name: {sid: [sb.job, sb.batch] for sid, sb in n.sandboxes.items()}
                for n in self.nodes.values() if n.alive}

    def fault(self, kind: str, node: str | None, value: float) -> dict[str, Any]:
        """Inject one fault (see the module docstring); what it did."""
        if kind == "latency":
            _FLEET_LATENCY[0] = value
            return {"latency": value}
        target = self.nodes.get(node or "")
        if target is None:
            raise KeyError(f"no simulated node {node!r}")
        if kind == "die":
            self.version += 1
            return {"lost": target.die(f"node {target.name} was killed by the fleet simulator")}
        if kind == "drain":
            target.draining = bool(value)
            target.publish_state()
        elif kind == "slow":
            target.delay = value
        elif kind == "lag":
            target.lag_next = int(value)
        elif kind == "expire":
            return {"node": target.name, "expired": target.expire(int(value))}
        else:
            raise KeyError(f"unknown fault {kind!r}: die, drain, slow, latency, lag or expire")
        return {"node": target.name, kind: value}

    def _control_handle(self, request: Request, _conn: HttpConnection) -> Answer | Awaitable[Answer]:
        if request.path == "/fleet/membership":
            version = f"{self.version}"
            if request.headers.get(b"if-none-match") == f'"{version}"'.encode():
                return Answer(304)
            return Answer(200, json.dumps(self.membership()).encode(), etag=version)
        if request.path == "/fleet/add" and request.method == "POST":
            raw = json.loads(request.body or b"{}")
            return self._add_answer(int(raw.get("count", 1)), raw.get("capacity"))
        try:
            return Answer(200, json.dumps(self._control_answer(request)).encode())
        except KeyError as exc:
            return Answer(404, _error("NotFound", str(exc.args[0])))
        except (ValueError, TypeError) as exc:
            return Answer(400, _error("InvalidRequest", str(exc)))

    async def _add_answer(self, count: int, capacity: dict[str, Any] | None) -> Answer:
        return Answer(200, json.dumps({"added": await self.add(count, capacity)}).encode())

    def _control_answer(self, request: Request) -> Any:
        path = request.path
        if path == "/fleet/membership":
            return self.membership()
        if path == "/fleet/stats":
            return self.statistics()
        if path == "/fleet/sandboxes":
            return self.sandboxes()
        if path == "/fleet/fault" and request.method == "POST":
            raw = json.loads(request.body)
            return self.fault(str(raw["kind"]), raw.get("node"), float(raw.get("value", 1.0)))
        raise KeyError(f"no control route {request.method} {path}")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (1 << 20, 262_144, 65_536, hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))
            return


async def _run(nodes: int, capacity: dict[str, Any]) -> None:
    _raise_fd_limit()
    fleet = Fleet(nodes, capacity)
    await fleet.start()
    print(json.dumps({"control": fleet.control_url, "nodes": len(fleet.nodes)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.testing.fleet --nodes N``: print the control URL as one JSON line, serve until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m dsec.testing.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True, help="how many node daemons to simulate")
    parser.add_argument("--capacity", default='{"cpu": 4096, "memory": 17592186044416, "slots": {"function": 4000}}',
                        help="JSON capacity every node reports and enforces (cpu, memory bytes, slots per backend)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_run(args.nodes, json.loads(args.capacity)))
    return 0


class FleetProcess:
    """The fleet as a child process (its CPU is then its own), and a client of its control API."""

    def __init__(self, nodes: int, capacity: dict[str, Any] | None = None, *, cpus: set[int] | None = None) -> None:
        self.nodes = nodes
        self.capacity = capacity or {"cpu": 4096.0, "memory": 2**44, "slots": {"function": 4000}}
        self.cpus = cpus
        self.proc: subprocess.Popen[str] | None = None
        self.control = ""
        self._http: httpx.Client | None = None

    def _pin(self) -> None:
        os.sched_setaffinity(0, self.cpus or set())

    def start(self, timeout: float = 300.0) -> None:
        """Start it and wait until every node listens."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsec.testing.fleet", "--nodes", str(self.nodes),
             "--capacity", json.dumps(self.capacity)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
            preexec_fn=self._pin if self.cpus else None)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and not line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"the fleet simulator exited with {self.proc.returncode}")
        self.control = json.loads(line)["control"]
        self._http = httpx.Client(base_url=self.control, timeout=60)

    def stop(self) -> None:
        """SIGTERM it and wait (SIGKILL after 10 s)."""
        if self._http is not None:
            self._http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> FleetProcess:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _get(self, path: str) -> Any:
        assert self._http is not None, "start the fleet first"
        response = self._http.get(path)
        response.raise_for_status()
        return response.json()

    def membership(self) -> list[dict[str, Any]]:
        """Every node as Ray would report it."""
        return list(self._get("/fleet/membership"))

    def statistics(self) -> dict[str, Any]:
        """CPU and counts (see :meth:`Fleet.statistics`)."""
        return dict(self._get("/fleet/stats"))

    def sandboxes(self) -> dict[str, dict[str, list[str | None]]]:
        """node -> sandbox id -> [job, batch], for every live node."""
        return dict(self._get("/fleet/sandboxes"))

    def fault(self, kind: str, node: str | None = None, value: float = 1.0) -> dict[str, Any]:
        """Inject a fault: ``die``, ``drain`` (value 0 ends it), ``slow`` (seconds), ``latency`` (seconds,
        fleet-wide), ``lag`` (events to drop) or ``expire`` (sandboxes the node times out)."""
        assert self._http is not None, "start the fleet first"
        response = self._http.post("/fleet/fault", json={"kind": kind, "node": node, "value": value})
        response.raise_for_status()
        return dict(response.json())

    def cpu_seconds(self) -> float:
        """User + system CPU of the fleet process so far (from /proc, all its threads)."""
        assert self.proc is not None
        return tree_cpu(self.proc.pid)[0]

    def add(self, count: int, capacity: dict[str, Any] | None = None) -> list[str]:
        """``count`` more nodes join (with the fleet's capacity, or ``capacity``); their names."""
        assert self._http is not None, "start the fleet first"
        response = self._http.post("/fleet/add", json={"count": count, "capacity": capacity})
        response.raise_for_status()
        return list(response.json()["added"])


if __name__ == "__main__":
    raise SystemExit(main())
