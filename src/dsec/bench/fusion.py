"""The function suite's ``run_code`` phase: SandboxFusion's ``/run_code`` on a daemon against a bare
``subprocess.run(["python3", "-c", code])`` on the host, in the same run.

Owns the daemon with a SandboxFusion listener (a process of its own, as ``dsec serve --sandbox-fusion``
runs), the request p50 (one client, keep-alive, requests one after another) and the throughput with the same
number of threads as the peer's. Each request includes what a grader's includes: a sandbox claimed from the
warm pool, the code written, the program run, the sandbox wiped. The daemon's sandboxes run at normal CPU
weight (``DSEC_SANDBOX_CPU_IDLE=0``), as the peer does. It must never leave the daemon running.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import httpx

from dsec.bench.report import Row, summarize
from dsec.config import Settings

__all__ = ["CODE", "fusion_rows", "measure"]

CODE = "print(1)"


def host_python() -> str:
    """The host's own ``python3`` for the peer: the distribution's, as in the image, rather than whatever is
    first on ``PATH`` (a pyenv shim is a shell script that costs ~100 ms before Python starts)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("python3") or sys.executable


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one(client: httpx.Client) -> bool:
    r = client.post("/run_code", json={"code": CODE, "language": "python"})
    body = r.json() if r.status_code == 200 else {}
    return body.get("status") == "Success" and (body.get("run_result") or {}).get("stdout") == "1\n"


def _latencies(client: httpx.Client, n: int, warmup: int) -> tuple[list[float], int]:
    samples, failures = [], 0
    for i in range(warmup + n):
        t0 = time.perf_counter()
        ok = _one(client)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
            failures += not ok
    return samples, failures


def _sustained(url: str, auth: tuple[str, str], concurrency: int, seconds: float) -> dict[str, Any]:
    """Requests back to back from ``concurrency`` threads, each with a keep-alive client of its own."""
    from dsec.bench.function import threads_rate

    local = threading.local()
    clients: list[httpx.Client] = []

    def one() -> bool:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=url, auth=auth, timeout=60)
            clients.append(client)
        return _one(client)

    try:
        return threads_rate(one, concurrency, seconds)
    finally:
        for client in clients:
            client.close()


async def measure(settings: Settings, n: int, warmup: int, concurrency: int, seconds: float,
                  results: dict[str, Any]) -> None:
    """run_code p50 and throughput on a daemon of ``settings`` (no other daemon may be serving it), and the
    bare peer's; into ``results['latencies']`` (``run_code``, ``bare_python``) and ``results['fusion']``."""
    from dsec.bench.function import _threads_rate, _timed
    from dsec.daemon import server

    token = secrets.token_hex(16)
    port = _port()
    # The peer runs at the node's normal CPU weight, so the sandboxes do too: in the default idle class
    # (cpu.idle) every sandbox yields to every other process, and on a node shared with other work the ratio
    # measured that work's load, not DSec (at load 20-44: run_code 0.0/s against the peer's 35.6/s).
    settings = replace(settings, sandbox_cpu_idle=False)
    results["fusion"] = {"sandbox_cpu_idle": False}
    await asyncio.to_thread(server.up, settings, None, token, 60.0, ["--sandbox-fusion", f"127.0.0.1:{port}"])
    try:
        url, auth = f"http://127.0.0.1:{port}", ("dsec", token)
        with httpx.Client(base_url=url, auth=auth, timeout=60) as client:
            samples, failures = await asyncio.to_thread(_latencies, client, n, warmup)
        results["latencies"]["run_code"] = summarize(samples)
        sustained = await asyncio.to_thread(_sustained, url, auth, concurrency, seconds)
        results["fusion"].update(p50_failures=failures, sustained=sustained)
    finally:
        await asyncio.to_thread(server.down, settings, destroy=True)
    python = host_python()
    results["fusion"]["peer_python"] = python
    argv = [python, "-c", CODE]
    results["latencies"]["bare_python"] = summarize(await asyncio.to_thread(_timed, argv, n, 5))
    results["fusion"]["bare_sustained"] = await asyncio.to_thread(_threads_rate, argv, concurrency, seconds)


def fusion_rows(latencies: dict[str, Any], extra: dict[str, Any]) -> list[Row]:
    """The issue's two run_code targets: p50 ≤ 1.5x the bare peer's, throughput ≥ 0.7x at the same threads."""
    fusion = extra.get("fusion")
    if not fusion or "run_code" not in latencies:
        return []
    p50 = latencies["run_code"].p50 * 1000
    peer = latencies["bare_python"].p50 * 1000 if "bare_python" in latencies else None
    rows = [Row("run_code (python, print(1)) p50 (HTTP+daemon)", "ms", p50, peer,
                f"subprocess.run({fusion.get('peer_python', 'python3')} -c)",
                target="≤ 1.5x the peer", passed=peer is not None and p50 <= 1.5 * peer and not fusion["p50_failures"],
                note=f"{fusion['p50_failures']} failed" + ("" if fusion.get("sandbox_cpu_idle", True) else
                                                           "; sandboxes at normal CPU weight, as the peer"))]
    s, bare = fusion["sustained"], fusion.get("bare_sustained")
    row = Row(f"run_code/s (C={s['concurrency']}, {s['failures']} failed)", "/s", s["rate"],
              bare["rate"] if bare else None, f"subprocess.run({fusion.get('peer_python', 'python3')} -c)",
              better="higher", target="≥ 0.7x")
    row.passed = row.ratio is not None and row.ratio >= 0.7 and not s["failures"]
    rows.append(row)
    return rows
