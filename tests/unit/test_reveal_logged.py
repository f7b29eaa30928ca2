"""``sb.reveal()`` on a trajectory-bound sandbox is a logged call: replayed from the log (the hidden paths are
not revealed twice), a divergence when another call sits at its position, and re-run on a rebuilt sandbox.
Against a fake backend that counts reveals (the real reveals are tested per backend)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from test_app import client_for
from test_engine import started

from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.models import SandboxRecord
from dsec.testing.fake import FakeBackend, FakeImages


class HidingBackend(FakeBackend):
    """A fake with hidden paths: it records every reveal it is asked for."""

    def __init__(self, root: Path) -> None:
        super().__init__("container", root)
        self.reveals: list[str] = []

    async def reveal(self, record: SandboxRecord) -> None:
        self.reveals.append(record.id)
        record.backend_state["hidden"] = []


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, HidingBackend]]:
    backend = HidingBackend(tmp_path / "fake")
    async with started(Engine(Settings(home=tmp_path / "home"), {"container": backend}, FakeImages())) as eng:
        yield eng, backend


@pytest.fixture
async def client(engine: tuple[Engine, HidingBackend]) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(engine[0]) as c:
        yield c


async def test_reveal_is_logged_and_replayed(client: httpx.AsyncClient, engine: tuple[Engine, HidingBackend]) -> None:
    eng, backend = engine
    r = await client.post("/v1/sandboxes", json={"image": "base", "trajectory": "grade/1", "hidden": ["/tests"]})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", params={"seq": 0}, json={"command": "true"})
    assert r.status_code == 200, r.text
    r = await client.post(f"/v1/sandboxes/{sid}/reveal", params={"seq": 1})
    assert r.status_code == 200 and r.json()["id"] == sid, r.text
    log = (await client.get("/v1/trajectories/log", params={"name": "grade/1", "start": 0})).json()
    assert [(c["op"], c["status"]) for c in log] == [("exec", "done"), ("reveal", "done")]
    assert backend.reveals == [sid]
    # the same call again (an agent replaying its rollout): answered from the log, not revealed again
    r = await client.post(f"/v1/sandboxes/{sid}/reveal", params={"seq": 1})
    assert r.status_code == 200, r.text
    assert backend.reveals == [sid]
    # another call where the log has the reveal: a divergence naming it
    r = await client.post(f"/v1/sandboxes/{sid}/exec/result", params={"seq": 1}, json={"command": "true"})
    assert r.status_code == 409 and "reveal" in r.text, r.text
    # a branch rebuilt from the image (no checkpoint) lacks the reveal: reported missing, or re-run when asked
    branch = await eng.trajectories.branch("grade/1", 2, rerun_missing=False)
    assert branch.trajectory is not None and branch.trajectory.missing_effects == [0, 1], branch.trajectory
    assert backend.reveals == [sid]
    rebuilt = await eng.trajectories.branch("grade/1", 2, rerun_missing=True)
    assert rebuilt.trajectory is not None and rebuilt.trajectory.missing_effects == [], rebuilt.trajectory
    assert backend.reveals == [sid, rebuilt.id]


async def test_reveal_without_a_trajectory_is_not_logged(client: httpx.AsyncClient,
                                                         engine: tuple[Engine, HidingBackend]) -> None:
    _, backend = engine
    sid = (await client.post("/v1/sandboxes", json={"image": "base", "hidden": ["/tests"]})).json()["id"]
    r = await client.post(f"/v1/sandboxes/{sid}/reveal")
    assert r.status_code == 200, r.text
    assert backend.reveals == [sid]
    r = await client.post(f"/v1/sandboxes/{sid}/reveal", params={"seq": 0})
    assert r.status_code == 200 and backend.reveals == [sid, sid]  # seq means nothing without a trajectory
