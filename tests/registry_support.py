"""A real OCI registry (Debian's ``docker-registry``, distribution 2.8) on loopback, and a real token service.

The registry runs as a subprocess bound to 127.0.0.1 with a filesystem root under the test's temporary
directory, in one of three auth modes: none, HTTP basic (an htpasswd file with a bcrypt hash), or bearer
tokens. The token service is a small HTTP server on 127.0.0.1 that checks basic credentials and signs
JWTs (RS256, with the signing certificate in ``x5c``) with ``openssl``, the way docker's auth servers do;
the registry trusts that certificate through ``rootcertbundle``. Everything is stopped by its handle.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from dsec._ports import free_port

USER, PASSWORD = "agent", "s3cret-pw"
SERVICE, ISSUER = "dsec-test-registry", "dsec-test-issuer"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """Issues registry bearer tokens to ``USER``/``PASSWORD`` (anyone else gets 401)."""

    def __init__(self, workdir: Path) -> None:
        self.key, self.cert = workdir / "token.key", workdir / "token.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "1", "-subj", "/CN=dsec-test-token",
                        "-addext", "keyUsage=digitalSignature,keyCertSign"], check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], check=True,
                             capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.issued = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query)
                expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                if url.path != "/token" or self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": server.sign(query.get("scope", []))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def sign(self, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":", 2)
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": ISSUER, "sub": USER, "aud": SERVICE, "exp": now + 600, "nbf": now - 30, "iat": now,
                  "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(),
                             check=True, capture_output=True).stdout
        self.issued += 1
        return f"{signing_input}.{b64url(sig)}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@dataclass
class Registry:
    """A running docker-registry: ``host`` is ``127.0.0.1:PORT``; ``root`` its storage directory."""

    host: str
    root: Path
    process: subprocess.Popen[bytes]
    mode: str
    token: TokenServer | None = None

    def blob_path(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _htpasswd(path: Path) -> None:
    # bcrypt (the only scheme the registry accepts) from the system's crypt(3), cost 4 to keep requests fast
    code = ("import crypt, sys; sys.stdout.write(crypt.crypt(sys.argv[1], "
            "crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)))")
    hashed = subprocess.run([sys.executable, "-W", "ignore", "-c", code, PASSWORD], check=True,
                            capture_output=True, text=True).stdout
    assert hashed.startswith("$2"), hashed
    path.write_text(f"{USER}:{hashed}\n")


@contextlib.contextmanager
def running_registry(workdir: Path, mode: str = "none") -> Iterator[Registry]:
    """A docker-registry on 127.0.0.1 in auth ``mode`` none | basic | token; stopped (and its files kept
    under ``workdir`` for pytest to remove) at the end."""
    exe = shutil.which("docker-registry")
    if exe is None:
        raise RuntimeError("docker-registry is not installed: apt-get install docker-registry (scripts/setup)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lines = ["version: 0.1", "log:", "  level: error", "  accesslog:", "    disabled: true", "storage:",
             "  filesystem:", f"    rootdirectory: {workdir / 'storage'}", "  delete:", "    enabled: true",
             "http:", f"  addr: 127.0.0.1:{port}", f"  secret: {secrets.token_hex(16)}"]
    token = None
    if mode == "basic":
        _htpasswd(workdir / "htpasswd")
        lines += ["auth:", "  htpasswd:", "    realm: dsec-test", f"    path: {workdir / 'htpasswd'}"]
    elif mode == "token":
        token = TokenServer(workdir)
        lines += ["auth:", "  token:", f"    realm: {token.realm}", f"    service: {SERVICE}",
                  f"    issuer: {ISSUER}", f"    rootcertbundle: {token.cert}"]
    config = workdir / "config.yml"
    config.write_text("\n".join(lines) + "\n")
    log = open(workdir / "registry.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([exe, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(workdir / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield Registry(host=f"127.0.0.1:{port}", root=workdir / "storage", process=proc, mode=mode, token=token)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        if token is not None:
            token.close()
