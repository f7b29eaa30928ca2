"""The load side of ``dsec bench cluster-sim``: creates, destroys and probes sent to a gateway, cheaply.

Owns the bench's client: raw HTTP/1.1 requests on the keep-alive connections of the node API's client
(:mod:`dsec._http.http11`), each operation's method, route and success status taken from
:class:`~dsec.api.protocol.NodeAPI` (the contract the SDK and the server share), bodies serialised once,
answers read with ``json.loads``, so that one client process on the shared core can keep a gateway busy;
and the gateway's CPU split by part from py-spy's samples. It runs in its own process
(``python -m dsec.bench.sim_load``, one JSON document on stdout), pinned away from the gateway. It
measures; it must never decide whether a target is met.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dsec._http.http11 import Http11Error, Http11Pool
from dsec.api.operations import Operation
from dsec.api.protocol import NodeAPI

__all__ = ["Client", "cpu_by_part", "main"]


class Client:
    """Raw requests to one gateway with a job token, on a keep-alive pool of ``connections``."""

    def __init__(self, url: str, token: str, connections: int = 256) -> None:
        parts = urlsplit(url)
        self.host = parts.netloc
        self.pool = Http11Pool(host=parts.hostname or "", port=parts.port or 80, max_connections=connections,
                             keepalive_expiry=20.0)
        self.auth = f"Authorization: Bearer {token}\r\n"

    async def call(self, op: Operation[Any, Any], *in_path: str, body: bytes = b"", timeout: float | None = 600.0
                   ) -> tuple[int, bytes]:
        """One call of ``op`` (``in_path``: its path arguments; ``body``: its JSON, serialised once by the
        caller); the answer's status and body."""
        method = op.method
        path = op.encode(in_path, {})[0] if in_path else op.path
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.auth}"
        if body or method in ("POST", "PUT"):
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return await self.pool.request(head.encode() + b"\r\n" + body, connect_timeout=30.0, read_timeout=timeout)

    async def aclose(self) -> None:
        await self.pool.aclose()


def _error(status: int, body: bytes) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        err = json.loads(body)["error"]
        return f"{err['type']}: {err['message']}"[:240]
    return f"HTTP {status}: {body[:200]!r}"


async def cycles(url: str, token: str, spec: bytes, seconds: float, concurrency: int) -> dict[str, Any]:
    """``concurrency`` workers each create a sandbox then destroy it, for ``seconds``: latencies and counts.
    ``url``: one gateway, or several (comma-separated replicas) that the workers are dealt to in turn."""
    clients = [Client(one, token, connections=concurrency * 2) for one in url.split(",")]
    creates: list[float] = []
    destroys: list[float] = []
    failures: Counter[str] = Counter()
    deadline = time.monotonic() + seconds

    async def worker(client: Client) -> None:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                status, body = await client.call(NodeAPI.create, body=spec, timeout=120.0)
            except Http11Error as exc:
                failures[f"create: {exc.kind}: {exc}"[:200]] += 1
                continue
            made = time.perf_counter()
            if status != NodeAPI.create.status:
                failures[f"create: {_error(status, body)}"] += 1
                await asyncio.sleep(0.05)
                continue
            creates.append(made - start)
            sid = json.loads(body)["id"]
            try:
                status, body = await client.call(NodeAPI.destroy, sid, timeout=120.0)
            except Http11Error as exc:
                failures[f"destroy: {exc.kind}: {exc}"[:200]] += 1
                continue
            if status != NodeAPI.destroy.status:
                failures[f"destroy: {_error(status, body)}"] += 1
            destroys.append(time.perf_counter() - made)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    for client in clients:
        await client.aclose()
    return {"creates": creates, "destroys": destroys, "wall": wall, "failures": dict(failures.most_common(10)),
            "failed": sum(failures.values()), "client_cpu_s": cpu}


async def batch(url: str, token: str, spec: dict[str, Any], count: int, stream: bool = False) -> dict[str, Any]:
    """One batch create of ``count`` through the gateway: time to the whole answer, the ids (or the error)."""
    client = Client(url, token, connections=4)
    body = json.dumps({"count": count, "spec": spec}).encode()
    start = time.perf_counter()
    try:
        status, answer = await client.call(NodeAPI.create_many, body=body, timeout=900.0)
    except Http11Error as exc:
        return {"seconds": time.perf_counter() - start, "error": f"{exc.kind}: {exc}", "ids": []}
    finally:
        await client.aclose()
    seconds = time.perf_counter() - start
    if status != NodeAPI.create_many.status:
        return {"seconds": seconds, "error": _error(status, answer), "ids": []}
    return {"seconds": seconds, "error": None, "ids": [item["id"] for item in json.loads(answer)]}


