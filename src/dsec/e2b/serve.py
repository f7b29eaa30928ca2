"""Wiring an E2B listener into a node daemon or the cluster gateway.

Owns which keys a listener accepts (the node's tokens, or the gateway's jobs), where its envd-token key is
kept, and the settings handed to uvicorn: TLS, and an HTTP/1.1 protocol that lets the app reset a connection
(:data:`dsec.e2b.app.RESET`). It must never serve requests itself (:mod:`dsec.e2b.app`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsec.api.protocol import NodeAPI
from dsec.daemon.auth import TokenFile
from dsec.e2b.app import RESET, E2BApp
from dsec.e2b.keys import EnvdTokens, GatewayKeys, NodeKeys, load_secret
from dsec.e2b.options import E2BOptions

__all__ = ["ResettableHttp", "gateway_app", "node_app", "uvicorn_settings"]


def node_app(api: NodeAPI, options: E2BOptions, admin_token: str | None, tokens: TokenFile, home: Path) -> E2BApp:
    """The E2B app of a node daemon: API keys are its tokens; the envd-token key is kept in its home."""
    secret = load_secret(options.secret_file or home / "e2b-secret")
    return E2BApp(api, options, NodeKeys(admin_token, tokens), EnvdTokens(secret))


def gateway_app(api: NodeAPI, options: E2BOptions, by_token: dict[str, str],
                set_job: Callable[[str], Callable[[], None]]) -> E2BApp:
    """The E2B app of the cluster gateway: API keys are its jobs' tokens."""
    return E2BApp(api, options, GatewayKeys(by_token, set_job), EnvdTokens(load_secret(options.secret_file)))


class ResettableHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, with a way for the app to reset the connection (a TCP RST, not a FIN).

    A sandbox that dies mid-stream must look to the SDK like a dropped connection, as E2B's proxy resets the
    HTTP/2 stream: the SDK then probes the sandbox's health and says it was killed. Over HTTP/1.1 a clean
    close reads as a malformed response (a protocol error, no probe); a reset reads as a transport error."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {**(self.scope.get("extensions") or {}), RESET: {"reset": self._reset}}

    def _reset(self) -> None:
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # linger 0: close() discards what is unsent and sends RST
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


def uvicorn_settings(options: E2BOptions) -> dict[str, Any]:
    """uvicorn's settings for the listener: its HTTP protocol, and TLS when it has a certificate."""
    settings: dict[str, Any] = {"http": ResettableHttp}
    if options.tls_cert is not None:
        settings |= {"ssl_certfile": str(options.tls_cert), "ssl_keyfile": str(options.tls_key or options.tls_cert)}
    return settings
