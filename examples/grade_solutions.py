"""Grade candidate solutions in a function sandbox, online-judge style: each candidate in its own isolated call.

Start the daemon (`dsec up`), then `python examples/grade_solutions.py --n 1000`. The candidates are
generated here to cover what a judge meets: correct, wrong, slow (infinite loop), memory hogs and crashing
solutions to one problem (sum of the squares of a list). Every candidate runs against every test case in a
fresh process tree of the sandbox with a time limit, and a memory limit of its own (the sandbox's, per
call: another candidate's hog never counts against it). Verdicts: AC (accepted), WA (wrong answer), TLE (time
limit), MLE (memory limit), RE (runtime error).
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from typing import Any

import dsec

TESTS: list[tuple[list[int], int]] = [([], 0), ([3], 9), ([1, 2, 3], 14), ([-4, 5], 41), (list(range(100)), 328350)]

CANDIDATES = {
    "correct": "def solve(xs):\n    return sum(x * x for x in xs)\n",
    "correct_loop": "def solve(xs):\n    t = 0\n    for x in xs:\n        t += x ** 2\n    return t\n",
    "wrong": "def solve(xs):\n    return sum(xs) ** 2\n",
    "off_by_one": "def solve(xs):\n    return sum(x * x for x in xs[1:])\n",
    "slow": "def solve(xs):\n    while True:\n        pass\n",
    "memory_hog": "def solve(xs):\n    hog = []\n    while True:\n        hog.append(bytearray(128 << 20))\n",
    "crash": "def solve(xs):\n    return xs[len(xs)] * 2\n",
    "syntax_error": "def solve(xs)\n    return 0\n",
}
KINDS = list(CANDIDATES)
WEIGHTS = [40, 20, 12, 10, 5, 3, 7, 3]


def generate(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (kind, source) pairs; each source differs (a comment) so no two candidates are byte-identical."""
    rng = random.Random(seed)
    kinds = KINDS[:n] + rng.choices(KINDS, weights=WEIGHTS, k=max(0, n - len(KINDS)))  # every kind at least once
    return [(kind, f"# candidate {i}\n{CANDIDATES[kind]}") for i, kind in enumerate(kinds)]


def run_tests(source: str) -> list[bool]:
    """Runs inside the sandbox: load the candidate and check it on every test case."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "<candidate>", "exec"), namespace)
    solve = namespace["solve"]
    return [solve(list(case)) == expected for case, expected in TESTS]


def verdict(outcome: Any) -> str:
    """The judge's verdict for one call's outcome (a list of booleans or the error it raised)."""
    if isinstance(outcome, list):
        return "AC" if all(outcome) else "WA"
    if isinstance(outcome, dsec.CallFailed):
        return {"time": "TLE", "memory": "MLE"}.get(str(outcome.detail.get("limit")), "RE")
    return "RE"


def grade(n: int, concurrency: int = 8, time_limit: float = 5.0, url: str | None = None) -> dict[str, Any]:
    """Grade ``n`` generated candidates; returns the summary (also printed as a table)."""
    candidates = generate(n)
    started = time.perf_counter()
    with dsec.Client(url=url) as client, dsec.Sandbox.create(
            image="debian-python", backend="function", memory="512Mi", pids=256, timeout=3600, client=client) as sb:
        outcomes = sb.map(run_tests, [src for _, src in candidates], concurrency=concurrency,
                          timeout=time_limit, return_exceptions=True)
    elapsed = time.perf_counter() - started
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for (kind, _), outcome in zip(candidates, outcomes, strict=True):
        table[kind][verdict(outcome)] += 1
    totals = collections.Counter(verdict(o) for o in outcomes)
    _print(table, totals, n, elapsed)
    return {"n": n, "seconds": elapsed, "by_kind": {k: dict(v) for k, v in table.items()}, "totals": dict(totals)}


def _print(table: dict[str, collections.Counter[str]], totals: collections.Counter[str], n: int,
           elapsed: float) -> None:
    columns = ["AC", "WA", "TLE", "MLE", "RE"]
    print(f"{'candidate kind':<16}" + "".join(f"{c:>6}" for c in columns))
    for kind in KINDS:
        if kind in table:
            print(f"{kind:<16}" + "".join(f"{table[kind][c]:>6}" for c in columns))
    print(f"{'total':<16}" + "".join(f"{totals[c]:>6}" for c in columns))
    print(f"{n} candidates x {len(TESTS)} tests graded in {elapsed:.1f} s ({n / elapsed:.0f} candidates/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="candidates to generate and grade")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight at once")
    parser.add_argument("--time-limit", type=float, default=5.0,
                        help="seconds per candidate (time it waits for a CPU on a busy node is not counted)")
    parser.add_argument("--url", default=None, help="daemon URL (default: DSEC_URL or the local daemon)")
    args = parser.parse_args()
    grade(args.n, args.concurrency, args.time_limit, args.url)


if __name__ == "__main__":
    main()
