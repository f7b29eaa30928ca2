"""Docker Compose files as the harness integrations read them: each service's image or build, environment,
working directory and user.

Owns reading a compose file (YAML, with compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``$VAR`` and ``$$`` interpolation from the variables the caller gives) into :class:`ComposeService` records.
It must never start anything: the integrations decide what a service becomes (a sandbox per service for
inspect, the single task sandbox for harbor). Keys DSec cannot honour (ports, volumes, depends_on...) are
ignored, as a one-sandbox-per-service platform must; a malformed file gets an error naming the file and key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dsec.errors import InvalidRequest

__all__ = ["ComposeService", "load_compose"]

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class ComposeService:
    """One service of a compose file."""

    name: str
    image: str | None = None
    build_context: Path | None = None
    """Absolute build context, when the service has ``build:``."""
    dockerfile: str | None = None
    """Dockerfile path relative to the context (``None``: its ``Dockerfile``)."""
    build_args: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    network_mode: str | None = None


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's variable substitution; an unset variable without a default becomes empty, as in compose."""
    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        value = variables.get(name)
        if m.group(3) == ":-" and not value:
            return m.group(4)
        if m.group(3) == "-" and value is None:
            return m.group(4)
        return value or ""
    return _VARIABLE.sub(one, text)


def _pairs(value: Any, path: Path, where: str) -> dict[str, str]:
    """A compose mapping given as a dict or a ``KEY=VALUE`` list (a bare ``KEY`` is dropped, being unset)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        return dict(str(item).split("=", 1) for item in value if "=" in str(item))
    raise InvalidRequest(f"compose file {path}: {where} must be a mapping or a list of KEY=VALUE, not {value!r}")


def _service(name: str, spec: Any, path: Path) -> ComposeService:
    if not isinstance(spec, dict):
        raise InvalidRequest(f"compose file {path}: service {name!r} must be a mapping, not {spec!r}")
    build = spec.get("build")
    if isinstance(build, str):
        build = {"context": build}
    if build is not None and not isinstance(build, dict):
        raise InvalidRequest(f"compose file {path}: services.{name}.build must be a path or a mapping")
    user = spec.get("user")
    return ComposeService(
        name=str(name), image=str(spec["image"]) if spec.get("image") else None,
        build_context=(path.parent / str(build.get("context") or ".")).resolve() if build else None,
        dockerfile=str(build["dockerfile"]) if build and build.get("dockerfile") else None,
        build_args=_pairs(build.get("args"), path, f"services.{name}.build.args") if build else {},
        environment=_pairs(spec.get("environment"), path, f"services.{name}.environment"),
        working_dir=str(spec["working_dir"]) if spec.get("working_dir") else None,
        user=None if user is None else str(user),
        network_mode=str(spec["network_mode"]) if spec.get("network_mode") else None)


def _substitute(value: Any, variables: Mapping[str, str]) -> Any:
    """``value`` with every string in it interpolated (compose substitutes values, never keys)."""
    if isinstance(value, str):
        return interpolate(value, variables)
    if isinstance(value, dict):
        return {k: _substitute(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, variables) for v in value]
    return value


def load_compose(path: Path, variables: Mapping[str, str] | None = None) -> list[ComposeService]:
    """The services of the compose file at ``path``, in file order, with ``variables`` substituted. A service
    may have neither ``build:`` nor ``image:`` (an overlay on a base the caller knows); the caller decides."""
    try:
        doc = _substitute(yaml.safe_load(path.read_text()), variables or {})
    except (OSError, yaml.YAMLError) as e:
        raise InvalidRequest(f"compose file {path}: {e}") from e
    services = (doc or {}).get("services") if isinstance(doc, dict) or doc is None else None
    if not isinstance(services, dict) or not services:
        raise InvalidRequest(f"compose file {path} has no services: it needs a services: mapping with one or more")
    return [_service(name, spec, path) for name, spec in services.items()]
