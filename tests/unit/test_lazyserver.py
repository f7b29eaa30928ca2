"""LazyServer's hung count belongs to one server: a replaced server's misses (and its probe still stuck in I/O)
must not count against its successor."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from dsec.images.lazyserver import LazyServer


def test_a_new_server_starts_with_no_misses_and_no_stuck_probe(tmp_path: Path) -> None:
    server = LazyServer(tmp_path, tmp_path / "lazyfs.log", list)  # no blobs mount: a probe's lookup is ENOENT
    stuck = threading.Event()
    old = subprocess.Popen(["sleep", "60"])
    new = subprocess.Popen(["sleep", "60"])
    probe = threading.Thread(target=stuck.wait, daemon=True)  # a lookup the hung server never answers
    try:
        server._track(old.pid)
        probe.start()
        server._probe, server.unanswered = probe, 3  # what node.check() replaced it for
        server._track(new.pid)  # its successor (ensure() -> _start() -> _track())
        assert server.unanswered == 0
        assert server.answers(timeout=5) is None, "the old server's stuck probe was taken for the new one's"
        assert server.unanswered == 0
        server._probe, server.unanswered = probe, 2
        server._track(new.pid)  # the same server again (adopted): its count stands
        assert server.unanswered == 2
        server.stop()
        assert server.unanswered == 0 and server._probe is None
        assert new.wait(10) is not None, "stop() ends the server it knows"
    finally:
        stuck.set()
        for proc in (old, new):
            proc.kill()
            proc.wait()
        server.close()
