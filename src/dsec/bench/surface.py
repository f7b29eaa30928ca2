"""``dsec bench surface``: the sandbox surface's round trips against what they replace, measured in one run.

A private daemon (``dsec up`` on a temporary home, container backend, the ``debian-python`` image), driven
through the public SDK (:class:`dsec.AsyncSandbox`) over its unix socket; samples of each pair interleaved so
that drift hits both sides alike:

- a shell-session command (``sb.shell().run("true")``, a builtin, and ``"/bin/true"``, a fork and exec) against
  an ``exec(["true"])``: target p50 ≤ 2x;
- an HTTP GET through an exposed port (the node's listener, its token, the relay into the sandbox) against the
  same GET sent to the same server directly, on a socket made in the sandbox's network namespace (the
  loopback the server listens on): kept-alive connections (one connect, then GETs) and a new connection per
  GET. Target: the kept-alive p50 ≤ 1 ms over the direct one; and the kept-alive GET through a cluster
  gateway's relay of the port (``dsec.cluster.surface``, run in the bench's process: one more hop) against
  the same GET through the node's listener: reported;
- ``files.stat``, ``files.mkdir`` and ``files.remove`` against the command a harness ran for each before
  (``exec`` of ``stat``, ``mkdir``, ``rm -r``): reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsec import AsyncSandbox, Client
from dsec.bench.container import (
    IMAGE,
    BenchUnavailable,
    _cleanup_backend,
    _daemon,
    _leaks,
    _private_settings,
    preflight,
)
from dsec.bench.report import Row, Suite, Summary, summarize
from dsec.config import Settings
from dsec.models.surface import PortInfo

__all__ = ["SHELL_TARGET", "SurfaceBench", "run"]

SHELL_TARGET = 2.0
"""A shell-session command's p50 may be this many times an exec's."""
PROXY_TARGET_MS = 1.0
"""A proxied GET's p50 may exceed the direct one by this much."""
_PORT = 8000
_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@dataclass(frozen=True)
class SurfaceBench:
    """Sample counts of one run (the defaults take about a minute on a quiet 2-core machine)."""

    warmup: int = 10
    commands: int = 300
    gets: int = 1000
    connections: int = 200
    files: int = 200

    def scaled(self, factor: float) -> SurfaceBench:
        """Every count times ``factor`` (a few samples at least)."""
        def n(v: int) -> int:
            return max(5, round(v * factor))
        return SurfaceBench(warmup=max(2, round(self.warmup * factor)), commands=n(self.commands), gets=n(self.gets),
                            connections=n(self.connections), files=n(self.files))


async def _timed(action: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await action()
    return time.perf_counter() - started


async def _pairs(count: int, warmup: int, *actions: Callable[[], Awaitable[Any]]) -> list[list[float]]:
    """``count`` samples of each action, interleaved (the order rotates each round), after a warm-up."""
    for _ in range(warmup):
        for action in actions:
            await action()
    samples: list[list[float]] = [[] for _ in actions]
    for i in range(count):
        for k in range(len(actions)):
            j = (i + k) % len(actions)
            samples[j].append(await _timed(actions[j]))
    return samples


async def _netns_of(marker: str) -> str:
    """``/proc/PID/ns/net`` of the host process whose command line carries ``marker`` (the sandbox's server,
    once it has exec'd)."""
    for _ in range(200):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    return str(entry / "ns" / "net")
            except OSError:
                continue
        await asyncio.sleep(0.05)
    raise BenchUnavailable("the sandbox's HTTP server is not among the host's processes")


class _Http:
    """One HTTP/1.1 connection sending ``GET /`` and reading the 2-byte answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str) -> None:
        self.reader, self.writer = reader, writer
        self.request = f"GET / HTTP/1.1\r\nHost: bench\r\nX-DSec-Token: {token}\r\n\r\n".encode()

    async def get(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the GET was answered {head[:40]!r}")
        await self.reader.readexactly(2)

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def _proxied(host: str, port: int, token: str) -> _Http:
    reader, writer = await asyncio.open_connection(host, port)
    return _Http(reader, writer, token)


async def _direct(netns: str, token: str) -> _Http:
    from dsec.isolation.ports import connect_in_netns

    stream = await connect_in_netns(netns, _PORT)
    reader, writer = await asyncio.open_connection(sock=stream.socket)
    return _Http(reader, writer, token)


async def _through_a_gateway(cfg: SurfaceBench, info: PortInfo) -> tuple[Summary, Summary]:
    """Kept-alive GETs through a cluster gateway's relay for the port (in this process: one more hop, bytes
    only) against the same GETs through the node's listener."""
    from dsec.cluster.surface import PortFronts

    fronts = PortFronts()
    seen = await fronts.front("bench", info)
    relayed, on_node = await _proxied(seen.host, seen.host_port, info.token), await _proxied(
        info.host, info.host_port, info.token)
    try:
        gateway_s, node_s = await _pairs(cfg.gets, cfg.warmup, relayed.get, on_node.get)
    finally:
        await relayed.aclose()
        await on_node.aclose()
        await fronts.aclose()
    return summarize(gateway_s), summarize(node_s)


