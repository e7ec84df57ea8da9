"""The vectorized lane (`lane: vectorized`): Flink's Arrow-batched Python function instead of the
keyed stage, for fast models and embedding backfills.

The keyed stage moves every record across into Python alone and through keyed `MapState`; that
crossing and that state are most of a record's CPU when the model answers in a millisecond. Here
Flink hands Python a whole Arrow batch of records (`vectorized.batch_size` rows) at once; the
function hands the batch's calls whole to the client's batch entry on its call loop
(`RecordPath.call_many` -> `InferenceClient.complete_many`, at most `async.capacity` at a time, what
every call shares paid once), waits for all of them, and returns one outgoing record per input
row, in input order. The rules
for a record are every lane's (`udfs/lanes/record_path.py`): the same decode, client
(retries, per-attempt and per-record deadlines, rate limits, AIMD, fleet, cache), output record
and dead letters; set-up and emitting are `udfs/lanes/base.py`'s `LaneParts`. The lane decides only
that a record's call is made with its Arrow batch's.

Its price is head-of-line blocking: a batch is done when its slowest call is, and a checkpoint
waits for the batch in progress and the rows already handed to Python (`vectorized.batch_size`
is also the Python bundle). The per-record deadline (`async.record_deadline_s`) bounds that
wait: a call past it is a dead letter, so no batch waits longer. Nothing holds calls in
flight across a checkpoint: a failover sends the calls since the last checkpoint again (the
result cache, `cache.*`, makes those replays free). Heavy-tailed models belong in the keyed lane.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pandas as pd
from pyflink.table import DataTypes
from pyflink.table.udf import (
    FunctionContext,
    ScalarFunction,
    UserDefinedScalarFunctionWrapper,
    udf,
)

from udfs.config import JobConfig
from udfs.lanes.base import LaneParts
from udfs.lanes.record_path import SKIP, Settled
from udfs.records import PendingRecord, Request

log = logging.getLogger("llmstream.udfs")

RESULT_TYPE = DataTypes.ROW([
    DataTypes.FIELD("k", DataTypes.BYTES()),
    DataTypes.FIELD("v", DataTypes.BYTES()),
    DataTypes.FIELD("topic", DataTypes.STRING()),
    # Arrow maps need non-null keys (Flink refuses a nullable key type when it writes the batch).
    DataTypes.FIELD("headers", DataTypes.MAP(DataTypes.STRING(False), DataTypes.BYTES())),
    DataTypes.FIELD("emit", DataTypes.BOOLEAN()),
])
"""One outgoing Kafka record per input row; `emit` is false for a skipped tombstone, which the
job's SQL filters out (a pandas function returns exactly one row per input row)."""

DEADLINE_SLACK_S = 30.0
"""How long past `async.record_deadline_s` a batch may take before its unfinished calls are given
up as `internal_error` dead letters: the client's own deadline ends every call first; this only
keeps a bug from holding the lane (and every checkpoint) forever."""


CANCEL_WAIT_S = 1.0
"""How long a batch given up at its guard waits for its cancelled calls to end, so that the answers
that came are kept; a call that ignores its cancellation is not waited for longer."""


