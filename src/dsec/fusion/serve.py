"""Wiring a SandboxFusion listener into a node daemon or the cluster gateway.

Owns the listener's options (address, image, memory) and which keys it accepts (the node's tokens, or the
gateway's jobs). It must never serve requests itself (:mod:`dsec.fusion.app`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastapi import FastAPI

from dsec.api.protocol import NodeAPI
from dsec.daemon.auth import TokenFile
from dsec.e2b.keys import GatewayKeys, NodeKeys

from .app import create_fusion_app
from .options import FusionOptions
from .runner import FusionRunner

__all__ = ["gateway_app", "node_app"]

def node_app(api: NodeAPI, options: FusionOptions, admin_token: str | None, tokens: TokenFile,
             node: str | None = None) -> FastAPI:
    """The SandboxFusion app of a node daemon: its tokens are the keys; ``node`` is its answers'
    ``executor_pod_name``."""
    settings = options.runner if node is None else dataclasses.replace(options.runner, node=node)
    return create_fusion_app(FusionRunner(api, settings), NodeKeys(admin_token, tokens))


def gateway_app(api: NodeAPI, options: FusionOptions, by_token: dict[str, str],
                set_job: Callable[[str], Callable[[], None]]) -> FastAPI:
    """The SandboxFusion app of the cluster gateway: its jobs' tokens are the keys."""
    return create_fusion_app(FusionRunner(api, options.runner), GatewayKeys(by_token, set_job))
