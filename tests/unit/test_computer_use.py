"""Computer use above the VM: key mapping, request validation, the HTTP routes and the SDK methods, against
a fake backend with a display and backends without one (the real display is tested in test_vm.py)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_app import client_for
from test_engine import started

from dsec.backends.base import ImageRef
from dsec.backends.vm import _combo as combo
from dsec.backends.vm import key_chunks, keys_for_text
from dsec.config import Settings
from dsec.daemon.engine import Engine
from dsec.errors import InvalidRequest
from dsec.models import SandboxRecord
from dsec.testing.fake import FakeBackend, FakeImages


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" + b"\xff" * 6)) + chunk(b"IEND", b""))


class DisplayBackend(FakeBackend):
    """A fake vm: its own images (``desk``), a display, and a log of the input it got."""

    def __init__(self, root: Path) -> None:
        super().__init__("vm", root)
        self.inputs: list[tuple[Any, ...]] = []

    def resolve_image(self, name: str) -> ImageRef | None:
        return ImageRef(name=name, rootfs=self.root) if name == "desk" else None

    async def screenshot(self, record: SandboxRecord) -> bytes:
        return tiny_png()

    async def mouse(self, record: SandboxRecord, x: int, y: int, button: str = "left", action: str = "click"
                    ) -> None:
        self.inputs.append(("mouse", x, y, button, action))

    async def keyboard(self, record: SandboxRecord, text: str | None = None, keys: list[str] | None = None
                       ) -> None:
        self.inputs.append(("keyboard", text, keys))


def test_text_becomes_us_layout_key_combos() -> None:
    assert keys_for_text("aZ 1!\n") == [["a"], ["shift", "z"], ["spc"], ["1"], ["shift", "1"], ["ret"]]
    assert keys_for_text('~"|') == [["shift", "grave_accent"], ["shift", "apostrophe"], ["shift", "backslash"]]
    with pytest.raises(InvalidRequest, match=r"text\[2\]='é' cannot be typed"):
        keys_for_text("caé")


def test_typing_is_cut_to_fit_the_ps2_queue() -> None:
    # 16 bytes: four plain keys (make + break, up to 2 bytes each), two shifted characters, a big combo alone
    chunks = key_chunks([*keys_for_text("echo A>\n"), ["ctrl", "alt", "shift", "delete", "f1"]])
    assert chunks == [[["e"], ["c"], ["h"], ["o"]], [["spc"], ["shift", "a"]], [["shift", "dot"], ["ret"]],
                      [["ctrl", "alt", "shift", "delete", "f1"]]]
    assert key_chunks([]) == []


def test_key_combos() -> None:
    assert combo("ctrl+c") == ["ctrl", "c"]
    assert combo("Enter") == ["ret"]
    assert combo("ctrl+alt+delete") == ["ctrl", "alt", "delete"]
    for bad, why in (("", "non-empty"), ("ctrl+", "unknown key ''"), ("hyper", "unknown key 'hyper'")):
        with pytest.raises(InvalidRequest, match=why):
            combo(bad)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, DisplayBackend]]:
    vm = DisplayBackend(tmp_path / "vm")
    async with started(Engine(Settings(home=tmp_path / "home"),
                              {"container": FakeBackend(root=tmp_path / "fake"), "vm": vm}, FakeImages())) as eng:
        yield eng, vm


@pytest.fixture
async def client(engine: tuple[Engine, DisplayBackend]) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(engine[0]) as c:
        yield c


async def test_routes_reach_the_display(client: httpx.AsyncClient, engine: tuple[Engine, DisplayBackend]) -> None:
    r = await client.post("/v1/sandboxes", json={"image": "desk", "backend": "vm"})  # the backend's own image
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    shot = await client.get(f"/v1/sandboxes/{sid}/screenshot")
    assert shot.status_code == 200 and shot.headers["content-type"] == "image/png" and shot.content == tiny_png()
    assert (await client.post(f"/v1/sandboxes/{sid}/mouse", json={"x": 3, "y": 4, "action": "double_click"})
            ).status_code == 204
    assert (await client.post(f"/v1/sandboxes/{sid}/keyboard", json={"keys": ["ctrl+c"]})).status_code == 204
    assert (await client.post(f"/v1/sandboxes/{sid}/keyboard", json={"text": "ls\n"})).status_code == 204
    assert engine[1].inputs == [("mouse", 3, 4, "left", "double_click"), ("keyboard", None, ["ctrl+c"]),
                                ("keyboard", "ls\n", None)]


async def test_bad_input_is_400_and_sends_nothing(client: httpx.AsyncClient,
                                                  engine: tuple[Engine, DisplayBackend]) -> None:
    sid = (await client.post("/v1/sandboxes", json={"image": "desk", "backend": "vm"})).json()["id"]
    for path, body, field in (("mouse", {"x": -1, "y": 0}, "x"),
                              ("mouse", {"x": 1, "y": 1, "button": "side"}, "button"),
                              ("mouse", {"x": 1, "y": 1, "action": "lick"}, "action"),
                              ("keyboard", {"text": "a", "keys": ["b"]}, "exactly one"),
                              ("keyboard", {}, "exactly one"), ("keyboard", {"keys": []}, "keys")):
        r = await client.post(f"/v1/sandboxes/{sid}/{path}", json=body)
        assert r.status_code == 400 and field in r.text, (path, body, r.text)
    assert engine[1].inputs == []


async def test_backends_without_a_display_say_so(client: httpx.AsyncClient) -> None:
    sid = (await client.post("/v1/sandboxes", json={"image": "base"})).json()["id"]
    for method, path, body in (("GET", "screenshot", None), ("POST", "mouse", {"x": 1, "y": 1}),
                               ("POST", "keyboard", {"text": "x"})):
        r = await client.request(method, f"/v1/sandboxes/{sid}/{path}", json=body)
        assert r.status_code == 501, r.text
        assert r.json()["error"]["type"] == "NotSupported" and "has no display" in r.text


async def test_computer_use_is_logged_on_trajectories(client: httpx.AsyncClient,
                                                      engine: tuple[Engine, DisplayBackend]) -> None:
    eng, vm = engine
    r = await client.post("/v1/sandboxes", json={"image": "desk", "backend": "vm", "trajectory": "cu/1"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    calls = [("GET", "screenshot", None), ("POST", "mouse", {"x": 3, "y": 4}), ("POST", "keyboard", {"text": "ls\n"})]
    for seq, (method, path, body) in enumerate(calls):
        r = await client.request(method, f"/v1/sandboxes/{sid}/{path}", params={"seq": seq}, json=body)
        assert r.status_code in (200, 204), r.text
    log = (await client.get("/v1/trajectories/log", params={"name": "cu/1", "start": 0})).json()
    assert [(c["op"], c["status"]) for c in log] == [("screenshot", "done"), ("mouse", "done"), ("keyboard", "done")]
    assert '"x": 3' in (await eng.trajectories.log.store.entries("cu/1", 1, 1))[0].request.replace('":', '": ')
    sent = list(vm.inputs)
    # the same calls again (an agent replaying its rollout): answered from the log, nothing reaches the display
    shot = await client.get(f"/v1/sandboxes/{sid}/screenshot", params={"seq": 0})
    assert shot.content == tiny_png()
    for seq, (method, path, body) in enumerate(calls[1:], start=1):
        assert (await client.request(method, f"/v1/sandboxes/{sid}/{path}", params={"seq": seq}, json=body)
                ).status_code == 204
    assert vm.inputs == sent == [("mouse", 3, 4, "left", "click"), ("keyboard", "ls\n", None)]
    # a different action at a logged position is a divergence naming both
    r = await client.post(f"/v1/sandboxes/{sid}/keyboard", params={"seq": 2}, json={"text": "rm\n"})
    assert r.status_code == 409 and "ReplayDivergence" in r.text and "rm" in r.text, r.text
    assert vm.inputs == sent


async def test_input_cut_by_a_daemon_death_is_not_sent_again(tmp_path: Path) -> None:
    from dsec.models import KeyboardRequest, SandboxSpec
    from dsec.trajectory.digest import call_identity
    from dsec.trajectory.store import Entry

    def make() -> tuple[Engine, DisplayBackend]:
        return Engine(Settings(home=tmp_path / "home"), {"vm": vm}, FakeImages()), vm

    vm = DisplayBackend(tmp_path / "vm")
    first, _ = make()
    await first.start()
    info = await first.create(SandboxSpec(image="desk", backend="vm", trajectory="cu/2"))
    request = KeyboardRequest(text="halt\n")
    digest, readable = call_identity("keyboard", request.model_dump(mode="json", exclude_none=True))
    # what a daemon killed while sending the keys leaves: the call logged as running, no answer
    await first.trajectories.log.store.put_entry("cu/2", Entry(seq=0, op="keyboard", digest=digest, request=readable))
    await first.aclose()
    second, _ = make()
    await second.start()
    try:
        from dsec.errors import SandboxError

        with pytest.raises(SandboxError, match="may or may not have received it"):
            await second.keyboard(info.id, request, seq=0)
        assert vm.inputs == []
        info2 = await second.get(info.id)
        assert info2.trajectory is not None and info2.trajectory.calls == 1
    finally:
        await second.destroy_all()
        await second.aclose()


async def test_the_sdk_fast_forwards_through_computer_use(tmp_path: Path) -> None:
    from sdk_daemon import running_daemon

    import dsec

    vm = DisplayBackend(tmp_path / "vm")

    async def episode(sb: dsec.AsyncSandbox) -> bytes:
        shot = await sb.screenshot()
        await sb.mouse(5, 6, action="move")
        await sb.keyboard(keys=["ctrl+c"])
        return shot

    with running_daemon(tmp_path / "home", backends={"vm": vm}) as daemon:
        async with dsec.Client(daemon.unix_url) as client:
            first = await dsec.AsyncSandbox.create(image="desk", backend="vm", trajectory="sdk/cu", client=client)
            try:
                assert await episode(first) == tiny_png()
                sent = list(vm.inputs)
                again = await dsec.AsyncSandbox.create(image="desk", backend="vm", trajectory="sdk/cu",
                                                       client=client)
                assert again.id == first.id and again._cursor is not None
                assert await episode(again) == tiny_png()
                assert again._cursor.served == 3 and vm.inputs == sent  # answered from the log, nothing re-sent
                await again.keyboard(text="x")  # past the log: live, logged
                assert vm.inputs == [*sent, ("keyboard", "x", None)]
                info = await again.info()
                assert info.trajectory is not None and info.trajectory.calls == 4
            finally:
                await first.close()
