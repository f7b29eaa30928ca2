"""A real DSec daemon app (engine + FakeBackend) served by uvicorn in a thread, for SDK and CLI tests.

SDK tests must exercise the real HTTP app, not mocks: this starts ``create_app(Engine(...))`` on a unix
socket (and optionally TCP with a token) in a background thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from dsec._ports import free_port as free_port
from dsec.backends.base import Backend, ImageRef
from dsec.config import Settings
from dsec.daemon.app import create_app
from dsec.daemon.engine import Engine
from dsec.errors import ImageNotFound
from dsec.models import ImageInfo
from dsec.testing.fake import FakeBackend

IMAGES = ("debian-python", "tiny")


class TinyImages:
    """An image resolver with a few empty images (the fake backend ignores the rootfs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str) -> ImageInfo:
        if name not in IMAGES:
            raise ImageNotFound(f"image {name!r} not found", image=name)
        return ImageInfo(name=name, created_at=0.0, size_bytes=0, files=0, source="test", uid_shift=0)

    def resolve(self, name: str) -> ImageRef:
        self.get(name)
        return ImageRef(name=name, rootfs=self.root)

    def list(self) -> builtins.list[ImageInfo]:
        return [self.get(n) for n in IMAGES]


@dataclass
class Daemon:
    unix_url: str
    tcp_url: str | None
    token: str | None
    engine: Engine
    loop: asyncio.AbstractEventLoop
    """The loop the engine runs on (call its methods there: ``loop.call_soon_threadsafe``)."""


@contextlib.contextmanager
def _serving(name: str, start: Callable[[], Awaitable[builtins.list[uvicorn.Config]]],
             stop: Callable[[], Awaitable[None]]) -> Iterator[asyncio.AbstractEventLoop]:
    """Run ``start()`` (which returns the servers' configs) and serve them with uvicorn on an event loop of
    their own in a thread; yield that loop once every server has started; stop them, then ``stop()``."""
    servers: list[uvicorn.Server] = []
    ready = threading.Event()
    failure: list[BaseException] = []
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        try:
            servers.extend(uvicorn.Server(c) for c in await start())
            tasks = [asyncio.create_task(s.serve()) for s in servers]
            while not all(s.started for s in servers):
                if any(t.done() for t in tasks):
                    raise RuntimeError("uvicorn stopped during startup")
                await asyncio.sleep(0.01)
            ready.set()
            await asyncio.gather(*tasks)
        except BaseException as exc:
            failure.append(exc)
            ready.set()
        finally:
            await stop()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name=name, daemon=True)
    thread.start()
    ready.wait(30)
    if failure:
        raise RuntimeError(f"{name} failed to start") from failure[0]
    try:
        yield loops[0]
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def running_daemon(home: Path, token: str | None = None, backends: dict[str, Backend] | None = None, *,
                   port: int | None = None, create_slots: int = 32, images: Any = None) -> Iterator[Daemon]:
    """Serve one engine on ``home/run/dsec.sock`` (and on TCP with ``token`` when given, on ``port`` or a free
    one); ``backends`` adds to (or replaces) the fake container backend; ``images`` replaces the tiny images."""
    settings = Settings(home=home, create_slots=create_slots)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine(settings, {"container": FakeBackend(root=home / "fake"), **(backends or {})},
                    images if images is not None else TinyImages(home / "rootfs"))
    sock = str(settings.socket_path)
    port = (port or free_port()) if token else None

    async def start() -> builtins.list[uvicorn.Config]:
        await engine.start()
        configs = [uvicorn.Config(create_app(engine), uds=sock, log_level="warning", lifespan="off")]
        if port is not None:
            configs.append(uvicorn.Config(create_app(engine, token), host="127.0.0.1", port=port,
                                          log_level="warning", lifespan="off"))
        return configs

    async def stop() -> None:
        await engine.destroy_all()
        await engine.aclose()

    with _serving("test-daemon", start, stop) as loop:
        yield Daemon(f"unix://{sock}", f"http://127.0.0.1:{port}" if port else None, token, engine, loop)


class _Writes:
    """The gateway's state writes, accepted and dropped (its database is tested on PostgreSQL elsewhere)."""

    async def put_rows(self, rows: builtins.list[object]) -> None:
        pass

    async def put_node(self, row: object) -> None:
        pass

    def submit_rows(self, rows: builtins.list[object], *, new: bool = False) -> None:
        pass

    def submit_delete(self, ids: builtins.list[str]) -> None:
        pass


class _NoRecords:
    """A gateway state store that starts empty and keeps nothing."""

    def __init__(self) -> None:
        self.writer = _Writes()

    def nodes(self) -> builtins.list[object]:
        return []

    def rows(self) -> builtins.list[object]:
        return []

    async def aclose(self) -> None:
        pass


@dataclass
class Gateway:
    url: str
    admin_token: str


@contextlib.contextmanager
def running_gateway(nodes: builtins.list[Daemon], admin_token: str = "gateway-admin-token-0123") -> Iterator[Gateway]:
    """Serve a cluster gateway over ``nodes`` (each served on TCP with a token) on a free loopback port, with
    ``admin_token`` as its only job token; its state store keeps nothing."""
    from dsec.cluster.gateway import GatewayEngine, NodeFacts
    from dsec.cluster.server import Jobs, gateway_config

    room = {"cpu": 64, "memory": 2**36, "slots": {"container": 100}}
    facts = []
    for i, node in enumerate(nodes):
        assert node.tcp_url is not None and node.token is not None, "gateway nodes need TCP and a token"
        facts.append(NodeFacts(f"node-{i}", True, node.tcp_url, node.token, room))

    async def membership() -> builtins.list[NodeFacts]:
        return facts

    port = free_port()
    gateway = GatewayEngine(_NoRecords(), membership)  # type: ignore[arg-type]

    async def start() -> builtins.list[uvicorn.Config]:
        await gateway.start()
        config = gateway_config(gateway, Jobs(by_token={admin_token: "admin"}, quotas={}), "127.0.0.1", port)
        config.lifespan = "off"
        return [config]

    with _serving("test-gateway", start, gateway.aclose):
        yield Gateway(f"http://127.0.0.1:{port}", admin_token)
