"""E2B's JSON and errors <-> DSec's models and errors: the facade's whole vocabulary, written once.

Owns the mapping of a ``NewSandbox`` body to a :class:`SandboxSpec` (template -> image and backend,
metadata -> labels, timeout, envs, network), of a :class:`SandboxInfo` to E2B's ``Sandbox``,
``SandboxDetail`` and ``ListedSandbox``, and of :class:`DSecError` to E2B's REST, envd-HTTP and Connect
errors. Pure functions: no I/O, no calls to DSec.
"""

from __future__ import annotations

import datetime
from typing import Any, get_args

import pydantic

from dsec.e2b.keys import JOB_LABEL, PRIVATE_TRAFFIC_LABEL, Principal
from dsec.e2b.options import E2BOptions
from dsec.e2b.wire import ENVD_VERSION, Code, ConnectError
from dsec.errors import (
    BackendUnavailable,
    DirectoryNotEmpty,
    DSecError,
    FileExists,
    Forbidden,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    NotSupported,
    PermissionDenied,
    QuotaExceeded,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SandboxTimeout,
    StoreUnavailable,
    Unauthorized,
    UserNotFound,
)
from dsec.models import BackendName, ImageInfo, SandboxInfo, SandboxSpec, SandboxStats

__all__ = [
    "GONE",
    "SUDO_LABEL",
    "TEMPLATE_LABEL",
    "connect_error",
    "detail",
    "envd_status",
    "listed",
    "metadata",
    "metric",
    "network_update",
    "rest_status",
    "sandbox",
    "spec_from_new",
    "template_image",
    "with_image",
]

TEMPLATE_LABEL = "dsec.e2b.template"
"""The label that keeps the E2B template a sandbox was created from (DSec's own labels are not metadata)."""

SUDO_LABEL = "dsec.e2b.sudo"
"""An image label: ``true`` says the image's user relies on setuid ``sudo``, as in E2B's ``base`` template; its
container sandboxes made through the facade get ``allow_privilege_escalation`` (docs/security.md)."""


GONE = (SandboxNotFound, SandboxTimeout, SandboxLost)
"""The errors that mean the sandbox itself is gone (not a file or process in it)."""


def template_image(template: str, options: E2BOptions) -> tuple[str, str]:
    """``(image, backend)`` of an E2B template: ``base`` is the default image, ``BACKEND/IMAGE`` picks the
    backend, any other name is an image of the node (``:tag`` suffixes are E2B's and ignored)."""
    name = template.rsplit(":", 1)[0] if ":" in template.rsplit("/", 1)[-1] else template
    backend: str = options.backend
    head, sep, rest = name.partition("/")
    if sep and head in get_args(BackendName):
        backend, name = head, rest
    if name in options.extra_images:
        name = options.extra_images[name]
    elif name == "base":
        name = options.default_image
    if not name:
        raise InvalidRequest(f"templateID {template!r} names no image (give IMAGE or BACKEND/IMAGE)")
    return name, backend


def _egress(config: dict[str, Any]) -> str | list[str] | None:
    """DSec's policy for E2B's ``allowOut``/``denyOut`` rules; None when there are none."""
    allow_out = [str(x) for x in config.get("allowOut") or []]
    deny_out = [str(x) for x in config.get("denyOut") or []]
    if any(d not in ("0.0.0.0/0", "::/0") for d in deny_out):
        raise NotSupported("network.denyOut of specific ranges is not supported by DSec: its network policies "
                           "are allowlists (deny everything with ['0.0.0.0/0'] and list allowOut)")
    if allow_out:
        return allow_out
    return "none" if deny_out else None


def _network(body: dict[str, Any], options: E2BOptions) -> str | list[str]:
    network = body.get("network")
    policy = _egress(network) if isinstance(network, dict) else None
    if policy is not None:
        return policy
    # The SDK asks for internet access unless told otherwise: the operator's --e2b-network says what it gets.
    allow = body.get("allow_internet_access", body.get("allowInternetAccess"))
    return "none" if allow is False else options.network


