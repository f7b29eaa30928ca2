"""An asyncio RL rollout loop over many sandboxes, with a stub policy standing in for the model.

Start the daemon (`dsec up`), then `python examples/rl_rollouts.py --episodes 16 --concurrency 8`.

Each episode is one task in its own sandbox: the agent must leave a `solution.py` whose `fib(n)` is right
(a hidden test grades it). Each step the policy sees the last observation (the command's output) and
picks the next shell command; the environment runs it in the sandbox; after the last step a grader
command computes the reward. The stub policy is a seeded random choice among good and bad moves, so
rewards vary between episodes as they would with a real model. Sandboxes are created in bulk with
`AsyncSandbox.create_many`, episodes run concurrently (bounded by `--concurrency`) and every sandbox is
destroyed when its episode ends, even on failure. `--trajectory PREFIX` binds each episode to a
trajectory `PREFIX/episode-N`, so a re-run after the training job is preempted fast-forwards through what
already ran instead of running it again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import dsec

GOOD = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
BUGGY = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 3)\n"
ACTIONS = {
    "look": "ls -la; cat solution.py 2>/dev/null || echo 'no solution yet'",
    "write_good": f"cat > solution.py <<'EOF'\n{GOOD}EOF\necho written",
    "write_buggy": f"cat > solution.py <<'EOF'\n{BUGGY}EOF\necho written",
    "self_test": "python3 -c 'from solution import fib; print([fib(i) for i in range(8)])'",
    "noop": "true",
}
GRADER = ("python3 -c 'from solution import fib; import sys; "
          "sys.exit(0 if [fib(i) for i in range(15)] == [0,1,1,2,3,5,8,13,21,34,55,89,144,233,377] else 1)'")


class StubPolicy:
    """Chooses the next command from the last observation; a seeded stand-in for a model's sampling."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def act(self, observation: str) -> str:
        if "no solution yet" in observation:
            return self.rng.choices(["write_good", "write_buggy", "look"], weights=[6, 3, 1])[0]
        if "[0, 1, 1, 2, 3, 5, 8, 13]" in observation:
            return "noop"  # its self-test passed
        if "written" in observation:
            return "self_test"
        return self.rng.choice(list(ACTIONS))


@dataclass
class Episode:
    index: int
    sandbox: str
    steps: list[tuple[str, int]] = field(default_factory=list)
    """(action, exit code) per step."""
    reward: float = 0.0
    seconds: float = 0.0


async def run_episode(sb: dsec.AsyncSandbox, index: int, steps: int, seed: int) -> Episode:
    """One episode: ``steps`` policy actions in ``sb``, then the grader's reward (1.0 or 0.0)."""
    started = time.monotonic()
    policy = StubPolicy(seed + index)
    episode = Episode(index, sb.id)
    observation = ""
    for _ in range(steps):
        action = policy.act(observation)
        result = await sb.exec(ACTIONS[action], timeout=30)
        observation = (result.stdout + result.stderr).decode(errors="replace")
        episode.steps.append((action, result.exit_code))
    graded = await sb.exec(GRADER, timeout=30)
    episode.reward = 1.0 if graded.exit_code == 0 else 0.0
    episode.seconds = time.monotonic() - started
    return episode


async def rollouts(episodes: int, concurrency: int, steps: int = 4, *, backend: str = "container",
                   image: str = "debian-python", seed: int = 0, trajectory: str | None = None,
                   url: str | None = None) -> dict[str, Any]:
    """Run ``episodes`` episodes, ``concurrency`` sandboxes at a time; returns rewards and timings."""
    results: list[Episode] = []
    started = time.monotonic()
    async with dsec.Client(url) as client:
        for first in range(0, episodes, concurrency):
            batch = range(first, min(episodes, first + concurrency))
            if trajectory is None:
                sandboxes = await dsec.AsyncSandbox.create_many(
                    len(batch), image=image, backend=backend, memory="256Mi", timeout=600,
                    labels={"example": "rl-rollouts"}, client=client)
            else:  # one trajectory per episode: created one by one (a trajectory binds one sandbox)
                sandboxes = await asyncio.gather(*(dsec.AsyncSandbox.create(
                    image=image, backend=backend, memory="256Mi", timeout=600, labels={"example": "rl-rollouts"},
                    trajectory=f"{trajectory}/episode-{i}", client=client) for i in batch))
            try:
                results += await asyncio.gather(*(run_episode(sb, i, steps, seed)
                                                  for sb, i in zip(sandboxes, batch, strict=True)))
            finally:
                await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
    rewards = [e.reward for e in results]
    return {
        "episodes": len(results),
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "rewards": rewards,
        "steps": [e.steps for e in results],
        "sandboxes": [e.sandbox for e in results],
        "wall_s": round(time.monotonic() - started, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", default="container")
    parser.add_argument("--image", default="debian-python")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trajectory", help="bind each episode to the trajectory PREFIX/episode-N")
    args = parser.parse_args()
    if args.episodes < 1 or args.concurrency < 1 or args.steps < 1:
        parser.error("--episodes, --concurrency and --steps must be at least 1")
    summary = asyncio.run(rollouts(args.episodes, args.concurrency, args.steps, backend=args.backend,
                                   image=args.image, seed=args.seed, trajectory=args.trajectory))
    print(json.dumps({k: summary[k] for k in ("episodes", "mean_reward", "rewards", "wall_s")}))


if __name__ == "__main__":
    main()
