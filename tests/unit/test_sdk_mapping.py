"""``sb.map``'s batches: how the client cuts them, keeps them in flight and puts them back in order; where the node
ends an answer."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, cast

import cloudpickle
import pytest

from dsec._sdk.mapping import BATCH_BYTES, BATCH_ITEMS, map_calls, plan_batches
from dsec.api.client import NodeClient
from dsec.daemon.commands import BATCH_REPLY_BYTES, Commands
from dsec.errors import InvalidRequest, NotSupported, RemoteError, SandboxError, SandboxLost
from dsec.models import CallBatch, CallBatchResult, CallOutcome, CallRequest, CallResult, ExecResult


def test_batches_cover_every_item_in_order_within_bounds() -> None:
    for n, concurrency in ((1, 4), (7, 4), (1500, 4), (100_000, 8), (3, 1)):
        batches = plan_batches([10] * n, concurrency)
        assert [i for b in batches for i in b] == list(range(n))
        assert all(1 <= len(b) <= BATCH_ITEMS for b in batches)
        # enough batches to keep every worker busy to the end (four each while items last)
        assert len(batches) >= min(n, 4 * concurrency)


def test_batches_respect_the_byte_bound_and_carry_a_large_item_alone() -> None:
    sizes = [BATCH_BYTES // 3] * 5 + [BATCH_BYTES * 2] + [1] * 3
    batches = plan_batches(sizes, 1)
    assert [i for b in batches for i in b] == list(range(len(sizes)))
    for b in batches:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= BATCH_BYTES
    assert range(5, 6) in batches


class _Api:
    """Answers each batch as the daemon would: an item's value, a raised exception, or a sandbox error."""

    def __init__(self, fail_batch: Exception | None = None, answer_at_most: int | None = None) -> None:
        self.answer_at_most = answer_at_most
        self.batches: list[CallBatch] = []
        self.in_flight = 0
        self.most = 0
        self.fail_batch = fail_batch

    async def call_many(self, sandbox_id: str, batch: CallBatch) -> CallBatchResult:
        self.batches.append(batch)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        if self.fail_batch is not None:
            raise self.fail_batch
        func = cloudpickle.loads(batch.function)
        outcomes = []
        for item in batch.items[:self.answer_at_most]:
            (x,), _ = cloudpickle.loads(item)
            if x == "sandbox":
                outcomes.append(CallOutcome(error=SandboxError("the zygote went away").to_payload()["error"]))
            elif x == "raise":
                reply = ("error", {"type": "ValueError", "message": "no", "traceback": "", "stage": "call"})
                outcomes.append(CallOutcome(result=CallResult(reply=pickle.dumps(reply),
                                                              result=ExecResult(exit_code=1))))
            else:
                reply = ("ok", pickle.dumps(func(x)))
                outcomes.append(CallOutcome(result=CallResult(reply=pickle.dumps(reply),
                                                              result=ExecResult(exit_code=0))))
        return CallBatchResult(outcomes=outcomes)


def _map(api: _Api, inputs: list[Any], concurrency: int = 4, return_exceptions: bool = False) -> list[Any]:
    items = [cloudpickle.dumps(((x,), {})) for x in inputs]
    return asyncio.run(map_calls(cast(NodeClient, api), "sb-x", cloudpickle.dumps(lambda x: x * 2), items,
                                 concurrency=concurrency, trusted=False, return_exceptions=return_exceptions,
                                 options={"client_python": "3.11"}))


def test_values_come_back_in_input_order_with_bounded_batches_in_flight() -> None:
    api = _Api()
    assert _map(api, list(range(300)), concurrency=3) == [2 * i for i in range(300)]
    assert 1 < api.most <= 3
    assert sum(len(b.items) for b in api.batches) == 300
    assert all(b.function == api.batches[0].function for b in api.batches)  # pickled once


def test_items_a_full_answer_left_out_are_sent_again() -> None:
    api = _Api(answer_at_most=2)
    assert _map(api, list(range(50)), concurrency=2) == [2 * i for i in range(50)]
    assert sum(min(len(b.items), 2) for b in api.batches) == 50  # each item ran once


