"""The host side of the guest agent protocol treats the guest as hostile: bounded frames, strict parsing.

A fake agent on a real unix socket sends what a compromised guest could; a fuzz loop feeds the parser
random and mutated bytes. Neither may raise anything but ProtocolError, nor buffer past one frame."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dsec.backends.qemu.agent import GuestAgent
from dsec.errors import InvalidRequest, NotFound, SandboxError
from dsec.guest.protocol import (
    EXT_CREDIT,
    EXT_OUTPUT_CREDIT,
    FEATURE_CREDIT,
    FEATURE_OUTPUT_CREDIT,
    MAX_GUEST_PAYLOAD,
    OUTPUT_WINDOW,
    STDIN_WINDOW,
    AgentClient,
    AgentGone,
    FrameParser,
    ProtocolError,
    T,
    parse_exit,
    parse_list,
)
from dsec.models import ExecRequest, SandboxRecord, SandboxSpec


def frame(ftype: int, channel: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) + 5, ftype, channel) + payload


def test_parser_splits_frames_across_reads() -> None:
    data = frame(T.READY, 0) + frame(T.STDOUT, 3, b"hello") + frame(T.EXIT, 3, struct.pack(">iBB", 0, 0, 0))
    parser = FrameParser()
    got = [f for i in range(len(data)) for f in parser.feed(data[i:i + 1])]
    assert [(f.type, f.channel, f.payload) for f in got] == [
        (T.READY, 0, b""), (T.STDOUT, 3, b"hello"), (T.EXIT, 3, b"\0\0\0\0\0\0")]


@pytest.mark.parametrize("bad", [
    struct.pack(">I", 1 << 31) + b"x" * 5,                    # oversized length
    struct.pack(">I", MAX_GUEST_PAYLOAD + 6) + b"\x81" + b"\0" * 4,
    struct.pack(">I", 3) + b"abc",                            # shorter than a header
    frame(0x01, 1, b"host-only type"),                        # a host -> guest type
    frame(0xFF, 1),
])
def test_parser_rejects_malformed_frames(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        FrameParser().feed(bad)


def test_parser_fuzz() -> None:
    rng = random.Random(5)
    valid = frame(T.STDOUT, 1, b"x" * 100) + frame(T.EXIT, 1, b"\0\0\0\0\0\0")
    for _ in range(3000):
        data = bytearray(valid if rng.random() < 0.5 else os.urandom(rng.randrange(1, 300)))
        for _ in range(rng.randrange(0, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        parser = FrameParser()
        try:
            for f in parser.feed(bytes(data)):
                assert len(f.payload) <= MAX_GUEST_PAYLOAD
                for parse in (parse_exit, lambda p: parse_list("/d", p)):
                    with contextlib.suppress(ProtocolError):
                        parse(f.payload)
        except ProtocolError:
            pass
        assert len(parser._buf) <= MAX_GUEST_PAYLOAD + 9


def test_exit_and_list_payloads_are_checked() -> None:
    assert parse_exit(struct.pack(">iBB", 137, 9, 1)) == (137, 9, True)
    assert parse_exit(struct.pack(">iBB", 3, 0, 0)) == (3, None, False)
    for bad in (b"", b"\0" * 5, struct.pack(">iBB", -1, 0, 0), struct.pack(">iBB", 0, 200, 0),
                struct.pack(">iBB", 0, 0, 7)):
        with pytest.raises(ProtocolError):
            parse_exit(bad)
    rec = struct.pack(">BIQQH", ord("f"), 0o100644, 5, 10**18, 3) + b"a.t"
    [entry] = parse_list("/w", rec)
    assert (entry.name, entry.path, entry.type, entry.size, entry.mode) == ("a.t", "/w/a.t", "file", 5, 0o644)
    for bad in (rec[:-1], struct.pack(">BIQQH", ord("f"), 0, 0, 0, 3) + b"../",
                struct.pack(">BIQQH", ord("?"), 0, 0, 0, 1) + b"a",
                struct.pack(">BIQQH", ord("f"), 0, 0, 0, 2) + b".."):
        with pytest.raises(ProtocolError):
            parse_list("/w", bad)


async def with_fake_agent(script: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                          body: Callable[[AgentClient], Awaitable[None]]) -> None:
    """Serve ``script`` on a real unix socket and run ``body`` against an AgentClient connected to it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "agent.sock")
        async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await script(reader, writer)
            except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
                pass  # the client hung up (the end of every test), or the server is closing
            finally:
                writer.close()

        server = await asyncio.start_unix_server(guarded, path)
        try:
            client = await AgentClient.connect(path)
            try:
                await asyncio.wait_for(body(client), 10)
            finally:
                await client.aclose()
        finally:
            server.close()
            await server.wait_closed()


