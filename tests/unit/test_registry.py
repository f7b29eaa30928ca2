"""The registry client's logic above HTTP: retries, auth challenges, error mapping, verified downloads.

These use httpx's MockTransport to script failures a real registry will not produce on demand (a 503
burst, a connection cut mid-blob); the real protocol is tested against docker-registry in
tests/integration/functional/test_image_pull.py.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from dsec.errors import DSecError, ImageNotFound, InvalidRequest, Unauthorized
from dsec.images.oci_import import OCI_MANIFEST
from dsec.images.registry import RegistryClient, default_name, parse_reference

BLOB = b"layer bytes " * 1000
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


def client(handler: httpx.MockTransport, **kw: object) -> RegistryClient:
    return RegistryClient("reg.test", transport=handler, backoff=0.0, **kw)  # type: ignore[arg-type]


def test_retries_5xx_then_succeeds() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            return httpx.Response(503)
        return httpx.Response(200, content=b"{}", headers={"Content-Type": OCI_MANIFEST})

    with client(httpx.MockTransport(handler)) as c:
        data, media = c.manifest("team/app", "v1")
    assert (data, media, len(calls)) == (b"{}", OCI_MANIFEST, 3)


def test_gives_up_after_retries_with_a_clear_error() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    with client(httpx.MockTransport(handler)) as c, pytest.raises(DSecError, match=r"cannot reach registry reg\.test"):
        c.manifest("team/app", "v1")
    assert calls == 3


def test_a_host_that_does_not_resolve_is_named_as_such_even_with_insecure() -> None:
    """A DNS failure is no TLS problem: the error says the name does not resolve, never "use --insecure"."""

    def handler(request: httpx.Request) -> httpx.Response:
        try:
            raise socket.gaierror(-2, "Name or service not known")
        except socket.gaierror as exc:
            raise httpx.ConnectError("[Errno -2] Name or service not known", request=request) from exc

    for insecure in (False, True):
        with client(httpx.MockTransport(handler), insecure=insecure) as c, pytest.raises(DSecError) as err:
            c.manifest("team/app", "v1")
        assert "the host name 'reg.test' does not resolve" in err.value.message
        assert "insecure" not in err.value.message


def test_refused_connections_and_tls_to_a_plain_http_registry_say_what_failed() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RegistryClient(f"127.0.0.1:{port}", insecure=True, retries=1) as c, pytest.raises(DSecError) as err:
        c.manifest("team/app", "v1")
    assert "nothing accepts connections there" in err.value.message and "insecure" not in err.value.message
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with RegistryClient(f"127.0.0.1:{server.server_port}", retries=1) as c, pytest.raises(DSecError) as err:
            c.manifest("team/app", "v1")
        assert "the TLS handshake failed" in err.value.message and "needs --insecure" in err.value.message
    finally:
        server.shutdown()
        server.server_close()


def test_download_restarts_after_a_cut_connection_and_verifies() -> None:
    attempts = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1

        def body() -> Iterator[bytes]:
            yield BLOB[:5000]
            if attempts == 1:
                raise httpx.ReadError("connection reset", request=request)
            yield BLOB[5000:]

        return httpx.Response(200, content=body())

    out = io.BytesIO()
    with client(httpx.MockTransport(handler)) as c:
        assert c.download("team/app", DIGEST, out, "layer") == len(BLOB)
    assert out.getvalue() == BLOB and attempts == 2


def test_download_refuses_wrong_bytes() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=BLOB[::-1])

    with client(httpx.MockTransport(handler)) as c, pytest.raises(InvalidRequest, match="digest mismatch"):
        c.download("team/app", DIGEST, io.BytesIO(), "layer")


def test_manifest_by_digest_is_verified() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"not": "it"}')

    with client(httpx.MockTransport(handler)) as c, pytest.raises(InvalidRequest, match="digest mismatch"):
        c.manifest("team/app", DIGEST)


def test_bearer_challenge_fetches_a_token_with_credentials() -> None:
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("Authorization")))
        if request.url.host == "auth.test":
            assert request.url.params["scope"] == "repository:team/app:pull"
            assert request.url.params["service"] == "reg"
            return httpx.Response(200, json={"access_token": "tok"})
        if request.headers.get("Authorization") != "Bearer tok":
            return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="https://auth.test/token",'
                                                                     'service="reg",scope="repository:team/app:pull"'})
        return httpx.Response(200, content=b"{}")

    with client(httpx.MockTransport(handler), username="u", password="p") as c:
        c.manifest("team/app", "v1")
        c.manifest("team/app", "v2")  # the token is reused, no second challenge
    assert seen[1][0].startswith("https://auth.test/token") and seen[1][1] == "Basic dTpw"
    assert [a for _, a in seen] == [None, "Basic dTpw", "Bearer tok", "Bearer tok"]


def test_token_service_refusal_is_unauthorized() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.test":
            return httpx.Response(401)
        return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="https://auth.test/token"'})

    with client(httpx.MockTransport(handler)) as c, pytest.raises(Unauthorized, match="anonymous access"):
        c.manifest("team/app", "v1")


def test_basic_challenge_without_credentials_is_unauthorized() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'},
                              json={"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})

    with client(httpx.MockTransport(handler)) as c, pytest.raises(Unauthorized, match="UNAUTHORIZED"):
        c.manifest("team/app", "v1")


def test_not_found_names_the_registry_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, content=json.dumps(
            {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}).encode())

    with client(httpx.MockTransport(handler)) as c, pytest.raises(ImageNotFound, match="MANIFEST_UNKNOWN"):
        c.manifest("team/app", "nope")


@pytest.mark.parametrize(("ref", "name"), [("debian", "debian"), ("debian:bookworm", "debian-bookworm"),
                                           ("h:5000/a/b:V1.0", "b-v1.0"), ("h:5000/a/b@" + DIGEST, "b")])
def test_default_names(ref: str, name: str) -> None:
    assert default_name(parse_reference(ref)) == name