def network_update(body: dict[str, Any]) -> str | list[str]:
    """DSec's policy for E2B's ``SandboxNetworkUpdateConfig`` (an omitted rule is cleared: no rules, no limit)."""
    return _egress(body) or "allow"


def spec_from_new(body: Any, options: E2BOptions, principal: Principal) -> SandboxSpec:
    """The DSec spec of an E2B ``NewSandbox`` body; :class:`InvalidRequest` names what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("templateID"), str):
        raise InvalidRequest("the body must be a JSON object with a string templateID")
    for unsupported in ("volumeMounts", "mcp", "iam"):
        if body.get(unsupported):
            raise NotSupported(f"{unsupported} is not supported by DSec")
    if body.get("autoPause"):
        raise NotSupported("autoPause is not supported by DSec: a sandbox past its timeout is destroyed "
                           "(pause it yourself, or extend it with set_timeout)")
    template = body["templateID"]
    image, backend = template_image(template, options)
    metadata = body.get("metadata") or {}
    envs = body.get("envVars") or {}
    if not isinstance(metadata, dict) or not isinstance(envs, dict):
        raise InvalidRequest("metadata and envVars must be objects of strings")
    reserved = sorted(k for k in metadata if str(k).startswith("dsec."))
    if reserved:
        raise InvalidRequest(f"metadata keys starting with 'dsec.' are DSec's own labels: {reserved}")
    labels = {str(k): str(v) for k, v in metadata.items()}
    labels[TEMPLATE_LABEL] = template
    network = body.get("network")
    if isinstance(network, dict) and network.get("allowPublicTraffic") is False:
        labels[PRIVATE_TRAFFIC_LABEL] = "true"
    if principal.job is not None:
        labels[JOB_LABEL] = principal.job
    timeout = body.get("timeout", 15)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
        raise InvalidRequest(f"timeout must be a non-negative integer of seconds, got {timeout!r}")
    try:
        return SandboxSpec(image=image, backend=backend, timeout=max(timeout, 1), labels=labels,
                           env={str(k): str(v) for k, v in envs.items()}, network=_network(body, options))
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"cannot map the sandbox onto DSec: {problems}") from None


def with_image(spec: SandboxSpec, image: ImageInfo) -> SandboxSpec:
    """``spec`` with what its image declares for E2B: setuid ``sudo`` (:data:`SUDO_LABEL`) on the container
    backend, the one where the opt-in exists (elsewhere the spec is left as it is)."""
    declared = image.config.labels.get(SUDO_LABEL, "").lower() == "true"
    if declared and spec.backend == "container":
        return spec.model_copy(update={"allow_privilege_escalation": True})
    return spec


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def micros(when: float | datetime.datetime) -> int:
    """Microseconds since the epoch of a time as it goes out in ``startedAt`` (Unix seconds are rounded the way
    :func:`_iso` rounds them), by datetime arithmetic: a float product can land one microsecond off."""
    if not isinstance(when, datetime.datetime):
        when = datetime.datetime.fromtimestamp(when, datetime.UTC)
    return (when - _EPOCH) // datetime.timedelta(microseconds=1)


def _template(info: SandboxInfo) -> str:
    return info.labels.get(TEMPLATE_LABEL) or (info.image or "")


def metadata(info: SandboxInfo) -> dict[str, str]:
    """A sandbox's E2B metadata: its labels without DSec's own."""
    return {k: v for k, v in info.labels.items() if not k.startswith("dsec.")}


def sandbox(info: SandboxInfo, access_token: str, traffic_token: str | None, domain: str | None
            ) -> dict[str, Any]:
    """E2B's ``Sandbox`` (what create, connect and resume answer)."""
    return {"templateID": _template(info), "sandboxID": info.id, "alias": _template(info), "clientID": info.node,
            "envdVersion": ENVD_VERSION, "envdAccessToken": access_token, "trafficAccessToken": traffic_token,
            "domain": domain}