async def test_oversized_frame_ends_the_connection_with_a_reason() -> None:
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0))
        await reader.read(100)  # the exec request
        writer.write(struct.pack(">IBI", 1 << 30, T.STDOUT, 1) + b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        channel = await client.start_exec(["true"], {}, "/")
        with pytest.raises(AgentGone, match="frame of 1073741824 bytes"):
            await client.next_frame(channel)
        with pytest.raises(AgentGone):
            await client.read("/x", 10)

    await with_fake_agent(agent, body)


async def test_guest_sending_more_than_asked_is_refused() -> None:
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await reader.readexactly(9)
        _, _, channel = struct.unpack(">IBI", header)
        await reader.readexactly(struct.unpack(">I", header[:4])[0] - 5)
        for _ in range(3):
            writer.write(frame(T.DATA, channel, b"z" * 8))
        writer.write(frame(T.END, channel))
        await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        with pytest.raises(ProtocolError, match="more than the 10 bytes"):
            await client.read("/f", 10)

    await with_fake_agent(agent, body)


async def test_guest_errors_map_to_dsec_errors() -> None:
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for errno_ in (2, 21):
            header = await reader.readexactly(9)
            length, _, channel = struct.unpack(">IBI", header)
            await reader.readexactly(length - 5)
            writer.write(frame(T.ERROR, channel, struct.pack(">I", errno_) + b"guest says no"))
            await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        with pytest.raises(NotFound):
            await client.read("/missing", 10)
        with pytest.raises(InvalidRequest, match="is a directory"):
            await client.read("/dir", 10)

    await with_fake_agent(agent, body)


async def test_pristine_exec_frame_and_the_vm_backends_refusal() -> None:
    seen: list[int] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0))
        await writer.drain()
        header = await reader.readexactly(9)
        seen.append(header[4])
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        await client.start_exec(["true"], {}, "/", pristine=True)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)

    await with_fake_agent(agent, body)
    assert seen == [T.EXEC_PRISTINE]
    # the vm backend runs pristine execs only in a confined sandbox (with grading paths): a clear refusal
    from dsec.backends.vm import VMBackend
    from dsec.config import Settings
    from dsec.errors import NotSupported
    from dsec.models import ExecRequest, SandboxRecord, SandboxSpec

    record = SandboxRecord(id="sb-x", spec=SandboxSpec(image="x"), state="running", created_at=0, expires_at=0)
    with pytest.raises(NotSupported, match="pristine execs on the vm backend need a confined sandbox"):
        async for _ in VMBackend(Settings(home=Path(tempfile.gettempdir()))).exec_stream(
                record, ExecRequest(command="true", pristine=True)):
            pass


