"""The soak's census judges the host against what the daemon lists: a sandbox's resource outliving it for a
few looks is a leak (one in flight is not), an image not ``ok`` past the bound is wedged, and the daemon's
RSS growth is counted per process after its warm-up."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsec.bench import soak_watch
from dsec.bench.soak_watch import Census, Item, footprint
from dsec.config import Settings


def census(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, items: set[Item]) -> Census:
    monkeypatch.setattr(soak_watch, "footprint", lambda settings: items)
    return Census(Settings(home=tmp_path), wedged_after=90)


def test_a_resource_outliving_its_sandbox_for_three_looks_is_a_leak(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    cg = Item("cgroup", "/sys/fs/cgroup/dsec-x/sb-0123456789ab", "sb-0123456789ab")
    home = Item("process", "dsec-lazyfs pid 1", None)
    watch = census(monkeypatch, tmp_path, {cg, home})
    watch.look({"sb-0123456789ab"}, [], 1, None)  # listed: its own
    watch.look(set(), [], 1, None)
    watch.look(set(), [], 1, None)
    assert watch.leaks == {}  # gone from the list for two looks: a destroy in flight
    watch.look({"sb-0123456789ab"}, [], 1, None)  # back (a create in flight): the count starts again
    for _ in range(2):
        watch.look(set(), [], 1, None)
    assert watch.leaks == {}
    watch.look(set(), [], 1, None)
    assert watch.leaks == {f"cgroup {cg.name}": "sb-0123456789ab"}  # the home's own process is never one


def test_an_image_not_ok_past_the_bound_is_wedged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    watch = census(monkeypatch, tmp_path, set())
    now = time.time()
    watch.look(set(), [("image:a", "degraded", now - 10, "remounting"), ("lazy-server", "down", now - 500, "x"),
                       ("image:b", "ok", now - 500, None)], 1, None)
    assert watch.wedged == {}
    watch.look(set(), [("image:a", "down", now - 200, "mount gone")], 1, None)
    assert list(watch.wedged) == ["image:a"] and "mount gone" in watch.wedged["image:a"]


def test_rss_growth_counts_each_daemon_after_its_warm_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    watch = census(monkeypatch, tmp_path, set())
    assert watch.growth_mib_per_hour() is None
    # daemon 1: 50 -> 80 MiB while warming, then +10 MiB over 600 s; daemon 2 (after a restart): flat over 600 s
    warm = soak_watch.WARM_S
    watch.rss = [(0, 1, 50.0), (warm, 1, 80.0), (warm + 600, 1, 90.0),
                 (2000, 2, 60.0), (2000 + warm, 2, 85.0), (2600 + warm, 2, 85.0)]
    assert watch.growth_mib_per_hour() == pytest.approx(10 / 1200 * 3600)
    assert watch.warm_seconds() == pytest.approx(1200)
    watch.rss = [(0, 3, 50.0), (warm - 1, 3, 90.0)]  # a daemon killed while still warming: nothing to judge
    assert watch.growth_mib_per_hour() is None and watch.warm_seconds() == 0


def test_footprint_of_an_unused_home_is_empty(tmp_path: Path) -> None:
    assert footprint(Settings(home=tmp_path)) == set()



async def test_an_unrecovered_fault_names_what_was_waited_for_and_the_last_answer() -> None:
    from dsec.bench import soak
    from dsec.errors import SandboxStateError

    async def refused() -> bool:
        raise SandboxStateError("sandbox sb-1 is failed; the operation needs it running")

    async def unlike() -> bool:
        unlike.last = "exec on the victim: exit 1, b''"  # type: ignore[attr-defined]
        return False

    with pytest.raises(soak._Unrecovered) as err:
        await soak._until(refused, "victim sb-1 to be revived or reported lost", bound=0.3)
    assert str(err.value) == ("waited 0.3 s for victim sb-1 to be revived or reported lost; last seen: "
                              "SandboxStateError: sandbox sb-1 is failed; the operation needs it running")
    with pytest.raises(soak._Unrecovered, match=r"last seen: exec on the victim: exit 1, b''$"):
        await soak._until(unlike, "victim sb-1 to be revived or reported lost", bound=0.3)
