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


def test_rss_growth_is_each_lifes_least_squares_slope_past_its_warm_up(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    watch = census(monkeypatch, tmp_path, set())
    assert watch.lives(600) == []
    warm = soak_watch.WARM_S
    # daemon 1: 50 -> 80 MiB while warming, then +10 MiB/h for 20 min but its last sample 2.3 MiB low (a heap
    # trimmed) that a start -> end difference would read as 3 MiB/h; daemon 2 (after a restart): flat; daemon 3
    # killed while warming
    one = [(warm + 60 * i, 80 + i / 6) for i in range(21)]
    one[-1] = (one[-1][0], 81.0)
    watch.rss = [(0, 1, 50.0, 0.0), *((age, 1, mib, age) for age, mib in one),
                 *((2000 + age, 2, 85.0, age) for age in (10, warm, warm + 300, warm + 700)),
                 (3000, 3, 60.0, 5.0), (3100, 3, 90.0, warm - 1)]
    first, second, third = watch.lives(600)
    assert first.pid == 1 and first.judged and first.warm_s == 1200 and first.samples == 22
    assert first.slope_mib_per_h == pytest.approx(8.18, abs=0.01)  # the line through all 21 warm samples
    assert first.rss_warm_mib == 80 and first.rss_first_mib == 50 and first.rss_last_mib == 81
    assert second.slope_mib_per_h == 0 and second.judged and second.warm_s == 700
    assert third.slope_mib_per_h is None and not third.judged and third.warm_s == 0 and third.lived_s == warm - 1
    assert not watch.lives(1300)[0].judged  # a warm part shorter than asked for is reported, not judged
    exact = census(monkeypatch, tmp_path, set())
    exact.rss = [(age, 4, 80 + age / 360, age) for age in (warm, warm + 600, warm + 1200)]  # 10 MiB/h exactly
    assert exact.lives(600)[0].slope_mib_per_h == pytest.approx(10)


def test_the_figure_is_the_steepest_judged_life() -> None:
    from dataclasses import asdict

    def life(pid: int, slope: float | None, judged: bool) -> soak_watch.Life:
        return soak_watch.Life(pid, 1500.0, 90, 1200.0 if judged else 200.0, 80.0, 85.0, 86.0, slope, judged)

    lives = [life(1, 4.0, True), life(2, 30.0, False), life(3, 9.5, True), life(4, None, False)]
    assert soak_watch.worst_life(lives) == lives[2]  # a steeper life too short to judge is not the figure
    assert soak_watch.worst_life(lives[1:2]) == lives[1]  # ... unless no life was judged (reported, not judged)
    assert soak_watch.worst_life([lives[3]]) is None
    assert soak_watch.lives_note([asdict(x) for x in lives]) == \
        "2 of 4 daemon lives judged (each warm 20+ min): 4.0, 9.5 MiB/h"
    assert soak_watch.lives_note([asdict(lives[1])]) == "1 daemon life, none warm for 600 s"


def test_the_census_samples_rss_with_the_daemons_age(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    watch = census(monkeypatch, tmp_path, set())
    watch.look(set(), [], 7, 81.5, 42.0)
    watch.look(set(), [], 7, None, 57.0)  # the daemon's RSS could not be read: no sample
    watch.look(set(), [], 7, 81.5, None)  # nor its age
    assert [(pid, mib, age) for _, pid, mib, age in watch.rss] == [(7, 81.5, 42.0)]


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


def test_the_daemon_is_killed_at_its_turn_once_it_lived_long_enough() -> None:
    from dsec.bench.soak import SoakBench, _daemon_due

    cfg = SoakBench(fault_every_s=60, daemon_every_s=1200)
    assert _daemon_due(1200, True, 3000, cfg, 7) and _daemon_due(None, True, 3000, cfg, 7)  # old, or age unknown
    assert not _daemon_due(420, False, 3000, cfg, 7)  # young, and its next turn comes before the end
    assert _daemon_due(420, False, 400, cfg, 7)  # young, but its only chance in this soak
    assert not _daemon_due(420, True, 400, cfg, 7)  # ... once it was killed, young stays spared


async def test_the_chaos_schedule_spares_a_young_daemon_and_keeps_the_others_rate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An hour at a fault a minute over the seven components, the daemon killed at most once per 20 min of its
    life: a fault every minute all the same, the daemon's spared turns going to the next component."""
    import asyncio
    import types

    from dsec.bench import soak, soak_load

    clock = [0.0]
    born = [0.0]
    done: list[tuple[float, str]] = []

    class Node:
        def age_s(self) -> float:
            return clock[0] - born[0]

    async def fault(node: object, tally: soak_load.Tally, cfg: soak.SoakBench, name: str, progress: object) -> None:
        clock[0] += cfg.fault_every_s
        done.append((clock[0], name))
        tally.recoveries.setdefault(name, []).append(1.0)
        if name == "daemon":
            born[0] = clock[0]

    monkeypatch.setattr(soak, "_fault", fault)
    monkeypatch.setattr(soak, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda seconds: real_sleep(0))  # the wait for the deadline: none
    tally = soak_load.Tally(backends=(*soak_load.BACKENDS, "microvm"))
    cfg = soak.SoakBench(minutes=60, fault_every_s=60, daemon_every_s=1200)
    await soak._faults(Node(), tally, cfg, 3600.0, asyncio.Event(), print)  # type: ignore[arg-type]
    kills = [at for at, name in done if name == "daemon"]
    assert len(done) == 59 and [at for at, _ in done] == [60.0 * i for i in range(1, 60)]  # one a minute
    assert kills == [1500.0, 3000.0]  # its turn every 6 faults once spared; killed past 20 min of each life
    assert tally.daemon_turns_passed == 7
    assert {name for _, name in done} == set(soak.COMPONENTS)
    others = [name for _, name in done if name != "daemon"]
    assert max(others.count(c) for c in set(others)) - min(others.count(c) for c in set(others)) <= 1

    clock[0] = born[0] = 0.0
    done.clear()
    short = soak_load.Tally()  # no microvm: six components; a soak shorter than a daemon life still kills it once
    await soak._faults(Node(), short, soak.SoakBench(minutes=3, fault_every_s=20), 180.0, asyncio.Event(),
                       print)  # type: ignore[arg-type]
    assert [name for _, name in done].count("daemon") == 1 and len(done) == 8
