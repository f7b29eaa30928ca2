"""``sb.call`` / ``sb.map`` end to end: SDK -> HTTP -> daemon -> function backend -> the image's python3.

The daemon runs for real in a thread (uvicorn on a unix socket) with the function backend over the
``debian-python`` image; every call is a real cloudpickled callable run by the image's interpreter."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import dsec
from dsec.backends.base import ImageRef
from function_support import ServedFunctionDaemon, served_function_daemon

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module")
def served(debian_python_image: ImageRef) -> Iterator[ServedFunctionDaemon]:
    with served_function_daemon("dsec-fc-") as s:
        yield s


@pytest.fixture
async def sb(served: ServedFunctionDaemon) -> AsyncIterator[dsec.AsyncSandbox]:
    client = dsec.Client(url=served.url)
    box = await dsec.AsyncSandbox.create(image="debian-python", backend="function", memory="256Mi", client=client)
    try:
        yield box
    finally:
        await box.close()
        await client.aclose()


def square(x: int) -> int:
    return x * x


def fails(message: str) -> None:
    raise ValueError(message)


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


async def test_call_returns_values(sb: dsec.AsyncSandbox) -> None:
    assert await sb.call(square, 7) == 49
    assert await sb.call(lambda a, b=1: {"sum": a + b, "t": (a, b), "s": {1, 2}, "raw": b"\x00"}, 2, b=3) == {
        "sum": 5, "t": (2, 3), "s": {1, 2}, "raw": b"\x00"}
    # a closure over local state travels by value
    offset = 10
    assert await sb.call(lambda v: v + offset, 5) == 15
    # the callable's prints do not disturb the result channel
    assert await sb.call(lambda: print("noise") or "value") == "value"


async def test_call_sees_the_workspace(sb: dsec.AsyncSandbox) -> None:
    await sb.files.write("/workspace/data.txt", b"from the host")

    def read() -> str:
        with open("/workspace/data.txt") as f:
            return f.read()

    assert await sb.call(read) == "from the host"


async def test_call_reraises_with_remote_traceback(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.RemoteError) as info:
        await sb.call(fails, "bad input 42")
    err = info.value
    assert err.type_name == "ValueError" and err.stage == "call", err.detail
    assert "bad input 42" in err.message and "in fails" in err.remote_traceback, err.remote_traceback
    assert "Remote traceback" in str(err)


async def test_unpicklable_callable(sb: dsec.AsyncSandbox) -> None:
    lock = threading.Lock()
    with pytest.raises(dsec.InvalidRequest, match="cannot pickle"):
        await sb.call(lambda: lock.locked())
    # pickles here, but cannot be loaded in the sandbox: the image has no httpx
    import httpx

    with pytest.raises(dsec.RemoteError) as info:
        await sb.call(str, httpx.URL("http://example.invalid/"))
    assert info.value.stage == "load" and info.value.type_name == "ModuleNotFoundError", info.value.detail
    with pytest.raises(dsec.InvalidRequest, match="callable"):
        await sb.call("not a function")  # type: ignore[arg-type]


async def test_huge_return_value_is_capped(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.RemoteError, match="over max_result_bytes") as info:
        await sb.call_with(lambda: b"x" * (3 << 20), max_result_bytes=1 << 20)
    assert info.value.type_name == "OverflowError" and info.value.stage == "result"
    assert len(await sb.call_with(lambda: b"x" * (3 << 20), max_result_bytes=4 << 20)) == 3 << 20


async def test_limits_end_calls_with_verdicts(sb: dsec.AsyncSandbox) -> None:
    def spin() -> None:
        while True:
            pass

    def hog() -> None:
        blocks = []
        while True:
            blocks.append(bytearray(16 << 20))

    with pytest.raises(dsec.CallFailed, match="time limit") as info:
        await sb.call_with(spin, timeout=1.5)
    assert info.value.detail["limit"] == "time"
    with pytest.raises(dsec.CallFailed, match="memory limit") as info:
        await sb.call_with(hog, timeout=60)
    assert info.value.detail["limit"] == "memory"
    assert await sb.call(square, 3) == 9  # the sandbox is fine afterwards


async def test_results_are_plain_data_unless_trusted(sb: dsec.AsyncSandbox) -> None:
    with pytest.raises(dsec.CallFailed, match="not plain data"):
        await sb.call(Point, 3)
    point = await sb.call_with(Point, (3,), trusted=True)
    assert point.x == 3


async def test_map_runs_inputs_concurrently(sb: dsec.AsyncSandbox) -> None:
    assert await sb.map(square, range(20), concurrency=4) == [i * i for i in range(20)]

    def maybe(i: int) -> int:
        if i % 3 == 0:
            raise KeyError(i)
        return i

    out: list[Any] = await sb.map(maybe, range(6), return_exceptions=True)
    assert [type(o).__name__ if isinstance(o, Exception) else o for o in out] == [
        "RemoteError", 1, 2, "RemoteError", 4, 5]
    with pytest.raises(dsec.InvalidRequest):
        await sb.map(square, [1], concurrency=0)


async def test_call_on_container_backend_is_not_supported(served: ServedFunctionDaemon) -> None:
    assert "container" not in served.engine.backends.loaded  # this daemon serves only the function backend
    client = dsec.Client(url=served.url)
    try:
        with pytest.raises(dsec.BackendUnavailable):
            await dsec.AsyncSandbox.create(image="debian-python", backend="container", client=client)
    finally:
        await client.aclose()


EXPECTED_VERDICTS = {"correct": "AC", "correct_loop": "AC", "wrong": "WA", "off_by_one": "WA", "slow": "TLE",
                     "memory_hog": "MLE", "crash": "RE", "syntax_error": "RE"}


def test_grade_solutions_example(served: ServedFunctionDaemon) -> None:
    """examples/grade_solutions.py with a smaller N: every kind of candidate gets its verdict."""
    path = Path(__file__).parents[3] / "examples" / "grade_solutions.py"
    spec = importlib.util.spec_from_file_location("grade_solutions", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["grade_solutions"] = module  # cloudpickle ships a module's functions by value only if imported
    try:
        spec.loader.exec_module(module)
        summary = module.grade(40, concurrency=8, time_limit=6.0, url=served.url)
    finally:
        sys.modules.pop("grade_solutions", None)
    assert summary["n"] == 40 and sum(summary["totals"].values()) == 40, summary
    assert set(summary["by_kind"]) == set(EXPECTED_VERDICTS), summary
    for kind, verdicts in summary["by_kind"].items():
        assert verdicts == {EXPECTED_VERDICTS[kind]: sum(verdicts.values())}, (kind, verdicts)
