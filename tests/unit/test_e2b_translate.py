"""The E2B facade's pure parts: templates, network, metadata, errors, keys and signed URLs."""

from __future__ import annotations

import base64
import datetime
import hashlib
import random
import time

import pytest

pytest.importorskip("e2b", reason="the E2B endpoint needs the e2b SDK's wire modules: pip install 'dsec[e2b]'")

from dsec.e2b import translate
from dsec.e2b.keys import JOB_LABEL, EnvdTokens, GatewayKeys, NodeKeys, Principal, load_secret
from dsec.e2b.options import E2BOptions
from dsec.errors import (
    DirectoryNotEmpty,
    FileExists,
    ImageNotFound,
    InvalidRequest,
    NotSupported,
    PermissionDenied,
    ProcessNotFound,
    SandboxNotFound,
    SandboxTimeout,
    Unauthorized,
    UserNotFound,
)
from dsec.models import ImageConfig, ImageInfo

OPTS = E2BOptions(listen="127.0.0.1:3000", default_image="debian-python", network="allow")
ADMIN = Principal("admin", None)


def test_templates_name_images_and_backends() -> None:
    assert translate.template_image("base", OPTS) == ("debian-python", "container")
    assert translate.template_image("base:default", OPTS) == ("debian-python", "container")
    assert translate.template_image("microvm/debian-python", OPTS) == ("debian-python", "microvm")
    assert translate.template_image("team/tiny:v2", OPTS) == ("team/tiny", "container")


