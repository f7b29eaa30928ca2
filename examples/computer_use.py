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
INSIDE_TERMINAL = (600, 380)
"""A pixel inside the window TERMINAL opens (70x12 characters at +380+300)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="debian-desktop")
    parser.add_argument("--out", type=Path, default=Path("computer-use"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with dsec.Sandbox.create(image=args.image, backend="vm", memory="1Gi", timeout=1800) as sb:
        print(f"sandbox {sb.id} ready in {time.monotonic() - started:.1f}s")
        (args.out / "before.png").write_bytes(sb.screenshot())
        # open a terminal on the desktop (an agent could click a menu instead; this is the shortest way)
        sb.exec(f"DISPLAY=:0 setsid {TERMINAL} >/dev/null 2>&1 < /dev/null &")
        for _ in range(120):
            if sb.exec("pgrep -f agent-terminal").exit_code == 0:
                break
            time.sleep(0.5)
        time.sleep(3)  # let it draw
        sb.mouse(*INSIDE_TERMINAL, action="move")
        sb.keyboard(text="uname -a; echo hello from the agent | tee /tmp/agent.txt\n")
        for _ in range(120):
            if sb.exec("test -s /tmp/agent.txt").exit_code == 0:
                break
            time.sleep(0.5)
        time.sleep(2)
        (args.out / "after.png").write_bytes(sb.screenshot())
        print("the typed command wrote:", sb.files.read("/tmp/agent.txt").decode().strip())
    print(f"screenshots: {args.out / 'before.png'} {args.out / 'after.png'}")


if __name__ == "__main__":
    main()
