"""What every lane is made of, written once: the seam the three lanes vary.

A lane (keyed `udfs/lanes/keyed.py`, vectorized `udfs/lanes/vectorized.py`, provider-batch
`udfs/lanes/provider_batch/lane.py`) decides only how records are grouped and when their calls are made.
Everything else is here or in the record path (`udfs/lanes/record_path.py`):

- `LaneParts`: set-up and tear-down (metrics, the client with its cache, the formats, the record
  path, a call loop), and the one place a record leaves (`emit`: its row, its dead letter counted
  by reason);
- the rows as Flink hands them over and takes them back (`INPUT_ROW_TYPE`, `SINK_ROW_TYPE`,
  `pending_record`, `salvage`);
- `KeyedLane`: the skeleton of a lane over keyed buckets and ticks (the keyed and provider-batch
  lanes): a bucket's first sight (`FLUSH_AT` armed, its state taken up again), reading an input row
  under the never-raise guard, the wake-up timers, the end of input. Its hooks, one per variation:
  `_adopt`, `_take_in`, `_wake`, `_flush`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyflink.common import Row, Types
from pyflink.datastream import KeyedProcessFunction, RuntimeContext

from udfs.config import JobConfig
from udfs.errors import InternalError
from udfs.lanes.record_path import RecordPath, Settled
from udfs.records import PendingRecord, SinkRow

if TYPE_CHECKING:
    from udfs.inference.client import InferenceClient
    from udfs.lanes.inflight import CallRunner
    from udfs.metrics import InferenceMetrics
    from udfs.records.formats import JobFormats

log = logging.getLogger("llmstream.udfs")

_BYTES = Types.PRIMITIVE_ARRAY(Types.BYTE())
_HEADERS = Types.MAP(Types.STRING(), _BYTES)
SINK_ROW_TYPE = Types.ROW_NAMED(["k", "v", "topic", "headers"], [_BYTES, _BYTES, Types.STRING(), _HEADERS])
"""One outgoing Kafka record (`SinkRow`): the topic says output or dead letter."""
INPUT_ROW_TYPE = Types.ROW_NAMED(
    ["k", "v", "topic", "partition", "offset", "ts", "headers"],
    [_BYTES, _BYTES, Types.STRING(), Types.INT(), Types.LONG(), Types.INSTANT(), _HEADERS])
"""One Kafka record as the source table hands it over (the value of the keyed stream)."""
FLUSH_AT = 2**62
"""Event time of the end-of-input timer: only the final MAX watermark reaches it."""


def epoch_ms(ts: Any) -> int | None:
    """A Kafka timestamp as PyFlink hands it over (Instant, datetime or millis) in epoch ms."""
    if ts is None or isinstance(ts, int):
        return ts
    to_ms = getattr(ts, "to_epoch_milli", None)
    if to_ms is not None:
        return int(to_ms())
    timestamp = getattr(ts, "timestamp", None)
    return int(timestamp() * 1000) if timestamp is not None else None


def pending_record(row: Row) -> PendingRecord:
    """An `INPUT_ROW_TYPE` row as the record kept in state. The headers arrive as a map (the
    table connector's `headers` metadata); none, or an empty map, are kept as None."""
    headers = row[6]
    return PendingRecord(row[0], row[1], row[2], row[3], row[4], epoch_ms(row[5]),
                         tuple(headers.items()) if headers else None)


def salvage(row: Any) -> PendingRecord:
    """What can be read of a row (or a state entry) that could not be read as a record: its key
    and value when they are bytes, so even its dead letter carries the original."""
    def field(i: int) -> Any:
        try:
            return row[i]
        except Exception:  # noqa: BLE001 - a row that cannot be read still gets a dead letter
            return None

    key, value = field(0), field(1)
    return PendingRecord(key if isinstance(key, bytes) else None, value if isinstance(value, bytes) else None,
                         "unknown", -1, -1)


def sink_row(row: SinkRow) -> Row:
    return Row(row.key, row.value, row.topic, row.headers)


@dataclass
class LaneParts:
    """What a lane opens in its `open()` and releases in its `close()`, the same for every lane."""

    config: JobConfig
    metrics: InferenceMetrics
    client: InferenceClient
    formats: JobFormats
    path: RecordPath
    runner: CallRunner

    @classmethod
    def open(cls, config: JobConfig, metrics_group: Any, *, subtasks: int, cache_file: str | None,
             capacity: int, runner_name: str) -> LaneParts:
        """`metrics_group`: Flink's (none with `flink.python.metric.enabled: false`: the same figures,
        kept in Python only). `capacity`: the call loop's slots. `cache_file`: the local result cache's
        file as the job's launch decided it (`udfs.cost.cache.open_cache`)."""
        from udfs.inference.client import InferenceClient
        from udfs.lanes.inflight import CallRunner
        from udfs.metrics import InferenceMetrics
        from udfs.records.formats import JobFormats

        metrics = InferenceMetrics(metrics_group.add_group("llmstream") if metrics_group is not None else None)
        runner = CallRunner(capacity, name=runner_name)
        client = InferenceClient(config, subtasks=subtasks, metrics=metrics, cache_file=cache_file)
        formats = JobFormats.open(config)  # e.g. Avro's registry client and output schema
        return cls(config, metrics, client, formats, RecordPath(config, client, formats, metrics), runner)

    def announce(self, lane: str, extra: str = "") -> None:
        """The lane's start-up line: the model's API, where it is served, the model and the capacity
        (and `extra`, the lane's own settings)."""
        model = self.config.model
        where = model.endpoint or ", ".join(e.url for e in model.endpoints or [])
        log.info("%s: %s %s model=%s capacity=%s%s", lane, model.api, where, model.model,
                 self.config.async_.capacity, extra)

    def close(self, before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """The call loop stopped (after `before_stop` and the client's close ran on it), then the
        formats' connections and the user functions."""
        async def shut() -> None:
            if before_stop is not None:
                await before_stop()
            await self.client.close()
        self.runner.close(before_stop=shut)
        self.formats.close()
        self.path.close()

    def emit(self, settled: Settled) -> Iterator[Row]:
        """`settled` as the row it leaves as (none for a record the user's functions drop), its
        dead letter counted by reason: the one place a record leaves a lane."""
        self.count(settled)
        if settled.row is not None:
            yield sink_row(settled.row)

    def count(self, settled: Settled) -> None:
        if settled.dead_letter_reason is not None:
            self.metrics.dead_letter(settled.dead_letter_reason)

    def internal(self, err: BaseException | str, record: PendingRecord, request_id: str | None = None) -> Settled:
        """A bug's dead letter (`internal_error`): what the never-raise guard makes of an exception."""
        failure = InternalError(err) if isinstance(err, str) else InternalError.from_exception(err)
        return self.path.dead_letter(failure, record, request_id)


class KeyedLane(KeyedProcessFunction):
    """A lane over keyed buckets: input `INPUT_ROW_TYPE` rows keyed by bucket, or `None` (a tick);
    output `SINK_ROW_TYPE` rows, results and dead letters alike (the topic tells them apart).

    Keys are a few buckets per subtask (`jobs/graph/pipeline.py`), only so that keyed state and
    timers exist. Per bucket: its first element or timer in this instance takes up what its state
    holds (`_adopt`: nothing is live in a fresh instance, so after a restore) and arms `FLUSH_AT`,
    which only the final watermark reaches (`_flush`); an input record is read under the guard (a
    row that cannot be read is an `internal_error` dead letter, never a raise) and handed to
    `_take_in`; every element, tick and timer then `_wake`s the bucket, which asks for a timer with
    `_wake_in` while it has work out.
    """

    RUNNER_NAME = "llmstream-calls"

    def __init__(self, config: JobConfig, gate_dir: str | None = None, cache_file: str | None = None) -> None:
        """`gate_dir`: the directory the admission gate in front and this lane share
        (`udfs/lanes/admission.py`), when the job has one."""
        self._config = config
        self._gate_dir = gate_dir
        self._cache_file = cache_file

    def _capacity(self) -> int:
        """The call loop's slots."""
        return self._config.async_.capacity

    def open(self, runtime_context: RuntimeContext) -> None:
        self._parts = parts = LaneParts.open(
            self._config, runtime_context.get_metrics_group(),
            subtasks=runtime_context.get_number_of_parallel_subtasks(), cache_file=self._cache_file,
            capacity=self._capacity(), runner_name=self.RUNNER_NAME)
        self._metrics, self._client, self._path, self._runner = parts.metrics, parts.client, parts.path, parts.runner
        self._adopted: set[Any] = set()
        self._timer_at: dict[Any, int] = {}
        self._opened(runtime_context)

    def _opened(self, runtime_context: RuntimeContext) -> None:
        """The lane's own set-up, after the parts every lane has."""

    async def _before_stop(self) -> None:
        """Run on the call loop before it stops (the lane's own connections)."""

    def close(self) -> None:
        parts = getattr(self, "_parts", None)
        if parts is not None:
            parts.close(before_stop=self._before_stop)
        self._closed()

    def _closed(self) -> None:
        """The lane's own tear-down (it may run after a failed `open`)."""

    # ------------------------------------------------------------------ Flink callbacks
    def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
        bucket = ctx.get_current_key()
        yield from self._first_sight(bucket, ctx)
        if value is not None:  # else a tick: it only wakes the bucket
            self._metrics.records_in.inc()
            try:
                record = pending_record(value)
            except Exception as err:
                log.exception("unexpected error reading an input row")
                yield from self._parts.emit(self._parts.internal(err, salvage(value)))
            else:
                yield from self._take_in(bucket, record)
        yield from self._wake(bucket, ctx)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterator[Row]:
        bucket = ctx.get_current_key()
        yield from self._first_sight(bucket, ctx)
        if timestamp >= FLUSH_AT:
            yield from self._flush(bucket, ctx)
            return
        if self._timer_at.get(bucket) == timestamp:
            del self._timer_at[bucket]
        yield from self._wake(bucket, ctx)

    def _first_sight(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        if bucket in self._adopted:
            return
        self._adopted.add(bucket)
        ctx.timer_service().register_event_time_timer(FLUSH_AT)
        yield from self._adopt(bucket, ctx)

    def _wake_in(self, bucket: Any, ctx: Any, delay_ms: int) -> None:
        """A processing-time timer for `bucket` `delay_ms` from now, unless one comes sooner."""
        at = ctx.timer_service().current_processing_time() + delay_ms
        if self._timer_at.get(bucket, at + 1) <= at:
            return
        ctx.timer_service().register_processing_time_timer(at)
        self._timer_at[bucket] = at

    # ------------------------------------------------------------------ the hooks: one per variation
    def _adopt(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """First sight of `bucket` in this instance: take up what its state holds (after a restore)."""
        raise NotImplementedError

    def _take_in(self, bucket: Any, record: PendingRecord) -> Iterator[Row]:
        """An input record of `bucket`: into the lane's grouping (or settled at once)."""
        raise NotImplementedError

    def _wake(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """What has come back for `bucket` out, the next calls started, a timer asked for while work is out."""
        raise NotImplementedError

    def _flush(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """End of input: every record of `bucket` waited for and out."""
        raise NotImplementedError