def test_new_sandbox_maps_onto_a_spec() -> None:
    body = {"templateID": "base", "timeout": 300, "metadata": {"k": "v"}, "envVars": {"A": "1"},
            "allow_internet_access": True}
    spec = translate.spec_from_new(body, OPTS, Principal("tok", "job-1"))
    assert (spec.image, spec.backend, spec.timeout, spec.env, spec.network) == (
        "debian-python", "container", 300, {"A": "1"}, "allow")
    assert spec.labels == {"k": "v", translate.TEMPLATE_LABEL: "base", JOB_LABEL: "job-1"}
    assert translate.spec_from_new({**body, "allow_internet_access": False}, OPTS, ADMIN).network == "none"
    allow = {**body, "network": {"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]}}
    assert translate.spec_from_new(allow, OPTS, ADMIN).network == ["pypi.org"]



def test_an_image_declaring_sudo_gets_setuid_on_the_container_backend_only() -> None:
    def image(labels: dict[str, str]) -> ImageInfo:
        return ImageInfo(name="e2b-base", created_at=0, size_bytes=0, files=0, source="t", uid_shift=0,
                         config=ImageConfig(labels=labels))

    spec = translate.spec_from_new({"templateID": "base"}, OPTS, ADMIN)
    assert not spec.allow_privilege_escalation  # off unless the image asks
    assert translate.with_image(spec, image({translate.SUDO_LABEL: "true"})).allow_privilege_escalation
    assert not translate.with_image(spec, image({translate.SUDO_LABEL: "false"})).allow_privilege_escalation
    assert not translate.with_image(spec, image({})).allow_privilege_escalation
    microvm = translate.spec_from_new({"templateID": "microvm/debian-python"}, OPTS, ADMIN)
    assert not translate.with_image(microvm, image({translate.SUDO_LABEL: "true"})).allow_privilege_escalation

@pytest.mark.parametrize(("body", "error", "match"), [
    ({}, InvalidRequest, "templateID"),
    ({"templateID": "base", "metadata": {"dsec.job": "x"}}, InvalidRequest, "DSec's own labels"),
    ({"templateID": "base", "timeout": -1}, InvalidRequest, "timeout"),
    ({"templateID": "base", "autoPause": True}, NotSupported, "autoPause"),
    ({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}, NotSupported, "volumeMounts"),
    ({"templateID": "base", "network": {"denyOut": ["10.0.0.0/8"]}}, NotSupported, "allowlists"),
])
def test_bad_new_sandbox_bodies_name_the_problem(body: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        translate.spec_from_new(body, OPTS, ADMIN)


def test_errors_map_onto_e2b_statuses_and_codes() -> None:
    assert translate.rest_status(SandboxNotFound("gone"))[0] == 404
    assert translate.rest_status(SandboxTimeout("expired"))[0] == 404
    assert translate.rest_status(Unauthorized("key"))[0] == 401
    status, body = translate.rest_status(ImageNotFound("image 'x' not found"))
    assert status == 404 and "an E2B template is a DSec image" in body["message"]
    assert translate.rest_status(NotSupported("volumes are not supported by DSec")) == (
        501, {"code": 501, "message": "volumes are not supported by DSec"})
    assert translate.envd_status(SandboxNotFound("gone"))[0] == 502
    assert translate.connect_error(SandboxTimeout("expired")).code.name == "UNAVAILABLE"
    assert translate.connect_error(InvalidRequest("bad")).code.name == "INVALID_ARGUMENT"
    # The surface's errors: a missing user is a bad argument (not a missing file), the file errors keep their kind.
    assert translate.connect_error(UserNotFound("unable to find user x")).code.name == "INVALID_ARGUMENT"
    assert translate.envd_status(UserNotFound("unable to find user x"))[0] == 400
    assert translate.connect_error(ProcessNotFound("no process 9")).code.name == "NOT_FOUND"
    assert translate.connect_error(FileExists("exists")).code.name == "ALREADY_EXISTS"
    assert translate.connect_error(PermissionDenied("denied")).code.name == "PERMISSION_DENIED"
    assert translate.envd_status(PermissionDenied("denied"))[0] == 403
    assert translate.connect_error(DirectoryNotEmpty("not empty")).code.name == "FAILED_PRECONDITION"


def test_keys_resolve_principals_and_scope_by_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dsec.daemon.auth import TokenFile

    tokens = TokenFile(tmp_path / "tokens.json")
    key = tokens.create("agent", job="rl-1", e2b_format=True)
    assert key.startswith("e2b_") and len(key) == 44 and int(key[4:], 16) >= 0
    keys = NodeKeys("admin-token", tokens)
    assert keys.principal("admin-token") == ADMIN
    assert keys.principal(key) == Principal("agent", "rl-1")
    assert keys.principal("nope") is None
    assert keys.principal(key).owns({JOB_LABEL: "rl-1"})  # type: ignore[union-attr]
    assert not keys.principal(key).owns({JOB_LABEL: "rl-2"})  # type: ignore[union-attr]
    jobs: list[str] = []
    gateway = GatewayKeys({"t" * 16: "rl-9", "a" * 16: "admin"}, lambda job: (jobs.append(job), jobs.pop)[1])
    assert gateway.principal("a" * 16) == ADMIN
    with gateway.acting(gateway.principal("t" * 16)):  # type: ignore[arg-type]
        assert jobs == ["rl-9"]
    assert jobs == []


def test_envd_tokens_and_signed_urls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    secret = load_secret(tmp_path / "e2b-secret")
    assert load_secret(tmp_path / "e2b-secret") == secret and (tmp_path / "e2b-secret").stat().st_mode & 0o777 == 0o600
    tokens = EnvdTokens(secret)
    token = tokens.token("sb-1")
    assert tokens.check("sb-1", token) and not tokens.check("sb-2", token)
    expiry = str(int(time.time()) + 60)
    raw = f"/a.txt:read::{token}:{expiry}"
    signature = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
    tokens.check_signature("sb-1", "/a.txt", "read", None, signature, expiry)  # the SDK's get_signature
    with pytest.raises(Unauthorized, match="invalid signature"):
        tokens.check_signature("sb-1", "/a.txt", "write", None, signature, expiry)
    past = str(int(time.time()) - 60)
    raw = f"/a.txt:read::{token}:{past}"
    expired = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
    with pytest.raises(Unauthorized, match="signature is already expired"):
        tokens.check_signature("sb-1", "/a.txt", "read", None, expired, past)
    with pytest.raises(Unauthorized, match="missing signature"):
        tokens.check_signature("sb-1", "/a.txt", "read", None, None, None)


def test_options_refuse_bad_values() -> None:
    with pytest.raises(InvalidRequest, match="HOST:PORT"):
        E2BOptions(listen="3000")
    with pytest.raises(InvalidRequest, match="DNS name"):
        E2BOptions(listen="127.0.0.1:3000", domain="not a domain")
    with pytest.raises(InvalidRequest, match="--e2b-network"):
        E2BOptions(listen="127.0.0.1:3000", network="sometimes")
    assert E2BOptions(listen="127.0.0.1:3000", domain="e2b.localhost:3443").bare_domain == "e2b.localhost"


def test_watch_events_map_onto_envd_events() -> None:
    from dsec.e2b.filesystem import _watch_event
    from dsec.e2b.wire import filesystem_pb
    from dsec.models.surface import FileEvent

    kinds = filesystem_pb.EventType

    def mapped(event: FileEvent) -> list[tuple[str, object]]:
        return [(e.name, e.type) for e in _watch_event(event, "/w")]

    assert mapped(FileEvent(type="modify", path="/w/a/b.txt")) == [("a/b.txt", kinds.WRITE)]
    assert mapped(FileEvent(type="chmod", path="/w/x")) == [("x", kinds.CHMOD)]
    # fsnotify's view of a rename: the old name renamed, the new one created (a move out of the tree: only the first)
    assert mapped(FileEvent(type="move", path="/w/a", dest="/w/d/b")) == [("a", kinds.RENAME), ("d/b", kinds.CREATE)]
    assert mapped(FileEvent(type="move", path="/w/a")) == [("a", kinds.RENAME)]
    assert mapped(FileEvent(type="delete", path="/w/a", is_dir=True)) == [("a", kinds.REMOVE)]


def test_a_started_at_given_back_is_the_same_microsecond() -> None:
    """``startedAfter`` set to a sandbox's own ``startedAt`` must still list it: both sides in whole
    microseconds, with no float product one microsecond off (seen for about one time in a thousand)."""
    rng = random.Random(7)
    for _ in range(20_000):
        t = 1.7e9 + rng.random() * 1e8
        back = datetime.datetime.fromisoformat(translate._iso(t).replace("Z", "+00:00"))
        assert translate.micros(back) == translate.micros(t), t
