"""A function sandbox from an imported image that has a ``User`` and no Python: every call runs as the image's
user (as a container's commands do), the workspace is that user's, and ``sb.call`` fails with a clear error
naming what is missing while ``exec`` works."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_image_sandbox import runnable_image, source

from container_support import short_home
from dsec._sdk.calls import client_python, encode_call
from dsec.backends.function import FunctionBackend
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import InvalidRequest
from dsec.images.image_store import ImageStore
from dsec.images.node import NodeImages
from dsec.images.oci_import import import_image
from dsec.models import CallRequest, ExecRequest, SandboxSpec
from function_support import fn_leftovers

pytestmark = [pytest.mark.root]


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, ImageStore]]:
    home = short_home("dsec-fimg-")
    settings = Settings(home=home, images_dir=tmp_path / "images")
    store = ImageStore(tmp_path / "images")
    backend = FunctionBackend(settings)
    await backend.start()
    images = NodeImages(settings, store, tag_ttl=0)
    try:
        yield Engine(settings, {"function": backend}, images), store
    finally:
        removed = await backend.cleanup_orphans(set())
        await backend.aclose()
        await images.aclose(unmount=True)
        left = fn_leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert removed == [] and not any(left.values()), (removed, left)


def square(x: int) -> int:
    return x * x


async def test_image_user_and_no_python(engine: tuple[Engine, ImageStore], tmp_path: Path) -> None:
    eng, store = engine
    import_image(store, "busy", source(runnable_image().write_docker_archive(tmp_path / "busy.tar")),
                 uid_shift=Settings().uid_shift)
    sb = await eng.create(SandboxSpec(image="busy", backend="function"))
    try:
        r = await eng.exec(sb.id, ExecRequest(command='id -u; id -g; pwd; echo mine > own; stat -c "%u %a" . own; '
                                                      'echo "$GREETING"', timeout=30))
        assert r.exit_code == 0, r
        assert r.stdout.decode().splitlines() == ["1000", "1000", "/home/app/work", "1000 755", "1000 644",
                                                  "hello from the image config"], r
        request = CallRequest(payload=encode_call(square, (3,), {}), client_python=client_python())
        for _ in range(2):  # refused at once the second time: the image will not grow a Python
            with pytest.raises(InvalidRequest, match=r"sb.call needs Python in the sandbox's image.*'python3'"):
                await eng.call(sb.id, request)
        r = await eng.exec(sb.id, ExecRequest(command="cat own", timeout=30))
        assert r.stdout == b"mine\n", "exec stopped working after a refused call"
    finally:
        await eng.destroy(sb.id)
