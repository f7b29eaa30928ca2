"""``dsec exec -t / --user``, ``dsec expose / ports / unexpose / forward`` against a real daemon app (the fake
backend: its sandboxes' ports are the host's loopback)."""

from __future__ import annotations

import http.server
import json
import os
import pty
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sdk_daemon import Daemon, running_daemon

import dsec
from dsec.cli import main


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("home")) as d:
        yield d


@pytest.fixture
def env(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> Iterator[dsec.Client]:
    monkeypatch.setenv("DSEC_URL", daemon.unix_url)
    with dsec.Client(url=daemon.unix_url) as client:
        yield client


@pytest.fixture
def web() -> Iterator[int]:
    """An HTTP server on the host's loopback (which is the fake sandbox's): ``GET`` answers ``hello <path>``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_exec_as_user_and_on_a_terminal(env: dsec.Client) -> None:
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        assert invoke("exec", "--user", "root", sb.id, "--", "echo as-root")[:2] == (0, "as-root\n")
        code, out, _ = invoke("exec", "-t", sb.id, "--", "test -t 0 && echo on-a-tty; exit 3")
        assert code == 3 and "on-a-tty" in out


def test_exec_tty_is_interactive(daemon: Daemon, env: dsec.Client) -> None:
    """What is typed on this terminal reaches the command's (in raw mode: the sandbox's terminal echoes)."""
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "dsec", "exec", "-t", sb.id, "--",
                                 "read line; echo got:$line; exit 5"],
                                stdin=follower, stdout=follower, stderr=follower,
                                env=dict(os.environ, DSEC_URL=daemon.unix_url), start_new_session=True)
        os.close(follower)
        seen = b""
        try:
            deadline = time.monotonic() + 30
            typed = False
            while b"got:typed" not in seen and time.monotonic() < deadline:
                if not typed and proc.poll() is None:
                    time.sleep(1.0)  # the remote terminal is up once the first byte could be sent; type once
                    os.write(leader, b"typed\r")
                    typed = True
                if select.select([leader], [], [], 0.5)[0]:
                    try:
                        seen += os.read(leader, 4096)
                    except OSError:
                        break
            assert proc.wait(timeout=30) == 5, seen
            assert b"got:typed" in seen, seen
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(leader)


def test_expose_ports_unexpose(env: dsec.Client, web: int) -> None:
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        code, out, _ = invoke("expose", sb.id, str(web), "--json")
        info = json.loads(out)
        assert code == 0 and info["protocol"] == "http" and info["port"] == web
        request = urllib.request.Request(info["url"] + "/x", headers={"X-DSec-Token": info["token"]})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.read() == b"hello /x"
        code, out, _ = invoke("ports", sb.id)
        assert code == 0 and f"{web}/http" in out and info["url"] in out
        assert invoke("unexpose", sb.id, str(web))[0] == 0
        assert json.loads(invoke("ports", sb.id, "--json")[1]) == []
        code, out, _ = invoke("expose", sb.id, str(web), "--tcp")
        assert code == 0 and f"{web}/tcp" in out and "DSEC " in out


def test_forward_carries_connections_with_the_token(daemon: Daemon, env: dsec.Client, web: int,
                                                    tmp_path: Path) -> None:
    with dsec.Sandbox.create(image="tiny", client=env) as sb:
        proc = subprocess.Popen([sys.executable, "-m", "dsec", "forward", sb.id, str(web)], stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, DSEC_URL=daemon.unix_url))
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            host, port = line.split()[0].rsplit(":", 1)
            for _ in range(2):  # each connection is carried on its own
                with socket.create_connection((host, int(port)), timeout=10) as conn:
                    conn.sendall(b"GET /fwd HTTP/1.0\r\n\r\n")
                    answer = b""
                    while chunk := conn.recv(65536):
                        answer += chunk
                assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"hello /fwd"), answer
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