async def _measure(cfg: SurfaceBench, client: Client, progress: Callable[[str], None]) -> Suite:
    suite = Suite("surface")
    lat = suite.latencies
    sb = await AsyncSandbox.create(image=IMAGE, client=client)
    try:
        progress(f"shell-session command vs exec, x{cfg.commands}")
        shell = await sb.shell()
        try:
            async def by_shell() -> None:
                result = await shell.run("true")
                assert result.exit_code == 0, result

            async def by_shell_fork() -> None:
                result = await shell.run("/bin/true")
                assert result.exit_code == 0, result

            async def by_exec() -> None:
                result = await sb.exec(["true"])
                assert result.exit_code == 0, result

            exec_s, shell_s, fork_s = await _pairs(cfg.commands, cfg.warmup, by_exec, by_shell, by_shell_fork)
        finally:
            await shell.close()
        lat["exec_true"], lat["shell_true"], lat["shell_bin_true"] = map(summarize, (exec_s, shell_s, fork_s))

        marker = f"dsec-bench-{secrets.token_hex(6)}"
        server = await sb.exec(["python3", "-c", _SERVER, str(_PORT), marker], background=True)
        netns = await _netns_of(marker)
        info = await sb.expose(_PORT)
        for _ in range(1200):  # up once a direct connection is accepted (a loaded host starts python3 slowly)
            with contextlib.suppress(OSError):
                await (await _direct(netns, info.token)).aclose()
                break
            await asyncio.sleep(0.05)
        else:
            raise BenchUnavailable(f"the sandbox's HTTP server did not accept a connection on port {_PORT} in 60 s")
        progress(f"GET through the exposed port vs direct, kept alive x{cfg.gets}")
        proxied, direct = await _proxied(info.host, info.host_port, info.token), await _direct(netns, info.token)
        try:
            lat["get_proxied"], lat["get_direct"] = map(summarize, await _pairs(
                cfg.gets, cfg.warmup, proxied.get, direct.get))
        finally:
            await proxied.aclose()
            await direct.aclose()
        lat["get_gateway"], lat["get_node"] = await _through_a_gateway(cfg, info)

        progress(f"GET on a new connection each, x{cfg.connections}")

        async def proxied_once() -> None:
            conn = await _proxied(info.host, info.host_port, info.token)
            await conn.get()
            await conn.aclose()

        async def direct_once() -> None:
            conn = await _direct(netns, info.token)
            await conn.get()
            await conn.aclose()

        lat["connect_get_proxied"], lat["connect_get_direct"] = map(summarize, await _pairs(
            cfg.connections, cfg.warmup, proxied_once, direct_once))
        await server.kill()

        progress(f"file stat / mkdir / remove vs exec, x{cfg.files}")
        await sb.files.write("/workspace/f", b"x")
        api_s: dict[str, list[float]] = {"stat": [], "mkdir": [], "remove": []}
        cmd_s: dict[str, list[float]] = {"stat": [], "mkdir": [], "remove": []}
        for i in range(cfg.warmup + cfg.files):
            keep = i >= cfg.warmup
            timings = (
                ("stat", lambda: sb.files.stat("/workspace/f"), lambda: sb.exec(["stat", "/workspace/f"])),
                ("mkdir", lambda: sb.files.mkdir("/workspace/d"), lambda: sb.exec(["mkdir", "/workspace/e"])),
                ("remove", lambda: sb.files.remove("/workspace/d"), lambda: sb.exec(["rm", "-r", "/workspace/e"])),
            )
            for name, by_api, by_command in timings:
                a, c = await _timed(by_api), await _timed(by_command)
                if keep:
                    api_s[name].append(a)
                    cmd_s[name].append(c)
        for name in api_s:
            lat[f"file_{name}"], lat[f"exec_{name}"] = summarize(api_s[name]), summarize(cmd_s[name])
    finally:
        await sb.close()
    return suite


