"""A free TCP port for a server DSec starts (a test database, a local daemon, a benchmark's service).

Owns nothing but the probe; must never keep the port: the caller's server binds it right after, so a race
with another process is possible and the caller's start must report a bind failure clearly.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the kernel's pick of an ephemeral one)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
