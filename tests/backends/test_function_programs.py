"""Python programs forked from a function sandbox's warm interpreter (``ExecRequest(warm_python=True)``, the path
of SandboxFusion's ``run_code``): each behaves as the same program run by a fresh ``python3`` in the same
sandbox (output, exit status, ``SystemExit``, tracebacks, stdin, threads, ``atexit``), with the same limits and
verdicts, and a request the zygote cannot run faithfully runs as a fresh process."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.accounts import ROOT
from dsec.backends.base import ImageRef
from dsec.backends.function import FunctionBackend
from dsec.models import ExecRequest, ExecResult, SandboxRecord
from dsec.testing import sandbox
from function_support import function_backend_fixtures

pytestmark = [pytest.mark.root]

MiB = 1024 * 1024

home, backend = function_backend_fixtures("function-programs-home")

PROGRAMS = {
    "hello": "print(1)",
    "argv": "import sys, os\nprint(sys.argv, __name__, __file__, sys.path[0], os.getcwd())",
    "main-module": "import sys\nprint(sorted(k for k in vars() if k.startswith('__')), __spec__, "
                   "type(__loader__).__name__, sys.modules['__main__'] is sys.modules[__name__])",
    "stdio": "import sys\nprint(sys.stdin.read().upper(), end='')\nprint('err', file=sys.stderr)\n"
             "print(sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors, sys.stdin.name, sys.stdout.name)",
    "env": "import os, locale\nprint(sorted(os.environ), os.environ.get('LC_CTYPE'), "
           "locale.setlocale(locale.LC_CTYPE))",
    "exit-int": "import sys\nprint('before', flush=True)\nsys.exit(3)",
    "exit-str": "raise SystemExit('bad input')",
    "exit-none": "import sys\nsys.exit()",
    "exit-big": "import sys\nsys.exit(258)",
    "raises": "def f():\n    raise ValueError('boom')\nf()",
    "syntax": "def (:\n",
    "buffered": "import os\nprint('lost?', end='')\nos._exit(4)",
    "atexit-threads": "import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
                      "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\nprint('main')",
    "pickle-main": "import pickle\nclass A: pass\nprint(type(pickle.loads(pickle.dumps(A()))).__name__)",
    "imports": "import sys\nprint('cloudpickle' in sys.modules, 'loader' in sys.modules, '/.dsec' in sys.path)",
}


async def run(b: FunctionBackend, sb: SandboxRecord, name: str, warm: bool, *args: str, stdin: bytes | None = None,
              **request: object) -> ExecResult:
    return await b.exec(sb, ExecRequest(command=["python3", f"{name}.py", *args], warm_python=warm, stdin=stdin,
                                        **{"timeout": 60, **request}))


def _mode(r: ExecResult) -> str:
    return r.stdout.decode().strip()


async def test_a_warm_program_behaves_as_a_fresh_one(backend: FunctionBackend, debian_python_image: ImageRef
                                                     ) -> None:
    async with sandbox(backend, debian_python_image) as sb:
        for name, source in PROGRAMS.items():
            await backend.write_file(sb, f"/workspace/{name}.py", source.encode(), None)
        for name in PROGRAMS:
            stdin = b"some input\n" if name == "stdio" else None
            fresh = await run(backend, sb, name, False, "x", "y z", stdin=stdin)
            warm = await run(backend, sb, name, True, "x", "y z", stdin=stdin)
            assert (warm.exit_code, warm.stdout, warm.stderr) == (fresh.exit_code, fresh.stdout, fresh.stderr), name
            assert warm.limit is None, (name, warm)
        missing = await run(backend, sb, "missing", True)
        assert missing.exit_code == 2 and b"can't open file '/workspace/missing.py'" in missing.stderr, missing


async def test_warm_programs_keep_limits_and_verdicts(backend: FunctionBackend, debian_python_image: ImageRef
                                                      ) -> None:
    programs = {
        "hog": "x = bytearray(200 << 20)\nprint(len(x))",
        "spin": "while True: pass",
        "flood": "import sys\nwhile True: sys.stdout.write('x' * 65536)",
        "forks": "import subprocess\nps = [subprocess.Popen(['sleep', '2']) for _ in range(12)]\n"
                 "[p.wait() for p in ps]",
        "fill": "f = open('/tmp/data', 'wb')\nfor _ in range(64): f.write(bytes(1 << 20))",
        "isolated": "import sys\nprint(sys.flags.isolated)",
    }
    async with sandbox(backend, debian_python_image, memory="128Mi", pids=8, disk="16Mi") as sb:
        for name, source in programs.items():
            await backend.write_file(sb, f"/workspace/{name}.py", source.encode(), None)
        assert (await run(backend, sb, "hog", True)).limit == "memory"
        assert (await run(backend, sb, "spin", True, timeout=1.5)).limit == "time"
        flood = await run(backend, sb, "flood", True, max_output=MiB)
        assert flood.truncated and len(flood.stdout) <= MiB, flood.model_copy(update={"stdout": b""})
        forks = await run(backend, sb, "forks", True)
        assert forks.limit == "pids", forks
        assert (await run(backend, sb, "fill", True)).limit == "disk"
        # the zygote's path (an interpreter started with -I) or a fresh process
        assert _mode(await run(backend, sb, "isolated", True)) == "1"
        assert _mode(await run(backend, sb, "isolated", False)) == "0"
        fresh: dict[str, Any]
        for fresh in ({"env": {"PYTHONPATH": "/workspace"}}, {"env": {"LANG": "de_DE.ISO-8859-1"}},
                      {"user": True}):
            user = ROOT if fresh.pop("user", None) else None
            request = ExecRequest(command=["python3", "isolated.py"], warm_python=True, **fresh)
            assert _mode(await backend.exec(sb, request, user)) == "0", (fresh, user)
        argv_forms = (["python3", "-c", "import sys; print(sys.flags.isolated)"], ["/usr/bin/python3", "isolated.py"],
                      "python3 isolated.py")
        for command in argv_forms:
            r = await backend.exec(sb, ExecRequest(command=command, warm_python=True))
            assert _mode(r) == "0", command