def _rows(suite: Suite) -> list[Row]:
    lat = suite.latencies
    ms = 1000.0
    exe = lat["exec_true"].p50 * ms
    rows = []
    for key, what in (("shell_true", "shell-session command `true` (a builtin) p50"),
                      ("shell_bin_true", "shell-session command `/bin/true` (fork + exec) p50")):
        shell = lat[key].p50 * ms
        rows.append(Row(what, "ms", shell, exe, "exec(['true'])", target=f"≤ {SHELL_TARGET:g}x exec",
                        passed=shell <= SHELL_TARGET * exe, note=f"shell/exec {shell / exe:.2f}x"))
    for key, what in (("get", "GET through an exposed port, kept-alive connection, p50"),
                      ("connect_get", "connect + GET through an exposed port, p50")):
        proxied, direct = lat[f"{key}_proxied"].p50 * ms, lat[f"{key}_direct"].p50 * ms
        rows.append(Row(what, "ms", proxied, direct, "the same GET direct in the sandbox's netns",
                        target=f"≤ direct + {PROXY_TARGET_MS:g} ms" if key == "get" else None,
                        passed=proxied - direct <= PROXY_TARGET_MS if key == "get" else None,
                        note=f"+{proxied - direct:.3f} ms"))
    if "get_gateway" in lat:
        relayed, on_node = lat["get_gateway"].p50 * ms, lat["get_node"].p50 * ms
        rows.append(Row("GET through a cluster gateway's relay of the port, kept-alive, p50", "ms", relayed, on_node,
                        "the same GET through the node's listener", note=f"+{relayed - on_node:.3f} ms"))
    for name, command in (("stat", "stat"), ("mkdir", "mkdir"), ("remove", "rm -r")):
        rows.append(Row(f"files.{name} round trip p50", "ms", lat[f"file_{name}"].p50 * ms,
                        lat[f"exec_{name}"].p50 * ms, f"exec of `{command}`"))
    return rows


async def run(cfg: SurfaceBench, node: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure everything against a private daemon; ``progress`` is told each phase as it starts."""
    node = node or Settings()
    preflight(node)
    settings = _private_settings(node)
    started = time.perf_counter()
    try:
        progress(f"starting a private daemon in {settings.home}")
        with _daemon(settings, "process"):
            client = Client(url=f"unix://{settings.socket_path}")
            try:
                suite = await _measure(cfg, client, progress)
            finally:
                await client.aclose()
    finally:
        await _cleanup_backend(settings)
        leaks = _leaks(settings)
        shutil.rmtree(settings.home, ignore_errors=True)
    suite.rows = _rows(suite)
    suite.extra = {"config": asdict(cfg), "phases_s": {"all": round(time.perf_counter() - started, 1)},
                   "load": os.getloadavg()[0], "home": str(settings.home), "leaks": leaks}
    return suite
