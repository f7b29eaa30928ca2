"""A QMP client for one QEMU's monitor socket: a short-lived connection per batch of commands.

Owns the wire format of QMP (greeting, ``qmp_capabilities``, one reply per command, events skipped) and the
passing of a file descriptor with the first command (``getfd``); must never keep a connection open between
calls, nor know what the commands mean.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

from dsec.errors import SandboxError

__all__ = ["qmp"]


async def qmp(rundir: Path, commands: list[tuple[str, dict[str, Any]]], fd: int | None = None) -> list[Any]:
    """Run QMP commands on one connection to ``rundir/qmp.sock``; ``fd`` rides along the first command (for
    ``getfd``). Returns each command's ``return``; any failure is a :class:`SandboxError` naming the command."""
    try:
        return await _qmp_once(rundir, commands, fd)
    except (OSError, ValueError, TimeoutError) as e:
        raise SandboxError(f"QEMU's monitor failed ({commands[0][0]}): {e}") from None


async def _qmp_once(rundir: Path, commands: list[tuple[str, dict[str, Any]]], fd: int | None) -> list[Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(500):
            try:
                await loop.sock_connect(sock, str(rundir / "qmp.sock"))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.01)
        else:
            raise SandboxError("QEMU's QMP socket did not open")
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        try:
            await asyncio.wait_for(reader.readline(), 10)
            out = []
            for i, (name, args) in enumerate([("qmp_capabilities", {}), *commands]):
                data = json.dumps({"execute": name, "arguments": args}).encode() + b"\n"
                if fd is not None and i == 1:
                    await writer.drain()
                    # a few hundred bytes on an idle socket: sendmsg does not block
                    socket.send_fds(sock, [data], [fd])
                else:
                    writer.write(data)
                    await writer.drain()
                reply = await _reply(reader, name)
                if "error" in reply:
                    raise SandboxError(f"QMP {name} failed: {reply['error'].get('desc')}")
                out.append(reply.get("return"))
            return out[1:]
        finally:
            writer.close()
    finally:
        sock.close()


async def _reply(reader: asyncio.StreamReader, name: str) -> dict[str, Any]:
    """The reply to the command just sent (events in between are skipped)."""
    while True:
        line = await asyncio.wait_for(reader.readline(), 30)
        if not line:
            raise SandboxError(f"QEMU closed QMP during {name}")
        reply: dict[str, Any] = json.loads(line)
        if "event" not in reply:
            return reply
