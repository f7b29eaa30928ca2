"""Helpers shared by the tests that run real ``function`` sandboxes (root, namespaces, cgroups, Landlock).

Every such test uses its own ``DSEC_HOME``; the backend keeps its host resources under it
(``<home>/function/sb-*``) and under the home's cgroup parent (``/sys/fs/cgroup/*/dsec-<tag>-fn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from container_support import CGROUP_ROOT, home_tag, images_dir, mounts_under, py, run, short_home
from dsec.backends.base import ImageRef
from dsec.backends.function import FunctionBackend
from dsec.config import Settings


def fn_leftovers(home: Path) -> dict[str, list[str]]:
    """Sandbox directories, workspace mounts, cgroups and zygotes of this home still on the host: empty lists
    when clean."""
    tag = home_tag(home)
    root = home / "function"
    zygotes = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                if cmd[0].startswith(str(home / "bin" / "dsec-zygote").encode()):
                    zygotes.append(proc.name)
    return {
        "dirs": sorted(str(p) for p in root.glob("sb-*")) if root.is_dir() else [],
        "mounts": mounts_under(str(root)),
        "cgroups": sorted(str(p) for p in CGROUP_ROOT.glob(f"*/dsec-{tag}-fn/sb-*") if p.is_dir()),
        "zygotes": zygotes,
    }


@contextlib.asynccontextmanager
async def checked_fn_backend(home: Path) -> AsyncIterator[FunctionBackend]:
    """A started function backend for one test; afterwards nothing of its sandboxes may remain."""
    backend = FunctionBackend(Settings(home=home, images_dir=images_dir()))
    await backend.start()
    try:
        yield backend
    finally:
        left = fn_leftovers(home)
        removed = await backend.cleanup_orphans(set())
        await backend.aclose()
        parents = [str(p) for p in CGROUP_ROOT.glob(f"*/dsec-{home_tag(home)}-fn") if p.is_dir()]
    assert removed == [] and not any(left.values()), f"test leaked: {removed} {left}"
    assert parents == [], f"cgroup parents left: {parents}"



def function_backend_fixtures(prefix: str) -> tuple[Any, Any]:
    """A test module's ``home`` (module-scoped, checked for leftovers at the end) and ``backend`` fixtures.

    Use as ``home, backend = function_backend_fixtures("fn-x-home")`` at module level.
    """

    @pytest.fixture(scope="module")
    def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
        path = tmp_path_factory.mktemp(prefix)
        yield path
        assert not any(fn_leftovers(path).values()), fn_leftovers(path)

    @pytest.fixture
    async def backend(home: Path, debian_python_image: ImageRef) -> AsyncIterator[FunctionBackend]:
        async with checked_fn_backend(home) as b:
            yield b

    return home, backend


class ServedFunctionDaemon:
    """A real daemon (uvicorn on a unix socket, in a thread) serving only the function backend."""

    def __init__(self, home: Path) -> None:
        from dsec.daemon.engine import Engine
        from dsec.daemon.server import Daemon
        from dsec.images.node import NodeImages

        settings = Settings(home=home, images_dir=images_dir())
        self.engine = Engine(settings, {"function": FunctionBackend(settings)}, NodeImages(settings))
        self.daemon = Daemon(settings, engine=self.engine)
        self.url = f"unix://{settings.socket_path}"
        self.thread = threading.Thread(target=lambda: asyncio.run(self.daemon.run()), daemon=True)


@contextlib.contextmanager
def served_function_daemon(prefix: str) -> Iterator[ServedFunctionDaemon]:
    """Start a :class:`ServedFunctionDaemon` in a home of its own; afterwards no zygote of it may be left."""
    home = short_home(prefix)
    served = ServedFunctionDaemon(home)
    served.thread.start()
    try:
        assert served.daemon.started.wait(60), "daemon did not start"
        yield served
    finally:
        served.daemon.stop()
        served.thread.join(60)
        left = fn_leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
    assert not left["zygotes"], left


__all__ = ["ServedFunctionDaemon", "checked_fn_backend", "fn_leftovers", "function_backend_fixtures", "py", "run",
           "served_function_daemon"]
