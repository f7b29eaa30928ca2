"""Query parameters whose text is not their value's own, each written once for the client and the server.

Owns the text forms: an octal file mode, a mapping as repeated ``key=value``, and a request model as JSON in
the query with its credentials in a header. Must never do I/O.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pydantic

from dsec.errors import InvalidRequest
from dsec.models import ImageBuildRequest, parse_pairs

from .operations import Codec

__all__ = ["BUILD_REQUEST", "OCTAL", "pairs"]


def _octal_mode(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text, 8)
    except ValueError:
        raise InvalidRequest(f"mode must be an octal string such as '644' or '0755', got {text!r}") from None


OCTAL = Codec(wire=str | None, default=None, encode=lambda mode: format(mode, "o"), decode=_octal_mode)
"""File permission bits as octal text, like chmod (``644``)."""


def pairs(what: str) -> Codec:
    """A mapping as repeated ``key=value`` parameters; a malformed one is an InvalidRequest naming ``what``."""
    return Codec(wire=list[str], default=[],
                 encode=lambda mapping: [f"{k}={v}" for k, v in dict(mapping or {}).items()],
                 decode=lambda items: parse_pairs(items, what))


def _build_query(request: ImageBuildRequest) -> str:
    return request.model_copy(update={"username": None, "password": None}).model_dump_json(exclude_defaults=True)


def _build_auth(request: ImageBuildRequest) -> str | None:
    if request.username is None:
        return None
    auth = json.dumps({"username": request.username, "password": request.password or ""})
    return base64.urlsafe_b64encode(auth.encode()).decode().rstrip("=")


def _build_request(encoded: str, registry_auth: str | None) -> ImageBuildRequest:
    try:
        request = ImageBuildRequest.model_validate_json(encoded)
    except pydantic.ValidationError as exc:
        raise InvalidRequest(f"invalid build request: {exc.errors()[0].get('msg')} at "
                             f"{'.'.join(str(p) for p in exc.errors()[0].get('loc', ()))}") from None
    if request.password is not None:
        raise InvalidRequest("send the registry password in the X-Registry-Auth header, not the query")
    if registry_auth:
        try:
            auth: Any = json.loads(base64.urlsafe_b64decode(registry_auth + "=" * (-len(registry_auth) % 4)))
            request = request.model_copy(update={"username": str(auth["username"]),
                                                 "password": str(auth.get("password") or "")})
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest("X-Registry-Auth is not base64url JSON with a username") from None
    return request


BUILD_REQUEST = Codec(wire=str, default=None, encode=_build_query, decode=_build_request, header="X-Registry-Auth",
                      header_description="base64url JSON username/password", encode_header=_build_auth)
"""An :class:`ImageBuildRequest` as JSON in the query (the body is the build context), its registry credentials
in ``X-Registry-Auth`` (base64url JSON ``{"username", "password"}``), never in a URL."""
