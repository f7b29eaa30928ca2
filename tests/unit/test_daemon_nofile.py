"""The daemon raises its soft limit of open files to the hard one (a dense node holds many descriptors)."""

from __future__ import annotations

import subprocess
import sys


def test_raise_nofile_lifts_the_soft_limit_to_the_hard_one() -> None:
    # In a child, so this process keeps its limits.
    code = (
        "import resource\n"
        "from dsec.daemon.server import raise_nofile\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "got = raise_nofile()\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard) == (got, hard), got\n"
        "assert raise_nofile() == hard\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
