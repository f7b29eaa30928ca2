"""What the operator chooses for an E2B listener: where it listens, under which domain, with which TLS
certificate, and how E2B's templates become DSec sandboxes.

Owns parsing and checking those choices (each error names the option and the fix). It must never import
the E2B wire modules: ``dsec serve --help`` and option errors work without the ``e2b`` extra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import InvalidRequest
from dsec.models import BackendName, parse_network

__all__ = ["DEFAULT_IMAGE", "E2BOptions", "parse_listen"]

DEFAULT_IMAGE = "debian-python"
"""The image E2B's default template ``base`` maps to."""

_DOMAIN = re.compile(r"^(?=.{1,253}(:|$))([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
                     r"(:\d{1,5})?$")


def parse_listen(value: str, option: str = "--e2b") -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; :class:`InvalidRequest` naming ``option`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"{option} must look like HOST:PORT (e.g. 127.0.0.1:3000), got {value!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class E2BOptions:
    """One E2B listener's settings (``dsec serve --e2b ...``)."""

    listen: str
    """``HOST:PORT`` of the listener."""
    domain: str | None = None
    """The ``E2B_DOMAIN`` clients use: ``api.<domain>`` is the control plane and ``<port>-<id>.<domain>`` a
    sandbox's port (49983: its envd). May carry ``:PORT`` when the listener is not on 443. None: only the
    ``E2B_API_URL``/``E2B_SANDBOX_URL`` form is served."""
    tls_cert: Path | None = None
    """PEM certificate (chain) for HTTPS; for a domain it should cover ``*.<domain>`` and ``api.<domain>``."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert`` (default: in the same file)."""
    default_image: str = DEFAULT_IMAGE
    """The image of the ``base`` template."""
    backend: BackendName = "container"
    """The backend of a template that names none (``microvm/debian-python`` names one)."""
    network: str = "none"
    """The network policy a sandbox gets when it asks for internet access (the SDK's default): ``none`` (DSec's
    default: no egress), ``allow``, or an allowlist. ``allow_internet_access=False`` always gets ``none``."""
    secret_file: Path | None = None
    """Where the key that signs envd access tokens lives (created 0600 on first use); None: a fresh key per
    start, so tokens do not survive a restart."""
    extra_images: dict[str, str] = field(default_factory=dict)
    """Template name -> image, for templates whose name is not an image's."""

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        if self.domain is not None and not _DOMAIN.match(self.domain):
            raise InvalidRequest(f"--e2b-domain must be a DNS name, optionally with :PORT (e.g. e2b.localhost:3443), "
                                 f"got {self.domain!r}")
        if (self.tls_key is not None) and self.tls_cert is None:
            raise InvalidRequest("--e2b-tls-key needs --e2b-tls-cert")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not path.is_file():
                raise InvalidRequest(f"TLS file {path} does not exist (give a PEM certificate and key)")
        if self.backend not in ("container", "microvm", "vm", "function"):
            raise InvalidRequest(f"--e2b-backend must be container, microvm, vm or function, got {self.backend!r}")
        try:
            parse_network(self.network)
        except ValueError as exc:
            raise InvalidRequest(f"--e2b-network: {exc}") from None

    @property
    def address(self) -> tuple[str, int]:
        """The listener's ``(host, port)``."""
        return parse_listen(self.listen)

    @property
    def scheme(self) -> str:
        """``https`` with a certificate, else ``http``."""
        return "https" if self.tls_cert is not None else "http"

    @property
    def bare_domain(self) -> str | None:
        """The domain without its ``:PORT``."""
        return None if self.domain is None else self.domain.split(":", 1)[0]
