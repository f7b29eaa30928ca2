"""Grading at scale, as a new user would: 200 candidates graded with ``sb.map(..., concurrency=4)`` in ONE
function sandbox, three times over. Among them fork bombs, memory hogs, /tmp fillers, output floods, slow and
crashing solutions: every correct candidate must get its value and every bad one the verdict of the limit it
hit, whatever the candidates beside it do (each call has its own cgroup, pids, memory and /tmp)."""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from typing import Any

import pytest

import dsec
from dsec.backends.base import ImageRef
from function_support import ServedFunctionDaemon, served_function_daemon

pytestmark = [pytest.mark.root, pytest.mark.slow]

# (kind, weight, expected verdict); each candidate's source differs (a comment)
KINDS = [
    ("correct", 120, "ok"), ("correct_loop", 30, "ok"), ("wrong", 14, "wrong"), ("crash", 6, "raised"),
    ("fork_bomb", 6, "limit:pids"), ("memory_hog", 6, "limit:memory"), ("tmp_filler", 6, "limit:disk"),
    ("flood", 6, "limit:output"), ("slow", 6, "limit:time"),
]
SOURCES = {
    "correct": "def solve(xs):\n    return sum(x * x for x in xs)\n",
    "correct_loop": "def solve(xs):\n    t = 0\n    for x in xs:\n        t += x ** 2\n    return t\n",
    "wrong": "def solve(xs):\n    return sum(xs) ** 2\n",
    "crash": "def solve(xs):\n    return xs[len(xs)]\n",
    "fork_bomb": "import os\ndef solve(xs):\n    while True:\n        os.fork()\n",
    "memory_hog": "def solve(xs):\n    hog = []\n    while True:\n        hog.append(bytearray(16 << 20))\n",
    "tmp_filler": "def solve(xs):\n    with open('/tmp/f', 'wb') as f:\n        while True:\n"
                  "            f.write(bytes(1 << 20))\n",
    "flood": "def solve(xs):\n    while True:\n        print('x' * 4096)\n",
    "slow": "def solve(xs):\n    while True:\n        pass\n",
}
TESTS = [([], 0), ([3], 9), ([1, 2, 3], 14), (list(range(50)), 40425)]


def candidates(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    kinds = [k for k, weight, _ in KINDS for _ in range(weight)]
    assert len(kinds) == n
    rng.shuffle(kinds)
    return [(kind, f"# candidate {i}\n{SOURCES[kind]}") for i, kind in enumerate(kinds)]


def run_tests(source: str) -> bool:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<candidate>", "exec"), namespace)
    return all(namespace["solve"](list(case)) == want for case, want in TESTS)


def verdict(outcome: Any) -> str:
    if isinstance(outcome, bool):
        return "ok" if outcome else "wrong"
    if isinstance(outcome, dsec.CallFailed) and outcome.detail.get("limit"):
        return f"limit:{outcome.detail['limit']}"
    if isinstance(outcome, dsec.RemoteError):
        return "raised"
    return f"{type(outcome).__name__}: {outcome}"  # a crash without a limit, or the sandbox's own error


@pytest.fixture(scope="module")
def served(debian_python_image: ImageRef) -> Iterator[ServedFunctionDaemon]:
    with served_function_daemon("dsec-fg-") as s:
        yield s


@pytest.mark.parametrize("round_", [0, 1, 2])
def test_two_hundred_candidates_at_concurrency_four(served: ServedFunctionDaemon, round_: int) -> None:
    graded = candidates(200, seed=round_)
    expected = {kind: want for kind, _, want in KINDS}
    # 128 MiB: the memory hog meets its limit well inside its 5 s even when it shares the CPUs with other tests
    with dsec.Client(url=served.url) as client, dsec.Sandbox.create(
            image="debian-python", backend="function", memory="128Mi", pids=64, client=client) as sb:
        # 5 s: a first round on a fresh node reads image parts not cached yet, blocked (not waiting for a CPU,
        # which is not counted): 3 s killed 2 of 120 correct candidates in a CI run. The slow ones pay ~3 s.
        outcomes = sb.map(run_tests, [src for _, src in graded], concurrency=4, timeout=5.0, return_exceptions=True)
        # the sandbox serves on: nothing of the bad candidates is left in it
        assert sb.call(run_tests, SOURCES["correct"]) is True
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for (kind, _), outcome in zip(graded, outcomes, strict=True):
        table[kind][verdict(outcome)] += 1
    wrong = {kind: dict(got) for kind, got in table.items() if set(got) != {expected[kind]}}
    details = [f"{kind}: {outcome!r} {getattr(outcome, 'detail', '')}"[:600]
               for (kind, _), outcome in zip(graded, outcomes, strict=True) if verdict(outcome) != expected[kind]]
    assert not wrong, f"round {round_}: verdicts that are not the limit hit: {wrong}\n" + "\n".join(details[:12])

