"""``dsec bench e2b``: the same workload through the e2b SDK (against ``dsec serve --e2b``) and DSec's own SDK.

Measured in one run, against one private daemon (container backend, the ``debian-python`` image) that serves
both its node API and the E2B endpoint (plain HTTP on loopback, the ``E2B_API_URL``/``E2B_SANDBOX_URL``
form), samples of the two paths interleaved so that drift hits both alike:

- create -> run ``true`` -> kill, back to back (cycles per second);
- a command round trip on a live sandbox (p50). The e2b SDK runs every command as ``/bin/bash -l -c CMD``;
  DSec's side runs the same argv, so the row compares the paths, not the shells;
- a 10 MiB file written and read back (p50).

Target: the e2b path within 1.5x of DSec's own SDK on each row. Both clients are the blocking SDKs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec._ports import free_port
from dsec.bench.container import IMAGE, _cleanup_backend, _leaks, _private_settings, preflight
from dsec.bench.report import Row, Suite, summarize
from dsec.config import Settings

__all__ = ["E2BBench", "run"]

TARGET = 1.5
_LOGIN_TRUE = ["/bin/bash", "-l", "-c", "true"]


@dataclass(frozen=True)
class E2BBench:
    """Sample counts of one run."""

    cycles: int = 60
    execs: int = 300
    files: int = 20
    file_mib: int = 10

    def scaled(self, factor: float) -> E2BBench:
        """Every count times ``factor`` (a few samples at least)."""
        return E2BBench(cycles=max(6, int(self.cycles * factor)), execs=max(20, int(self.execs * factor)),
                        files=max(3, int(self.files * factor)), file_mib=self.file_mib)


def _timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _ratio_row(metric: str, unit: str, e2b: float, dsec: float, better: str) -> Row:
    """A row whose figure is the e2b path and whose peer is DSec's SDK; passed when within the target."""
    ratio = e2b / dsec if better == "lower" else dsec / e2b
    return Row(metric, unit, e2b, dsec, "DSec SDK", better=better,  # type: ignore[arg-type]
               target=f"≤ {TARGET:g}x DSec SDK", passed=ratio <= TARGET, note=f"e2b/DSec {ratio:.2f}x")


def _measure(cfg: E2BBench, key: str, url: str, unix_url: str, progress: Callable[[str], None]) -> Suite:
    import e2b

    import dsec

    opts: dict[str, Any] = {"api_key": key, "api_url": url, "sandbox_url": url}
    client = dsec.Client(unix_url)
    suite = Suite("e2b")
    try:
        progress("cycles: create -> run true -> kill")
        cycle: dict[str, list[float]] = {"e2b": [], "dsec": []}

        def e2b_cycle() -> None:
            sb = e2b.Sandbox.create(image_template(), **opts)
            sb.commands.run("true")
            sb.kill()

        def dsec_cycle() -> None:
            sb = dsec.Sandbox.create(image=IMAGE, client=client)
            sb.exec(_LOGIN_TRUE)
            sb.close()

        for _ in range(cfg.cycles):
            cycle["e2b"].append(_timed(e2b_cycle))
            cycle["dsec"].append(_timed(dsec_cycle))
        progress("command round trips")
        rt: dict[str, list[float]] = {"e2b": [], "dsec": []}
        esb = e2b.Sandbox.create(image_template(), **opts)
        dsb = dsec.Sandbox.create(image=IMAGE, client=client)
        blob = os.urandom(cfg.file_mib * 2**20)
        files: dict[str, list[float]] = {"e2b": [], "dsec": []}
        try:
            for _ in range(5):  # warm both paths' connections
                esb.commands.run("true")
                dsb.exec(_LOGIN_TRUE)
            for _ in range(cfg.execs):
                rt["e2b"].append(_timed(lambda: esb.commands.run("true")))
                rt["dsec"].append(_timed(lambda: dsb.exec(_LOGIN_TRUE)))
            progress(f"{cfg.file_mib} MiB file round trips")
            def e2b_file() -> None:
                esb.files.write("/tmp/blob", blob)
                assert len(esb.files.read("/tmp/blob", format="bytes")) == len(blob)

            def dsec_file() -> None:
                dsb.files.write("/tmp/blob", blob)
                assert len(dsb.files.read("/tmp/blob")) == len(blob)

            for _ in range(cfg.files):
                files["e2b"].append(_timed(e2b_file))
                files["dsec"].append(_timed(dsec_file))
        finally:
            esb.kill()
            dsb.close()
    finally:
        client.close()
    for name, samples in (("cycle", cycle), ("exec", rt), ("file", files)):
        for side, values in samples.items():
            suite.latencies[f"{name}_{side}"] = summarize(values)
    rate = {side: len(v) / sum(v) for side, v in cycle.items()}
    suite.rows.append(_ratio_row("create -> run true -> kill, sustained (1 client)", "/s", rate["e2b"], rate["dsec"],
                                 "higher"))
    suite.rows.append(_ratio_row("command round trip (bash -l -c true) p50", "ms",
                                 suite.latencies["exec_e2b"].p50 * 1000, suite.latencies["exec_dsec"].p50 * 1000,
                                 "lower"))
    suite.rows.append(_ratio_row(f"{cfg.file_mib} MiB file write + read p50", "ms",
                                 suite.latencies["file_e2b"].p50 * 1000, suite.latencies["file_dsec"].p50 * 1000,
                                 "lower"))
    suite.extra["config"] = {"cycles": cfg.cycles, "execs": cfg.execs, "files": cfg.files, "file_mib": cfg.file_mib,
                             "transport": "plain HTTP on loopback (E2B_API_URL/E2B_SANDBOX_URL form)"}
    return suite


def image_template() -> str:
    """The E2B template that names the bench's image."""
    return IMAGE


def run(cfg: E2BBench, node: Settings | None = None, progress: Callable[[str], None] = lambda _: None) -> Suite:
    """Measure both paths against a private daemon serving the node API and the E2B endpoint."""
    from dsec.bench.container import BenchUnavailable
    from dsec.daemon import server

    try:
        import e2b  # noqa: F401
    except ImportError:
        raise BenchUnavailable("the e2b suite needs the e2b SDK: pip install 'dsec[e2b]'") from None
    node = node or Settings()
    preflight(node)
    settings = _private_settings(node)
    key = "e2b_" + secrets.token_hex(20)
    port = free_port()
    progress("starting a daemon with --e2b")
    server.up(settings, token=key, timeout=60, args=["--e2b", f"127.0.0.1:{port}"])
    try:
        suite = _measure(cfg, key, f"http://127.0.0.1:{port}", f"unix://{settings.socket_path}", progress)
    finally:
        server.down(settings, destroy=True)
        import asyncio

        asyncio.run(_cleanup_backend(settings))
        leaks = _leaks(settings)
        shutil.rmtree(settings.home, ignore_errors=True)
    if leaks:
        suite.extra["leaks"] = leaks
    return suite
