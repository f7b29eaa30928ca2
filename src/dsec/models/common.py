"""Building blocks of the wire models: the base ``Model``, sizes, network allowlists, env-style mappings.

Owns the value parsers every model shares (``parse_size``, ``parse_network``, ``parse_pairs``,
``check_mapping``, ``check_command``), the fields of a command (``Env``, ``Cwd``, ``User``), the backend and
state literals, and the sandbox-id digest. Must never define a request or response of a route, and never import
another ``dsec.models`` module. No I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from dsec.accounts import parse_user
from dsec.errors import InvalidRequest

BackendName = Literal["function", "container", "microvm", "vm"]
SandboxState = Literal["creating", "running", "paused", "stopped", "expired", "failed", "lost"]
LimitHit = Literal["time", "memory", "output", "pids", "disk"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Parse ``"1Gi"``, ``"512MiB"``, ``"4G"`` or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"not a size: {value!r} (use bytes or a string such as '512Mi', '1Gi', '4G')")
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


Size = Annotated[int, BeforeValidator(parse_size)]


_DOMAIN_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


class NetworkEntry(BaseModel):
    """One allowlist entry: a CIDR or a domain name (``*.`` allows its subdomains), optionally a port."""

    model_config = ConfigDict(frozen=True)

    cidr: str | None = None
    domain: str | None = None
    port: int | None = None

    def matches_name(self, name: str) -> bool:
        """True if DNS name ``name`` (no trailing dot, any case) is allowed by this domain entry."""
        if self.domain is None:
            return False
        name = name.rstrip(".").lower()
        if self.domain.startswith("*."):
            return name.endswith(self.domain[1:])
        return name == self.domain


def _parse_network_entry(entry: str) -> NetworkEntry:
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"network entry must be a non-empty string, got {entry!r}")
    text = entry.strip().lower()
    host, port = text, None
    if text.count(":") == 1:  # IPv4 or a name with a port; bare IPv6 is not supported in allowlists
        host, port_text = text.split(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"network entry {entry!r}: port must be 1-65535")
        port = int(port_text)
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        net = None
    if net is not None:
        if net.version != 4:
            raise ValueError(f"network entry {entry!r}: only IPv4 CIDRs are supported")
        return NetworkEntry(cidr=str(net), port=port)
    labels = host.removeprefix("*.").split(".")
    if len(host) > 253 or len(labels) < 2 or not all(_DOMAIN_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"network entry {entry!r} is neither an IPv4 CIDR[:port] nor a domain name[:port] "
                         f"(e.g. '10.0.0.0/8', '192.0.2.1:443', 'pypi.org', '*.pythonhosted.org:443')")
    return NetworkEntry(domain=host, port=port)


def parse_network(value: str | Sequence[str]) -> tuple[str, tuple[NetworkEntry, ...]]:
    """``("none" | "allow" | "list", entries)`` for a ``network=`` value; ValueError naming a bad entry."""
    if isinstance(value, str):
        if value in ("none", "allow"):
            return value, ()
        raise ValueError(f"network must be 'none', 'allow' or a list of allowlist entries, got {value!r}")
    entries = tuple(_parse_network_entry(e) for e in value)
    if len(entries) > 1024:
        raise ValueError(f"network allowlist has {len(entries)} entries; at most 1024")
    return "list", entries


def parse_pairs(items: Sequence[str], what: str) -> dict[str, str]:
    """``["k=v", ...]`` (CLI flags, query parameters) as a dict; a malformed item is an InvalidRequest."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"{what} must look like key=value, got {item!r}")
        out[key] = value
    return out


def check_mapping(v: dict[str, str]) -> dict[str, str]:
    """Environment-style keys: non-empty, no '=' or NUL; values without NUL (execve cannot carry them)."""
    for key, val in v.items():
        if not key or "\0" in key or "=" in key or "\0" in val:
            raise ValueError(f"invalid entry {key!r}: keys must be non-empty without '=' or NUL, values without NUL")
    return v


def check_command(v: str | list[str] | None) -> str | list[str] | None:
    """A command (a shell string or an argv list; None: none given): not empty, no NUL byte."""
    if v is None:
        return v
    if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
        raise ValueError("command must not be empty")
    if any("\0" in part for part in ([v] if isinstance(v, str) else v)):
        raise ValueError("command must not contain NUL bytes")
    return v


def check_user(v: str | None) -> str | None:
    """A ``user=`` value is a name or uid, optionally ``:group``; checked for shape here, resolved in the
    sandbox (:mod:`dsec.accounts`)."""
    if v is not None:
        parse_user(v)
    return v


def check_cwd(v: str | None) -> str | None:
    """A working directory: a non-empty path without NUL (absolute, or relative to the sandbox's workdir)."""
    if v is not None and (not v or "\0" in v):
        raise ValueError(f"cwd must be a non-empty path without NUL bytes (absolute, or relative to the "
                         f"sandbox's working directory), got {v!r}")
    return v


def _env(v: dict[str, str] | None) -> dict[str, str] | None:
    return None if v is None else check_mapping(v)


Env = Annotated[dict[str, str] | None, AfterValidator(_env)]
"""Extra environment of a command (:func:`check_mapping`)."""
Cwd = Annotated[str | None, AfterValidator(check_cwd)]
"""A command's working directory (:func:`check_cwd`)."""
User = Annotated[str | None, AfterValidator(check_user)]
"""The user a command runs as (:func:`check_user`)."""


class Model(BaseModel):
    """Base of every wire model: unknown fields are an error, bytes are base64 in JSON."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        ser_json_bytes="base64",
        val_json_bytes="base64",
        populate_by_name=True,
    )


def id_hash(sandbox_id: str) -> int:
    """A sandbox id's 64-bit hash; :func:`ids_digest` XORs them, so a digest is kept up to date one id at a time."""
    return int.from_bytes(hashlib.blake2b(sandbox_id.encode(), digest_size=8).digest(), "big")


def ids_digest(sandbox_ids: Iterable[str]) -> str:
    """The order-free digest of a set of sandbox ids, as :attr:`NodeInfo.digest` reports it (16 hex digits)."""
    value = 0
    for sandbox_id in sandbox_ids:
        value ^= id_hash(sandbox_id)
    return f"{value:016x}"
