"""Who is calling: an E2B API key is a DSec token, and an envd access token opens one sandbox.

Owns the key -> principal lookup (the node's admin token and token file, or the cluster gateway's jobs),
the scoping rule (a job's key sees the sandboxes labelled ``dsec.job=<job>``, as a job token does on the
node API), and the envd access tokens and signed file URLs of E2B. It must never decide anything about a
sandbox beyond whether this caller may see it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dsec.daemon.auth import JOB_LABEL, TokenFile
from dsec.errors import Unauthorized

__all__ = ["JOB_LABEL", "PRIVATE_TRAFFIC_LABEL", "EnvdTokens", "GatewayKeys", "Keys", "NodeKeys", "Principal",
           "load_secret"]

PRIVATE_TRAFFIC_LABEL = "dsec.e2b.private-traffic"
"""The label of a sandbox created with ``allowPublicTraffic: false``: its ports ask for its traffic token."""


@dataclass(frozen=True)
class Principal:
    """The caller behind an API key."""

    name: str
    """The token's name (the audit trail's ``who``)."""
    job: str | None
    """The job its sandboxes belong to; None for an admin token, which sees every sandbox."""

    def owns(self, labels: dict[str, str]) -> bool:
        """Whether a sandbox with these labels is this caller's."""
        return self.job is None or labels.get(JOB_LABEL) == self.job


class Keys(Protocol):
    """API key -> principal, and the context a call on behalf of that principal runs in."""

    def principal(self, key: str) -> Principal | None:
        """The principal of ``key``, or None when the key is unknown."""

    def acting(self, principal: Principal) -> contextlib.AbstractContextManager[None]:
        """Context for calls made for ``principal`` (the gateway's engine reads the job from it)."""


class NodeKeys:
    """A node daemon's keys: its admin token and the job and admin tokens of its token file."""

    def __init__(self, admin_token: str | None, tokens: TokenFile | None) -> None:
        self._admin = admin_token
        self._tokens = tokens

    def principal(self, key: str) -> Principal | None:
        """The admin token, or an entry of the token file."""
        if self._admin and secrets.compare_digest(key.encode(), self._admin.encode()):
            return Principal("admin", None)
        entry = self._tokens.lookup(key) if self._tokens is not None else None
        if entry is None:
            return None
        return Principal(entry.name, entry.job if entry.scope == "job" else None)

    @contextlib.contextmanager
    def acting(self, principal: Principal) -> Iterator[None]:
        """The node's engine trusts its caller: scoping is done by the facade."""
        yield


class GatewayKeys:
    """The cluster gateway's keys: its jobs file (token -> job; ``admin`` sees every job)."""

    def __init__(self, by_token: dict[str, str], set_job: Callable[[str], Callable[[], None]]) -> None:
        self._by_token = by_token
        self._set_job = set_job

    def principal(self, key: str) -> Principal | None:
        """The job whose token ``key`` is."""
        found = None
        for known, job in self._by_token.items():
            if secrets.compare_digest(key.encode(), known.encode()):
                found = job
        if found is None:
            return None
        return Principal(found, None if found == "admin" else found)

    @contextlib.contextmanager
    def acting(self, principal: Principal) -> Iterator[None]:
        """The gateway's engine scopes by its current job."""
        reset = self._set_job(principal.job or "admin")
        try:
            yield
        finally:
            reset()


def load_secret(path: Path | None) -> bytes:
    """The key that signs envd access tokens: read from ``path`` (created 0600 with a fresh key when missing);
    a fresh key when ``path`` is None."""
    if path is None:
        return secrets.token_bytes(32)
    with contextlib.suppress(FileNotFoundError):
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


class EnvdTokens:
    """Envd access tokens (``X-Access-Token``): an HMAC of the sandbox id, so a token opens that sandbox's
    envd only, and the v1 signatures of E2B's signed file URLs, which are derived from it."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def token(self, sandbox_id: str) -> str:
        """The access token of ``sandbox_id``'s envd."""
        return "ea1_" + hmac.new(self._secret, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def check(self, sandbox_id: str, given: str) -> bool:
        """Whether ``given`` is that token."""
        return secrets.compare_digest(given.encode(), self.token(sandbox_id).encode())

    def traffic_token(self, sandbox_id: str, labels: dict[str, str]) -> str | None:
        """The token a private sandbox's ports ask for (E2B's ``trafficAccessToken``, sent as the
        ``e2b-traffic-access-token`` header); None for a sandbox whose ports are public."""
        if labels.get(PRIVATE_TRAFFIC_LABEL) != "true":
            return None
        return "eta1_" + hmac.new(self._secret, b"traffic:" + sandbox_id.encode(), hashlib.sha256).hexdigest()

    def traffic_allowed(self, sandbox_id: str, labels: dict[str, str], given: bytes | None) -> bool:
        """Whether a request to one of the sandbox's ports may pass: public, or carrying its traffic token."""
        token = self.traffic_token(sandbox_id, labels)
        return token is None or (given is not None and secrets.compare_digest(given, token.encode()))

    def check_signature(self, sandbox_id: str, path: str, operation: str, user: str | None, signature: str | None,
                        expiration: str | None) -> None:
        """Raise :class:`Unauthorized` unless ``signature`` signs ``operation`` on ``path`` as ``user`` (with
        the SDK's ``get_signature``) and has not expired."""
        if signature is None:
            raise Unauthorized("missing signature query parameter (or an X-Access-Token header)")
        parts = [path, operation, user or "", self.token(sandbox_id)]
        if expiration is not None:
            if not expiration.lstrip("-").isdigit():
                raise Unauthorized(f"signature_expiration must be a Unix time in seconds, got {expiration!r}")
            parts.append(expiration)
        digest = hashlib.sha256(":".join(parts).encode()).digest()
        expected = "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")
        if not secrets.compare_digest(expected.encode(), signature.encode()):
            raise Unauthorized("invalid signature")
        if expiration is not None and int(expiration) < time.time():
            raise Unauthorized("signature is already expired")
