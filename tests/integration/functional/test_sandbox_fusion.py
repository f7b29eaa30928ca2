"""The SandboxFusion-compatible ``/run_code`` driven by SandboxFusion's own client (``sandbox-fusion`` from
PyPI, pinned in constraints.txt), sync and async, and by the exact request verl's reward code sends
(``verl/utils/reward_score/sandbox_fusion/utils.py``: ``call_sandbox_api``), against a daemon serving
``--sandbox-fusion`` on the function backend and the debian-python image."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from container_support import daemon_process

sandbox_fusion = pytest.importorskip(
    "sandbox_fusion", reason="the SandboxFusion endpoint's tests need its client: pip install 'dsec[sandbox-fusion]'")

from sandbox_fusion import RunCodeRequest, RunStatus, run_code, run_code_async  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.slow]

TOKEN = "fusion-" + "7" * 32
MiB = 1024**2
COMPILE = 120
"""Compile timeout: g++ on a loaded 2-core machine (and its first read from the lazy image) takes seconds."""


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """The listener's URL with the token as basic auth's password (all SandboxFusion's client takes is a URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with daemon_process("dsec-fusion-", tcp_token=TOKEN, args=["--sandbox-fusion", f"127.0.0.1:{port}"]):
        yield f"http://dsec:{TOKEN}@127.0.0.1:{port}"


def _run(endpoint: str, **fields: Any) -> Any:
    """One request through SandboxFusion's client (one attempt: it retries errors, which would hide them)."""
    return run_code(RunCodeRequest(**fields), endpoint=endpoint, max_attempts=1)


def _post(endpoint: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{endpoint}/run_code", json=body, timeout=120)


def test_python_bash_and_cpp_with_the_client(endpoint: str) -> None:
    r = _run(endpoint, code="import sys\nprint('hi', sys.version_info[0])\nprint('e', file=sys.stderr)",
             language="python")
    assert r.status == RunStatus.Success and r.compile_result is None, r
    assert (r.run_result.status.value, r.run_result.return_code) == ("Finished", 0), r
    assert (r.run_result.stdout, r.run_result.stderr) == ("hi 3\n", "e\n"), r
    assert r.run_result.execution_time is not None and r.run_result.execution_time > 0
    assert r.executor_pod_name, "the node that ran it"
    r = _run(endpoint, code="echo $((6 * 7)); pwd; exit 3", language="bash")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 3, r
    assert r.run_result.stdout == "42\n/workspace\n", r
    cpp = "#include <iostream>\n#include <vector>\nint main(){std::vector<int> v{1,2,3}; int s=0; " \
          "for(int x: v) s+=x; std::cout << s << std::endl;}"
    r = _run(endpoint, code=cpp, language="cpp", compile_timeout=COMPILE)
    assert r.status == RunStatus.Success, r
    assert (r.compile_result.status.value, r.compile_result.return_code) == ("Finished", 0), r
    assert r.run_result.stdout == "6\n", r


def test_c_and_stdin(endpoint: str) -> None:
    # c is DSec's addition to SandboxFusion's languages (their client's Literal lacks it): raw JSON
    code = '#include <stdio.h>\nint main(void){int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a * b); return 0;}'
    r = _post(endpoint, {"code": code, "language": "c", "stdin": "6 7\n", "compile_timeout": COMPILE})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "42\n", body
    r2 = _run(endpoint, code="import sys\nprint(sum(map(int, sys.stdin.read().split())))", language="python",
              stdin="1 2 3\n4")
    assert r2.run_result.stdout == "10\n", r2


def test_files_and_fetch_files(endpoint: str) -> None:
    data = bytes(range(256))
    code = ("import pathlib\nraw = pathlib.Path('in/data.bin').read_bytes()\n"
            "pathlib.Path('out.txt').write_text(str(sum(raw)))\npathlib.Path('copy.bin').write_bytes(raw[::-1])\n"
            "print(open('notes.txt').read())")
    r = _run(endpoint, code=code, language="python",
             files={"in/data.bin": base64.b64encode(data).decode(), "notes.txt": base64.b64encode(b"ok").decode()},
             fetch_files=["out.txt", "copy.bin", "missing.txt"])
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == "ok\n"
    assert base64.b64decode(r.files["out.txt"]) == str(sum(data)).encode()
    assert base64.b64decode(r.files["copy.bin"]) == data[::-1]
    assert "missing.txt" not in r.files  # as SandboxFusion: a file that is not there is left out
    # each request has a sandbox of its own: nothing written by the last one is there
    r = _run(endpoint, code="import os; print(sorted(os.listdir('.')))", language="python", fetch_files=["out.txt"])
    assert "out.txt" not in r.run_result.stdout and r.files == {}, r


def test_a_request_sees_nothing_of_the_ones_before(endpoint: str) -> None:
    """Sandboxes serve again once their working directory is wiped: files (even in a directory the code made
    unreadable), processes started in the background and /tmp of an earlier request are gone."""
    leave = ("mkdir -p locked/deep && echo s > locked/deep/secret && chmod 000 locked; echo t > /tmp/mark; "
             "(setsid sleep 300 >/dev/null 2>&1 &); echo left")
    look = ("ls -A; ls -A /tmp; for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done "
            "| grep -c '[s]leep 300' || true")
    for _ in range(6):
        assert _run(endpoint, code=leave, language="bash").run_result.stdout == "left\n"
        time.sleep(0.3)  # the wipe runs after the answer: let the next request find the sandbox idle again
        r = _run(endpoint, code=look, language="bash")
        names = r.run_result.stdout.split()
        assert "locked" not in names and "mark" not in names and names[-1] == "0", r.run_result


def test_python_runs_warm_and_sees_nothing_of_the_python_before(endpoint: str) -> None:
    """Python is forked from the sandbox's warm interpreter (whose flags are those of ``-I``); a later request gets
    neither the processes, /tmp nor the interpreter state of an earlier one."""
    leave = ("import builtins, subprocess, sys\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\n"
             "open('/tmp/mark', 'w').write('t')\nbuiltins.left = sys.modules['left'] = 1\nprint('left')")
    look = ("import builtins, os, sys\nprocs = [open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') "
            "if p.isdigit()]\nprint(sys.flags.isolated, os.listdir('/tmp'), hasattr(builtins, 'left'), "
            "'left' in sys.modules, sum(b'sleep' in p for p in procs))")
    for _ in range(3):
        assert _run(endpoint, code=leave, language="python").run_result.stdout == "left\n"
        time.sleep(0.3)
        r = _run(endpoint, code=look, language="python")
        assert r.run_result.stdout == "1 [] False False 0\n", r.run_result


def test_bad_base64_is_a_sandbox_error_naming_the_file(endpoint: str) -> None:
    body = _post(endpoint, {"code": "print(1)", "language": "python", "files": {"a.txt": "not base64!"}}).json()
    assert body["status"] == "SandboxError" and "a.txt" in body["message"] and "base64" in body["message"], body


def test_compile_error(endpoint: str) -> None:
    r = _run(endpoint, code="int main() { return undefined_name; }", language="cpp", compile_timeout=COMPILE)
    assert r.status == RunStatus.Failed and r.run_result is None, r
    assert r.compile_result.status.value == "Finished" and r.compile_result.return_code != 0, r
    assert "undefined_name" in r.compile_result.stderr, r


def test_time_limit(endpoint: str) -> None:
    r = _run(endpoint, code="import time\nprint('start', flush=True)\ntime.sleep(30)", language="python",
             run_timeout=1)
    assert r.status == RunStatus.Failed, r
    assert r.run_result.status.value == "TimeLimitExceeded" and r.run_result.return_code is None, r
    assert r.run_result.stdout == "start\n" and 0.9 < r.run_result.execution_time < 60, r


def test_memory_limit(endpoint: str) -> None:
    body = _post(endpoint, {"code": "x = bytearray(512 << 20)\nprint(len(x))", "language": "python",
                            "memory_limit_MB": 128}).json()
    assert body["status"] == "Failed", body
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] != 0, body
    assert "memory limit of 128 MB" in body["message"], body
    # the same program under a limit it fits in
    body = _post(endpoint, {"code": "x = bytearray(64 << 20)\nprint(len(x) >> 20)", "language": "python",
                            "memory_limit_MB": 512}).json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "64\n", body


def test_a_gigabyte_of_output_is_cut_and_the_message_says_so(endpoint: str) -> None:
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    r = _run(endpoint, code=code, language="python", run_timeout=60)
    assert r.status == RunStatus.Failed and r.run_result.return_code != 0, r.message
    assert "output truncated" in r.message, r.message
    assert 0 < len(r.run_result.stdout) <= 8 * MiB, len(r.run_result.stdout)


def test_unknown_and_unsupported_languages(endpoint: str) -> None:
    # not one of SandboxFusion's languages: their FastAPI's 422, naming the value
    r = _post(endpoint, {"code": "x", "language": "cobol"})
    assert r.status_code == 422 and "cobol" in r.text, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "language"]
    # one of theirs the image has no toolchain for: SandboxError naming it (their client raises)
    with pytest.raises(Exception, match="language 'go' is not supported"):
        _run(endpoint, code="package main\nfunc main() {}", language="go")


