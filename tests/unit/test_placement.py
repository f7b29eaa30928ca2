"""Placement logic (``dsec.cluster.placement``): capacity, locality, spreading, quotas, the fair queue."""

from __future__ import annotations

import asyncio
import collections

import pytest

from dsec.cluster.placement import Capacity, JobQuota, Placer
from dsec.errors import BackendUnavailable, InvalidRequest, QuotaExceeded
from dsec.models import SandboxSpec

SPEC = SandboxSpec(image="img", backend="function", cpu=1.0, memory="1Gi")


def placer(nodes: int = 3, slots: int = 10, cpu: float = 100.0, memory: int = 100 * 1024**3) -> Placer:
    p = Placer()
    for i in range(nodes):
        p.set_node(f"n{i}", Capacity(cpu=cpu, memory=memory, slots={"function": slots, "container": slots}))
    return p


def test_a_batch_spreads_in_one_decision() -> None:
    p = placer()
    placement = p.try_place(SPEC, 9, "job")
    assert placement is not None and placement.counts == {"n0": 3, "n1": 3, "n2": 3}
    assert collections.Counter(placement.nodes()) == {"n0": 3, "n1": 3, "n2": 3}


def test_image_locality_is_preferred_while_the_node_is_not_much_busier() -> None:
    p = placer(slots=4)  # 8 slots a node (4 function + 4 container): each sandbox is 1/8 of its load
    p.add_image("n2", "img")
    first = p.try_place(SPEC, 2, "job")
    assert first is not None and first.counts == {"n2": 2}
    rest = p.try_place(SPEC, 4, "job")
    assert rest is not None and set(rest.counts) == {"n0", "n1", "n2"}, rest.counts


def test_cpu_memory_and_slots_each_limit() -> None:
    assert placer(nodes=1, cpu=2.5).try_place(SPEC, 3, "j") is None  # 2 cores' worth fit, not 3
    assert placer(nodes=1, memory=2 * 1024**3).try_place(SPEC, 3, "j") is None
    assert placer(nodes=1, slots=2).try_place(SPEC, 3, "j") is None
    p = placer(nodes=1, slots=2)
    assert p.try_place(SPEC, 2, "j") is not None and p.try_place(SPEC, 1, "j") is None


def test_all_or_nothing_takes_nothing_when_a_batch_does_not_fit() -> None:
    p = placer(nodes=2, slots=2)
    assert p.try_place(SPEC, 5, "j") is None
    assert all(not n.live.get("function") for n in p.nodes.values())
    assert p.job("j").live == 0


def test_dead_nodes_and_missing_backends() -> None:
    p = placer(nodes=2)
    p.mark_dead("n0")
    placement = p.try_place(SPEC, 2, "j")
    assert placement is not None and placement.counts == {"n1": 2}
    with pytest.raises(BackendUnavailable, match="microvm"):
        p.try_place(SPEC.model_copy(update={"backend": "microvm"}), 1, "j")
    with pytest.raises(InvalidRequest):
        p.try_place(SPEC, 0, "j")


def test_live_quota_and_release() -> None:
    p = placer()
    p.quotas["small"] = JobQuota(max_live=2)
    assert p.try_place(SPEC, 2, "small") is not None
    with pytest.raises(QuotaExceeded, match="quota is 2") as err:
        p.try_place(SPEC, 1, "small")
    assert err.value.detail["max_live"] == 2
    node = next(n.name for n in p.nodes.values() if n.live.get("function"))
    p.release("small", node, SPEC)
    assert p.try_place(SPEC, 1, "small") is not None
    assert p.try_place(SPEC, 5, "other") is not None  # other jobs have their own (default: none) quota


def test_rate_quota() -> None:
    p = placer()
    p.quotas["r"] = JobQuota(max_rate=3)
    placed = p.try_place(SPEC, 3, "r")
    assert placed is not None
    with pytest.raises(QuotaExceeded, match="per second"):
        p.try_place(SPEC, 1, "r")
    # Two of them no node took (its daemon stopping): placing them again is not a new creation.
    for node in placed.nodes()[:2]:
        p.release("r", node, SPEC)
    p.refund("r", 2)
    assert p.try_place(SPEC, 2, "r") is not None
    with pytest.raises(QuotaExceeded, match="per second"):
        p.try_place(SPEC, 1, "r")


