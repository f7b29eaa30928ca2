"""A SWE-style task: clone a git repository into a sandbox, reproduce the failing test, patch, test again.

Start the daemon (`dsec up`), then `python examples/swe_task.py` (a demo repository with a bug is made in a
temporary directory) or `python examples/swe_task.py --repo PATH --patch FILE --test 'CMD'` for your own.

The repository is a local one on the machine running this script: it is packed with `git bundle` and
uploaded, and the sandbox clones the bundle (sandboxes have no network by default, and nothing of the
host is mounted into them). The agent's patch (a unified diff) is applied with `git apply`, the tests run
before and after, and the result is the diff and both test runs -- what an RL environment turns into a
reward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import dsec

DEMO_FILES = {
    "calc/__init__.py": "",
    "calc/stats.py": (
        "def mean(xs):\n"
        "    \"\"\"Arithmetic mean of a non-empty list.\"\"\"\n"
        "    return sum(xs) / (len(xs) - 1)\n"
    ),
    "tests/__init__.py": "",
    "tests/test_stats.py": (
        "import unittest\n\nfrom calc.stats import mean\n\n\n"
        "class MeanTest(unittest.TestCase):\n"
        "    def test_mean(self):\n"
        "        self.assertEqual(mean([1, 2, 3, 4]), 2.5)\n\n"
        "    def test_single(self):\n"
        "        self.assertEqual(mean([7]), 7)\n"
    ),
}
DEMO_PATCH = """\
--- a/calc/stats.py
+++ b/calc/stats.py
@@ -1,3 +1,3 @@
 def mean(xs):
     \"\"\"Arithmetic mean of a non-empty list.\"\"\"
-    return sum(xs) / (len(xs) - 1)
+    return sum(xs) / len(xs)
"""
DEMO_TEST = "python3 -m unittest -q"
GIT_ENV = {"GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.invalid",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.invalid"}


def make_demo_repo(where: Path) -> Path:
    """A git repository with a bug that its own test catches."""
    repo = where / "calc-repo"
    for name, text in DEMO_FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(where), **GIT_ENV}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "."], ["git", "commit", "-q", "-m", "calc"]):
        subprocess.run(argv, cwd=repo, env=env, check=True)
    return repo


def bundle(repo: Path, where: Path) -> bytes:
    """The whole repository (every branch) as one `git bundle` file."""
    path = where / "repo.bundle"
    subprocess.run(["git", "bundle", "create", "-q", str(path), "--all"], cwd=repo, check=True)
    return path.read_bytes()


def solve(repo: Path, patch: str, test: str, *, backend: str = "container", image: str = "debian-python",
          url: str | None = None) -> dict[str, Any]:
    """Clone ``repo`` into a fresh sandbox, run ``test``, apply ``patch``, run ``test`` again."""
    with tempfile.TemporaryDirectory() as scratch, dsec.Client(url) as client, dsec.Sandbox.create(
            image=image, backend=backend, memory="512Mi", timeout=900, labels={"example": "swe-task"},
            client=client) as sb:
        sb.files.write("/tmp/repo.bundle", bundle(repo, Path(scratch)))
        clone = sb.exec("git clone -q /tmp/repo.bundle repo && git -C repo log --oneline | head -1", timeout=120)
        if clone.exit_code != 0:
            raise RuntimeError(f"git clone failed in the sandbox: {clone.stderr.decode()}")
        before = sb.exec(test, cwd="/workspace/repo", timeout=300)
        sb.files.write("/tmp/agent.patch", patch.encode())
        applied = sb.exec("git apply --verbose /tmp/agent.patch", cwd="/workspace/repo", timeout=60)
        after = sb.exec(test, cwd="/workspace/repo", timeout=300) if applied.exit_code == 0 else None
        diff = sb.exec("git diff --stat && git diff", cwd="/workspace/repo", timeout=60)
        commit = sb.exec("git commit -qam 'agent: fix' && git rev-parse HEAD", cwd="/workspace/repo",
                         env=GIT_ENV, timeout=60)
        return {
            "sandbox": sb.id,
            "head": clone.stdout.decode().strip(),
            "tests_before": {"exit_code": before.exit_code, "output": (before.stdout + before.stderr).decode()},
            "patch_applied": applied.exit_code == 0,
            "patch_output": (applied.stdout + applied.stderr).decode(),
            "tests_after": None if after is None else {"exit_code": after.exit_code,
                                                       "output": (after.stdout + after.stderr).decode()},
            "diff": diff.stdout.decode(),
            "commit": commit.stdout.decode().strip() if commit.exit_code == 0 else None,
            "resolved": before.exit_code != 0 and after is not None and after.exit_code == 0,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="a local git repository (default: a demo with a bug)")
    parser.add_argument("--patch", type=Path, help="a unified diff to apply (default: the demo's fix)")
    parser.add_argument("--test", default=DEMO_TEST, help="the test command, run in the repository")
    parser.add_argument("--backend", default="container")
    args = parser.parse_args()
    if (args.repo is None) != (args.patch is None):
        parser.error("--repo and --patch go together (or neither, for the demo)")
    with tempfile.TemporaryDirectory() as where:
        repo = args.repo or make_demo_repo(Path(where))
        patch = args.patch.read_text() if args.patch else DEMO_PATCH
        result = solve(repo, patch, args.test, backend=args.backend)
    print(json.dumps(result, indent=2))
    raise SystemExit(0 if result["resolved"] else 1)


if __name__ == "__main__":
    main()
