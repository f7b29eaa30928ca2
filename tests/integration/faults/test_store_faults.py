"""Chaos on the node's stores: a real daemon whose trajectory database turns read-only (PostgreSQL, and the
local SQLite file made immutable), and whose image store (S3 on SeaweedFS) stops answering.

For each: the calls that need the store fail with an error naming it (and nothing half-happens: a logged
command refused before it ran never runs), the rest of the node keeps working, ``/v1/health`` shows the
store degraded while it is and ``ok`` again after, and nothing of the home is left behind (``node_on``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_chaos import component, node_on, wait_ok

import dsec
from container_support import images_dir, short_home
from dsec.config import Settings
from dsec.images.image_store import ImageStore
from image_support import seaweedfs
from postgres_support import PgServer, postgres_or_missing, read_only

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    yield from postgres_or_missing()


async def wait_not_ok(client: dsec.Client, name: str, timeout: float = 40) -> dsec.models.ComponentHealth:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        part = await component(client, name)
        if part.state != "ok":
            return part
        assert asyncio.get_running_loop().time() < deadline, f"{name} still ok: {part}"
        await asyncio.sleep(0.5)


def test_trajectory_db_turns_read_only(pg: PgServer, debian_python_image: object) -> None:
    home = short_home("dsec-chaosro-")
    try:
        with node_on(home, DSEC_TRAJECTORY_DB=pg.dsn) as node:
            asyncio.run(_read_only_db(node.url, lambda on: read_only(pg, on), "read-only"))
    finally:
        read_only(pg, False)
        shutil.rmtree(home, ignore_errors=True)


def immutable(paths: list[Path], on: bool) -> None:
    """``chattr +i`` (or ``-i``): root itself cannot write the files then, through descriptors already open too.
    The ``-shm`` file SQLite maps stays writable: a write to that mapping would be a SIGBUS, not an error."""
    subprocess.run(["chattr", "+i" if on else "-i", *map(str, paths)], check=True)


def test_sqlite_trajectory_db_turns_read_only(debian_python_image: object) -> None:
    home = short_home("dsec-chaosrol-")
    db = Settings(home=home).home_trajectory_db
    files = [db, db.with_name(db.name + "-wal")]
    try:
        with node_on(home) as node:
            asyncio.run(_read_only_db(node.url, lambda on: immutable(files, on), "trajectories.db"))
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            immutable([f for f in files if f.exists()], False)
        shutil.rmtree(home, ignore_errors=True)


async def _read_only_db(url: str, set_read_only: Callable[[bool], None], cause: str) -> None:
    async with dsec.Client(url) as client:
        sb = await dsec.AsyncSandbox.create(image="debian-python", trajectory="chaos/ro", client=client)
        try:
            await sb.exec("echo a >> ran")
            set_read_only(True)
            with pytest.raises(dsec.SandboxError, match="trajectory log"):
                await sb.exec("echo b >> ran")  # refused: its log entry could not be written, so it did not run
            part = await wait_not_ok(client, "trajectory-store")
            assert cause in str(part.error) or cause in str(part.detail), part
            plain = await dsec.AsyncSandbox.create(image="debian-python", client=client)  # the node works on
            assert (await plain.exec("echo ok")).stdout == b"ok\n"
            await plain.close()
            set_read_only(False)
            await wait_ok(client, "trajectory-store", part.faults)
            assert (await sb.exec("echo b >> ran")).exit_code == 0  # the same call again: now logged and run
            assert (await sb.exec("cat ran")).stdout == b"a\nb\n"  # b ran once
            assert [c.status for c in await dsec.AsyncTrajectory("chaos/ro", client).log()] == ["done"] * 3
        finally:
            await dsec.AsyncTrajectory("chaos/ro", client).delete()


def test_image_store_stops_answering(monkeypatch: pytest.MonkeyPatch, debian_python_image: object) -> None:
    with seaweedfs(monkeypatch) as weed:
        ImageStore(images_dir(), weed.url()).copy_image(ImageStore(images_dir()), "debian-python")
        home = short_home("dsec-chaoss3-")
        try:
            # 5 s per S3 attempt, not 10: the calls that meet the stopped store give up sooner (two slow
            # attempts in a row are still needed to fail one while it answers)
            with node_on(home, DSEC_IMAGE_STORE=weed.url() + "&timeout=5") as node:
                asyncio.run(_store_stops(node.url, weed.proc.pid, weed.endpoint))
        finally:
            os.killpg(weed.proc.pid, signal.SIGCONT)
            shutil.rmtree(home, ignore_errors=True)


async def _store_stops(url: str, weed: int, endpoint: str) -> None:
    async with dsec.Client(url) as client:
        box = await dsec.AsyncSandbox.create(image="debian-python", client=client)
        assert (await box.exec("python3 -c 'print(6 * 7)'", timeout=60)).stdout == b"42\n"
        os.killpg(weed, signal.SIGSTOP)  # up, but answering nothing: the worst kind of unreachable
        try:
            part = await wait_not_ok(client, "image-store", timeout=60)
            assert endpoint.split("//")[1] in str(part.error) or "did not answer" in str(part.error), part
            # what is cached keeps working; a create either works from the cache or names the store
            assert (await box.exec("python3 -c 'print(6 * 7)'", timeout=60)).stdout == b"42\n"
            try:
                again = await dsec.AsyncSandbox.create(image="debian-python", client=client)
            except dsec.DSecError as exc:
                assert "image store" in str(exc), exc
            else:
                await again.close()
        finally:
            os.killpg(weed, signal.SIGCONT)
        await wait_ok(client, "image-store", part.faults)
        fresh = await dsec.AsyncSandbox.create(image="debian-python", client=client)
        assert (await fresh.exec("python3 -c 'import json; print(1)'", timeout=60)).exit_code == 0
        for sb in (box, fresh):
            await sb.close()
