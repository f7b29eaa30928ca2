"""Wiring an E2B listener into a node daemon or the cluster gateway.

Owns which keys a listener accepts (the node's tokens, or the gateway's jobs), where its envd-token key is
kept, and the TLS settings handed to uvicorn. It must never serve requests itself (:mod:`dsec.e2b.app`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.api.protocol import NodeAPI
from dsec.daemon.auth import TokenFile
from dsec.e2b.app import E2BApp
from dsec.e2b.keys import EnvdTokens, GatewayKeys, NodeKeys, load_secret
from dsec.e2b.options import E2BOptions

__all__ = ["gateway_app", "node_app", "uvicorn_tls"]


def node_app(api: NodeAPI, options: E2BOptions, admin_token: str | None, tokens: TokenFile, home: Path) -> E2BApp:
    """The E2B app of a node daemon: API keys are its tokens; the envd-token key is kept in its home."""
    secret = load_secret(options.secret_file or home / "e2b-secret")
    return E2BApp(api, options, NodeKeys(admin_token, tokens), EnvdTokens(secret))


def gateway_app(api: NodeAPI, options: E2BOptions, by_token: dict[str, str],
                set_job: Callable[[str], Callable[[], None]]) -> E2BApp:
    """The E2B app of the cluster gateway: API keys are its jobs' tokens."""
    return E2BApp(api, options, GatewayKeys(by_token, set_job), EnvdTokens(load_secret(options.secret_file)))


def uvicorn_tls(options: E2BOptions) -> dict[str, Any]:
    """uvicorn's TLS settings for the listener (none without a certificate)."""
    if options.tls_cert is None:
        return {}
    return {"ssl_certfile": str(options.tls_cert), "ssl_keyfile": str(options.tls_key or options.tls_cert)}