async def test_system_exec_and_vm_confine_frames() -> None:
    """The vm backend's upkeep goes as EXEC_SYSTEM, and its CONFINE carries the full-VM entries after the paths;
    only sandboxes with grading paths are confined there."""
    seen: list[tuple[int, bytes]] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0))
        await writer.drain()
        for _ in range(2):
            header = await reader.readexactly(9)
            length, kind, channel = struct.unpack(">IBI", header)
            seen.append((kind, await reader.readexactly(length - 5)))
            if kind == T.CONFINE:
                writer.write(frame(T.DATA, channel, b"/workspace/tests\0") + frame(T.END, channel))
                await writer.drain()
        await asyncio.sleep(5)

    from dsec.backends.vm import VMBackend
    from dsec.config import Settings
    from dsec.models import SandboxRecord, SandboxSpec

    backend = VMBackend(Settings(home=Path(tempfile.gettempdir())))
    plain = SandboxRecord(id="sb-x", spec=SandboxSpec(image="x"), state="running", created_at=0, expires_at=0)
    graded = SandboxRecord(id="sb-y", spec=SandboxSpec(image="x", hidden=["/workspace/tests"]), state="running",
                           created_at=0, expires_at=0)
    assert not backend.profile.confines(plain) and backend.profile.confines(graded)
    extra = backend.profile.confine_extra(graded)
    assert ("T", "/run") in extra and ("B", "/dev") in extra and ("W", "/workspace") in extra
    assert len([p for kind, p in extra if kind == "W"]) == len({p for kind, p in extra if kind == "W"})

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        await client.start_exec(["date"], {}, "/", system=True)
        assert await client.confine([], ["/workspace/tests"], extra) == ["/workspace/tests"]

    await with_fake_agent(agent, body)
    assert seen[0][0] == T.EXEC_SYSTEM
    assert seen[1] == (T.CONFINE, b"H/workspace/tests\0" + b"".join(k.encode() + p.encode() + b"\0" for k, p in extra))


def test_a_vm_image_built_with_another_agent_is_refused(tmp_path: Path) -> None:
    """The vm backend refuses an image whose recorded recipe (agent, units) is not this code's, naming the
    rebuild; the current recipe is accepted."""
    import json

    from dsec.backends.vm import VMBackend
    from dsec.config import Settings
    from dsec.errors import BackendUnavailable
    from dsec.guest.vmimage import recipe_digest

    d = tmp_path / "images" / "old"
    d.mkdir(parents=True)
    for f in ("disk.qcow2", "vmlinuz", "initrd.img"):
        (d / f).write_bytes(b"")
    (d / "image.json").write_text(json.dumps({"name": "old", "desktop": True}))
    backend = VMBackend(Settings(home=tmp_path / "home"), vm_dir=tmp_path)
    with pytest.raises(BackendUnavailable, match="dsec image build-vm old --desktop --replace"):
        backend.resolve_image("old")
    (d / "image.json").write_text(json.dumps({"name": "old", "desktop": True, "recipe": recipe_digest(True)}))
    assert backend.resolve_image("old").rootfs == d


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    length, kind, channel = struct.unpack(">IBI", await reader.readexactly(9))
    return kind, channel, await reader.readexactly(length - 5)


async def test_stdin_keeps_to_the_window_the_agent_credits() -> None:
    """An agent announcing credit gets its commands as EXEC_EXT asking for it, and never more stdin in flight than
    the window however slowly it credits; a command's exit ends the window (the rest of its stdin is moot)."""
    size = 3 * STDIN_WINDOW + 12345
    seen: dict[str, int] = {"in_flight": 0, "received": 0}

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT)))
        kind, channel, payload = await read_frame(reader)
        assert kind == T.EXEC_EXT and struct.unpack_from(">I", payload, 4)[0] & EXT_CREDIT
        credited = 0
        while True:
            kind, _, payload = await read_frame(reader)
            if not payload:
                break
            assert kind == T.STDIN
            seen["received"] += len(payload)
            seen["in_flight"] = max(seen["in_flight"], seen["received"] - credited)
            await asyncio.sleep(0.001)  # a slow command
            writer.write(frame(T.CREDIT, channel, struct.pack(">I", len(payload))))
            credited += len(payload)
        writer.write(frame(T.EXIT, channel, struct.pack(">iBB", 0, 0, 0)))
        # a second command exits without reading, and credits nothing (the agent still reads the port)
        _, channel, _ = await read_frame(reader)
        await read_frame(reader)
        writer.write(frame(T.EXIT, channel, struct.pack(">iBB", 0, 0, 0)))
        await writer.drain()
        while True:
            await read_frame(reader)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        assert client.credits
        channel = await client.start_exec(["wc", "-c"], {}, "/")
        assert await client.stdin(channel, b"s" * size)
        await client.send(T.STDIN, channel, b"")
        assert (await client.next_frame(channel, 5)).type == T.EXIT
        channel = await client.start_exec(["true"], {}, "/")
        assert not await client.stdin(channel, b"t" * size)  # ended by its exit, not hung

    await with_fake_agent(agent, body)
    assert seen["received"] == size and 0 < seen["in_flight"] <= STDIN_WINDOW