async def test_admission_queue_waits_for_room_and_times_out() -> None:
    p = placer(nodes=1, slots=1)
    assert p.try_place(SPEC, 1, "a") is not None
    waiter = asyncio.create_task(p.place(SPEC, 1, "b", wait=10))
    await asyncio.sleep(0.05)
    assert not waiter.done() and p.statistics()["waiting"] == 1
    p.release("a", "n0", SPEC)
    placement = await asyncio.wait_for(waiter, 5)
    assert placement.counts == {"n0": 1} and p.queued == 1
    with pytest.raises(QuotaExceeded, match="admission queue"):
        await p.place(SPEC, 1, "c", wait=0.1)


async def test_fair_queue_serves_jobs_round_robin() -> None:
    p = placer(nodes=1, slots=1)
    assert p.try_place(SPEC, 1, "hog") is not None
    order: list[str] = []

    async def want(job: str) -> None:
        await p.place(SPEC, 1, job, wait=10)
        order.append(job)

    tasks = [asyncio.create_task(want("hog")) for _ in range(3)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(want("small")))
    await asyncio.sleep(0.01)
    for _ in range(4):
        holder = "hog" if not order else order[-1]
        p.release(holder, "n0", SPEC)
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    # The small job's one request is served second, not after all of the hog's queued ones.
    assert order.index("small") <= 1, order


def _greedy(p: Placer, spec: SandboxSpec, count: int) -> dict[str, int] | None:
    """The reference rule: each sandbox to the fitting node of the lowest (load - bonus, name), one by one."""
    import copy

    nodes = {name: copy.deepcopy(n) for name, n in p.nodes.items() if n.alive}
    counts: dict[str, int] = {}
    for _ in range(count):
        fitting = [n for n in nodes.values() if n.fits(spec)]
        if not fitting:
            return None
        best = min(fitting, key=lambda n: n.rank(spec.image))
        best.cpu += spec.cpu
        best.memory += spec.memory
        best.live[spec.backend] = best.live.get(spec.backend, 0) + 1
        best.total += 1
        counts[best.name] = counts.get(best.name, 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(12))