async def destroy_all(url: str, token: str, ids: list[str], concurrency: int = 64) -> dict[str, Any]:
    """Destroy ``ids`` one request each, ``concurrency`` at a time: seconds and failures."""
    client = Client(url, token, connections=concurrency)
    todo = list(ids)
    failed = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal failed
        while todo:
            sid = todo.pop()
            try:
                status, _ = await client.call(NodeAPI.destroy, sid, timeout=120.0)
            except Http11Error:
                failed += 1
                continue
            failed += status != NodeAPI.destroy.status

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return {"seconds": time.perf_counter() - start, "failed": failed}


async def probe(url: str, token: str, seconds: float, interval: float = 0.01) -> dict[str, Any]:
    """``GET /v1/health`` every ``interval`` for ``seconds``: each round trip (a stalled event loop shows as
    one long answer)."""
    client = Client(url, token, connections=1)
    samples: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        with contextlib.suppress(Http11Error):
            await client.call(NodeAPI.health, timeout=60.0)
            samples.append(time.perf_counter() - start)
        await asyncio.sleep(interval)
    await client.aclose()
    return {"samples": samples}


_CONTEXTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("events", ("_follow_node",)), ("postgresql", ("psycopg", "cluster/state.py")))
"""Parts named by any frame of a sample: the node event streams, the state writer (their reads and writes are
theirs, whatever the innermost frame)."""
_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (("placement", ("cluster/placement.py", "cluster/spread.py")),
          ("forward", ("_http/", "api/client.py", "api/operations.py", "httpx", "httpcore")),
          ("gateway", ("cluster/gateway", "cluster/records.py", "cluster/authority.py", "cluster/cells.py",
                       "cluster/replica.py", "cluster/surface.py", "daemon/auth.py")),
          ("http", ("uvicorn", "starlette", "fastapi", "daemon/app.py", "api/binding.py", "cluster/server.py",
                    "cluster/router.py", "cluster/front.py", "h11")))
"""Parts named by the innermost frame of a sample that is one of theirs (a request's parse is HTTP, the
engine call it makes the gateway's, a node call the forward)."""


def cpu_by_part(raw: Path) -> dict[str, float]:
    """Shares of py-spy samples (``--format raw``: collapsed stacks, outermost frame first) by part of the
    gateway: HTTP serving (the request's parse and answer), placement, the forward to nodes, PostgreSQL, node
    events, the rest of the gateway's own code, and the event loop and libraries under none of these."""
    parts: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            parts[_part(stack.split(";"))] += int(count)
    total = sum(parts.values()) or 1
    return {name: n / total for name, n in parts.most_common()}


def _part(frames: list[str]) -> str:
    for name, needles in _CONTEXTS:
        if any(needle in frame for frame in frames for needle in needles):
            return name
    for frame in reversed(frames):
        if "asyncio/runners.py" in frame:  # the loop itself (its callbacks' C code): what runs it is not a part
            break
        for name, needles in _PARTS:
            if any(needle in frame for needle in needles):
                return name
    return "loop"


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Start py-spy sampling ``pid`` for ``seconds`` into ``out`` (None when py-spy is not installed)."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return None
    return subprocess.Popen([str(spy), "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200",
                             "-f", "raw", "-o", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.bench.sim_load KIND --url URL --token T ...``: one JSON document on stdout."""
    parser = argparse.ArgumentParser(prog="python -m dsec.bench.sim_load")
    parser.add_argument("kind", choices=["cycles", "batch", "destroy", "probe"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--spec", default="{}", help="SandboxSpec JSON")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--ids", type=Path, help="file of sandbox ids, one a line (destroy)")
    parser.add_argument("--cpus", default="", help="pin this process to these CPUs (comma list)")
    args = parser.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from dsec.daemon.server import loop_factory

    spec = json.loads(args.spec)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        if args.kind == "cycles":
            result = runner.run(cycles(args.url, args.token, json.dumps(spec).encode(), args.seconds,
                                       args.concurrency))
        elif args.kind == "batch":
            result = runner.run(batch(args.url, args.token, spec, args.count))
        elif args.kind == "destroy":
            ids = args.ids.read_text().split() if args.ids else []
            result = runner.run(destroy_all(args.url, args.token, ids, args.concurrency))
        else:
            result = runner.run(probe(args.url, args.token, args.seconds))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
