"""``sb.map`` on the client: many calls of one callable, sent in batches.

Owns cutting a map's items into batches (:class:`~dsec.models.CallBatch`: the function pickled once, each
item's arguments apart), keeping ``concurrency`` batches in flight, and putting each item's value or error
back in input order. A batch is one request: what HTTP, JSON and the daemon's request handling cost is paid
once per batch instead of once per call, while every item still runs as a call of its own, a fresh process
with its own limits and verdict. Must never decode a reply other than through :func:`decode_reply`.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Sequence
from typing import Any

import pydantic

from dsec.api.client import NodeClient
from dsec.errors import DSecError, SandboxError, error_from_payload
from dsec.models import CallBatch, CallOutcome

from .calls import decode_reply
from .handle import invalid as _invalid

__all__ = ["BATCH_BYTES", "BATCH_ITEMS", "map_calls", "plan_batches"]

BATCH_ITEMS = 64
"""Items of one batch at most: enough to spread a request's cost thin, few enough that ``concurrency`` batches in
flight keep the load balanced to the end of a map."""
BATCH_BYTES = 4 * 1024 * 1024
"""Pickled arguments of one batch at most (a larger item goes alone)."""


def plan_batches(sizes: Sequence[int], concurrency: int) -> builtins.list[range]:
    """Consecutive runs of items: at least four batches per worker while there are items for them, at most
    :data:`BATCH_ITEMS` items and :data:`BATCH_BYTES` bytes each."""
    per = max(1, min(BATCH_ITEMS, -(-len(sizes) // (4 * concurrency))))
    batches: builtins.list[range] = []
    start = 0
    while start < len(sizes):
        stop, total = start, 0
        while stop < len(sizes) and stop - start < per and (stop == start or total + sizes[stop] <= BATCH_BYTES):
            total += sizes[stop]
            stop += 1
        batches.append(range(start, stop))
        start = stop
    return batches


async def map_calls(api: NodeClient, sandbox_id: str, function: bytes, items: Sequence[bytes], *, concurrency: int,
                    trusted: bool, return_exceptions: bool, options: dict[str, Any]) -> builtins.list[Any]:
    """Every item's value (or, with ``return_exceptions``, its error), in input order; without it the first error
    is raised and the batches still running are abandoned (hanging up kills their running calls)."""
    if not items:
        return []
    try:
        template = CallBatch(function=function, items=[items[0]], **options)
    except pydantic.ValidationError as exc:
        raise _invalid(exc, "map") from None
    results: builtins.list[Any] = [None] * len(items)
    pending = plan_batches([len(item) for item in items], concurrency)
    pending.reverse()

    async def worker() -> None:
        while pending:
            batch = pending.pop()
            request = template.model_copy(update={"items": [items[i] for i in batch]})
            try:
                answer = await api.call_many(sandbox_id, request)
            except DSecError as exc:  # every item's (no such sandbox, no calls on its backend...)
                if not return_exceptions:
                    raise
                for index in batch:
                    results[index] = exc
                continue
            if not answer.outcomes or len(answer.outcomes) > len(batch):
                raise SandboxError(f"the node answered {len(answer.outcomes)} outcomes for a batch of {len(batch)}")
            if len(answer.outcomes) < len(batch):  # its replies filled an answer: the rest go again
                pending.append(batch[len(answer.outcomes):])
            for index, outcome in zip(batch, answer.outcomes, strict=False):
                results[index] = _value(outcome, trusted, return_exceptions)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(pending)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)  # they have hung up before map returns or raises
    return results


def _value(outcome: CallOutcome, trusted: bool, return_exceptions: bool) -> Any:
    try:
        if outcome.error is not None:
            raise error_from_payload({"error": outcome.error})
        if outcome.result is None:
            raise error_from_payload({"error": {"type": "SandboxError", "message": "a call of the batch has no "
                                                "outcome"}})
        return decode_reply(outcome.result, trusted=trusted)
    except Exception as exc:
        if return_exceptions:
            return exc
        raise