def listed(info: SandboxInfo) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    spec = info.spec
    return {"templateID": _template(info), "alias": _template(info), "sandboxID": info.id, "clientID": info.node,
            "startedAt": _iso(info.created_at), "endAt": _iso(info.expires_at), "cpuCount": max(1, round(spec.cpu)),
            "memoryMB": spec.memory // 2**20, "diskSizeMB": spec.disk // 2**20, "metadata": metadata(info),
            "state": "paused" if info.state == "paused" else "running", "envdVersion": ENVD_VERSION}


def detail(info: SandboxInfo, access_token: str, domain: str | None) -> dict[str, Any]:
    """E2B's ``SandboxDetail`` (what get answers)."""
    out = listed(info)
    out.update({"envdAccessToken": access_token, "domain": domain,
                "allowInternetAccess": info.spec.network != "none"})
    return out


def metric(stats: SandboxStats, info: SandboxInfo, now: float) -> dict[str, Any]:
    """One E2B ``SandboxMetric`` from DSec's usage now."""
    return {"timestamp": _iso(now), "timestampUnix": int(now), "cpuCount": max(1, round(info.spec.cpu)),
            "cpuUsedPct": 0.0, "memUsed": stats.memory_bytes, "memTotal": info.spec.memory, "memCache": 0,
            "diskUsed": stats.disk_bytes, "diskTotal": stats.disk_limit_bytes or info.spec.disk}


_REST: tuple[tuple[type[DSecError], int], ...] = (
    (UserNotFound, 400), (PermissionDenied, 403), (FileExists, 409), (DirectoryNotEmpty, 409), (SandboxTimeout, 404),
    (SandboxLost, 404), (NotFound, 404), (InvalidRequest, 400), (Unauthorized, 401),
    (Forbidden, 403), (SandboxStateError, 409), (QuotaExceeded, 429), (NotSupported, 501),
    (BackendUnavailable, 503), (StoreUnavailable, 503),
)


def rest_status(exc: DSecError) -> tuple[int, dict[str, Any]]:
    """E2B's control-plane ``Error`` for a DSec error: its status and body."""
    status = next((code for kind, code in _REST if isinstance(exc, kind)), 500)
    message = exc.message
    if isinstance(exc, ImageNotFound):
        message += " (an E2B template is a DSec image: `dsec image ls`; build, import or pull it)"
    return status, {"code": status, "message": message}


def envd_status(exc: DSecError) -> tuple[int, dict[str, Any]]:
    """envd's HTTP ``Error`` (``/files``) for a DSec error."""
    if isinstance(exc, SandboxError) and "disk is full" in exc.message:
        status = 507
    elif isinstance(exc, GONE):
        status = 502
    else:
        status = next((code for kind, code in _REST if isinstance(exc, kind)), 500)
    return status, {"code": status, "message": exc.message}


def connect_error(exc: DSecError) -> ConnectError:
    """The Connect error an envd call answers for a DSec error."""
    if isinstance(exc, GONE):
        return ConnectError(Code.UNAVAILABLE, exc.message)  # the SDK reads it as the sandbox being gone
    for kind, code in ((UserNotFound, Code.INVALID_ARGUMENT), (NotFound, Code.NOT_FOUND),
                       (FileExists, Code.ALREADY_EXISTS), (PermissionDenied, Code.PERMISSION_DENIED),
                       (DirectoryNotEmpty, Code.FAILED_PRECONDITION), (InvalidRequest, Code.INVALID_ARGUMENT),
                       (Unauthorized, Code.UNAUTHENTICATED), (Forbidden, Code.PERMISSION_DENIED),
                       (SandboxStateError, Code.FAILED_PRECONDITION), (QuotaExceeded, Code.RESOURCE_EXHAUSTED),
                       (NotSupported, Code.UNIMPLEMENTED), (BackendUnavailable, Code.UNAVAILABLE)):
        if isinstance(exc, kind):
            return ConnectError(code, exc.message)
    return ConnectError(Code.INTERNAL, exc.message)
