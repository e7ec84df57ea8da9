"""Micro-batches of calls: records already admitted to one inference subtask share one request.

An embeddings server takes a list of inputs per request and serves it far faster per input
than one request per record (issue 13). `Batcher` sits on the subtask's call loop (the
`CallRunner`'s): every admitted record's coroutine hands its item to `submit` and awaits its
own outcome, so `async.capacity` still counts records, and the stage's state, exactly-once
and dead-letter paths see one call per record as before. A batch is sent when it holds
`max_size` items or when its oldest item has waited `max_wait_s`, whichever comes first;
items only share a batch when their `group` is equal (e.g. the same model).

`batch_group` says which request bodies may share a batch and `batch_payload` makes their one
body. A lane that hands the client a whole batch of records at once (`InferenceClient.complete_many`)
needs no waiting: `chunks` cuts it into as few requests as `max_size` allows, sent the same way. `split_on_rejection` is the failure policy: the batch is retried as a whole by the one retry
layer inside `send_batch`; if the server rejects it permanently with a 4xx, one bad input may
be the cause, so every item is sent again on its own and only the bad one fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from udfs.errors import InferenceError, PermanentError

log = logging.getLogger(__name__)

I = TypeVar("I")
O = TypeVar("O")

SendBatch = Callable[[list[I]], Awaitable[Sequence[O | BaseException]]]


class _Open(Generic[I, O]):
    """A batch still taking items."""

    __slots__ = ("futures", "items", "timer")

    def __init__(self) -> None:
        self.items: list[I] = []
        self.futures: list[asyncio.Future[O]] = []
        self.timer: asyncio.TimerHandle | None = None


class Batcher(Generic[I, O]):
    """Groups items submitted on one event loop into lists for `send`.

    `send(items)` returns one outcome per item, in order: its value, or the exception that
    item's `submit` raises. If `send` itself raises, every item of the batch raises that.
    Use from one event loop (the one that calls `submit`).
    """

    def __init__(self, send: SendBatch[I, O], *, max_size: int, max_wait_s: float) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._send = send
        self._open: dict[Hashable, _Open[I, O]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches_sent = 0
        self.items_sent = 0

    async def submit(self, item: I, group: Hashable = None) -> O:
        """The outcome of `item`, once the batch it joined has been sent and answered."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(group)
        if batch is None:
            batch = self._open[group] = _Open()
            if self.max_size > 1:
                batch.timer = loop.call_later(self.max_wait_s, self._dispatch, group, batch)
        future: asyncio.Future[O] = loop.create_future()
        batch.items.append(item)
        batch.futures.append(future)
        if len(batch.items) >= self.max_size:
            self._dispatch(group, batch)
        return await future

    def _dispatch(self, group: Hashable, batch: _Open[I, O]) -> None:
        if self._open.get(group) is batch:
            del self._open[group]
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        if not batch.items:
            return
        self.batches_sent += 1
        self.items_sent += len(batch.items)
        task = asyncio.get_running_loop().create_task(self._run(batch.items, batch.futures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[I], futures: list[asyncio.Future[O]]) -> None:
        try:
            outcomes: Sequence[O | BaseException] = await self._send(items)
            if len(outcomes) != len(items):
                raise RuntimeError(f"a batch of {len(items)} items got {len(outcomes)} outcomes")
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - every item of the batch fails with the batch
            outcomes = [err] * len(items)
        for future, outcome in zip(futures, outcomes, strict=True):
            if future.done():  # its record's call was cancelled meanwhile
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    @property
    def waiting(self) -> int:
        """Items in batches not yet sent."""
        return sum(len(batch.items) for batch in self._open.values())

    async def close(self) -> None:
        """Cancels batches not yet sent and those in flight (their records' calls are cancelled)."""
        for batch in self._open.values():
            if batch.timer is not None:
                batch.timer.cancel()
            for future in batch.futures:
                future.cancel()
        self._open.clear()
        loop = asyncio.get_running_loop()
        tasks = [task for task in self._tasks if task.get_loop() is loop]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def is_rejection(err: BaseException) -> bool:
    """A permanent 4xx from the server: the request, maybe one input in it, was refused."""
    return isinstance(err, PermanentError) and err.status is not None and 400 <= err.status < 500


def split_on_rejection(send_batch: Callable[[list[I]], Awaitable[Sequence[O | BaseException]]],
                       send_one: Callable[[I], Awaitable[O]]) -> SendBatch[I, O]:
    """A batch sender that retries a rejected batch item by item.

    `send_batch` runs the batch through the retry layer (a retryable failure is retried as
    a batch there). When it raises a rejection (`is_rejection`) for more than one item,
    each item is sent alone with `send_one` (its own retries), so one bad input is
    dead-lettered alone and its neighbours still get answers. Any other `InferenceError`
    is every item's outcome.
    """

    async def send(items: list[I]) -> Sequence[O | BaseException]:
        try:
            return await send_batch(items)
        except InferenceError as err:
            if len(items) == 1 or not is_rejection(err):
                return [err] * len(items)
            log.debug("a batch of %d was rejected (%s); sending its items one by one", len(items), err.detail)
        results = await asyncio.gather(*(send_one(item) for item in items), return_exceptions=True)
        return list(results)

    return send


def share_usage(total: int, weights: Sequence[int]) -> list[int]:
    """`total` (a batch's token usage) split in proportion to `weights` (each input's estimated
    tokens), in whole tokens that add up to `total` (largest remainder first)."""
    if not weights:
        return []
    weight_sum = sum(weights)
    if weight_sum <= 0:
        weights, weight_sum = [1] * len(weights), len(weights)
    exact = [total * w / weight_sum for w in weights]
    shares = [int(x) for x in exact]
    left = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def batch_group(payload: dict[str, Any]) -> str:
    """Records whose bodies differ only in `input` can share a batch request."""
    if len(payload) == 2 and "input" in payload and "model" in payload:  # the usual embeddings body
        return str(payload["model"])
    return json.dumps({k: v for k, v in payload.items() if k != "input"}, sort_keys=True)


def batch_payload(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One embeddings body for bodies of one `batch_group`: their fields, every input in order."""
    return {**payloads[0], "input": [payload["input"] for payload in payloads]}


def chunks(bodies: Sequence[dict[str, Any]], max_size: int) -> list[list[int]]:
    """The indexes of `bodies` (embeddings request bodies, all in hand at once: a lane's whole
    batch) as few batch requests as `max_size` allows: grouped by `batch_group`, each group cut in
    order into lists of at most `max_size`. What `Batcher` does for records arriving one by one,
    without a future, a timer or a wait a record."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    groups: dict[str, list[int]] = {}
    for i, body in enumerate(bodies):
        groups.setdefault(batch_group(body), []).append(i)
    return [members[at:at + max_size] for members in groups.values() for at in range(0, len(members), max_size)]
