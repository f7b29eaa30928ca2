"""The soak's short version (``dsec bench soak`` for a minute): mixed load on a private daemon while each
component of the chaos list is SIGKILLed once. Its invariants are the assertions: every fault recovered, no
sandbox lost without a reason, no command of a cut-off rollout run twice, nothing left behind."""

from __future__ import annotations

import asyncio

import pytest

from container_support import images_dir
from dsec.bench.soak import COMPONENTS, SoakBench, run
from dsec.config import Settings

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_a_short_soak_keeps_its_invariants(debian_python_image: object) -> None:
    suite = asyncio.run(run(SoakBench(minutes=0.5, workers=2, fault_every_s=3),
                            Settings(images_dir=images_dir())))
    extra = suite.extra
    assert extra["unrecovered"] == [], extra
    assert sorted(extra["recoveries_s"]) == sorted(COMPONENTS), extra["recoveries_s"]
    assert extra["lost_without_reason"] == [], extra["lost_without_reason"]
    assert extra["exactly_once_violations"] == [], extra["exactly_once_violations"]
    assert extra["leaks"] == [] and extra["sandboxes_left"] == [], (extra["leaks"], extra["sandboxes_left"])
    assert sum(extra["ops"].values()) > 0 and extra["daemon_restarts"] == 1
    assert all(row.passed is not False for row in suite.rows), [r for r in suite.rows if r.passed is False]