async def test_a_stdin_write_cancelled_before_it_was_sent_takes_no_room() -> None:
    """A write cancelled while another holds the port sent nothing: it must not shrink the window for good."""
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT)))
        while True:
            await read_frame(reader)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        channel = await client.start_exec(["cat"], {}, "/")
        window = client._windows[channel]
        async with client._write_lock:  # another channel's write holds the port
            write = asyncio.create_task(client.stdin(channel, b"x" * 1000))
            await asyncio.sleep(0.05)
            write.cancel()
            with pytest.raises(asyncio.CancelledError):
                await write
        assert window.unacked == 0
        assert await client.stdin(channel, b"y" * 10) and window.unacked == 10  # what was sent is counted

    await with_fake_agent(agent, body)


async def test_credit_for_stdin_never_sent_ends_the_connection() -> None:
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT)))
        _, channel, _ = await read_frame(reader)
        await read_frame(reader)
        writer.write(frame(T.CREDIT, channel, struct.pack(">I", 1 << 30)))
        await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        channel = await client.start_exec(["cat"], {}, "/")
        await client.stdin(channel, b"abc")
        with pytest.raises(AgentGone, match="credited 1073741824 bytes of stdin with 3 in flight"):
            await client.next_frame(channel, 5)

    await with_fake_agent(agent, body)


async def test_an_agent_without_credit_gets_the_older_protocol_and_a_clear_error() -> None:
    """An agent older than credit (a snapshot's, a hibernated guest's, a VM adopted after an upgrade) announces
    nothing: commands go as EXEC, stdin as fast as the port takes it, and its ENOBUFS refusal is named as such."""
    kinds: list[int] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0))
        kind, channel, _ = await read_frame(reader)
        kinds.append(kind)
        received = 0
        while received < (9 << 20):
            kind, _, payload = await read_frame(reader)
            received += len(payload)
        writer.write(frame(T.ERROR, channel, struct.pack(">I", errno.ENOBUFS) + b"stdin: No buffer space available"))
        await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        assert not client.credits
        machines = cast(Any, SimpleNamespace(client=lambda record: client, why_gone=None))
        guest = GuestAgent(machines, cast(Any, None))  # (the profile only matters to pristine execs)
        record = SandboxRecord(id="sb-old", spec=SandboxSpec(image="x"), state="running", created_at=0, expires_at=0)
        with pytest.raises(SandboxError, match="guest agent is older than this DSec: it takes at most 8 MiB"):
            await guest.exec(record, ExecRequest(command="sleep 9; wc -c", stdin=b"o" * (12 << 20)))

    await with_fake_agent(agent, body)
    assert kinds == [T.EXEC]