def _epoch_ms(ts: Any) -> int | None:
    """A Kafka timestamp as the Arrow batch holds it (a pandas Timestamp, NaT or None) in epoch ms."""
    if ts is None:
        return None
    try:
        value = ts.value  # pandas.Timestamp: ns since the epoch; NaT has no usable value
    except AttributeError:
        return int(ts) if isinstance(ts, int) else None
    return None if pd.isna(ts) else int(value // 1_000_000)


def _headers(value: Any) -> tuple[tuple[str, bytes], ...] | None:
    """The `headers` map as the Arrow batch holds it (a list of pairs, a dict, or null)."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    pairs = value.items() if isinstance(value, dict) else value
    found = tuple((str(k), bytes(v) if v is not None else b"") for k, v in pairs)
    return found or None


def _listed(column: Any) -> list[Any]:
    """A column of the Arrow batch (a pandas Series) as a list of Python values."""
    return column.tolist() if hasattr(column, "tolist") else list(column)


def _as_bytes(value: Any) -> bytes | None:
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


class VectorizedInference(ScalarFunction):
    """A pandas scalar function over the source table's columns (key, value, topic, partition,
    offset, timestamp, headers): a DataFrame of `RESULT_TYPE` out, one row per input row."""

    def __init__(self, config: JobConfig, cache_file: str | None = None) -> None:
        self._config = config
        self._cache_file = cache_file  # the local result cache's file, as the launch decided it

    def is_deterministic(self) -> bool:
        # The planner must not call it once per projected field of its result: every call is a model call.
        return False

    def open(self, function_context: FunctionContext) -> None:
        self._parts = parts = LaneParts.open(
            self._config, function_context.get_metric_group(), subtasks=self._config.parallelism.of("inference"),
            cache_file=self._cache_file, capacity=self._config.async_.capacity,
            runner_name="llmstream-vectorized-calls")
        self._metrics, self._path, self._runner = parts.metrics, parts.path, parts.runner
        parts.announce("vectorized inference", f" batch={self._config.vectorized.batch_size}")

    def close(self) -> None:
        parts = getattr(self, "_parts", None)
        if parts is not None:
            parts.close()

    def eval(self, k: Any, v: Any, topic: Any, partition: Any, offset: Any, ts: Any, headers: Any) -> Any:
        outcomes = self.outcomes(self.records(k, v, topic, partition, offset, ts, headers))
        rows = [o.row if o is not None else None for o in outcomes]
        return pd.DataFrame({
            "k": pd.Series([r.key if r else None for r in rows], dtype=object),
            "v": pd.Series([r.value if r else None for r in rows], dtype=object),
            "topic": pd.Series([r.topic if r else None for r in rows], dtype=object),
            "headers": pd.Series([list(r.headers.items()) if r and r.headers else None for r in rows],
                                 dtype=object),
            "emit": pd.Series([r is not None for r in rows], dtype=bool),
        })

    @staticmethod
    def records(k: Any, v: Any, topic: Any, partition: Any, offset: Any, ts: Any, headers: Any) -> list[PendingRecord]:
        """The batch's rows as the records both lanes work on. Each column becomes a list first:
        indexing a pandas Series costs microseconds a cell, a list's item nanoseconds."""
        return [PendingRecord(_as_bytes(key), _as_bytes(value), str(t), int(p), int(o), _epoch_ms(stamp), _headers(h))
                for key, value, t, p, o, stamp, h in zip(*(_listed(c) for c in (k, v, topic, partition, offset, ts,
                                                                               headers)), strict=True)]

    def outcomes(self, records: list[PendingRecord]) -> list[Settled | None]:
        """What each record came to, in input order (None: nothing leaves, a skipped tombstone or a
        record the user's functions drop); every call of the batch runs at once on the call loop, at
        most `async.capacity` at a time. Never raises."""
        self._metrics.records_in.inc(len(records))
        self._metrics.holding.set(len(records), 0.0)
        outcomes: list[Settled | None] = [None] * len(records)
        calls: list[tuple[int, Request, PendingRecord]] = []
        for i, record in enumerate(records):
            try:
                prepared = self._path.prepare(record)
            except Exception as err:  # prepare settles bad input itself; this is a bug
                log.exception("unexpected error preparing %s", record.handle)
                prepared = self._parts.internal(err, record)
            if prepared is SKIP:
                continue
            if isinstance(prepared, Request):
                calls.append((i, prepared, record))
            else:
                outcomes[i] = prepared
        if calls:
            # The call and each user function may take up to the record deadline.
            timeout_s = self._config.async_.record_deadline_s * (1 + self._path.user_functions) + DEADLINE_SLACK_S
            answers = self._runner.run_sync(self._batch(calls, timeout_s), timeout_s + DEADLINE_SLACK_S)
            for (i, _, _), settled in zip(calls, answers, strict=True):
                outcomes[i] = settled if settled.row is not None else None  # None: the user's functions dropped it
        for outcome in outcomes:
            if outcome is not None:
                self._parts.count(outcome)
        self._metrics.holding.set(0, 0.0)
        return outcomes

    async def _batch(self, calls: list[tuple[int, Request, PendingRecord]], timeout_s: float) -> list[Settled]:
        """The batch's outcomes, in order. Without user functions the whole batch is one call of
        the record path (`RecordPath.call_many`: the client's batch entry, its rows written in one
        pass); with them, the calls by `async.capacity` workers, each taking the next call when its
        last ends (`_each`). Either way a call that outlives `timeout_s` is an `internal_error`."""
        answers: list[Settled | None] = [None] * len(calls)
        if self._path.batches:
            await self._whole(calls, answers, timeout_s)
        else:
            await self._each(calls, answers, timeout_s)
        out: list[Settled] = []
        for answer, (_, request, record) in zip(answers, calls, strict=True):
            if answer is None:
                answer = self._parts.internal(f"the call did not end within {timeout_s:g} s, past its own deadline",
                                              record, request.id)
            out.append(answer)
        return out

    async def _whole(self, calls: list[tuple[int, Request, PendingRecord]], answers: list[Settled | None],
                     timeout_s: float) -> None:
        """The batch through `RecordPath.call_many`; `admitted` is the batch's workers while it runs
        (the gauge is read between batches, where it is 0). A raise from it is a bug: the calls it
        left unanswered are `internal_error` dead letters."""
        workers = min(self._config.async_.capacity, len(calls))
        self._metrics.admitted += workers
        task = asyncio.ensure_future(self._path.call_many([(request, record) for _, request, record in calls],
                                                          answers))
        try:
            await asyncio.wait([task], timeout=timeout_s)
        finally:
            self._metrics.admitted -= workers
        if not task.done():
            task.cancel()  # its calls end, and the answers that came are written as rows (`call_many`)
            await asyncio.wait([task], timeout=CANCEL_WAIT_S)
        elif (err := task.exception()) is not None:
            log.error("unexpected error calling a batch", exc_info=err)
            for i, (_, request, record) in enumerate(calls):
                if answers[i] is None:
                    answers[i] = self._parts.internal(err, record, request.id)

    async def _each(self, calls: list[tuple[int, Request, PendingRecord]], answers: list[Settled | None],
                    timeout_s: float) -> None:
        """The batch's calls by `async.capacity` workers, each taking the next call when its last
        ends: the same bound as a task a call behind a semaphore, without a task and a wait in
        line for each of a batch's thousand records."""
        queue = iter(range(len(calls)))  # shared: each call is taken by one worker

        async def worker() -> None:
            for i in queue:
                _, request, record = calls[i]
                self._metrics.admitted += 1
                try:
                    answers[i] = await self._path.call(request, record)
                except Exception as err:  # the record path settles what it knows; this is a bug
                    log.exception("unexpected error calling for %s", record.handle)
                    answers[i] = self._parts.internal(err, record, request.id)
                finally:
                    self._metrics.admitted -= 1

        workers = [asyncio.ensure_future(worker()) for _ in range(min(self._config.async_.capacity, len(calls)))]
        await asyncio.wait(workers, timeout=timeout_s)
        for task in workers:
            task.cancel()


def vectorized_function(config: JobConfig, cache_file: str | None = None) -> UserDefinedScalarFunctionWrapper:
    """The lane's function, registered by the job (`jobs/graph/pipeline.py`)."""
    return udf(VectorizedInference(config, cache_file), result_type=RESULT_TYPE, func_type="pandas")
