"""Computer use on a VM desktop: open a terminal, type a command, save before/after screenshots.

Start the daemon (`dsec up`) on a node with the vm backend and the `debian-desktop` VM image
(`dsec image build-vm debian-desktop --desktop`, done by ./scripts/setup), then
`python examples/computer_use.py --out /tmp/computer-use`. The desktop is Xorg with the twm window manager,
whose keyboard focus follows the pointer: the agent moves the mouse onto the terminal it opened before typing.
Under TCG (no KVM) the first sandbox of a shape boots the template VM once, which takes minutes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import dsec

TERMINAL = "xterm -geometry 70x12+380+300 -bg navy -fg yellow -fs 14 -fa Monospace -title agent-terminal"
SHELL_READY = ('until p=$(pgrep -x bash -P "$(pgrep -d, -f agent-terminal)") && '
               'stty -a < /proc/$p/fd/0 2>/dev/null | grep -q -- -icanon; do sleep 0.5; done')
INSIDE_TERMINAL = (600, 380)
"""A pixel inside the window TERMINAL opens (70x12 characters at +380+300)."""


def run(out: Path, image: str = "debian-desktop", url: str | None = None, wait_s: float = 60.0) -> dict[str, object]:
    """Open a terminal, point at it, type a command; save ``before.png`` and ``after.png`` in ``out``.

    Returns what happened: the screenshots' paths, the sandbox, and ``typed``: what the typed command wrote,
    or None when the keystrokes did not reach the terminal within ``wait_s``.
    """
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with dsec.Client(url) as client, dsec.Sandbox.create(image=image, backend="vm", memory="1Gi", timeout=1800,
                                                         client=client) as sb:
        ready_s = time.monotonic() - started
        (out / "before.png").write_bytes(sb.screenshot())
        # open a terminal on the desktop (an agent could click a menu instead; this is the shortest way)
        sb.exec(f"DISPLAY=:0 setsid {TERMINAL} >/dev/null 2>&1 < /dev/null &")
        # Keys typed before the terminal's shell runs are lost (under TCG an xterm takes seconds to start
        # it): wait until the shell waits at its prompt (readline puts the terminal in non-canonical mode).
        sb.exec(SHELL_READY, timeout=max(wait_s, 300))
        sb.mouse(*INSIDE_TERMINAL, action="move")
        sb.keyboard(text="uname -a; echo hello from the agent | tee /tmp/agent.txt\n")
        typed = None
        for _ in range(int(wait_s * 2)):
            if sb.exec("test -s /tmp/agent.txt").exit_code == 0:
                typed = sb.files.read("/tmp/agent.txt").decode().strip()
                break
            time.sleep(0.5)
        time.sleep(2)
        (out / "after.png").write_bytes(sb.screenshot())
        terminal = sb.exec("pgrep -f agent-terminal").exit_code == 0
        return {"sandbox": sb.id, "ready_s": round(ready_s, 1), "before": out / "before.png",
                "after": out / "after.png", "terminal_opened": terminal, "typed": typed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="debian-desktop")
    parser.add_argument("--out", type=Path, default=Path("computer-use"))
    args = parser.parse_args()
    result = run(args.out, args.image)
    print(f"sandbox {result['sandbox']} ready in {result['ready_s']}s")
    if result["typed"] is None:
        print("the keystrokes did not reach the terminal's shell")
    else:
        print("the typed command wrote:", result["typed"])
    print(f"screenshots: {result['before']} {result['after']}")


if __name__ == "__main__":
    main()