def test_index_and_water_fill_place_as_the_greedy_fill(seed: int) -> None:
    import random

    rng = random.Random(seed)
    p = Placer()
    for i in range(rng.randint(3, 60)):
        p.set_node(f"n{i:03d}", Capacity(cpu=rng.choice([8.0, 16.0, 64.0]), memory=rng.choice([16, 64, 256]) * 2**30,
                                         slots={"function": rng.randint(5, 400), "container": rng.randint(0, 50)}),
                   images={"img"} if rng.random() < 0.3 else set())
        if rng.random() < 0.1:
            p.mark_dead(f"n{i:03d}")
    specs = [SandboxSpec(image=rng.choice(["img", "other"]), backend="function", cpu=rng.choice([0.1, 0.5, 1.0]),
                         memory=rng.choice(["64Mi", "256Mi", "1Gi"])) for _ in range(3)]
    for _ in range(25):
        spec = rng.choice(specs)
        count = rng.choice([1, 1, 2, 5, 9, 40, 300, 2000])
        expected = _greedy(p, spec, count)
        placed = p.try_place(spec, count, "job")
        got = placed.counts if placed else None
        if got is None or expected is None or count <= 8:
            assert got == expected
        else:  # a batch's water level is computed, not accumulated: ties may round the other way
            assert sum(got.values()) == count
            assert all(abs(got.get(n, 0) - expected.get(n, 0)) <= 1 for n in {*got, *expected}), (got, expected)
        if placed and rng.random() < 0.3:  # some go away again: loads fall, the index must follow
            for node in placed.nodes()[: count // 2]:
                p.release("job", node, spec)


async def test_the_queue_is_served_only_when_capacity_grows() -> None:
    p = placer(nodes=2, slots=5)
    assert p.try_place(SPEC, 10, "a") is not None  # full (5 function slots a node)
    big = asyncio.create_task(p.place(SPEC, 8, "b", wait=10))
    await asyncio.sleep(0.01)
    served = p.served
    for _ in range(20):  # membership polls refresh the same nodes: nothing grew, the queue is not served
        p.set_node("n0", Capacity(cpu=100.0, memory=100 * 1024**3, slots={"function": 5, "container": 5}))
    await asyncio.sleep(0.01)
    assert p.served == served
    for _ in range(5):  # five releases in one turn of the loop: served once, and 8 still do not fit
        p.release("a", "n0", SPEC)
    await asyncio.sleep(0.01)
    assert p.served == served + 1 and not big.done()
    for _ in range(3):
        p.release("a", "n1", SPEC)
    assert (await asyncio.wait_for(big, 5)).counts == {"n0": 5, "n1": 3}


def test_the_burst_lets_a_job_create_its_quota_in_one_batch() -> None:
    p = placer(nodes=4, slots=20_000)
    p.quotas["rl"] = JobQuota(max_live=32_000, max_rate=2_000)
    placed = p.try_place(SPEC.model_copy(update={"cpu": 0.001, "memory": 1024}), 32_000, "rl")
    assert placed is not None and sum(placed.counts.values()) == 32_000
    p.quotas["small"] = JobQuota(max_rate=10, burst=50)
    with pytest.raises(QuotaExceeded, match="burst is 50"):
        p.try_place(SPEC, 51, "small")
    assert p.try_place(SPEC, 50, "small") is not None


def test_the_load_index_stays_small_under_churn() -> None:
    p = placer(nodes=10, slots=1000)
    p.add_image("n3", "img")
    for _ in range(2000):  # membership polls that change nothing, and sandboxes coming and going
        p.set_node("n0", Capacity(cpu=100.0, memory=100 * 1024**3, slots={"function": 1000, "container": 1000}))
        placed = p.try_place(SPEC, 1, "j")
        assert placed is not None
        p.release("j", placed.nodes()[0], SPEC)
    heaps = p._index._heaps
    assert all(len(heap) <= 2 * 10 + 65 for heap in heaps.values()), {k: len(h) for k, h in heaps.items()}


def test_rows_loaded_at_once_count_as_rows_put_one_by_one() -> None:
    """A restart's bulk load keeps the same counters, digests, pages and trajectories as row-by-row puts."""
    import itertools

    from dsec.cluster.records import Records, Row, Shape
    from dsec.models import ids_digest

    shape = Shape("function", 0.5, 2**20, "debian-python")
    rows = [(f"sb-{i:04d}", Row(f"n{i % 5}", ("a", "b")[i % 2], ("running", "paused", "lost", "expired")[i % 4],
                                 shape, b"{}", float(i), f"t{i}" if i % 7 == 0 else None)) for i in range(400)]
    one, bulk = Records(cell_of=lambda n: int(n[1:]) % 3), Records(cell_of=lambda n: int(n[1:]) % 3)
    for sid, row in rows:
        one.put(sid, row)
    assert bulk.load(rows[:250]) == 250 and bulk.load(rows) == 150  # rows already there are not loaded twice
    live = {sid for sid, row in rows if row.state in ("running", "paused")}
    assert bulk.live == one.live == len(live)
    for node in (f"n{i}" for i in range(5)):
        held = [sid for sid in live if rows[int(sid[3:])][1].node == node]
        assert bulk.digest(node) == one.digest(node) == (len(held), ids_digest(held))
        assert sorted(bulk.on_node(node)) == sorted(one.on_node(node))
    for cell in range(3):
        for job in ("a", "b"):
            assert bulk.live_in(cell, job) == one.live_in(cell, job) > 0
    first = [list(itertools.islice(r.page("a", "sb-0100", 5), 5)) for r in (bulk, one)]
    assert first[0] == first[1] == ["sb-0102", "sb-0104", "sb-0106", "sb-0108", "sb-0110"]
    assert bulk.trajectory("t21") == one.trajectory("t21") == "sb-0021"  # paused: bound
    assert bulk.trajectory("t7") is None and one.trajectory("t7") is None  # i=7 is expired: not bound


def test_removals_of_two_listings_of_one_node_are_kept_apart() -> None:
    """Two reconciles of one node may list it at once: each collects the rows removed while it is inside, and
    the first to finish (its set equal to the other's while both are empty) leaves the other collecting."""
    from dsec.cluster.records import Records, Row, Shape

    shape = Shape("function", 0.5, 2**20, "debian-python")
    records = Records()
    for i in range(3):
        records.put(f"sb-{i}", Row("n0", "a", "running", shape, b"{}", float(i)))
    with records.removals("n0") as first:
        with records.removals("n0") as second:
            pass  # ended first, while both sets were empty (equal)
        records.remove("sb-0")
        with records.removals("n1") as elsewhere:
            records.remove("sb-1")
    records.remove("sb-2")
    assert first == {"sb-0", "sb-1"} and second == set() and elsewhere == set()
