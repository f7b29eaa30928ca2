"""Commands of ``dsec`` on a running sandbox's surface: ``expose``, ``ports``, ``unexpose``, ``forward``, and
the interactive terminal behind ``dsec exec -t``.

Everything goes through the SDK (:class:`dsec.AsyncSandbox`): ports through ``expose``/``ports``/``unexpose``,
the terminal through ``sb.pty`` (its output copied to this terminal, which is put in raw mode, what is typed
sent as its input, this window's size followed with ``resize``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import tty
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from dsec._sdk.sandbox import AsyncSandbox
    from dsec.models.surface import PortInfo

__all__ = ["register", "terminal_session"]

T = TypeVar("T")


def _with_sandbox(sandbox_id: str, work: Callable[[AsyncSandbox], Coroutine[Any, Any, T]]) -> T:
    """Run ``work`` on the sandbox ``sandbox_id`` (through ``DSEC_URL`` / ``DSEC_TOKEN``) on a private loop."""
    from dsec._sdk.client import Client
    from dsec._sdk.sandbox import AsyncSandbox

    async def main() -> T:
        async with Client() as client:
            return await work(await AsyncSandbox.connect(sandbox_id, client=client))

    return asyncio.run(main())


def _port_line(info: PortInfo) -> str:
    if info.url is not None:
        return f"{info.port}/http  {info.url}  (header X-DSec-Token: {info.token}; browser: {info.authenticated_url})"
    return f"{info.port}/tcp   {info.address}  (first line of each connection: DSEC {info.token})"


@click.command()
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--tcp", is_flag=True, help="Raw TCP (default: HTTP, WebSocket upgrades included).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def expose(sandbox_id: str, port: int, tcp: bool, as_json: bool) -> None:
    """Make PORT inside a sandbox reachable through the node (with the sandbox's token; never open to all)."""

    async def work(sb: AsyncSandbox) -> PortInfo:
        return await sb.expose(port, "tcp" if tcp else "http")

    info = _with_sandbox(sandbox_id, work)
    click.echo(info.model_dump_json() if as_json else _port_line(info))


@click.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ports(sandbox_id: str, as_json: bool) -> None:
    """A sandbox's exposed ports and how to reach them."""

    async def work(sb: AsyncSandbox) -> list[PortInfo]:
        return await sb.ports()

    infos = _with_sandbox(sandbox_id, work)
    if as_json:
        click.echo(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        return
    for info in infos:
        click.echo(_port_line(info))


@click.command()
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
def unexpose(sandbox_id: str, port: int) -> None:
    """Stop forwarding PORT of a sandbox (its open connections end)."""

    async def work(sb: AsyncSandbox) -> None:
        await sb.unexpose(port)

    _with_sandbox(sandbox_id, work)


@click.command()
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--local", "local", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Local port to listen on (127.0.0.1; 0: any free one).")
def forward(sandbox_id: str, port: int, local: int) -> None:
    """Listen on 127.0.0.1 and carry each connection to PORT inside a sandbox (its token sent for you), until
    interrupted: for tools that cannot send a header or a first line (ssh, a database client...)."""

    async def work(sb: AsyncSandbox) -> None:
        current = {p.port: p for p in await sb.ports()}.get(port)
        info = current if current is not None and current.protocol == "tcp" else await sb.expose(port, "tcp")
        preamble = f"DSEC {info.token}\n".encode()

        async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(info.host, info.host_port)
            except OSError as exc:
                Console(stderr=True).print(f"[red]error: {escape(str(exc))}[/red]")
                writer.close()
                return
            up_writer.write(preamble)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        server = await asyncio.start_server(carry, "127.0.0.1", local)
        bound = server.sockets[0].getsockname()[1]
        click.echo(f"127.0.0.1:{bound} -> {sandbox_id}:{port} (Ctrl-C to stop)")
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        _with_sandbox(sandbox_id, work)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


def terminal_session(sandbox_id: str, command: str | list[str] | None, user: str | None, cwd: str | None,
                     env: Mapping[str, str] | None) -> int:
    """``dsec exec -t``: ``command`` on a terminal in the sandbox, wired to this one; its exit code."""

    async def work(sb: AsyncSandbox) -> int:
        size = shutil.get_terminal_size()
        term = {"TERM": os.environ.get("TERM", "xterm-256color")}
        proc = await sb.pty(size.columns, size.lines, user=user, cwd=cwd, env={**term, **(env or {})},
                            command=command)
        loop = asyncio.get_running_loop()
        fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
        typed: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            assert fd is not None
            data = os.read(fd, 65536)
            if not data:
                loop.remove_reader(fd)  # this side's input ended: so does the terminal's
            typed.put_nowait(data)

        async def send() -> None:
            while data := await typed.get():
                await proc.send_stdin(data)
            await proc.close_stdin()

        resizes: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

        def resized() -> None:
            now = shutil.get_terminal_size()
            task = loop.create_task(proc.resize(now.columns, now.lines))
            resizes.add(task)
            task.add_done_callback(resizes.discard)

        saved = termios.tcgetattr(fd) if fd is not None else None
        sender = loop.create_task(send())
        try:
            if fd is not None:
                tty.setraw(fd, termios.TCSADRAIN)  # as ssh: what was typed before the terminal was up is kept
                loop.add_reader(fd, readable)
                loop.add_signal_handler(signal.SIGWINCH, resized)
            out = sys.stdout.buffer
            async for data in proc.stdout():
                out.write(data)
                out.flush()
        finally:
            if fd is not None and saved is not None:
                loop.remove_reader(fd)
                loop.remove_signal_handler(signal.SIGWINCH)
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            sender.cancel()
        done = await proc.wait()
        return done.exit_code if done.exit_code is not None else 128 + (done.signal or 0)

    return _with_sandbox(sandbox_id, work)


def register(group: click.Group) -> None:
    """Add the surface commands to the ``dsec`` group."""
    for command in (expose, ports, unexpose, forward):
        group.add_command(command)
