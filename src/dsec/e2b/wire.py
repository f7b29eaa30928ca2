"""The E2B wire definitions: the envd messages and Connect services, and the protocol's constants.

Owns the one import of E2B's generated modules. They come from the pinned ``e2b`` wheel (``pip install
'dsec[e2b]'``): the SDK's own messages, so the facade can never drift from the client it serves. This
module must never define a message of its own or frame Connect RPC by hand.
"""

from __future__ import annotations

from typing import Any

from dsec.errors import BackendUnavailable

__all__ = [
    "ENVD_PORT",
    "ENVD_VERSION",
    "Code",
    "ConnectError",
    "Oneof",
    "RequestContext",
    "filesystem_connect",
    "filesystem_pb",
    "process_connect",
    "process_pb",
]

ENVD_PORT = 49983
"""The port envd listens on inside an E2B sandbox; the SDK names it in ``E2b-Sandbox-Port``."""

ENVD_VERSION = "0.6.4"
"""The envd version the facade reports. It decides which protocol features the SDK uses: default user
(0.4.0), stdin control (0.3.0, 0.5.2), octet-stream uploads (0.5.7), watch events with entries (0.6.3) and
on network mounts (0.6.4). File metadata (0.6.2, xattrs) comes with it: DSec's files API has no xattrs,
so an upload carrying metadata is refused (``/files``) rather than silently losing it."""

try:
    from connectrpc.code import Code
    from connectrpc.errors import ConnectError
    from connectrpc.request import RequestContext
    from e2b.envd.filesystem import filesystem_connect, filesystem_pb
    from e2b.envd.process import process_connect, process_pb
    from protobuf import Oneof
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    _missing = exc

    def __getattr__(name: str) -> Any:
        raise BackendUnavailable(
            f"the E2B endpoint needs the e2b SDK's wire modules ({_missing}): pip install 'dsec[e2b]'",
            package="dsec[e2b]",
        )
