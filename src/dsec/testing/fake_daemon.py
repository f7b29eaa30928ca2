"""``python -m dsec.testing.fake_daemon serve``: the daemon with the fake backend, for process-level tests.

Tests of starting and stopping the daemon (``up``/``down``, signals) run it through
``up(settings, module="dsec.testing.fake_daemon")`` without touching the host's isolation machinery. Owns
only that wiring; must never be reachable from the production entry point: the fake isolates nothing, and it
says so in the log.
"""

from __future__ import annotations

import logging
import sys

from dsec.config import Settings
from dsec.daemon.__main__ import main
from dsec.daemon.engine import Engine
from dsec.testing.fake import FakeBackend

__all__ = ["fake_engine"]


def fake_engine(settings: Settings) -> Engine:
    """An engine whose only backend, ``container``, is the fake."""
    logging.getLogger("dsec").warning("fake daemon: fake backend, NO ISOLATION (tests only)")
    fake = FakeBackend(root=settings.home / "fake")
    return Engine(settings, {"container": fake}, Engine.default_images(settings))


if __name__ == "__main__":
    sys.exit(main(engine=fake_engine))
