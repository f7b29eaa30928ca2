"""Reaching a port inside a sandbox's network namespace from the host, whatever the sandbox's network policy.

Owns :func:`connect_in_netns`: a socket is created inside the sandbox's network namespace by one dedicated
thread that enters the namespace, makes the socket and returns to the host's (a socket keeps the namespace
it was made in), and is then connected to the sandbox's own loopback from the event loop. Nothing is routed,
forwarded or opened for the sandbox: a ``network="none"`` sandbox still has no way out; this is the node's
way in. :class:`SocketStream` is such a connection as a :class:`~dsec.backends.surface.PortStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from dsec.errors import SandboxError

__all__ = ["SocketStream", "connect_in_netns"]

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-netns")
_host_netns: int | None = None
_lock = threading.Lock()


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _socket_in(netns_path: str) -> socket.socket:
    """A TCP socket of the network namespace at ``netns_path`` (runs on the dedicated thread only)."""
    global _host_netns
    with _lock:
        if _host_netns is None:
            _host_netns = os.open(f"/proc/{os.getpid()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        finally:
            try:
                _setns(_host_netns)
            except OSError:  # cannot happen (we came from there); a thread left elsewhere must not be reused
                os._exit(70)
    finally:
        os.close(target)


async def connect_in_netns(netns_path: str, port: int, host: str = "127.0.0.1") -> SocketStream:
    """A connected, non-blocking socket to ``host:port`` inside the namespace ``netns_path``
    (``/proc/<pid>/ns/net``); ConnectionRefusedError when nothing listens there."""
    loop = asyncio.get_running_loop()
    try:
        sock = await loop.run_in_executor(_executor, _socket_in, netns_path)
    except FileNotFoundError:
        raise SandboxError("the sandbox's network namespace is gone (it is not running)") from None
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return SocketStream(sock)


class SocketStream:
    """A connected non-blocking socket as a port stream (``socket``: for callers that splice it themselves)."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._loop = asyncio.get_running_loop()

    async def read(self, n: int) -> bytes:
        return await self._loop.sock_recv(self.socket, n)

    async def write(self, data: bytes) -> None:
        await self._loop.sock_sendall(self.socket, data)

    async def write_eof(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        self.socket.close()