def test_each_item_keeps_its_own_error() -> None:
    got = _map(_Api(), [1, "raise", 2, "sandbox", 3], return_exceptions=True)
    assert got[0::2] == [2, 4, 6]
    assert isinstance(got[1], RemoteError) and isinstance(got[3], SandboxError)
    with pytest.raises(RemoteError, match="ValueError"):
        _map(_Api(), [1, "raise", 2])


def test_a_batch_refused_as_a_whole_fails_each_of_its_items() -> None:
    refused = NotSupported("this backend runs no Python callables")
    with pytest.raises(NotSupported):
        _map(_Api(fail_batch=refused), [1, 2])
    assert _map(_Api(fail_batch=refused), [1, 2], return_exceptions=True) == [refused, refused]


def test_bad_options_are_the_callers_error_before_anything_is_sent() -> None:
    api = _Api()
    with pytest.raises(InvalidRequest):
        asyncio.run(map_calls(cast(NodeClient, api), "sb-x", b"f", [b"i"], concurrency=1, trusted=False,
                              return_exceptions=False, options={"client_python": "3.11", "timeout": -1}))
    assert api.batches == [] and _map(api, []) == []


class _Node:
    """The daemon's side of a batch (``Commands.call_many``) over calls that fail where told."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None, reply: int = 1) -> None:
        self.fail_at, self.error, self.reply, self.calls = fail_at, error, reply, 0

    async def call(self, sandbox_id: str, request: CallRequest) -> CallResult:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            assert self.error is not None
            raise self.error
        return CallResult(reply=b"r" * self.reply, result=ExecResult(exit_code=0))


def _batch(n: int, **options: Any) -> CallBatch:
    return CallBatch(function=b"f", items=[b"x"] * n, client_python="3.11", **options)


def test_a_node_error_after_some_items_keeps_their_outcomes_and_ends_the_answer() -> None:
    node = _Node(fail_at=2, error=SandboxLost("the sandbox was lost"))
    answer = asyncio.run(Commands.call_many(cast(Commands, node), "sb", _batch(5)))
    assert [o.result is not None for o in answer.outcomes] == [True, True]  # the client sends items 2-4 again
    with pytest.raises(SandboxLost):  # ... and meets the error: it stops the first item of a batch
        asyncio.run(Commands.call_many(cast(Commands, _Node(fail_at=0, error=SandboxLost("lost"))), "sb", _batch(3)))


def test_a_sandbox_error_is_only_its_items_outcome() -> None:
    node = _Node(fail_at=1, error=SandboxError("the zygote went away"))
    answer = asyncio.run(Commands.call_many(cast(Commands, node), "sb", _batch(3)))
    assert [o.error is not None for o in answer.outcomes] == [False, True, False]


def test_an_answer_ends_before_an_item_whose_largest_reply_would_pass_the_bound() -> None:
    # Each item may reply up to 8 MiB + 1 MiB of stderr: the answer ends where one more such reply would not fit.
    node = _Node(reply=4 * 1024 * 1024)
    answer = asyncio.run(Commands.call_many(cast(Commands, node), "sb",
                                            _batch(10, max_result_bytes=8 * 1024 * 1024, max_output=1024 * 1024)))
    ran = len(answer.outcomes)
    assert ran * 4 * 1024 * 1024 + 9 * 1024 * 1024 > BATCH_REPLY_BYTES >= (ran - 1) * 4 * 1024 * 1024 + 9 * 1024 * 1024
    assert ran == node.calls < 10
    assert sum(len(o.result.reply) for o in answer.outcomes if o.result) <= BATCH_REPLY_BYTES
    # a single item larger than the bound still runs alone
    big = _Node(reply=1)
    one = asyncio.run(Commands.call_many(cast(Commands, big), "sb", _batch(3, max_result_bytes=64 * 1024 * 1024)))
    assert len(one.outcomes) == 1