async def test_output_keeps_to_the_window_the_host_credits() -> None:
    """An agent announcing output credit gets commands asking for it; the host queues at most the window of a
    channel whose consumer does not read (the agent, keeping to it, waits), credits in batches of half the window as
    the consumer takes frames, and sees the exit after all of the output, in order. A channel given up before its
    end is released (the agent must not wait for credit that never comes)."""
    total, chunk = 8 * OUTPUT_WINDOW + 1000, MAX_GUEST_PAYLOAD
    credits: list[int] = []
    blocked = asyncio.Event()
    released: list[int] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT | FEATURE_OUTPUT_CREDIT)))
        kind, channel, payload = await read_frame(reader)
        assert kind == T.EXEC_EXT and struct.unpack_from(">I", payload, 4)[0] & EXT_OUTPUT_CREDIT
        sent = unacked = 0
        pending = asyncio.ensure_future(read_frame(reader))
        while sent < total:
            room = min(OUTPUT_WINDOW - unacked, chunk, total - sent)
            if room:
                writer.write(frame(T.STDOUT, channel, bytes([sent // chunk % 251]) * room))
                sent += room
                unacked += room
                await writer.drain()
                continue
            blocked.set()
            kind, ch, payload = await pending  # the window is full: wait for the host's credit
            pending = asyncio.ensure_future(read_frame(reader))
            if kind == T.STDIN:
                continue  # (the end of its stdin)
            assert (kind, ch) == (T.OUT_CREDIT, channel)
            credits.append(struct.unpack(">I", payload)[0])
            unacked -= credits[-1]
            assert unacked >= 0
        writer.write(frame(T.EXIT, channel, struct.pack(">iBB", 0, 0, 0)))
        kind, channel, _ = await pending  # a second command, given up before it ends
        assert kind == T.EXEC_EXT
        writer.write(frame(T.STDOUT, channel, b"x" * 10))
        while True:
            kind, ch, payload = await read_frame(reader)
            if kind == T.OUT_CREDIT and ch == channel:
                released.append(struct.unpack(">I", payload)[0])

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        assert client.output_credits
        channel = await client.start_exec(["yes"], {}, "/")
        await asyncio.wait_for(blocked.wait(), 5)
        await asyncio.sleep(0.1)
        assert client.queued(channel) == OUTPUT_WINDOW and credits == []  # held to the window, nothing credited
        got = bytearray()
        while (f := await client.next_frame(channel, 5)).type == T.STDOUT:
            got += f.payload
            assert client.queued(channel) <= OUTPUT_WINDOW
        assert f.type == T.EXIT and len(got) == total
        assert got == b"".join(bytes([i % 251]) * min(chunk, total - i * chunk) for i in range(-(-total // chunk)))
        client.close_channel(channel)
        channel = await client.start_exec(["yes"], {}, "/")
        assert (await client.next_frame(channel, 5)).payload == b"x" * 10
        client.close_channel(channel)
        for _ in range(50):
            if released:
                break
            await asyncio.sleep(0.02)

    await with_fake_agent(agent, body)
    assert credits and all(c >= OUTPUT_WINDOW // 2 for c in credits)  # batched, not per frame
    assert sum(credits) <= total and released == [0xFFFFFFFF]


async def test_output_past_the_window_ends_the_connection() -> None:
    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT | FEATURE_OUTPUT_CREDIT)))
        _, channel, _ = await read_frame(reader)
        for _ in range(OUTPUT_WINDOW // MAX_GUEST_PAYLOAD + 1):
            writer.write(frame(T.STDOUT, channel, b"y" * MAX_GUEST_PAYLOAD))
        await writer.drain()
        await asyncio.sleep(5)

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        channel = await client.start_exec(["yes"], {}, "/")
        with pytest.raises(AgentGone, match="bytes of output past a window"):
            while True:
                await client.next_frame(channel, 5)

    await with_fake_agent(agent, body)


async def test_an_agent_without_output_credit_is_neither_asked_nor_credited() -> None:
    """A stdin-credit-only agent (or an older one) gets no output flag and no OUT_CREDIT: output flows as before."""
    seen: list[int] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(T.READY, 0, struct.pack(">I", FEATURE_CREDIT)))
        kind, channel, payload = await read_frame(reader)
        assert kind == T.EXEC_EXT and not struct.unpack_from(">I", payload, 4)[0] & EXT_OUTPUT_CREDIT
        for _ in range(3 * OUTPUT_WINDOW // MAX_GUEST_PAYLOAD):
            writer.write(frame(T.STDOUT, channel, b"z" * MAX_GUEST_PAYLOAD))
        writer.write(frame(T.EXIT, channel, struct.pack(">iBB", 0, 0, 0)))
        while True:
            seen.append((await read_frame(reader))[0])

    async def body(client: AgentClient) -> None:
        await client.wait_ready(5)
        channel = await client.start_exec(["yes"], {}, "/")
        total = 0
        while (f := await client.next_frame(channel, 5)).type == T.STDOUT:
            total += len(f.payload)
        assert total == 3 * OUTPUT_WINDOW
        client.close_channel(channel)
        await asyncio.sleep(0.1)

    await with_fake_agent(agent, body)
    assert T.OUT_CREDIT not in seen