def test_verls_exact_request(endpoint: str) -> None:
    """``call_sandbox_api`` of verl: a JSON string body, these headers, the URL of ``sandbox_fusion_url``."""
    code = "a, b = map(int, input().split())\nprint(a + b)"
    payload = json.dumps({"compile_timeout": 10, "run_timeout": 10, "code": code, "stdin": "2 3\n",
                          "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []})
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    response = requests.post(f"{endpoint}/run_code", headers=headers, data=payload, timeout=10 + 10 + 10)
    response.raise_for_status()
    got = response.json()
    # what verl's _process_single_case reads
    assert got["status"] == "Success" and got["compile_result"] is None, got
    run = got["run_result"]
    assert (run["status"], run["return_code"], run["stdout"].rstrip("\n")) == ("Finished", 0, "5"), got
    assert isinstance(run["execution_time"], float) and run["stderr"] == ""


def test_the_token_is_required(endpoint: str) -> None:
    bare = endpoint.replace(f"dsec:{TOKEN}@", "")
    assert _post(bare, {"code": "print(1)", "language": "python"}).status_code == 401
    wrong = endpoint.replace(TOKEN, "wrong")
    assert _post(wrong, {"code": "print(1)", "language": "python"}).status_code == 401
    r = requests.post(f"{bare}/run_code", json={"code": "print(1)", "language": "python"},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n", r.text
    assert requests.get(f"{bare}/v1/ping", timeout=10).status_code == 200


def test_concurrent_requests_with_the_async_client(endpoint: str) -> None:
    async def many() -> list[Any]:
        return await asyncio.gather(*(run_code_async(RunCodeRequest(code=f"print({i} * {i})", language="python"),
                                                     endpoint=endpoint, max_attempts=1) for i in range(12)))

    results = asyncio.run(many())
    assert [r.run_result.stdout for r in results] == [f"{i * i}\n" for i in range(12)]
