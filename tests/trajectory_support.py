"""Checks every trajectory store (SQLite, PostgreSQL) must pass, run by each store's tests."""

from __future__ import annotations

import json

from dsec.trajectory.store import Binding, Entry, TrajectoryStore


async def check_list_end_and_delete(store: TrajectoryStore) -> None:
    """Listing by prefix (names with SQL wildcards match literally), ending, checkpoints a branch shares, and a
    delete that takes the binding, the calls and the end mark together."""
    for name in ("job_1/a", "job_1/b", "job%1/c", "job-2/a"):
        await store.put_binding(Binding(name=name, spec="{}", sandbox_id=f"sb-{name}"))
    snap = json.dumps("snap-00000000000000aa")
    await store.put_entry("job_1/a", Entry(seq=0, op="exec", digest="d0", request="{}", status="done", response="{}"))
    await store.put_entry("job_1/a", Entry(seq=1, op="snapshot", digest="d1", request="{}", status="done",
                                           response=snap))
    await store.put_entry("job_1/a", Entry(seq=2, op="snapshot", digest="d2", request="{}", status="done",
                                           response=json.dumps("snap-00000000000000bb")))
    await store.copy_prefix("job_1/a", "job_1/b", 2)  # a branch at 2 shares the first checkpoint

    listed = await store.summaries("job_1/")
    assert [(s.binding.name, s.calls, s.ended_at) for s in listed] == [("job_1/a", 3, None), ("job_1/b", 2, None)]
    assert [s.binding.name for s in await store.summaries("job%")] == ["job%1/c"]
    assert [s.binding.name for s in await store.summaries("", limit=2)] == ["job%1/c", "job-2/a"]
    assert await store.checkpoints("job_1/a") == ["snap-00000000000000aa", "snap-00000000000000bb"]
    assert await store.used_elsewhere("snap-00000000000000aa", "job_1/a")
    assert not await store.used_elsewhere("snap-00000000000000bb", "job_1/a")

    assert await store.ended_at("job_1/a") is None
    await store.end("job_1/a")
    ended = await store.ended_at("job_1/a")
    assert ended is not None and [s.ended_at for s in await store.summaries("job_1/a")] == [ended]

    await store.delete("job_1/a")
    assert await store.get_binding("job_1/a") is None and await store.entries("job_1/a") == []
    assert await store.ended_at("job_1/a") is None
    assert [s.binding.name for s in await store.summaries("job_1/")] == ["job_1/b"]
    assert not await store.used_elsewhere("snap-00000000000000aa", "job_1/b")  # the branch alone has it now
